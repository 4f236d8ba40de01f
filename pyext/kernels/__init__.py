"""Triton kernels. Importing this package never imports triton; each kernel module does."""
from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors; the tests use it (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable() -> str | None:
    """None if Triton kernels can run here, else why not. Never initialises CUDA."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def triton_devices() -> tuple[str, ...]:
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def interpreter_advisory(*args) -> list[str]:
    """Auto-dispatch never picks a Triton kernel running in the interpreter (CPU tensors): it is for tests."""
    import torch

    if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        return ["the Triton interpreter is for tests; force the triton backend to use it on CPU"]
    return []
