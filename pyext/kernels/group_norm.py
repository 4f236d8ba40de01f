"""Triton GroupNorm (+ per-(n, c) shift, + SiLU), channels-first and channels-last, in three launches.

1. `_gn_stats`, one program per (n, group, chunk): the chunk's count, a pivot m (the mean of its
   first tile) and the fp32 sums of d = x + shift - m and d^2, per lane then reduced. The pivot is
   an average of the chunk's own elements, so |m - mean| is at most std * sqrt(count / tile)
   (Cauchy-Schwarz) and the sums lose little to cancellation, unlike E[x^2] - E[x]^2.
2. `_gn_merge`, one program per (n, group): the chunks' moments merged in float64 in a fixed order
   (no atomics, so the result is reproducible); writes the mean as an fp32 pair hi + lo and rstd.
3. `_gn_apply`, one program per tile of a sample in memory order:
   y = ((x + shift - hi) - lo) * rstd * weight + bias, then SiLU, in x's dtype. Subtracting the
   mean as hi then lo keeps (x - mean) exact-ish where x is close to a large mean.

Offsets within a sample are 32-bit (the op routes larger samples elsewhere). Launch configurations
(`configs`): the default first; every one is compiled for sm_80 and sm_90 by `python -m pyext
kernels` (tests/test_kernels_compile.py). No GPU has timed them yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import Config, config, interpreting, tune

MAX_CHUNKS = 64  # per group: enough programs for a GPU at batch 1 with 32 groups, a small merge

_CONFIGS = [config(4, 2, BLOCK=1024), config(8, 2, BLOCK=2048), config(4, 2, BLOCK=512)]
_INTERPRETER = [config(1, 1, BLOCK=128)]  # the interpreter runs each program in numpy
MERGE_CONFIG = config(1, 1, SPLIT=MAX_CHUNKS)  # what the compile check builds; launches use <= SPLIT


def configs() -> list[Config]:
    """Launch candidates (BLOCK elements per tile, for the stats and apply kernels), the default first."""
    return _INTERPRETER if interpreting() else _CONFIGS


@triton.jit
def _load_group(x_base, shift_base, i, mask, g, C, S, CG, HAS_SHIFT: tl.constexpr, CHANNELS_LAST: tl.constexpr):
    """Elements i (in memory order) of group g of one sample, plus their channel's shift, in fp32."""
    if CHANNELS_LAST:  # a group is CG channels of every pixel
        channel = g * CG + i % CG
        offset = (i // CG) * C + channel
    else:  # a group is CG whole planes, contiguous
        channel = g * CG + i // S
        offset = g * CG * S + i
    v = tl.load(x_base + offset, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        v += tl.load(shift_base + channel, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _gn_stats(x_ptr, shift_ptr, part_ptr, C, S, G, CG, group_len, chunk_len,
              HAS_SHIFT: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    ng = tl.program_id(0)
    chunk = tl.program_id(1)
    n = ng // G
    g = ng % G
    x_base = x_ptr + n.to(tl.int64) * C * S
    shift_base = shift_ptr + n * C
    start = chunk * chunk_len
    stop = tl.minimum(start + chunk_len, group_len)
    lanes = tl.arange(0, BLOCK)
    first = start + lanes
    v = _load_group(x_base, shift_base, first, first < stop, g, C, S, CG, HAS_SHIFT, CHANNELS_LAST)
    pivot = tl.sum(v, 0) / tl.minimum(stop - start, BLOCK).to(tl.float32)
    s1 = tl.zeros((BLOCK,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for tile in range(start, stop, BLOCK):
        i = tile + lanes
        mask = i < stop
        v = _load_group(x_base, shift_base, i, mask, g, C, S, CG, HAS_SHIFT, CHANNELS_LAST)
        d = tl.where(mask, v - pivot, 0.0)
        s1 += d
        s2 += d * d
    out = part_ptr + (ng * tl.num_programs(1) + chunk) * 4
    tl.store(out, (stop - start).to(tl.float32))
    tl.store(out + 1, pivot)
    tl.store(out + 2, tl.sum(s1, 0))
    tl.store(out + 3, tl.sum(s2, 0))


@triton.jit
def _gn_merge(part_ptr, mean_hi_ptr, mean_lo_ptr, rstd_ptr, chunks, eps, SPLIT: tl.constexpr):
    ng = tl.program_id(0)
    k = tl.arange(0, SPLIT)
    mask = k < chunks
    p = part_ptr + (ng * chunks + k) * 4
    count = tl.load(p, mask=mask, other=0.0).to(tl.float64)
    pivot = tl.load(p + 1, mask=mask, other=0.0).to(tl.float64)
    s1 = tl.load(p + 2, mask=mask, other=0.0).to(tl.float64)
    s2 = tl.load(p + 3, mask=mask, other=0.0).to(tl.float64)
    safe = tl.where(mask, count, 1.0)
    mean_k = pivot + s1 / safe  # each chunk's mean and squared deviations about it
    m2_k = s2 - s1 * s1 / safe
    total = tl.sum(count, 0)
    mean = tl.sum(count * mean_k, 0) / total
    dev = mean_k - mean
    var = tl.sum(tl.where(mask, m2_k + count * dev * dev, 0.0), 0) / total
    var = tl.where(var < 0.0, 0.0, var)  # a rounding residue; NaN stays NaN
    hi = mean.to(tl.float32)
    tl.store(mean_hi_ptr + ng, hi)
    tl.store(mean_lo_ptr + ng, (mean - hi.to(tl.float64)).to(tl.float32))
    tl.store(rstd_ptr + ng, (1.0 / tl.sqrt(var + eps)).to(tl.float32))


@triton.jit
def _gn_apply(x_ptr, y_ptr, w_ptr, b_ptr, shift_ptr, mean_hi_ptr, mean_lo_ptr, rstd_ptr, C, S, G, CG,
              HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, SILU: tl.constexpr,
              CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    n = tl.program_id(1)
    i = tile * BLOCK + tl.arange(0, BLOCK)
    mask = i < C * S
    base = n.to(tl.int64) * C * S
    channel = i % C if CHANNELS_LAST else i // S
    group = n * G + channel // CG
    v = tl.load(x_ptr + base + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        v += tl.load(shift_ptr + n * C + channel, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(rstd_ptr + group, mask=mask, other=1.0)
    if HAS_WEIGHT:
        scale *= tl.load(w_ptr + channel, mask=mask, other=1.0).to(tl.float32)
    v = (v - tl.load(mean_hi_ptr + group, mask=mask, other=0.0)) - tl.load(mean_lo_ptr + group, mask=mask, other=0.0)
    v = v * scale
    if HAS_BIAS:
        v += tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        v = v / (1.0 + tl.exp(-v))
    tl.store(y_ptr + base + i, v.to(y_ptr.dtype.element_ty), mask=mask)


def group_norm_triton(x: torch.Tensor, num_groups: int, weight, bias, shift, eps: float, silu: bool) -> torch.Tensor:
    """x (N, C, *spatial) plain contiguous or channels-last; weight/bias (C,), shift (N, C) contiguous or None."""
    N, C = x.shape[:2]
    S = x[0, 0].numel() if N and C else 0
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    channels_last = not x.is_contiguous()
    G = num_groups
    CG = C // G
    group_len = CG * S
    stats = torch.empty((3, N * G), dtype=torch.float32, device=x.device)  # mean hi, mean lo, rstd
    flags = dict(HAS_SHIFT=shift is not None, CHANNELS_LAST=channels_last)

    def launch(cfg: Config) -> torch.Tensor:
        block = dict(cfg.blocks)["BLOCK"]
        chunk_len = max(block, triton.cdiv(triton.cdiv(group_len, MAX_CHUNKS), block) * block)
        chunks = triton.cdiv(group_len, chunk_len)
        parts = torch.empty((N * G, chunks, 4), dtype=torch.float32, device=x.device)
        _gn_stats[(N * G, chunks)](x, x if shift is None else shift, parts, C, S, G, CG, group_len, chunk_len,
                                   **flags, **cfg.launch_kwargs())
        _gn_merge[(N * G,)](parts, stats[0], stats[1], stats[2], chunks, eps,
                            SPLIT=triton.next_power_of_2(chunks), **MERGE_CONFIG.launch_options())
        _gn_apply[(triton.cdiv(C * S, block), N)](
            x, y, x if weight is None else weight, x if bias is None else bias, x if shift is None else shift,
            stats[0], stats[1], stats[2], C, S, G, CG, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            SILU=silu, **flags, **cfg.launch_kwargs())
        return y

    key = (f"{str(x.dtype).removeprefix('torch.')} {'cl' if channels_last else 'cf'} n{N} c{C} g{G} "
           f"s{triton.next_power_of_2(S)}")
    cfg = tune("group_norm:triton", key, x.device, configs(), lambda c: launch(c).clone())
    return launch(cfg)


_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def signature(function: str, dtype: torch.dtype, cfg: Config, channels_last: bool) -> tuple[dict, dict]:
    """(signature, constexprs) of one of the kernels to compile it without a GPU: 32-bit sizes, every
    optional input present (weight and bias in x's dtype) and SiLU on, the most registers."""
    kernel = {"_gn_stats": _gn_stats, "_gn_merge": _gn_merge, "_gn_apply": _gn_apply}[function]
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update({name: _PTR[dtype] for name in ("x_ptr", "y_ptr", "w_ptr", "b_ptr", "shift_ptr") if name in sig})
    sig.update({name: "*fp32" for name in ("part_ptr", "mean_hi_ptr", "mean_lo_ptr", "rstd_ptr") if name in sig})
    if "eps" in sig:
        sig["eps"] = "fp32"
    flags = dict(HAS_WEIGHT=True, HAS_BIAS=True, HAS_SHIFT=True, SILU=True, CHANNELS_LAST=channels_last)
    constexprs = {name: value for name, value in flags.items() if name in sig}
    constexprs.update(cfg.blocks)
    return {**sig, **{name: "constexpr" for name in constexprs}}, constexprs


__all__ = ["configs", "group_norm_triton", "signature"]
