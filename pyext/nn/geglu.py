"""diffusers' GEGLU (the feed-forward's gated GELU) with its chunk, GELU and product in one pass.

GEGLU projects h to 2 * D channels, then runs `a, gate = h.chunk(2, -1); a * gelu(gate)`: the
GELU writes a rounded copy of the gates and the product reads it back. `fuse_geglu` gives each
GEGLU module the forward of `FusedGEGLU` (by __class__ swap: the same module, parameters,
state_dict and hooks): GEGLU's own, its projection called as it is, then `pyext.ops.geglu`, which
reads the projection once, computes in float32 and rounds once. A call runs GEGLU's forward
instead wherever fusing could be seen: a `gelu` replaced on the instance (GEGLU calls its own), a
TorchFunctionMode watching torch's calls, a projection whose output needs autograd (the op has no
backward), a device or dtype the op does not take, arguments GEGLU deprecates.

Each module is probed when fused (pyext.nn.swap): on a small random input the fused forward must
give the plain one's output (within the rounding the plain path adds), else it stays plain and the
report says by how much they differed.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from pyext import _compat
from pyext.nn.swap import SwapReport, probe, swap_all, swap_back
from pyext.ops.geglu import DTYPES, geglu

DEVICES = ("cpu", "cuda")  # where the op has a kernel


def _geglu_class() -> type:
    from diffusers.models.activations import GEGLU  # imported on first use: pyext imports no diffusers

    return GEGLU


def unseen(module: nn.Module, h: torch.Tensor) -> bool:
    """Whether the fused call on the projection's output h is invisible, and the op takes h."""
    return ("gelu" not in module.__dict__ and not _compat.torch_function_mode_active() and not h.requires_grad
            and h.dtype in DTYPES and h.device.type in DEVICES)


@functools.lru_cache(maxsize=None)
def fused_geglu() -> type:
    """FusedGEGLU, made once diffusers is imported."""
    base = _geglu_class()

    class FusedGEGLU(base):
        """GEGLU's forward with the chunk, GELU and product one op."""

        def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs:  # GEGLU's deprecated `scale`: its own forward warns about it
                return base.forward(self, hidden_states, *args, **kwargs)
            hidden_states = self.proj(hidden_states)
            if unseen(self, hidden_states):
                return geglu(hidden_states)
            hidden_states, gate = hidden_states.chunk(2, dim=-1)
            return hidden_states * self.gelu(gate)

    return FusedGEGLU


def is_fused(module: nn.Module) -> bool:
    return type(module) is fused_geglu()


def fusable(module: nn.Module) -> bool:
    return type(module) is _geglu_class()


def _probe(module: nn.Module) -> str | None:
    """None when the fused module gives the plain one's output on a small input (and is fused),
    else why not. The plain path rounds gelu(gate) before the product: a rounding of the output."""
    w = module.proj.weight
    tolerance = 1e-5 if w.dtype == torch.float32 else 2 * torch.finfo(w.dtype).eps

    def args() -> tuple:
        return (torch.randn(2, module.proj.in_features, generator=torch.Generator().manual_seed(0)).to(w),)

    return probe(module, fused_geglu(), args, tolerance)


def fuse_geglu(model: nn.Module) -> SwapReport:
    """FusedGEGLU forwards for every probed-safe GEGLU of the model."""
    return swap_all(model, fusable, _probe)


def describe(report: SwapReport) -> str:
    return f"{len(report.swapped)} GEGLU activations in one pass"


def unfuse_geglu(model: nn.Module) -> list[str]:
    """Plain GEGLU forwards again (nothing else was changed)."""
    return swap_back(model, fused_geglu(), _geglu_class())
