"""GroupNorm then SiLU in one pass (pyext.ops.group_norm), inside diffusers' ResnetBlock2D.

A ResnetBlock2D runs norm1 -> nonlinearity and (time-embedding add ->) norm2 -> nonlinearity: two
passes over the activation each (read, write, read, write) where one read and one write suffice.
`fuse_norms` gives such a block the forward of `FusedResnetBlock2D` (by __class__ swap: the same
module, parameters, state_dict and hooks): ResnetBlock2D's own, with each pair one call of the
fused op and the time embedding's add folded into norm2's; and the residual add in conv2's call
where its weight is packed for oneDNN (`pyext.nn.packed.conv_add`: the output written once, the
sum rounded once). The fusion lives in the block that owns the ops: its norm, SiLU and conv2
modules stay plain, so whoever calls or hooks them gets what GroupNorm, SiLU and Conv2d give (a
hooked conv2 is called as itself, and the add follows). A call runs ResnetBlock2D's forward
instead wherever fusing could be seen: a hook, or a forward replaced per instance, on one of
those modules (or a global module hook), a TorchFunctionMode watching torch's calls, modules
swapped for others, inputs that need autograd (the op has no backward), arguments it does not
know.

Each block is probed when fused (pyext.nn.swap): on a small random input, the fused block must
give the plain block's output, else it stays plain and the report says by how much it differed. A
block with hooks already on it stays plain: they would see the probe's calls. The probe's
convolutions run torch's im2col kernel: both forwards call the same convolutions on the same
inputs, so the kernel does not change the comparison, and torch's default CPU path would reorder
every weight into oneDNN's layout on every call, most of a probe's time at a UNet's widths. So the
probe checks the norms' fusion, not conv2's add (prepack packs conv2 after fuse_norms anyway): that
is oneDNN's post-op, which the tests check against the two calls.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import _compat
from pyext.nn.packed import PackedConv2d, conv_add
from pyext.nn.swap import SwapReport, probe, swap_all, swap_back
from pyext.ops.group_norm import DTYPES, group_norm

# Below this many elements the op's per-call cost (custom op and dispatch) outweighs the pass it
# saves (measured on the UNet's 8x8 levels, where torch's GroupNorm + SiLU was faster).
MIN_FUSED_NUMEL = 1 << 18


def norm_silu(norm: nn.GroupNorm, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """silu(norm(x + shift[:, :, None, None])): one pass of the fused op, or torch's two below the
    size where that pays and for what the op refuses."""
    if shift is not None and tuple(shift.shape) != tuple(x.shape[:2]):  # one the op does not take: broadcast
        x, shift = x + shift[:, :, None, None], None
    if x.dtype in DTYPES and norm.eps > 0 and x.numel() >= MIN_FUSED_NUMEL:
        return group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, activation="silu", shift=shift)
    if shift is not None:
        x = x + shift[:, :, None, None]
    return F.silu(F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps))


def _plain_module(m: nn.Module, kind: type) -> bool:
    """m is a `kind` exactly, with no hook and no per-instance forward (how diffusers' and
    accelerate's hooks wrap a module) that fusing would bypass."""
    return type(m) is kind and "forward" not in m.__dict__ and not _compat.torch_hooks(m)


def unseen(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether fusing this call is invisible: plain, unhooked norms and SiLU; no gradient asked for."""
    if not (_plain_module(block.norm1, nn.GroupNorm) and _plain_module(block.norm2, nn.GroupNorm)
            and _plain_module(block.nonlinearity, nn.SiLU)) or _compat.torch_function_mode_active():
        return False  # (a TorchFunctionMode watches F.group_norm: pyext's exact VAE tiling does)
    if torch.is_grad_enabled():
        tensors = (x, block.norm1.weight, block.norm1.bias, block.norm2.weight, block.norm2.bias)
        return not any(t is not None and t.requires_grad for t in tensors)
    return True


def _resnet_block_2d() -> type:
    from diffusers.models.resnet import ResnetBlock2D  # imported on first use: pyext imports no diffusers

    return ResnetBlock2D


@functools.lru_cache(maxsize=None)
def fused_resnet_block_2d() -> type:
    """FusedResnetBlock2D, made once diffusers is imported."""
    base = _resnet_block_2d()

    class FusedResnetBlock2D(base):
        """ResnetBlock2D's forward with norm1 + SiLU and (time embedding +) norm2 + SiLU fused, and
        the residual add in conv2's call."""

        def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs or (temb is not None and self.time_emb_proj is None) or not unseen(self, input_tensor):
                return base.forward(self, input_tensor, temb, *args, **kwargs)
            hidden_states = norm_silu(self.norm1, input_tensor)
            if self.upsample is not None:
                if hidden_states.shape[0] >= 64:  # as the block does (nearest upsampling and large batches)
                    input_tensor = input_tensor.contiguous()
                    hidden_states = hidden_states.contiguous()
                input_tensor = self.upsample(input_tensor)
                hidden_states = self.upsample(hidden_states)
            elif self.downsample is not None:
                input_tensor = self.downsample(input_tensor)
                hidden_states = self.downsample(hidden_states)
            hidden_states = self.conv1(hidden_states)
            shift = None
            if self.time_emb_proj is not None and temb is not None:
                shift = self.time_emb_proj(temb if self.skip_time_act else self.nonlinearity(temb))
            hidden_states = self.dropout(norm_silu(self.norm2, hidden_states, shift))
            if _plain_module(self.conv2, PackedConv2d):  # nothing sees conv2's own output: the add in its call
                out = conv_add(self.conv2, hidden_states, self._shortcut(input_tensor))
            else:  # conv2 before the shortcut, as the block calls them (hooks on both fire in its order)
                hidden_states = self.conv2(hidden_states)
                out = self._shortcut(input_tensor) + hidden_states
            return out if self.output_scale_factor == 1 else out / self.output_scale_factor  # (x / 1 is x)

        def _shortcut(self, input_tensor: torch.Tensor) -> torch.Tensor:
            if self.conv_shortcut is None:
                return input_tensor
            return self.conv_shortcut(input_tensor.contiguous() if self.training else input_tensor)

    return FusedResnetBlock2D


def is_fused(block: nn.Module) -> bool:
    return type(block) is fused_resnet_block_2d()


def fusable(block: nn.Module) -> bool:
    """A diffusers ResnetBlock2D (the class itself) whose norms feed its SiLU directly: GroupNorm
    modules, a SiLU nonlinearity, and norm2 right after conv1 but for the "default" time-embedding
    norm's add. Without a time-embedding projection every other norm but "scale_shift" (which needs
    one) runs norm2 plainly too: a VAE decoder's "group" blocks."""
    return (type(block) is _resnet_block_2d() and type(block.norm1) is nn.GroupNorm and type(block.norm2) is nn.GroupNorm
            and type(block.nonlinearity) is nn.SiLU
            and (block.time_embedding_norm == "default"
                 or (block.time_emb_proj is None and block.time_embedding_norm != "scale_shift")))


def _probe_args(block: nn.Module):
    p = next(block.parameters())
    x = torch.randn(1, block.norm1.num_channels, 6, 5, generator=torch.Generator().manual_seed(0)).to(p)
    proj = block.time_emb_proj
    temb = torch.randn(1, proj.in_features, generator=torch.Generator().manual_seed(1)).to(p) if proj else None
    return x, temb


@contextlib.contextmanager
def _im2col_convs(block: nn.Module):
    """The block's plain CPU Conv2d layers run pyext._compat.im2col_conv2d inside (their forwards
    replaced per instance; unseen() looks only at the norms and the SiLU)."""
    convs = [m for m in block.modules() if type(m) is nn.Conv2d and m.weight.device.type == "cpu" and m.groups == 1
             and tuple(m.dilation) == (1, 1) and m.padding_mode == "zeros" and not isinstance(m.padding, str)]
    for conv in convs:
        conv.forward = functools.partial(_im2col_forward, conv)
    try:
        yield
    finally:
        for conv in convs:
            del conv.forward


def _im2col_forward(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return _compat.im2col_conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding)


def _probe(block: nn.Module) -> str | None:
    """None when the fused block gives the plain block's output on a small input (and is fused),
    else why not."""
    p = next(block.parameters())
    return probe(block, fused_resnet_block_2d(), lambda: _probe_args(block), 1e-4 if p.dtype == torch.float32 else 3e-2,
                 context=lambda: _im2col_convs(block))


def fuse_norms(model: nn.Module) -> SwapReport:
    """Fuse the GroupNorm -> SiLU pairs of every probed-safe ResnetBlock2D of the model."""
    return swap_all(model, fusable, _probe)


def describe(report: SwapReport) -> str:
    return f"{2 * len(report.swapped)} GroupNorm+SiLU pairs fused in {len(report.swapped)} ResnetBlock2D blocks"


def unfuse_norms(model: nn.Module) -> list[str]:
    """Plain ResnetBlock2D forwards again (nothing else was changed)."""
    return swap_back(model, fused_resnet_block_2d(), _resnet_block_2d())
