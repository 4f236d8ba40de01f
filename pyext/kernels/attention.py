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

Launch configurations (`configs`): a few candidates per head-dim width and dtype, the
first the default. Every one is compiled for sm_80 and sm_90 by `python -m pyext kernels`
(tests/test_kernels_compile.py), and the defaults are those that compile without register
spills there; on a GPU, measured dispatch times the candidates and keeps the fastest.
No GPU has timed them yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import Config, config, interpreting, tune

LOG2E = 1.4426950408889634
MAX_PARTS = 3

# Candidates by the padded head-dim width sum(head_dim_parts(d)) (up to the key) and by whether
# the inputs are fp32 (exact "ieee" dots keep fp32 operands in registers: smaller tiles). The
# default (first) of each is spill-free on sm_80 and sm_90 (`python -m pyext kernels`).
_CONFIGS_16BIT = {
    64: [config(4, 3, BLOCK_M=64, BLOCK_N=64), config(8, 3, BLOCK_M=128, BLOCK_N=64),
         config(4, 2, BLOCK_M=64, BLOCK_N=32)],
    96: [config(8, 2, BLOCK_M=128, BLOCK_N=32), config(8, 2, BLOCK_M=64, BLOCK_N=32)],
    128: [config(8, 2, BLOCK_M=64, BLOCK_N=64), config(8, 2, BLOCK_M=64, BLOCK_N=32)],
    192: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    256: [config(8, 2, BLOCK_M=32, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=64)],
}
_CONFIGS_FP32 = {
    64: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(4, 2, BLOCK_M=32, BLOCK_N=32)],
    128: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    192: [config(8, 2, BLOCK_M=32, BLOCK_N=16), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    256: [config(4, 2, BLOCK_M=16, BLOCK_N=32), config(8, 2, BLOCK_M=16, BLOCK_N=32)],
}
_INTERPRETER = [config(4, 1, BLOCK_M=32, BLOCK_N=32)]  # the interpreter runs each program in numpy


def head_dim_parts(d: int) -> tuple[int, int, int] | None:
    """Widths (powers of two, >= 16, zeros for absent parts) that cover d columns, or None.

    Greedy: up to two exact powers of two >= 16, then whatever is left becomes one
    last part rounded up to a power of two >= 16 whose extra columns are masked
    (100 = 64 + 32 + 16[4 used], 255 = 128 + 64 + 64[63 used]). Parts are at most 128 wide
    (256 = 128 + 128), and at most 64 between 129 and 192 (160 = 64 + 64 + 32): 128 + 32
    spilled registers on sm_80 and sm_90 in every tile size tried. None outside 1..256.
    """
    if d < 1 or d > 256:
        return None
    parts, rest = [], d
    widest = 64 if 128 < d <= 192 else 128
    while rest >= 16 and len(parts) < MAX_PARTS - 1:
        p = min(widest, 1 << (rest.bit_length() - 1))
        parts.append(p)
        rest -= p
    if rest > 0:
        parts.append(max(16, 1 << (rest - 1).bit_length()))
    return tuple(parts + [0] * (MAX_PARTS - len(parts)))


def configs(d: int, dtype: torch.dtype) -> list[Config]:
    """Launch candidates for head dim d (1..256) and the input dtype, the default first."""
    if interpreting():
        return _INTERPRETER
    width = sum(head_dim_parts(d))
    table = _CONFIGS_FP32 if dtype == torch.float32 else _CONFIGS_16BIT
    return table[next(w for w in sorted(table) if width <= w)]


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
        # A row whose keys so far all score -inf subtracts 0: exp2(-inf - -inf) would be NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
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
    # fp32 inputs must not be silently rounded to tf32 on tensor cores.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def launch(cfg: Config) -> torch.Tensor:
        _attention_fwd[(triton.cdiv(SQ, dict(cfg.blocks)["BLOCK_M"]), B * H)](
            q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, SQ, SKV, float(scale) * LOG2E,
            D=D, P0=parts[0], P1=parts[1], P2=parts[2], PRECISION=precision, **cfg.launch_kwargs(),
        )
        return out

    key = f"{str(q.dtype).removeprefix('torch.')} d{D} sq{triton.next_power_of_2(SQ)} skv{triton.next_power_of_2(SKV)}"
    cfg = tune("attention:triton", key, q.device, configs(D, q.dtype), lambda c: launch(c).clone())
    return launch(cfg)


def signature(dtype: torch.dtype, d: int, cfg: Config) -> tuple[dict, dict]:
    """(signature, constexprs) of _attention_fwd to compile it without a GPU: 32-bit strides and sizes,
    head-dim strides of 1 (Triton specialises an integer argument equal to 1 at launch; every layout
    diffusers passes, (B, H, S, D) or its (B, S, H, D) transpose, has them)."""
    ty = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    sig = {name: "i32" for name in _attention_fwd.arg_names}
    sig.update({p: ty for p in "QKVO"}, qk_scale="fp32")
    parts = head_dim_parts(d)
    constexprs = dict(sqd=1, skd=1, svd=1, sod=1, D=d, P0=parts[0], P1=parts[1], P2=parts[2],
                      PRECISION="ieee" if dtype == torch.float32 else "tf32", **dict(cfg.blocks))
    return {**sig, **{name: "constexpr" for name in constexprs}}, constexprs


def waste(d: int) -> float:
    """Fraction of the dot-product columns that are masked padding for head dim d."""
    return 1.0 - d / sum(head_dim_parts(d))


__all__ = ["attention_triton", "configs", "head_dim_parts", "signature", "waste"]
