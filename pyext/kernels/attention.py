"""Triton flash-attention forward: softmax(q k^T * scale) v, online softmax, fp32 accumulation.

Head dims are handled exactly, without padding to the next power of two: the head
dim is split into up to three parts, each loaded and multiplied on its own
(`head_dim_parts`): 40 = 32 + 8, 80 = 64 + 16, 160 = 128 + 32, 64 and 128 whole.
`tl.dot` needs an inner dimension >= 16, so a part narrower than 16 (the 8 of
40, the 1 of 33) is loaded as 16 columns with the missing ones masked to zero.
That costs 8 wasted columns of 48 for head dim 40 (17% of the tensor-core work of
that head; padding 40 to 64 would waste 37%); a broadcast multiply-sum for the
8-wide part would avoid the waste but runs on CUDA cores at a fraction of the
tensor-core rate, so the masked 16-wide dot is the cheaper choice.

Block sizes (`BLOCK_CONFIGS`) are NOT tuned on a GPU (none was available): they
follow the public Triton fused-attention tutorial (128 x 64 tiles, 4-8 warps,
3 stages) and shrink for wide heads to bound register use. Tune them on sm_80/sm_90.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import interpreting

LOG2E = 1.4426950408889634
MAX_PARTS = 3

# head_dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages). Untuned (see module docstring).
BLOCK_CONFIGS = {
    40: (128, 64, 4, 3),
    64: (128, 64, 4, 3),
    80: (128, 64, 8, 3),
    128: (128, 64, 8, 3),
    160: (64, 64, 4, 3),
}


def head_dim_parts(d: int) -> tuple[int, int, int] | None:
    """Widths (powers of two, >= 16, zeros for absent parts) that cover d columns, or None.

    Greedy: up to two exact powers of two >= 16, then whatever is left becomes one
    last part rounded up to a power of two >= 16 whose extra columns are masked
    (100 = 64 + 32 + 16[4 used], 255 = 128 + 64 + 64[63 used]). None outside 1..256.
    """
    if d < 1 or d > 256:
        return None
    parts, rest = [], d
    while rest >= 16 and len(parts) < MAX_PARTS - 1:
        p = 1 << (rest.bit_length() - 1)
        parts.append(p)
        rest -= p
    if rest > 0:
        parts.append(max(16, 1 << (rest - 1).bit_length()))
    return tuple(parts + [0] * (MAX_PARTS - len(parts)))


def _config(d: int) -> tuple[int, int, int, int]:
    if interpreting():  # the interpreter runs each program in numpy: few, mid-sized tiles
        return 32, 32, 4, 1
    if d in BLOCK_CONFIGS:
        return BLOCK_CONFIGS[d]
    width = sum(head_dim_parts(d))
    return (128, 64, 4, 3) if width <= 64 else (128, 64, 8, 3) if width <= 128 else (64, 32, 4, 2)


@triton.jit
def _load_part(base, rows, row_ok, stride_s, stride_d, OFF: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    cols = OFF + tl.arange(0, P)
    mask = row_ok[:, None]
    if OFF + P > D:  # only the last part can stick out past the head dim
        mask = mask & (cols[None, :] < D)
    return tl.load(base + rows[:, None] * stride_s + cols[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _store_part(base, rows, row_ok, stride_s, stride_d, x, OFF: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    cols = OFF + tl.arange(0, P)
    mask = row_ok[:, None]
    if OFF + P > D:
        mask = mask & (cols[None, :] < D)
    tl.store(base + rows[:, None] * stride_s + cols[None, :] * stride_d, x, mask=mask)


@triton.jit
def _attention_fwd(
    Q, K, V, O,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
    H, SQ, SKV, qk_scale,
    D: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    o_base = O + b * sob + h * soh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < SQ

    q0 = _load_part(q_base, rows, row_ok, sqs, sqd, 0, P0, D)
    acc0 = tl.zeros((BLOCK_M, P0), dtype=tl.float32)
    if P1 > 0:
        q1 = _load_part(q_base, rows, row_ok, sqs, sqd, P0, P1, D)
        acc1 = tl.zeros((BLOCK_M, P1), dtype=tl.float32)
    if P2 > 0:
        q2 = _load_part(q_base, rows, row_ok, sqs, sqd, P0 + P1, P2, D)
        acc2 = tl.zeros((BLOCK_M, P2), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

    for start in range(0, SKV, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < SKV
        # s = q k^T summed over the head-dim parts; base-2 softmax (scale folded into qk_scale).
        k0 = _load_part(k_base, keys, key_ok, sks, skd, 0, P0, D)
        s = tl.dot(q0, tl.trans(k0), input_precision=PRECISION)
        if P1 > 0:
            k1 = _load_part(k_base, keys, key_ok, sks, skd, P0, P1, D)
            s += tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        if P2 > 0:
            k2 = _load_part(k_base, keys, key_ok, sks, skd, P0 + P1, P2, D)
            s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(V.dtype.element_ty)  # as FlashAttention: probabilities in the input dtype for p @ v
        v0 = _load_part(v_base, keys, key_ok, svs, svd, 0, P0, D)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, v0, input_precision=PRECISION)
        if P1 > 0:
            v1 = _load_part(v_base, keys, key_ok, svs, svd, P0, P1, D)
            acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=PRECISION)
        if P2 > 0:
            v2 = _load_part(v_base, keys, key_ok, svs, svd, P0 + P1, P2, D)
            acc2 = acc2 * alpha[:, None] + tl.dot(p, v2, input_precision=PRECISION)

    inv = 1.0 / l_i
    out_ty = O.dtype.element_ty
    _store_part(o_base, rows, row_ok, sos, sod, (acc0 * inv[:, None]).to(out_ty), 0, P0, D)
    if P1 > 0:
        _store_part(o_base, rows, row_ok, sos, sod, (acc1 * inv[:, None]).to(out_ty), P0, P1, D)
    if P2 > 0:
        _store_part(o_base, rows, row_ok, sos, sod, (acc2 * inv[:, None]).to(out_ty), P0 + P1, P2, D)


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(B, H, Sq, D) x (B, H, Skv, D) -> (B, H, Sq, D); any strides; head_dim 1..256."""
    B, H, SQ, D = q.shape
    SKV = k.shape[2]
    parts = head_dim_parts(D)
    if parts is None:
        raise ValueError(f"attention_triton: head_dim {D} outside 1..256")
    out = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    scale = D ** -0.5 if scale is None else scale
    block_m, block_n, warps, stages = _config(D)
    grid = (triton.cdiv(SQ, block_m), B * H)
    # fp32 inputs must not be silently rounded to tf32 on tensor cores.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _attention_fwd[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, SQ, SKV, float(scale) * LOG2E,
        D=D, P0=parts[0], P1=parts[1], P2=parts[2], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )
    return out


def waste(d: int) -> float:
    """Fraction of the dot-product columns that are masked padding for head dim d."""
    return 1.0 - d / sum(head_dim_parts(d))


__all__ = ["BLOCK_CONFIGS", "attention_triton", "head_dim_parts", "waste"]
