"""GroupNorm then SiLU in one pass (pyext.ops.group_norm), inside diffusers' ResnetBlock2D.

A ResnetBlock2D runs norm1 -> nonlinearity and norm2 -> nonlinearity: two passes over the
activation each (read, write, read, write) where one read and one write suffice. `fuse_norms`
turns such a GroupNorm into a `GroupNormSiLU` (by __class__ swap: the same module, parameters,
state_dict and hooks) whose output has been through SiLU already and is marked so, and the
block's nonlinearity into a `SiLUAfterFusedNorm`, which hands a marked tensor on as it is and
applies SiLU to anything else (the time embedding goes through the same module).

The marking only holds where the norm's output goes straight into the nonlinearity, so each
block is probed when fused: on a small random input, the fused block must give the plain
block's output, else it is put back and reported with the difference. Blocks sharing one SiLU
module are left plain. A forward hook added later on a fused norm sees the SiLU'd output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext.ops.group_norm import DTYPES, group_norm

_MARK = "_pyext_silu_applied"
# Below this many elements the op's per-call cost (custom op and dispatch) outweighs the pass it
# saves (measured on the UNet's 8x8 levels, where torch's GroupNorm + SiLU was faster).
MIN_FUSED_NUMEL = 1 << 18


class GroupNormSiLU(nn.GroupNorm):
    """silu(group_norm(x)) in one pass; the output is marked for SiLUAfterFusedNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype not in DTYPES or not self.eps > 0  # what the op refuses, plain GroupNorm takes
                or x.numel() < MIN_FUSED_NUMEL
                or torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))):
            y = F.silu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))  # the op has no backward
        else:
            y = group_norm(x, self.num_groups, self.weight, self.bias, self.eps, activation="silu")
        setattr(y, _MARK, True)
        return y


class SiLUAfterFusedNorm(nn.SiLU):
    """SiLU, except on a tensor a GroupNormSiLU already put through it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if getattr(x, _MARK, False) else F.silu(x, inplace=self.inplace)


def _pairs(block: nn.Module) -> list[str]:
    """The GroupNorms of a ResnetBlock2D-shaped block whose output goes to its SiLU nonlinearity."""
    if type(getattr(block, "nonlinearity", None)) is not nn.SiLU:
        return []
    if getattr(block, "time_embedding_norm", None) == "scale_shift":
        return []  # applies the time embedding between norm2 and the nonlinearity
    return [name for name in ("norm1", "norm2") if type(getattr(block, name, None)) is nn.GroupNorm]


def _probe_args(block: nn.Module):
    p = next(block.parameters())
    x = torch.randn(1, block.norm1.num_channels, 6, 5, generator=torch.Generator().manual_seed(0)).to(p)
    proj = getattr(block, "time_emb_proj", None)
    temb = torch.randn(1, proj.in_features, generator=torch.Generator().manual_seed(1)).to(p) if proj else None
    return x, temb


def _set_classes(block: nn.Module, names: list[str], fused: bool) -> None:
    for name in names:
        getattr(block, name).__class__ = GroupNormSiLU if fused else nn.GroupNorm
    block.nonlinearity.__class__ = SiLUAfterFusedNorm if fused else nn.SiLU


def _probe(block: nn.Module, names: list[str]) -> str | None:
    """None when the fused block gives the plain block's output on a small input, else why not
    (and the block is plain again)."""
    if any(p.device.type == "meta" for p in block.parameters()):
        return "parameters on the meta device (offloaded): nothing to probe with"
    try:
        x, temb = _probe_args(block)
        with torch.no_grad():
            _set_classes(block, names, False)
            plain = block(x, temb)
            _set_classes(block, names, True)
            fused = block(x, temb)
        tolerance = 1e-4 if x.dtype == torch.float32 else 3e-2
        err = (fused.float() - plain.float()).abs().max().item()
        reason = None
        if not err <= tolerance * max(1.0, plain.float().abs().max().item()):
            reason = f"the fused block's output differs from the plain one's by {err:.3g}"
    except Exception as err:  # a block that wants other arguments or inputs
        reason = f"the probe could not run ({type(err).__name__}: {str(err)[:120]})"
    if reason:
        _set_classes(block, names, False)
    return reason


@dataclass
class FuseReport:
    fused: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{len(self.fused)} GroupNorm+SiLU pairs fused"


def fuse_norms(model: nn.Module) -> FuseReport:
    """Fuse every probed-safe GroupNorm -> SiLU pair of the model's ResnetBlock2D-shaped blocks."""
    report = FuseReport()
    blocks = [(name, block, _pairs(block)) for name, block in model.named_modules()]
    blocks = [(name, block, names) for name, block, names in blocks if names]
    owners: dict[int, int] = {}
    for _, block, _ in blocks:
        owners[id(block.nonlinearity)] = owners.get(id(block.nonlinearity), 0) + 1
    for name, block, names in blocks:
        # A SiLU shared by blocks would pass marked tensors through in blocks left plain.
        reason = ("its SiLU module is shared with other blocks" if owners[id(block.nonlinearity)] > 1
                  else _probe(block, names))
        if reason:
            report.skipped[name] = reason
        else:
            report.fused += [f"{name}.{n}" for n in names]
    return report


def unfuse_norms(model: nn.Module) -> list[str]:
    """Plain GroupNorm and SiLU modules again (nothing else was changed)."""
    done = []
    for name, module in model.named_modules():
        if type(module) is GroupNormSiLU:
            module.__class__ = nn.GroupNorm
            done.append(name)
        elif type(module) is SiLUAfterFusedNorm:
            module.__class__ = nn.SiLU
    return done
