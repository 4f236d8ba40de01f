"""Loads the compiled extension `pyext._C` if it was built; never fails at import.

`EXT` is the module or None, `EXT_ERROR` says why it is missing. The extension
registers its kernels as `torch.ops.pyext_C.*`; the public ops in `pyext.ops`
dispatch to them when they are there and fall back to the PyTorch reference.
"""
from __future__ import annotations

import torch  # noqa: F401  (the extension links against libtorch; load it first)

try:
    from pyext import _C as EXT  # type: ignore[attr-defined]

    EXT_ERROR: str | None = None
except ImportError as err:  # not built, or built against another torch
    EXT = None
    EXT_ERROR = (
        f"pyext._C could not be imported ({err}); build it with `make build` or "
        "`pip install --no-build-isolation .`. Reference (PyTorch) backends are used instead."
    )

try:
    from pyext._build_info import BUILD_INFO
except ImportError:
    BUILD_INFO = {"built": False}


def has_kernel(name: str) -> bool:
    """True when the extension registered torch.ops.pyext_C.<name>."""
    return EXT is not None and hasattr(torch.ops.pyext_C, name)


def kernel_missing(name: str) -> str | None:
    """Why torch.ops.pyext_C.<name> cannot run in this process, or None: a backend's `unavailable`."""
    if has_kernel(name):
        return None
    return EXT_ERROR or f"pyext._C was built without the {name} kernel; rebuild it"


def cuda_kernel_missing(name: str) -> str | None:
    """As kernel_missing, for the CUDA implementation of the kernel."""
    if EXT is not None and has_kernel(name) and not EXT.built_with_cuda():
        return "pyext._C was built without CUDA kernels (CPU torch or no nvcc)"
    return kernel_missing(name)


def cuda_kernels_built() -> bool:
    return EXT is not None and bool(EXT.built_with_cuda())


def cpu_capabilities() -> list[str]:
    """SIMD levels the CPU kernels can use on this machine (detected at run time)."""
    return list(EXT.cpu_capabilities()) if EXT is not None else []
