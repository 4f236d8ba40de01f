"""Triton flash-attention forward: softmax(q k^T * scale + bias) v, online softmax, fp32 accumulation.

Optionally an additive float32 bias (an attention mask, read through its strides with 0 for
broadcast dims), each row's log-sum-exp, and grouped-query heads (several query heads read one
k/v head). Bias and log-sum-exp are constexpr switches: without them the kernel compiles to
the plain one, and a launch with as many k/v heads as query heads passes a group of 1, which
Triton specialises away.

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
spills there, plain and with a bias (which makes another candidate the default in some
classes); on a GPU, measured dispatch times the candidates and keeps the fastest.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import Config, config, interpreting, tune

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # kernels read only constexpr globals
_LN2 = tl.constexpr(0.6931471805599453)
MAX_PARTS = 3

# Candidates by the padded head-dim width sum(head_dim_parts(d)) (up to the key) and by whether
# the inputs are fp32 (exact "ieee" dots keep fp32 operands in registers: smaller tiles). The
# default (first) of each is spill-free on sm_80 and sm_90 (`python -m pyext kernels`).
_CONFIGS_16BIT = {
    # Triton 3.6 on sm_90 computes head dim 40 (32 + 16) wrongly with 4 warps and 64 x 64 tiles.
    64: [config(4, 2, BLOCK_M=64, BLOCK_N=32), config(8, 2, BLOCK_M=64, BLOCK_N=64),
         config(4, 1, BLOCK_M=32, BLOCK_N=32)],
    96: [config(8, 2, BLOCK_M=128, BLOCK_N=32), config(8, 2, BLOCK_M=64, BLOCK_N=32)],
    128: [config(8, 2, BLOCK_M=64, BLOCK_N=64), config(8, 2, BLOCK_M=64, BLOCK_N=32)],
    192: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    256: [config(8, 2, BLOCK_M=32, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=64)],
}
_CONFIGS_FP32 = {
    64: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(4, 2, BLOCK_M=32, BLOCK_N=32)],
    128: [config(8, 2, BLOCK_M=64, BLOCK_N=32), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    192: [config(8, 2, BLOCK_M=32, BLOCK_N=16), config(8, 2, BLOCK_M=32, BLOCK_N=32)],
    256: [config(8, 2, BLOCK_M=16, BLOCK_N=32), config(4, 2, BLOCK_M=16, BLOCK_N=32)],
}
# Where the plain default spills with a feature, the candidate at this index of the class is the
# default with it (fp32 only): a bias's fp32 (BLOCK_M, BLOCK_N) tile is live beside the scores, and
# with the log-sum-exp (no bias) Triton 3.6 spills the 64 x 32 tiles at width 128 on sm_90.
_FP32_DEFAULT_WITH = {"bias": {64: 1}, "lse": {128: 1}}
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


def configs(d: int, dtype: torch.dtype, has_bias: bool = False, has_lse: bool = False) -> list[Config]:
    """Launch candidates for head dim d (1..256), the input dtype and whether a bias is added and
    the log-sum-exp returned, the default first."""
    if interpreting():
        return _INTERPRETER
    width = sum(head_dim_parts(d))
    fp32 = dtype == torch.float32
    table = _CONFIGS_FP32 if fp32 else _CONFIGS_16BIT
    cls = next(w for w in sorted(table) if width <= w)
    feature = "bias" if has_bias else "lse" if has_lse else None
    first = _FP32_DEFAULT_WITH.get(feature, {}).get(cls, 0) if fp32 else 0
    return [table[cls][first]] + table[cls][:first] + table[cls][first + 1:]


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
    Q, K, V, O, Bias, Lse,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod, sbb, sbh, sbs, sbn,
    H, GROUP, SQ, SKV, qk_scale,
    D: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    h_kv = h // GROUP  # grouped-query heads: GROUP consecutive query heads share one k/v head
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    o_base = O + b * sob + h * soh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < SQ
    if HAS_BIAS:  # broadcast dims of the bias have stride 0
        bias_rows = Bias + b * sbb + h * sbh + rows[:, None] * sbs

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
        if HAS_BIAS:  # the bias is in natural-log units: to base 2 like the scores
            bias = tl.load(bias_rows + keys[None, :] * sbn, mask=row_ok[:, None] & key_ok[None, :], other=0.0)
            s = s * qk_scale + bias * _LOG2E
        else:
            s = s * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
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

    # A row the mask hides entirely has l_i = 0: output 0, as SDPA gives, even where a masked key's
    # v is NaN (acc holds 0 * NaN then). Without a mask, l_i = 0 is fp32 overflow: softmax's NaN.
    inv = 1.0 / l_i
    hidden = (l_i == 0.0) & HAS_BIAS
    out_ty = O.dtype.element_ty
    _store_part(o_base, rows, row_ok, sos, sod, tl.where(hidden[:, None], 0.0, acc0 * inv[:, None]).to(out_ty),
                0, P0, D)
    if P1 > 0:
        _store_part(o_base, rows, row_ok, sos, sod, tl.where(hidden[:, None], 0.0, acc1 * inv[:, None]).to(out_ty),
                    P0, P1, D)
    if P2 > 0:
        _store_part(o_base, rows, row_ok, sos, sod, tl.where(hidden[:, None], 0.0, acc2 * inv[:, None]).to(out_ty),
                    P0 + P1, P2, D)
    if RETURN_LSE:  # natural log; a fully masked row gives -inf + log2(0) = -inf
        tl.store(Lse + bh * SQ + rows, (m_i + tl.math.log2(l_i)) * _LN2, mask=row_ok)


def _bias_strides(bias: torch.Tensor, shape: tuple[int, int, int, int], device) -> tuple[int, int, int, int]:
    """bias's strides with 0 where it broadcasts to shape (B, H, Sq, Skv); it is never expanded."""
    if bias.dim() != 4 or bias.dtype != torch.float32 or bias.device != device:
        raise ValueError(f"attention_triton: bias must be a 4-D float32 tensor on {device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if any(n not in (1, want) for n, want in zip(bias.shape, shape)):
        raise ValueError(f"attention_triton: bias {tuple(bias.shape)} does not broadcast to {shape}")
    return tuple(0 if n == 1 else st for n, st in zip(bias.shape, bias.stride()))


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     bias: torch.Tensor | None = None,
                     return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q k^T * scale + bias) v and, with return_lse, each row's natural-log log-sum-exp.

    q (B, H, Sq, D); k, v (B, Hkv, Skv, D) with H a multiple of Hkv (query head h reads k/v head
    h // (H // Hkv)); any strides; head_dim 1..256. bias: float32, broadcastable to (B, H, Sq, Skv),
    -inf allowed; a row whose scores are all -inf gives output 0 and lse -inf. Returns (out, lse):
    out (B, H, Sq, D) in q's dtype, lse float32 (B, H, Sq) contiguous, or None without return_lse.
    """
    B, H, SQ, D = q.shape
    HKV, SKV = k.shape[1], k.shape[2]
    parts = head_dim_parts(D)
    if parts is None:
        raise ValueError(f"attention_triton: head_dim {D} outside 1..256")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or HKV == 0 or H % HKV:
        raise ValueError(f"attention_triton: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "do not fit (B, H, Sq, D), (B, Hkv, Skv, D) with H a multiple of Hkv")
    bias_strides = (0, 0, 0, 0) if bias is None else _bias_strides(bias, (B, H, SQ, SKV), q.device)
    out = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, SQ), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0:
        return out, lse
    scale = D ** -0.5 if scale is None else scale
    # fp32 inputs must not be silently rounded to tf32 on tensor cores.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def launch(cfg: Config) -> torch.Tensor:
        # Without a bias or lse their pointers are never read or written: out stands in.
        _attention_fwd[(triton.cdiv(SQ, dict(cfg.blocks)["BLOCK_M"]), B * H)](
            q, k, v, out, out if bias is None else bias, out if lse is None else lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *bias_strides,
            H, H // HKV, SQ, SKV, float(scale) * LOG2E,
            D=D, P0=parts[0], P1=parts[1], P2=parts[2], PRECISION=precision,
            HAS_BIAS=bias is not None, RETURN_LSE=return_lse, **cfg.launch_kwargs(),
        )
        return out

    key = f"{str(q.dtype).removeprefix('torch.')} d{D} sq{triton.next_power_of_2(SQ)} skv{triton.next_power_of_2(SKV)}"
    key += " bias" * (bias is not None) + " lse" * return_lse
    cfg = tune("attention:triton", key, q.device, configs(D, q.dtype, bias is not None, return_lse),
               lambda c: launch(c).clone(),
               check=lambda out: _slice_problem(out, q, k, v, scale, bias))
    return launch(cfg), lse


def _slice_problem(out, q, k, v, scale, bias) -> str | None:
    """None when out's first rows of the first head match a float64 reference there (not TF32,
    whatever the user's matmul settings): each launch config is judged on its own, since a
    compiler can miscompile some, the default among them."""
    from pyext.kernels import relative_close
    from pyext.reference.attention import attention_reference

    rows = min(q.shape[2], 128)
    ref = attention_reference(q[:1, :1, :rows].double(), k[:1, :1].double(), v[:1, :1].double(), scale,
                              None if bias is None else bias[:1, :1, :rows])
    return relative_close(out[:1, :1, :rows], ref, rel=2e-2 if q.dtype != torch.float32 else 1e-4)


def signature(dtype: torch.dtype, d: int, cfg: Config, has_bias: bool = False, return_lse: bool = False,
              gqa: bool = False) -> tuple[dict, dict]:
    """(signature, constexprs) of _attention_fwd to compile it without a GPU, as `attention_triton`
    launches it: 32-bit strides and sizes, head-dim strides of 1, with a bias a key stride of 1, and
    without gqa (as many k/v heads as query heads) a group of 1. Triton specialises an integer
    argument equal to 1 at launch; every layout diffusers passes, (B, H, S, D) or its (B, S, H, D)
    transpose, and a dense or broadcast mask have those strides."""
    ty = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    sig = {name: "i32" for name in _attention_fwd.arg_names}
    # Without a bias or lse, out's pointer stands in for theirs.
    sig.update({p: ty for p in "QKVO"}, Bias="*fp32" if has_bias else ty, Lse="*fp32" if return_lse else ty,
               qk_scale="fp32")
    parts = head_dim_parts(d)
    constexprs = dict(sqd=1, skd=1, svd=1, sod=1, D=d, P0=parts[0], P1=parts[1], P2=parts[2],
                      PRECISION="ieee" if dtype == torch.float32 else "tf32", HAS_BIAS=has_bias,
                      RETURN_LSE=return_lse, **dict(cfg.blocks))
    if has_bias:
        constexprs["sbn"] = 1
    if not gqa:
        constexprs["GROUP"] = 1
    return {**sig, **{name: "constexpr" for name in constexprs}}, constexprs


def waste(d: int) -> float:
    """Fraction of the dot-product columns that are masked padding for head dim d."""
    return 1.0 - d / sum(head_dim_parts(d))


__all__ = ["attention_triton", "configs", "head_dim_parts", "signature", "waste"]
