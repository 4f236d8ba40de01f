"""Streaming tiled VAE decode/encode for diffusers' AutoencoderKL.

diffusers' tiled_decode keeps every decoded tile (about 1.8x the image), blends the
overlaps with one Python-level op per overlap row, then concatenates (peak about 3.8x
the output image). Here each tile goes straight into a preallocated output through
one fused `tile_blend` call and is freed at once; only the overlap strips the next
tiles need are kept (mode "diffusers") or nothing at all (mode "normalized").

Tiling changes the numbers for three reasons, each handled here:
- the decoder's mid block attends over the whole latent, a tile's only over the tile:
  with global_mid the part of the network at latent resolution (mid block included) runs
  once on the whole input, and only the up-sampling part (encode: down-sampling) is tiled;
- tile borders see zero padding instead of their neighbours: each tile runs with a margin
  of `context` real neighbours, cropped off before blending; by default the tiled part's
  receptive field, which makes every convolution in a tile's own region exact;
- each tile normalises with its own GroupNorm statistics: with consistent_tones every tile
  is normalised with whole-image statistics instead (_gather_stats): the first two tiled
  GroupNorms' exactly (their inputs are one and two convolutions away from the global
  features, so full-width strips of those give them in little memory), the rest estimated
  from small runs over evenly spread subsamples of the whole input (each at most one tile),
  weighted by how well each predicts the exact layers.
With global_mid and that context the statistics are the only difference left: with the
full run's own statistics the tiled decode equals the full one to rounding (tested), so
tiles agree where they overlap; by default (fit_tile) they do not overlap then, and each
tile's window, context included, fits in one tile's size, so no tile run needs more
memory than a plain tile's. The statistics estimate is the limit; a second pass collecting
them from all tiles was tried and makes it worse (the statistics of later layers then fit
the first pass's estimate of the earlier ones, and the error grows with depth: 44.7 -> 35.2
-> 14.9 dB over two passes on a half-width SD VAE at 512 px).

`tile_vae(vae)` patches one AutoencoderKL instance (instance attributes only) and
`untile_vae(vae)` undoes it.
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Optional

import torch
from torch import nn

from pyext import _compat, _state
from pyext.dispatch import PyextError
from pyext.ops.tile_blend import edge_weights, tile_blend_diffusers, tile_blend_normalized

MODES = ("normalized", "diffusers")
_STATE = "tiling"  # pyext._state key on a tiled VAE
_PATCHED = ("tiled_decode", _compat.VAE_TILED_ENCODE, "tiled_encode")


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.tile_vae: {msg}")


# ----------------------------------------------------------------------------- GroupNorm statistics

class GroupNormStats:
    """Whole-image GroupNorm statistics for every GroupNorm in `root`.

    mode None: GroupNorm runs as usual. "collect": runs as usual and accumulates the
    per-(sample, group) mean and mean square of its input.
    "apply": normalises with the accumulated statistics instead of the tile's own.
    "exact": normalises with `fixed` where it has the call; the first call it lacks
    accumulates the rows `crop` leaves of its input, then stops the run (_Stop): one
    strip's share of that layer's exact statistics (_exact_stats).
    Calls are keyed by (module, call index within a tile) so a module called twice
    per forward gets two sets of statistics.
    """

    def __init__(self, *roots: nn.Module):
        self.norms = [m for root in roots for m in root.modules() if isinstance(m, nn.GroupNorm)]
        self.mode: Optional[str] = None
        self.sums: dict = {}
        self.fixed: dict = {}
        self.crop = (0, 0, 1)  # "exact" mode: input rows to drop at the top and bottom, input rows run
        self._calls: dict = {}

    def start_tile(self) -> None:
        """Call before each network run: calls are numbered per run."""
        self._calls = {}

    def _key(self, m: nn.Module):
        i = self._calls.get(id(m), 0)
        self._calls[id(m)] = i + 1
        return (id(m), i)

    def collect(self, m: nn.GroupNorm, x: torch.Tensor, key) -> None:
        xs = x.float().reshape(x.shape[0], m.num_groups, -1)
        var, mean = torch.var_mean(xs, dim=-1, correction=0)
        cnt = xs.shape[-1]
        mean, var = mean.double(), var.double()
        acc = self.sums.setdefault(key, [0.0, 0.0, 0])
        acc[0] = acc[0] + mean * cnt
        acc[1] = acc[1] + (var + mean * mean) * cnt
        acc[2] += cnt

    def finish(self) -> None:
        """Turns the sums into (mean, variance) per (sample, group); clears the sums."""
        self.fixed = {}
        for key, (s, ss, cnt) in self.sums.items():
            mean = s / cnt
            self.fixed[key] = (mean, (ss / cnt - mean * mean).clamp_min(0))
        self.sums = {}

    def apply(self, m: nn.GroupNorm, x: torch.Tensor, key) -> torch.Tensor:
        if key not in self.fixed:  # a call the statistics pass never saw: fall back to the tile's own
            return nn.functional.group_norm(x, m.num_groups, m.weight, m.bias, m.eps)
        mean, var = self.fixed[key]
        rstd = torch.rsqrt(var + m.eps)
        per = x.shape[1] // m.num_groups
        scale = rstd.repeat_interleave(per, dim=1)           # (N, C)
        shift = -mean.repeat_interleave(per, dim=1) * scale
        if m.weight is not None:
            w = m.weight.double()
            scale, shift = scale * w, shift * w + m.bias.double()
        dt = x.dtype
        # one fused pass: y = x * scale + shift per (sample, channel)
        bcast = (*scale.shape, *[1] * (x.dim() - 2))
        return torch.addcmul(shift.to(dt).view(bcast), x, scale.to(dt).view(bcast))

    @contextlib.contextmanager
    def patched(self):
        """Swaps each GroupNorm instance's forward (accelerate's _old_forward when hooked)."""
        saved = []
        for m in self.norms:
            # accelerate's hook wrapper calls module._old_forward at call time: patch that
            # so offload hooks keep moving weights in before we run.
            hooked = _compat.has_accelerate_hook(m) and hasattr(m, _compat.ACCELERATE_OLD_FORWARD)
            attr = _compat.ACCELERATE_OLD_FORWARD if hooked else "forward"
            had = attr in m.__dict__
            original = getattr(m, attr)
            saved.append((m, attr, had, m.__dict__.get(attr)))
            m.__dict__[attr] = self._forward_for(m, original)
        try:
            yield self
        finally:
            for m, attr, had, old in saved:
                if had:
                    m.__dict__[attr] = old
                else:
                    del m.__dict__[attr]

    def _forward_for(self, m: nn.GroupNorm, original: Callable) -> Callable:
        def forward(x, *args, **kwargs):
            if self.mode is None:
                return original(x, *args, **kwargs)
            key = self._key(m)
            if self.mode == "apply" or (self.mode == "exact" and key in self.fixed):
                return self.apply(m, x, key)
            if self.mode == "exact":
                top, bottom, rows = self.crop
                scale = x.shape[-2] / rows  # this layer's rows per input row
                self.collect(m, x[..., round(top * scale):x.shape[-2] - round(bottom * scale), :], key)
                raise _Stop
            y = original(x, *args, **kwargs)
            if self.mode == "collect":
                self.collect(m, x, key)
            return y
        return forward


class _Stop(Exception):
    """Ends a network run once the layer whose statistics are wanted has been seen."""


# ----------------------------------------------------------------------------- tiled runner

def _spans(n: int, tile: int, stride: int) -> list[tuple[int, int]]:
    """diffusers' tile grid along one axis: starts 0, stride, 2*stride, ... < n."""
    return [(i, min(i + tile, n)) for i in range(0, n, stride)]


_QUERY_CHUNK = 4096  # tokens per query chunk in _lean_self_attention


def _lean_attention_unsupported(attn) -> Optional[str]:
    """Why _lean_self_attention cannot stand in for this attention module's forward, or None."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    if type(getattr(attn, "processor", None)) not in (AttnProcessor, AttnProcessor2_0):
        return f"processor {type(getattr(attn, 'processor', None)).__name__}"
    if attn.group_norm is None or attn.spatial_norm is not None or attn.is_cross_attention:
        return "not a group-normed self-attention"
    if getattr(attn, "norm_q", None) is not None or getattr(attn, "norm_k", None) is not None:
        return "q/k norms"
    inner = attn.to_k.out_features
    if inner % attn.heads or abs(attn.scale - (inner // attn.heads) ** -0.5) > 1e-12 * attn.scale:
        return "a softmax scale other than 1/sqrt(head_dim)"
    return None


def _lean_self_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The VAE mid block's attention layer, computed as AttnProcessor2_0 computes it, in less memory.

    Keys and values are computed once for all tokens; queries, the attention and the output
    projection then run in chunks of tokens, and each chunk's result (plus the residual) is
    written over the group-normed input's rows it was computed from, which no later chunk
    reads. Peak: input, normed input, keys, values (4x the input) instead of about 8x: the
    global part of a 2048x2048 decode peaked at 540 instead of 1025 MiB (more than a tile's
    working set, 965 MiB). Softmax rows do not depend on how queries are chunked, so the
    result is the unchunked one up to rounding."""
    b, c, h, w = x.shape
    n, heads, inner = h * w, attn.heads, attn.to_k.out_features
    normed = attn.group_norm(x)
    tokens = normed.view(b, c, n).transpose(1, 2)  # (b, tokens, channels), a view
    keys, values = (normed.new_empty(b, n, inner) for _ in range(2))
    for s in range(0, n, _QUERY_CHUNK):
        rows = tokens[:, s:s + _QUERY_CHUNK]
        keys[:, s:s + _QUERY_CHUNK] = attn.to_k(rows)
        values[:, s:s + _QUERY_CHUNK] = attn.to_v(rows)
    keys, values = (t.view(b, n, heads, inner // heads).transpose(1, 2) for t in (keys, values))
    out = normed.view(b, c, n)
    flat_x = x.view(b, c, n)
    for s in range(0, n, _QUERY_CHUNK):
        e = min(n, s + _QUERY_CHUNK)
        q = attn.to_q(tokens[:, s:e]).view(b, e - s, heads, inner // heads).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
        o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).reshape(b, e - s, inner).to(q.dtype)))
        o = o.transpose(1, 2)
        if attn.residual_connection:
            o = o + flat_x[:, :, s:e]
        out[:, :, s:e] = o / attn.rescale_output_factor
    return normed


def _stages(vae, kind: str) -> list[tuple[Callable, nn.Module, float]]:
    """The decoder (with post_quant_conv) or encoder (with quant_conv) as a sequence of
    (call, module, resolution scale) steps, split down to single resnets and resamplers in
    the plain blocks, so a run can stop at the first up- or after the last downsampling.
    Same calls in the same order as Decoder.forward / Encoder.forward (no gradient checkpointing)."""
    steps: list = []

    def add(module, scale=1.0, call=None):
        if module is not None:
            steps.append((call or module, module, scale))

    def block(b, resample_attr, scale):
        resamplers = getattr(b, resample_attr, None)
        if hasattr(b, "resnets") and not hasattr(b, "attentions"):  # Up/DownDecoder/EncoderBlock2D
            for r in b.resnets:
                add(r, call=lambda x, r=r: r(x, temb=None))
            for u in resamplers or []:
                add(u, scale)
        else:
            add(b, scale if resamplers else 1.0)

    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D

    def mid(m):
        """UNetMidBlock2D.forward as steps; attention layers in less memory where they can be."""
        if type(m).forward is not UNetMidBlock2D.forward:
            return add(m, call=lambda x: m(x, None))
        add(m.resnets[0], call=lambda x, r=m.resnets[0]: r(x, None))
        for attn, r in zip(m.attentions, m.resnets[1:]):
            if attn is not None:
                lean = _lean_attention_unsupported(attn) is None
                add(attn, call=(lambda x, a=attn: _lean_self_attention(a, x)) if lean else (lambda x, a=attn: a(x)))
            add(r, call=lambda x, r=r: r(x, None))

    if kind == "decode":
        d = vae.decoder
        add(vae.post_quant_conv)
        add(d.conv_in)
        mid(d.mid_block)
        for b in d.up_blocks:
            block(b, "upsamplers", 2.0)
        for m in (d.conv_norm_out, d.conv_act, d.conv_out):
            add(m)
    else:
        e = vae.encoder
        add(e.conv_in)
        for b in e.down_blocks:
            block(b, "downsamplers", 0.5)
        mid(e.mid_block)
        for m in (e.conv_norm_out, e.conv_act, e.conv_out, vae.quant_conv):
            add(m)
    return steps


def _sequential(steps) -> Callable:
    def run(x):
        for call, _, _ in steps:
            x = call(x)
        return x
    return run


def _reaches(steps, res: float) -> tuple[list[int], int]:
    """Latent pixels of input (per side) that the input of each GroupNorm in `steps` (in
    call order) depends on, and that one output pixel of `steps` depends on (convolutions
    only; GroupNorm is handled by the statistics). res: pixels per latent pixel at the input
    of steps. A context this wide makes a tile's core exact. Assumes modules are called in
    registration order, as in diffusers' resnets (norm1, conv1, norm2, conv2)."""
    radius, norms = 0.0, []
    for _, module, scale in steps:
        at = res * max(scale, 1.0)  # an upsampler's conv runs after its interpolation
        for m in module.modules():
            if isinstance(m, nn.GroupNorm):
                norms.append(int(-(-radius // 1)))
            elif isinstance(m, nn.Conv2d):
                k, d = m.kernel_size[0], m.dilation[0]
                reach = (k - 1) * d if m.stride[0] > 1 else (k - 1) // 2 * d  # stride-2 pad (0, 1): one-sided
                radius += reach / at
        res *= scale
    return norms, int(-(-radius // 1))


def _fit_spans(n: int, tile: int, margin: int, unit: int) -> list[tuple[int, int]]:
    """The fewest equal, abutting cores (multiples of `unit`) covering [0, n) whose windows
    (core plus `margin` on each side that has a neighbour) fit in `tile`. Cores do not shrink
    below a quarter tile: where the margins leave less (a tile smaller than about 2.5x the
    receptive field), windows exceed the tile instead of the run splitting into hundreds of
    tiles that are mostly margin (an encode with 64-px tiles took 40x diffusers' time so)."""
    floor = max(unit, tile // 4 // unit * unit)
    k = 1
    while True:
        core = -(-n // (k * unit)) * unit
        sides = min(k - 1, 2)
        if core + sides * margin <= tile or core <= floor:
            return [(a, min(n, a + core)) for a in range(0, n, core)]
        k += 1


class _Job:
    """One tiled decode or encode: the geometry and the per-tile function.

    global_mid: run the part of the network at latent resolution once on the whole input
    instead of per tile. Decode: post_quant_conv, conv_in, the mid block (whose attention
    then sees the whole latent, as in a full decode) and the resnets before the first
    upsampler; tiles run only the up-sampling part. Encode: tiles run the down-sampling
    part into a latent-resolution feature map, then the last resnets, the mid block and
    conv_out run once on it. That map (block_out_channels[-1] channels at latent size,
    32 MiB for a 1024x1024 SD image) is small next to one tile's working set.
    """

    def __init__(self, vae, kind: str, context: Optional[int] = 0, global_mid: bool = False):
        f = vae.tile_overlap_factor
        n_down = len(vae.config.block_out_channels) - 1
        self.factor = 2 ** n_down
        steps = _stages(vae, kind)
        self.pre = self.post = None
        if not global_mid:
            tiled = steps
        elif kind == "decode":
            k = next((i for i, (_, _, sc) in enumerate(steps) if sc != 1), len(steps))
            self.pre, tiled = _sequential(steps[:k]), steps[k:]
        else:
            k = max((i for i, (_, _, sc) in enumerate(steps) if sc != 1), default=-1) + 1
            tiled, self.post = steps[:k], _sequential(steps[k:])
        self.tiled_modules = [m for _, m, _ in tiled]
        self.norm_reach, radius = _reaches(tiled, 1.0 if kind == "decode" else float(self.factor))
        if context is None:  # just enough to make every tile's convolutions exact
            context = radius
        # tiles agree where they overlap: no blending needed (see tiled_run's fit_tile)
        self.exact_tiles = global_mid and context >= radius
        self.unit = 1 if kind == "decode" else self.factor  # input pixels per output step
        # extra input pixels run around each tile, then cropped off; given in latent pixels,
        # so encode windows stay aligned to the downsampling
        self.context = context if kind == "decode" else context * self.factor
        if kind == "decode":
            self.tile_in, self.tile_out = vae.tile_latent_min_size, vae.tile_sample_min_size
            self.out_extent = lambda n: n * 2 ** n_down
        else:
            self.tile_in, self.tile_out = vae.tile_sample_min_size, vae.tile_latent_min_size

            def out_extent(n):
                for _ in range(n_down):  # each Downsample2D: pad (0,1,0,1), 3x3 stride-2 conv -> floor(n/2)
                    n //= 2
                return n
            self.out_extent = out_extent
        # without the split, the tile runs the whole module as diffusers does (same numbers)
        if global_mid:
            self.run = _sequential(tiled)
        elif kind == "decode":
            self.run = lambda x: vae.decoder(vae.post_quant_conv(x) if vae.post_quant_conv is not None else x)
        else:
            self.run = lambda x: vae.quant_conv(vae.encoder(x)) if vae.quant_conv is not None else vae.encoder(x)
        self.kind = kind
        self.stride = int(self.tile_in * (1 - f))       # as diffusers: overlap_size
        self.extent = int(self.tile_out * f)            # as diffusers: blend_extent
        self.row_limit = self.tile_out - self.extent    # as diffusers: row_limit
        if self.stride < 1:
            _fail(f"tile_overlap_factor={f} leaves no stride between {self.tile_in}-pixel tiles")

    def window(self, span, n: int) -> tuple[int, int]:
        """The input range run for a tile span: the span plus `context` on each side."""
        return max(0, span[0] - self.context), min(n, span[1] + self.context)

    def tile(self, x: torch.Tensor, ys, xs) -> torch.Tensor:
        """Runs one tile; with context, on a larger window whose extra border is cropped off
        again, so the tile's own pixels see their real neighbours instead of zero padding."""
        (y0, y1), (x0, x1) = self.window(ys, x.shape[-2]), self.window(xs, x.shape[-1])
        t = self.run(x[..., y0:y1, x0:x1])
        if self.context:
            cy, cx = self.out_extent(ys[0] - y0), self.out_extent(xs[0] - x0)
            t = t[..., cy:cy + self.out_extent(ys[1] - ys[0]), cx:cx + self.out_extent(xs[1] - xs[0])].contiguous()
        want = (self.out_extent(ys[1] - ys[0]), self.out_extent(xs[1] - xs[0]))
        if tuple(t.shape[-2:]) != want:
            _fail(f"a {ys[1] - ys[0]}x{xs[1] - xs[0]} input tile gave a {tuple(t.shape[-2:])} output, expected {want}; "
                  f"this VAE's {self.kind}r does not scale like AutoencoderKL's")
        return t


def _exact_stats(job: _Job, h: torch.Tensor, stats: GroupNormStats, layers: int) -> dict:
    """Exact whole-image statistics of the first `layers` GroupNorm calls of the tiled part,
    from full-width strips of `h` (each about one tile's area), each run with the margin that
    layer's input depends on and stopped at that layer (mode "exact"). Layer k needs layers
    before it normalised exactly, so each layer is one more pass: k convolutions per pixel."""
    W, unit = h.shape[-1], job.unit
    rows = max(unit, job.tile_in * job.tile_in // W // unit * unit)
    stats.fixed, stats.mode = {}, "exact"
    for reach in job.norm_reach[:layers]:
        margin = reach * unit
        for a in range(0, h.shape[-2], rows):
            b = min(h.shape[-2], a + rows)
            y0, y1 = max(0, a - margin), min(h.shape[-2], b + margin)
            stats.crop = (a - y0, y1 - b, y1 - y0)
            stats.start_tile()
            try:
                job.run(h[..., y0:y1, :])
            except _Stop:
                pass
        done = stats.fixed
        stats.finish()  # the new layer's sums -> fixed
        stats.fixed.update(done)
    return dict(stats.fixed)


def _estimate(job: _Job, inputs: list, stats: GroupNormStats) -> dict:
    """Every tiled GroupNorm's statistics, pooled over runs of the tiled part on `inputs`."""
    stats.fixed, stats.mode = {}, "collect"
    for inp in inputs:
        stats.start_tile()
        job.run(inp)
    stats.finish()
    return stats.fixed


def _misfit(est: dict, exact: dict) -> float:
    """How far an estimate's statistics are from the exact ones (in units of the exact std)."""
    err = 0.0
    for key, (m0, v0) in exact.items():
        m, v = est[key]
        err += float(((m - m0) ** 2 / v0.clamp_min(1e-12)).mean() + ((v / v0.clamp_min(1e-12)).sqrt() - 1).pow(2).mean())
    return err


def _subsample(t: torch.Tensor, size: int) -> torch.Tensor:
    """At most size x size pixels of t, evenly spread (the middle pixel of each of `size`
    equal bands per axis; for size = n / 2 every second pixel)."""
    for dim in (-2, -1):
        n = t.shape[dim]
        if n > size:
            t = t.index_select(dim, ((torch.arange(size, device=t.device) * 2 + 1) * n // (2 * size)))
    return t


def _crops(job: _Job, h: torch.Tensor, size: int, per_axis: int = 2) -> list:
    """per_axis^2 crops of `h` at full resolution, each size/per_axis on a side (so all of them
    cost one tile's run), centred in equal cells of the image. Pooled by _estimate (each crop
    normalised with its own statistics while they are collected), they give an estimate with
    no aliasing, unlike a subsample: better where the input has structure at the pixel scale
    (an image to encode), worse where it varies over the whole image."""
    side = [max(job.unit, min(n, size // per_axis) // job.unit * job.unit) for n in h.shape[-2:]]
    starts = [sorted({max(0, min(n - c, (2 * i + 1) * n // (2 * per_axis) - c // 2)) // job.unit * job.unit
                      for i in range(per_axis)}) for n, c in zip(h.shape[-2:], side)]
    return [h[..., y:y + side[0], x:x + side[1]] for y in starts[0] for x in starts[1]]


def _gather_stats(job: _Job, x: torch.Tensor, h: torch.Tensor, stats: GroupNormStats, exact_layers: int,
                  size: int) -> None:
    """Whole-image statistics for every tiled GroupNorm.

    The first `exact_layers` exactly (_exact_stats). The rest are estimated from small full
    runs on an evenly spread subsample that fits in one tile, so every layer sees the whole image.
    Subsampled, not averaged: averaging would shrink the variance of noisy inputs. `size`:
    the subsample's side (input pixels), at most a tile window's, so these runs need no more
    memory than a tile's. With
    global_mid (x: latents, h: their global features) two subsamples: of the latents, run
    through the global part again (exact in distribution for white-noise latents, whose
    subsample is white noise too), and of the features (closer for smooth latents, whose
    features a stride barely changes). Each alone loses 5-10 dB on the other kind of input;
    they are mixed with weights set by how well each predicts the exact layers (the one that
    misses them by less gets more weight), which tracks which kind of input this is: on a
    half-width SD VAE at 512 px the mix leans 0.77 on the latent subsample for white-noise
    latents and 0.99 on the feature subsample for smooth ones. Encode (x: an image, no global
    part before the tiles) mixes the image's subsample with full-resolution crops
    (_crops), by the same weights."""
    exact = _exact_stats(job, h, stats, exact_layers) if exact_layers else {}
    ests = [_estimate(job, [_subsample(h, size)], stats)]
    if job.pre is not None:
        ests.append(_estimate(job, [job.pre(_subsample(x, size))], stats))
    if exact and job.kind == "encode":
        # an image's subsample aliases; latents and their features do not: on the SD VAE at
        # 1024 px the crops lifted encode from 44.2 to 48.7 dB and cost decode 0.7 dB (random
        # latents; smooth: no change). Used only where the exact layers can weigh it.
        ests.append(_estimate(job, _crops(job, h, size), stats))
    if len(ests) == 1 or not exact:
        weights = [1.0 / len(ests)] * len(ests)
    else:
        # weights ~ 1 / misfit^2: sharper than 1 / misfit, which gained 0.3-0.6 dB less on a
        # half-width SD VAE at 512 px (random and smooth latents)
        miss = [_misfit(e, exact) ** 2 for e in ests]
        if min(miss) == 0:
            weights = [float(m == 0) / miss.count(0) for m in miss]
        else:
            inv = [1 / m for m in miss]
            weights = [v / sum(inv) for v in inv]
    stats.fixed = {}
    for key in ests[0]:
        # a mixture of the estimates: mean and mean square weighted
        mean = sum(w * e[key][0] for w, e in zip(weights, ests))
        sq = sum(w * (e[key][1] + e[key][0] ** 2) for w, e in zip(weights, ests))
        stats.fixed[key] = (mean, (sq - mean * mean).clamp_min(0))
    stats.fixed.update(exact)
    stats.weights = weights
    stats.mode = "apply"


def _stream_diffusers(job: _Job, x: torch.Tensor, rows, cols, stats) -> torch.Tensor:
    """diffusers' blend_v/blend_h/crop, tile by tile into one output (same numbers)."""
    R, E = job.row_limit, job.extent
    heights = [min(R, job.out_extent(b - a)) for a, b in rows]
    widths = [min(R, job.out_extent(b - a)) for a, b in cols]
    oy = [sum(heights[:i]) for i in range(len(rows))]
    ox = [sum(widths[:j]) for j in range(len(cols))]
    out = None
    bottoms: list = [None] * len(cols)  # blended bottom rows of each tile of the previous tile row
    for r, ys in enumerate(rows):
        right = None                     # blended right columns of the previous tile in this row
        for c, xs in enumerate(cols):
            if stats is not None:
                stats.start_tile()
            tile = job.tile(x, ys, xs)
            if out is None:
                out = tile.new_empty((*tile.shape[:-2], sum(heights), sum(widths)))
            th, tw = tile.shape[-2:]
            keep_b = min(E, th) if r + 1 < len(rows) else 0
            keep_r = min(E, tw) if c + 1 < len(cols) else 0
            bottoms[c], right = tile_blend_diffusers(tile, out, oy[r], ox[c], (min(R, th), min(R, tw)),
                                                     bottoms[c], right, keep_b, keep_r)
            del tile
    return out


def _out_spans(job: _Job, spans, scale_num: int, scale_den: int):
    """Output ranges of input spans for normalized mode (input start * scale)."""
    out = []
    for a, b in spans:
        if (a * scale_num) % scale_den:
            _fail(f"normalized mode needs tile starts divisible by {scale_den} to place encoded tiles exactly "
                  f"(start {a}); use mode='diffusers' or a tile size/overlap whose stride is a multiple of {scale_den}")
        s = a * scale_num // scale_den
        out.append((s, s + job.out_extent(b - a)))
    return out


def _overlaps(spans, i):
    before = max(0, spans[i - 1][1] - spans[i][0]) if i > 0 else 0
    after = max(0, spans[i][1] - spans[i + 1][0]) if i + 1 < len(spans) else 0
    size = spans[i][1] - spans[i][0]
    return min(before, size), min(after, size)


def _stream_normalized(job: _Job, x: torch.Tensor, rows, cols, stats) -> torch.Tensor:
    """Weighted accumulation with symmetric ramps, normalised by separable weight sums."""
    num, den = (job.factor, 1) if job.kind == "decode" else (1, job.factor)
    orows, ocols = _out_spans(job, rows, num, den), _out_spans(job, cols, num, den)
    H, W = max(b for _, b in orows), max(b for _, b in ocols)
    out = None
    for r, ys in enumerate(rows):
        top, bottom = _overlaps(orows, r)
        for c, xs in enumerate(cols):
            left, right = _overlaps(ocols, c)
            if stats is not None:
                stats.start_tile()
            tile = job.tile(x, ys, xs)
            if out is None:
                out = tile.new_zeros((*tile.shape[:-2], H, W))
            tile_blend_normalized(tile, out, orows[r][0], ocols[c][0], (top, bottom, left, right))
            del tile
    wy = torch.zeros(H, device=out.device)
    wx = torch.zeros(W, device=out.device)
    for i, (a, b) in enumerate(orows):
        wy[a:b] += edge_weights(b - a, *_overlaps(orows, i), device=out.device)
    for j, (a, b) in enumerate(ocols):
        wx[a:b] += edge_weights(b - a, *_overlaps(ocols, j), device=out.device)
    # in place and per axis: no full-size weight image
    out.div_(wy[:, None])
    out.div_(wx)
    return out


TONES = (False, True)


def tiled_run(vae, x: torch.Tensor, kind: str, mode: str = "normalized", consistent_tones=False,
              context: Optional[int] = 0, global_mid: bool = False, exact_layers: int = 2,
              fit_tile: Optional[bool] = None) -> torch.Tensor:
    """Tiled decode (latents -> image) or encode (image -> moments) of `x`, streaming tiles.

    context: latent pixels of real neighbourhood run around each tile (x8 image pixels when
    encoding) and cropped off before blending; None: the tiled part's receptive field.
    consistent_tones: False: each tile its own GroupNorm statistics; True: whole-image
    statistics from a strided subsample (_gather_stats), the first `exact_layers` exact.
    global_mid: see _Job.
    fit_tile (normalized mode): the tiles' windows, context included, fit in one tile
    (tile_latent_min_size), so a tile's run needs no more memory than a plain tile's. When
    the tiles are exact (global_mid, consistent_tones, context >= the receptive field) they
    agree where they would overlap, so the cores abut and nothing is blended; otherwise the
    cores keep tile_overlap_factor. Default: on when the tiles are exact. Off: diffusers'
    tile grid, each tile run with its context around it (larger windows, more memory).
    """
    if mode not in MODES:
        _fail(f"mode must be one of {MODES}, got {mode!r}")
    if consistent_tones not in TONES:
        _fail(f"consistent_tones must be one of {TONES}, got {consistent_tones!r}")
    if not isinstance(exact_layers, int) or exact_layers < 0:
        _fail(f"exact_layers must be a non-negative int, got {exact_layers!r}")
    job = _Job(vae, kind, context, global_mid)
    exact = job.exact_tiles and bool(consistent_tones)
    if fit_tile is None:
        fit_tile = exact
    h = job.pre(x) if job.pre is not None else x
    if fit_tile and mode == "normalized":
        if exact:
            rows, cols = (_fit_spans(n, job.tile_in, job.context, job.unit) for n in h.shape[-2:])
        else:  # diffusers' grid of smaller cores
            core = max(job.unit, (job.tile_in - 2 * job.context) // job.unit * job.unit)
            stride = max(job.unit, int(core * (1 - vae.tile_overlap_factor)) // job.unit * job.unit)
            rows, cols = (_spans(n, core, stride) for n in h.shape[-2:])
    else:
        rows = _spans(h.shape[-2], job.tile_in, job.stride)
        cols = _spans(h.shape[-1], job.tile_in, job.stride)
    stream = _stream_diffusers if mode == "diffusers" else _stream_normalized
    if not consistent_tones:
        out = stream(job, h, rows, cols, None)
    else:
        stats = GroupNormStats(*job.tiled_modules)
        with stats.patched():
            windows = [job.window(span, n) for spans, n in ((rows, h.shape[-2]), (cols, h.shape[-1])) for span in spans]
            size = max(b - a for a, b in windows) if fit_tile else job.tile_in
            _gather_stats(job, x, h, stats, exact_layers, min(size, job.tile_in))
            out = stream(job, h, rows, cols, stats)
    del h
    return job.post(out) if job.post is not None else out


# ----------------------------------------------------------------------------- patching

def _is_autoencoder_kl(vae) -> bool:
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        return False
    return isinstance(vae, AutoencoderKL)


def tile_vae(vae, mode: str = "normalized", consistent_tones=True, tile_size: Optional[int] = None,
             overlap: Optional[float] = None, context: Optional[int] = None, global_mid: Optional[bool] = None,
             exact_layers: int = 2, fit_tile: Optional[bool] = None, enable: bool = True) -> dict:
    """Make this AutoencoderKL instance decode/encode large images with streaming tiles.

    Patches the instance's tiled_decode / _tiled_encode / tiled_encode (never the class,
    never forward, so accelerate offload hooks keep working). diffusers' own _decode /
    _encode still decide when to tile (use_tiling and the image larger than a tile) and
    decode()/encode() still split the batch when use_slicing is on.
    tile_size: output-side tile size in pixels (sets tile_sample_min_size and
    tile_latent_min_size); overlap: tile_overlap_factor.
    global_mid: run the latent-resolution part (mid block with its attention) once on the
    whole input and tile only the up/down-sampling part (default: on in normalized mode, off
    in diffusers mode so that mode gives diffusers' numbers).
    context: latent pixels of real neighbourhood run around each tile and cropped off
    (default: the tiled part's receptive field with global_mid (7 for the SD VAE), else
    max(4, tile_latent_min_size // 8) in normalized mode and 0 in diffusers mode).
    consistent_tones: normalise every tile with whole-image GroupNorm statistics from a
    strided subsample instead of the tile's own (see README for what each buys).
    exact_layers: with consistent_tones, how many of the first tiled GroupNorms get their
    exact whole-image statistics (one more pass over the image in strips each; they also
    weigh the subsample estimates). fit_tile: see tiled_run.
    enable: also turn use_tiling on.
    Returns a report dict; other VAE classes are left alone (they keep diffusers' tiling).
    """
    if not _is_autoencoder_kl(vae):
        return {"patched": False, "class": type(vae).__name__,
                "reason": "pyext tiling supports AutoencoderKL only; this VAE keeps diffusers' own tiling"}
    if mode not in MODES:
        _fail(f"mode must be one of {MODES}, got {mode!r}")
    if overlap is not None and not 0 <= overlap < 1:
        _fail(f"overlap must be a fraction in [0, 1), got {overlap!r}")
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if tile_size is not None and (not isinstance(tile_size, int) or tile_size < factor or tile_size % factor):
        _fail(f"tile_size must be a positive multiple of {factor} pixels, got {tile_size!r}")
    if context is not None and (not isinstance(context, int) or context < 0):
        _fail(f"context must be a non-negative int (latent pixels), got {context!r}")
    if consistent_tones not in TONES:
        _fail(f"consistent_tones must be one of {TONES}, got {consistent_tones!r}")
    if not isinstance(exact_layers, int) or exact_layers < 0:
        _fail(f"exact_layers must be a non-negative int, got {exact_layers!r}")
    if global_mid is None:  # diffusers mode defaults to diffusers' numbers
        global_mid = mode == "normalized"
    if _state.get(vae, _STATE) is not None:
        untile_vae(vae)
    state = {"saved": {name: vae.__dict__.get(name) for name in _PATCHED},
             "settings": {k: getattr(vae, k) for k in
                          ("tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor", "use_tiling")}}
    if tile_size is not None:
        vae.tile_sample_min_size, vae.tile_latent_min_size = tile_size, tile_size // factor
    if overlap is not None:
        vae.tile_overlap_factor = overlap
    if enable:
        vae.use_tiling = True

    def _context(self):
        if context is not None or global_mid:  # None: the receptive field of the tiled part
            return context
        return max(4, self.tile_latent_min_size // 8) if mode == "normalized" else 0

    def tiled_decode(self, z, return_dict=True):
        from diffusers.models.autoencoders.vae import DecoderOutput
        dec = tiled_run(self, z, "decode", mode, consistent_tones, _context(self), global_mid, exact_layers, fit_tile)
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    def _tiled_encode(self, x):
        return tiled_run(self, x, "encode", mode, consistent_tones, _context(self), global_mid, exact_layers, fit_tile)

    def tiled_encode(self, x, return_dict=True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        posterior = DiagonalGaussianDistribution(_tiled_encode(self, x))
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    for name, fn in zip(_PATCHED, (tiled_decode, _tiled_encode, tiled_encode)):
        vae.__dict__[name] = types.MethodType(fn, vae)
    _state.put(vae, _STATE, state)
    return {"patched": True, "class": type(vae).__name__, "mode": mode, "consistent_tones": consistent_tones,
            "context": _context(vae), "global_mid": global_mid, "exact_layers": exact_layers, "fit_tile": fit_tile,
            "tile_sample_min_size": vae.tile_sample_min_size, "tile_latent_min_size": vae.tile_latent_min_size,
            "tile_overlap_factor": vae.tile_overlap_factor, "use_tiling": vae.use_tiling,
            "use_slicing": getattr(vae, "use_slicing", False)}


def untile_vae(vae) -> bool:
    """Undo tile_vae on this instance (methods and tile settings); False if it was not patched."""
    state = _state.pop(vae, _STATE)
    if state is None:
        return False
    for name, old in state["saved"].items():
        if old is None:
            vae.__dict__.pop(name, None)
        else:
            vae.__dict__[name] = old
    for k, v in state["settings"].items():
        setattr(vae, k, v)
    return True

