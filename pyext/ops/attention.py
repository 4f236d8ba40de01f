"""Memory-efficient attention: softmax(q @ k^T * scale) @ v, SDPA's (batch, heads, seq, head_dim) layout.

Self- and cross-attention (k/v length may differ from q length), no mask, fp16 /
bf16 / fp32. The reference computes in fp32 and is the test oracle; the fast
backends never materialise the (seq_q, seq_kv) score matrix.
"""
from __future__ import annotations

import importlib.util
import math
from functools import cache, partial
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.kernels import interpreter_advisory, triton_devices, triton_unavailable
from pyext.ops._library import define, like_strides
from pyext.ops._triton import TRITON_NOTES, triton_dtypes

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (batch, heads, q length, kv length, head_dim) the op tests run every backend on: self- and
# cross-attention, a single query or key, head dims of SD (40, 80, 160) and odd ones.
TEST_SHAPES = ((1, 2, 9, 77, 40), (2, 1, 37, 45, 64), (1, 2, 16, 1, 33), (1, 1, 1, 33, 160), (1, 1, 5, 7, 1))


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.attention: {msg}")


def check_inputs(q, k, v, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            _fail(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        _fail(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        _fail(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head_dim")
    if q.shape[3] == 0:
        _fail(f"head_dim is 0 (q {tuple(q.shape)}); supported: head_dim >= 1")
    if k.shape[2] == 0 and q.shape[2] > 0:
        _fail("k/v have zero length: softmax over no keys is undefined")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        _fail(f"scale must be a finite float or None, got {scale!r}")


def attention_reference(q, k, v, scale: Optional[float] = None) -> torch.Tensor:
    """Naive attention in fp32 (materialises the scores): the oracle, not a fast path."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _scale(q, scale) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


# ----------------------------------------------------------------------------- cpp (CPU)

def _cpp_slower(q, k, v, scale):
    # The AVX-512 paths beat CPU SDPA on every SD1.5/SDXL/Flux shape and dtype tried, the AVX2
    # and scalar paths do not (`python -m bench.attention`; figures in docs/benchmarks.md). So
    # auto-dispatch takes cpp only with AVX-512 in static dispatch (measured dispatch times it);
    # backend="cpp" runs any path (PYEXT_CPU_SIMD caps it).
    best = torch.ops.pyext_C.attention_paths()[0]
    if not best.startswith("avx512"):
        return [f"the C++ {best} path is slower than sdpa on CPU (measured); it runs when forced"]
    return []


def _cpp(q, k, v, scale):
    return torch.ops.pyext_C.attention(q, k, v, _scale(q, scale), "")[0]


# ----------------------------------------------------------------------------- triton (CUDA)

def _triton(q, k, v, scale):
    from pyext.kernels.attention import attention_triton

    return attention_triton(q, k, v, _scale(q, scale))


# ----------------------------------------------------------------------------- PyTorch backends

def _amax_abs(x) -> float:
    """max |x| as a Python float, NaN when x holds one. aminmax, not vector_norm(x, inf): the
    latter is ~25x slower on CPU on large tensors, and abs() would copy x. The order of the
    elements does not matter, so a large permuted dense tensor (diffusers' (B, S, H, D)
    transposed to (B, H, S, D)) is read in memory order, several times faster than through its
    strides; a small one is read as it is, where the call's overhead is the cost."""
    if x.numel() > 4096 and not x.is_contiguous():
        dense = x.permute(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
        x = dense if dense.is_contiguous() else x
    low, high = (t.item() for t in torch.aminmax(x))  # CPU tensors only: no device sync
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def _sdpa_guard(q, k, v, scale):
    # torch's CPU SDPA returns zeros for rows whose softmax is NaN (a NaN in q or k, a score
    # that is +inf or overflows fp32). A bound on every score, two passes over q and k (small
    # next to the attention), finds the inputs where that cannot happen; others go elsewhere.
    if q.numel() == 0 or k.numel() == 0:
        return []
    bound = _amax_abs(q) * _amax_abs(k) * q.shape[-1] * abs(_scale(q, scale))
    if not bound < 1e37:  # NaN compares False; 0 * inf is NaN
        return ["q or k holds NaN/inf, or scores may overflow fp32: torch's CPU SDPA returns 0 "
                "where softmax gives NaN"]
    return []


def _sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


@cache  # asked on every call (devices are checked after availability): no import-path search each time
def _xformers_unavailable():
    return None if importlib.util.find_spec("xformers") is not None else "xformers is not installed"


def _xformers(q, k, v, scale):
    import xformers.ops as xops

    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


dispatch.register("attention", Backend(
    "cpp", _cpp, unavailable=partial(kernel_missing, "attention"), slower=_cpp_slower, devices=("cpu",),
    dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="C++ flash attention (AVX-512 BF16 / AVX-512 / AVX2 / scalar), O(seq) memory"))
dispatch.register("attention", Backend(
    "triton", _triton, unavailable=triton_unavailable, advisory=interpreter_advisory, devices=triton_devices(),
    dtypes=triton_dtypes(DTYPES), limits={"head_dim": range(1, 257)}, test_shapes=TEST_SHAPES,
    notes={**TRITON_NOTES, "head_dim": "the kernel keeps a head's accumulator in registers"},
    doc="Triton flash attention, head dim split into power-of-two parts; cpu only under TRITON_INTERPRET=1"))

dispatch.register("attention", Backend(
    "sdpa", _sdpa, guard=_sdpa_guard, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="torch.nn.functional.scaled_dot_product_attention"))
dispatch.register("attention", Backend(
    "xformers", _xformers, unavailable=_xformers_unavailable, devices=("cuda",), dtypes=DTYPES,
    test_shapes=TEST_SHAPES, doc="xformers.ops.memory_efficient_attention"))
dispatch.register("attention", Backend(
    "reference", attention_reference, timed=False, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="naive fp32 math; O(seq^2) memory; the test oracle"))

# Self-check (pyext.dispatch): a small input of the variant against the reference, within twice
# the error SDPA itself makes in that dtype at this size (fp32 accumulation, rounded outputs).
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _sample(q, k, v, scale):
    g = torch.Generator(device=q.device).manual_seed(0)

    def rand(n):
        return torch.randn(1, 2, n, q.shape[-1], generator=g, device=q.device).to(q.dtype)

    return rand(37), rand(45), rand(45), scale


def _close(out, ref, args):
    err = (out.float() - ref.float()).abs().max().item()
    return None if err <= _CHECK_TOLERANCE[ref.dtype] else f"max error {err:.3g} (tolerance {_CHECK_TOLERANCE[ref.dtype]:g})"


def _example(spec, dtype, device):
    batch, heads, seq_q, seq_kv, head_dim = spec
    q, k, v = (torch.randn(batch, heads, n, head_dim, device=device).to(dtype) for n in (seq_q, seq_kv, seq_kv))
    return q, k, v, None


dispatch.define("attention", check=check_inputs, sample=lambda args: _sample(*args), close=_close,
                variant=lambda args: (str(args[0].dtype), args[0].shape[-1]),
                sizes=lambda args: {"head_dim": args[0].shape[-1]}, example=_example)


def _attention_kernel(q, k, v, scale=None, backend=None):
    out = dispatch.select("attention", (q, k, v, scale), backend).run(q, k, v, scale)
    # The output has empty_like(q)'s strides on every backend, as the fake kernel promises: q's
    # own when q is dense (as SDPA does, e.g. the (B, S, H, D)-transposed layout diffusers
    # passes), contiguous otherwise. A custom op may not return one of its inputs either.
    aliased = out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if aliased or out.stride() != like_strides(q):
        out = torch.empty_like(q).copy_(out)
    return out


def _attention_fake(q, k, v, scale=None, backend=None):
    dispatch.check("attention", (q, k, v, scale))
    return torch.empty_like(q)


define("attention(Tensor q, Tensor k, Tensor v, float? scale=None, str? backend=None) -> Tensor",
       _attention_kernel, _attention_fake)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
              backend: Optional[str] = None) -> torch.Tensor:
    """softmax(q @ k^T * scale) @ v with scale defaulting to head_dim ** -0.5; returns q's layout.

    The op validates its inputs (`check_inputs`, the same for torch.ops.pyext.attention); here
    only what the op's schema cannot take is refused first."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        _fail(f"scale must be a finite float or None, got {scale!r}")
    return torch.ops.pyext.attention(q, k, v, None if scale is None else float(scale), backend)
