"""An AutoencoderKL's decoder or encoder as a flat sequence of steps, and how far each reaches.

A step is one call (a resnet, a resampler, a norm, a conv, the mid block's attention) with the
module it runs and how it scales the resolution. The calls and their order are those of
diffusers' Decoder.forward / Encoder.forward without gradient checkpointing, so running the
steps one after another is the module's own forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pyext import ops
from pyext.nn.fused_norm import is_fused, norm_silu, unseen

QUERY_CHUNK = 4096  # tokens per query chunk in lean_self_attention


@dataclass(frozen=True)
class Step:
    call: Callable[..., torch.Tensor]  # tensors -> a tensor or a tuple of them
    module: nn.Module
    scale: Fraction = Fraction(1)  # output pixels per input pixel, per side
    input_norm: Optional[nn.GroupNorm] = None  # a GroupNorm the step applies first, to its first input
    # a self-attention layer that the exact run applies over the whole image at once, its keys
    # and values folded into the normed input (fold_query, unfold_output); see pyext.vae.exact
    attends_whole: bool = False
    # the next step takes this step's input as its last argument too (a resnet's first half: the
    # second adds the block's input back); the exact run keeps that state for it rather than
    # writing a copy into the state between the two
    passes_input: bool = False


def run(steps, *x: torch.Tensor):
    """The steps one after another; a step that returns a tuple passes it on as its
    successor's arguments. (A step that passes_input ends its segment of an exact run, which
    supplies that input to the next.)"""
    for step in steps:
        x = step.call(*x)
        x = x if isinstance(x, tuple) else (x,)
    return x[0] if len(x) == 1 else x


def has_group_norm(step: Step) -> bool:
    return any(isinstance(m, nn.GroupNorm) for m in step.module.modules())


def has_attention(steps) -> bool:
    """Whether some step has an attention layer that a tile cannot run: any but the
    whole-image ones (Step.attends_whole) that the exact run applies on its own."""
    from diffusers.models.attention_processor import Attention
    return any(isinstance(m, Attention) for s in steps if not s.attends_whole for m in s.module.modules())


def _convs(steps):
    """(conv, pixels at which it runs per input pixel) for each Conv2d of `steps`. Assumes each
    module runs its convolutions in registration order at one resolution, as diffusers' resnets
    and resamplers do; an upsampler's conv runs after its interpolation."""
    res = Fraction(1)  # pixels at this point per input pixel
    for step in steps:
        at = res * max(step.scale, 1)
        for m in step.module.modules():
            if isinstance(m, nn.Conv2d):
                yield m, at
        res *= step.scale


def reads_at_most(steps, channels: int) -> bool:
    """Whether every Conv2d of `steps` reads at most `channels` channels."""
    return all(m.in_channels <= channels for m, _ in _convs(steps))


def radius(steps) -> float:
    """Input pixels (per side) that one output pixel of `steps` depends on, convolutions only."""
    r = 0.0
    for m, at in _convs(steps):
        k, d = m.kernel_size[0], m.dilation[0]
        # a stride-2 conv padded (0, 1) reads k-1 pixels on one side
        r += ((k - 1) * d if m.stride[0] > 1 else (k - 1) // 2 * d) / float(at)
    return r


def width(steps) -> Fraction:
    """Elements per input pixel of the widest tensor a run of `steps` makes: each conv's input
    and output channels at the resolution it runs."""
    return max((max(m.in_channels, m.out_channels) * at * at for m, at in _convs(steps)), default=Fraction(0))


def alignment(steps) -> int:
    """Input pixels a window of `steps` must start on so that every downsampling stays on the
    full run's pixel grid."""
    down = Fraction(1)
    for step in steps:
        down *= min(step.scale, Fraction(1))
    return int(1 / down)


def margin(steps) -> int:
    """The receptive-field radius rounded up to whole, aligned input pixels."""
    align = alignment(steps)
    return math.ceil(radius(steps) / align - 1e-9) * align


# ----------------------------------------------------------------------------- lean attention

def lean_attention_unsupported(attn) -> Optional[str]:
    """Why lean_self_attention cannot stand in for this attention layer's forward, or None."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    processor = getattr(attn, "processor", None)
    if type(processor) not in (AttnProcessor, AttnProcessor2_0):
        return f"processor {type(processor).__name__}"
    if attn.group_norm is None or attn.spatial_norm is not None or attn.is_cross_attention:
        return "not a group-normed self-attention"
    if getattr(attn, "norm_q", None) is not None or getattr(attn, "norm_k", None) is not None:
        return "q/k norms"
    if attn.to_k.out_features % attn.heads:
        return "an inner dim that the heads do not divide"
    return None


def lean_self_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The VAE mid block's self-attention layer in about half the memory of its processor.

    Keys and values are projected once for all tokens; the queries, pyext.ops.attention and the
    output projection then run per chunk of tokens, and each chunk's result (plus the residual)
    is written over the rows of the group-normed input it came from, which no later chunk
    reads. Live at the peak: input, normed input, keys and values (4x the input). Softmax rows
    do not depend on how the queries are chunked."""
    b, c, h, w = x.shape
    n, heads, inner = h * w, attn.heads, attn.to_k.out_features
    normed = attn.group_norm(x)
    tokens = normed.view(b, c, n).transpose(1, 2)  # (b, tokens, channels), a view
    keys, values = (normed.new_empty(b, n, inner) for _ in range(2))
    for s in range(0, n, QUERY_CHUNK):
        rows = tokens[:, s:s + QUERY_CHUNK]
        keys[:, s:s + QUERY_CHUNK] = attn.to_k(rows)
        values[:, s:s + QUERY_CHUNK] = attn.to_v(rows)
    keys, values = (t.view(b, n, heads, inner // heads).transpose(1, 2) for t in (keys, values))
    out, flat_x = normed.view(b, c, n), x.view(b, c, n)
    for s in range(0, n, QUERY_CHUNK):
        e = min(n, s + QUERY_CHUNK)
        q = attn.to_q(tokens[:, s:e]).view(b, e - s, heads, inner // heads).transpose(1, 2)
        o = ops.attention(q, keys, values, scale=attn.scale)
        out[:, :, s:e] = _layer_output(attn, o.transpose(1, 2).reshape(b, e - s, inner), flat_x[:, :, s:e])
    return normed


def _layer_output(attn, values: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The layer's output in residual's shape (b, channels, ...) from its attention output
    `values` (b, tokens, inner): the output projection, the residual, the rescale."""
    o = attn.to_out[1](attn.to_out[0](values)).transpose(1, 2).reshape(residual.shape)
    if attn.residual_connection:
        o = o + residual
    return o / attn.rescale_output_factor


def _folds(attn) -> bool:
    """Whether fold_query applies: one head, and the key weights at hand (not on the meta
    device, where accelerate's sequential offload keeps them outside the layer's forward)."""
    return attn.heads == 1 and attn.to_k.weight.device.type != "meta"


def fold_query(attn, tokens: torch.Tensor) -> torch.Tensor:
    """A single-head layer's queries for the normed tokens h themselves as keys: q.(W_k h + b_k)
    = (q W_k).h + q.b_k, and softmax cancels q.b_k, the same for every key of a query. So the
    whole image's keys and values need not be held: only h (half their memory)."""
    return attn.to_q(tokens) @ attn.to_k.weight.to(tokens.device)  # an offloaded layer's weight may be elsewhere


def unfold_output(attn, mixed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The layer's output (b, channels, h, w) from `mixed` (b, tokens, channels), the
    softmax-weighted mean of the normed tokens: that of the values is W_v mixed + b_v, as the
    weights sum to 1."""
    return _layer_output(attn, attn.to_v(mixed), residual)


# ----------------------------------------------------------------------------- the steps

def _mid_block_steps(mid) -> list[Step]:
    """UNetMidBlock2D.forward as steps, its attention layers lean where they can be."""
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D
    if type(mid).forward is not UNetMidBlock2D.forward:
        return [Step(lambda x: mid(x, None), mid)]
    steps = [Step(lambda x, r=mid.resnets[0]: r(x, None), mid.resnets[0])]
    for attn, r in zip(mid.attentions, mid.resnets[1:]):
        if attn is not None:
            lean = lean_attention_unsupported(attn) is None
            steps.append(Step((lambda x, a=attn: lean_self_attention(a, x)) if lean else (lambda x, a=attn: a(x)), attn,
                              input_norm=attn.group_norm if lean else None, attends_whole=lean and _folds(attn)))
        steps.append(Step(lambda x, r=r: r(x, None), r))
    return steps


def _block_steps(block, resample_attr: str, scale: Fraction) -> list[Step]:
    """A plain Up/DownDecoder/EncoderBlock2D split into its resnets and resamplers; any other
    block is one step."""
    resamplers = getattr(block, resample_attr, None) or []
    if not hasattr(block, "resnets") or hasattr(block, "attentions"):
        return [Step(block, block, scale if resamplers else Fraction(1))]
    return ([Step(lambda x, r=r: r(x, None), r) for r in block.resnets]
            + [Step(u, u, scale) for u in resamplers])


def steps_of(vae, kind: str) -> list[Step]:
    """The decoder (with post_quant_conv) or the encoder (with quant_conv) as steps."""
    plain = lambda *ms: [Step(m, m, input_norm=m if type(m) is nn.GroupNorm else None)  # noqa: E731
                         for m in ms if m is not None]
    if kind == "decode":
        d = vae.decoder
        steps = plain(vae.post_quant_conv, d.conv_in) + _mid_block_steps(d.mid_block)
        for b in d.up_blocks:
            steps += _block_steps(b, "upsamplers", Fraction(2))
        return steps + plain(d.conv_norm_out, d.conv_act, d.conv_out)
    e = vae.encoder
    steps = plain(e.conv_in)
    for b in e.down_blocks:
        steps += _block_steps(b, "downsamplers", Fraction(1, 2))
    return steps + _mid_block_steps(e.mid_block) + plain(e.conv_norm_out, e.conv_act, e.conv_out, vae.quant_conv)


# ----------------------------------------------------------------------------- resnet halves

def _splittable(module) -> bool:
    """A ResnetBlock2D whose forward without a time embedding is norm1, act, conv1, norm2, act,
    dropout, conv2, plus the (shortcut of the) input, over output_scale_factor (as in every
    AutoencoderKL: no resampling inside, no time projection, no scale-shift norm)."""
    from diffusers.models.resnet import ResnetBlock2D
    return (isinstance(module, ResnetBlock2D) and (type(module).forward is ResnetBlock2D.forward or is_fused(module))
            and module.upsample is None and module.downsample is None and module.time_emb_proj is None
            and module.time_embedding_norm != "scale_shift")


def _activate(r, x: torch.Tensor) -> torch.Tensor:
    """The resnet's nonlinearity on x, a GroupNorm's fresh output that nothing else holds: in
    place where it is SiLU, so a tile allocates one tensor fewer (on CPU each large allocation
    is fresh pages, each page a fault)."""
    if type(r.nonlinearity) is nn.SiLU and not torch.is_grad_enabled():
        return F.silu(x, inplace=True)
    return r.nonlinearity(x)


def _norm_then_activate(r, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The resnet's norm, then its nonlinearity: one pass where fuse_norms fused the block."""
    if is_fused(r) and unseen(r, x):
        return norm_silu(norm, x)
    return _activate(r, norm(x))


def resnet_first_half(r, x: torch.Tensor) -> torch.Tensor:
    """ResnetBlock2D up to its second GroupNorm: conv1's output."""
    return r.conv1(_norm_then_activate(r, r.norm1, x))


def resnet_second_half(r, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The rest of the block, from conv1's output h and the block's input x (its 1x1 shortcut,
    a per-pixel conv, runs here on x as in the block). Bit for bit the block's sum and division,
    in place on conv2's fresh output where no gradient is recorded."""
    h = r.conv2(r.dropout(_norm_then_activate(r, r.norm2, h)))
    residual = r.conv_shortcut(x) if r.conv_shortcut is not None else x
    if torch.is_grad_enabled():
        return (residual + h) / r.output_scale_factor
    h.add_(residual)  # residual + h: the same sum
    return h.div_(r.output_scale_factor) if r.output_scale_factor != 1 else h  # x / 1 is x


def whole_resnet(step: Step) -> Step:
    """A plain resnet step as its two halves run back to back: its forward bit for bit, with the
    halves' in-place activations and sum (a tile allocates three tensors fewer); other steps as
    they are."""
    r = step.module
    if not _splittable(r):
        return step
    return Step(lambda x, r=r: resnet_second_half(r, resnet_first_half(r, x), x), r, input_norm=r.norm1)


def split_resnets(steps, whole_channels: int = 0) -> list[Step]:
    """Each plain resnet step as two, cut before its second GroupNorm, so a run can store the
    state there instead of recomputing conv1 (pyext.vae.exact). The second half also takes the
    block's input (Step.passes_input). A resnet whose conv1 reads at most `whole_channels`
    channels stays whole (whole_resnet): conv1 then runs in two passes of the run instead."""
    out = []
    for step in steps:
        r = step.module
        if _splittable(r) and r.conv1.in_channels <= whole_channels:
            out.append(whole_resnet(step))
        elif _splittable(r):
            second = nn.ModuleList([m for m in (r.norm2, r.conv2, r.conv_shortcut) if m is not None])
            out += [Step(lambda x, r=r: resnet_first_half(r, x), nn.ModuleList([r.norm1, r.conv1]),
                         input_norm=r.norm1, passes_input=True),
                    Step(lambda h, x, r=r: resnet_second_half(r, h, x), second, input_norm=r.norm2)]
        else:
            out.append(step)
    return out


def split(steps, kind: str, exact: bool = False) -> tuple[list, list, list]:
    """(before, tiled, after): the part at latent resolution runs once on the whole input
    (before the tiles when decoding, after them when encoding); the tiles run the part that
    changes the resolution. The mid block's attention, which spans the whole latent, is thus
    never tiled. Except in the exact run when that attention is one it applies over the whole
    image (Step.attends_whole): then every step is tiled, the mid block's resnets too."""
    if exact and not has_attention(steps):
        return [], list(steps), []
    resampling = [i for i, s in enumerate(steps) if s.scale != 1]
    if kind == "decode":
        k = resampling[0] if resampling else len(steps)
        return steps[:k], steps[k:], []
    k = resampling[-1] + 1 if resampling else 0
    return [], steps[:k], steps[k:]
