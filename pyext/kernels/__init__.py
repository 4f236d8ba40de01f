"""Triton kernels. Importing this package never imports triton; each kernel module does."""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors; the tests use it (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)  # asked on every op call: no import-path search each time
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


@dataclass(frozen=True)
class Config:
    """One launch configuration of a Triton kernel: block-size constexprs, warps and pipeline stages.

    Each kernel lists its candidates per variant, the first being the default: the static
    dispatch launches it, measured dispatch times them all on the user's GPU (`tune`), and
    `python -m pyext kernels` compiles every one for sm_80 and sm_90."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2

    @property
    def label(self) -> str:
        return "_".join(f"{k}{v}" for k, v in self.blocks) + f"_w{self.num_warps}_s{self.num_stages}"

    def launch_options(self) -> dict:
        """Triton's compile options. FMA contraction is asked for, not left to Triton's default,
        which newer releases turn off: the kernels then compile alike on every Triton."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, "enable_fp_fusion": True}

    def launch_kwargs(self) -> dict:
        return {**dict(self.blocks), **self.launch_options()}


def config(num_warps: int, num_stages: int, **blocks: int) -> Config:
    return Config(tuple(blocks.items()), num_warps, num_stages)


def relative_close(out, ref, rel: float = 1e-2) -> str | None:
    """None when out is within rel of ref's largest finite magnitude (at least 1), else the error.
    Equal values, infinities and NaNs included, agree; a NaN against a number does not."""
    import torch

    o, r = out.float(), ref.float()
    if r.numel() == 0:
        return None
    err = torch.where((o == r) | (o.isnan() & r.isnan()), 0.0, (o - r).abs()).max().item()
    finite = r[r.isfinite()]
    scale = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
    return None if err <= rel * scale else f"max error {err:.3g}"


def tune(kernel: str, key: str, device, configs: list[Config], launch, check=None) -> Config:
    """The config to launch: the default (first) in static dispatch, where nothing can be timed, or
    when there is one; else the fastest of those whose output passes `check(output)` (None when
    right; by default: close to the default's output), measured once per key and cached with the
    dispatch decisions. launch(config) runs the kernel and returns its output. A `check` against a
    reference matters where a compiler may miscompile some configs, the default among them."""
    from pyext import dispatch

    if len(configs) == 1 or dispatch.mode(device) != "measured" or not dispatch.can_measure(device):
        return configs[0]
    by_label = {c.label: c for c in configs}
    runs = {c.label: (lambda c=c: launch(c)) for c in configs}
    decision = dispatch.measured_choice(f"{kernel} config", key, device, runs, relative_close, check=check)
    return by_label[decision["backend"]]
