"""Memory-efficient attention: softmax(q @ k^T * scale + mask) @ v, SDPA's (batch, heads, seq, head_dim) layout.

Self- and cross-attention (k/v length may differ from q length), fp16 / bf16 / fp32, with
an optional mask (boolean: True takes part, as SDPA's; or an additive float bias), grouped
query heads (k/v with fewer heads, as SDPA's enable_gqa) and each row's log-sum-exp. With a
mask, a row whose scores are all -inf gives 0 (as SDPA does) and log-sum-exp -inf. The reference
(pyext.reference.attention) computes in fp32 and is the test oracle; the fast backends never
materialise the (seq_q, seq_kv) score matrix.
"""
from __future__ import annotations

import importlib.util
import math
from functools import cache, partial
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import _compat, dispatch
from pyext._ext import has_kernel, kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.kernels import interpreter_advisory, triton_devices, triton_unavailable
from pyext.ops._library import define, like_strides
from pyext.ops._triton import TRITON_NOTES, triton_dtypes
from pyext.reference.attention import attention_reference, mask_as_bias

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (batch, heads, q length, kv length, head_dim[, k/v heads, mask, log-sum-exp]) the op tests run
# backends on: self- and cross-attention, a single query or key, head dims of SD (40, 80, 160)
# and odd ones; then masks (`_example_mask`), grouped heads and the log-sum-exp.
TEST_SHAPES = ((1, 2, 9, 77, 40), (2, 1, 37, 45, 64), (1, 2, 16, 1, 33), (1, 1, 1, 33, 160), (1, 1, 5, 7, 1))
MASKED_SHAPES = ((2, 2, 9, 77, 40, 2, "keys", False), (1, 4, 37, 45, 64, 2, "bias", False),
                 (1, 2, 16, 5, 33, 1, "rows", False))
LSE_SHAPES = ((2, 2, 9, 77, 40, 2, "keys", True), (1, 4, 37, 45, 80, 1, "bias", True), (1, 2, 16, 5, 33, 2, None, True))


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.attention: {msg}")


def check_inputs(q, k, v, scale, attn_mask=None, return_lse=False) -> None:
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
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        _fail(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim, and q's heads "
              "must be a multiple of k's (grouped-query heads)")
    if q.shape[3] == 0:
        _fail(f"head_dim is 0 (q {tuple(q.shape)}); supported: head_dim >= 1")
    if k.shape[2] == 0 and q.shape[2] > 0:
        _fail("k/v have zero length: softmax over no keys is undefined")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        _fail(f"scale must be a finite float or None, got {scale!r}")
    if attn_mask is not None:
        _check_mask(q, k, attn_mask)
    if not isinstance(return_lse, bool):
        _fail(f"return_lse must be True or False, got {return_lse!r}")


def _check_mask(q, k, mask) -> None:
    if not isinstance(mask, torch.Tensor):
        _fail(f"attn_mask must be a tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32):
        _fail(f"attn_mask has dtype {mask.dtype}; supported: bool (True takes part), or an additive "
              f"bias in q's dtype ({q.dtype}) or float32")
    if mask.device != q.device:
        _fail(f"attn_mask is on {mask.device}, q on {q.device}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(reversed(mask.shape), reversed(full))):
        _fail(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, q length, kv length) "
              f"= {full}")


def _scale(q, scale) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


# Every backend runs (q, k, v, scale, attn_mask, return_lse) and returns (out, lse or None).

# ----------------------------------------------------------------------------- cpp (CPU)

def _cpp_slower(q, k, v, scale, mask, lse):
    # The AVX-512 paths beat CPU SDPA on every SD1.5/SDXL/Flux shape and dtype tried; the AVX2
    # path is ahead of it at some shapes and behind at others, the scalar one behind everywhere
    # (`python -m bench.attention`; figures in docs/benchmarks.md). So static dispatch, which
    # cannot time, takes cpp only with AVX-512 (measured dispatch times it),
    # or where SDPA cannot answer (the log-sum-exp); backend="cpp" runs any path
    # (PYEXT_CPU_SIMD caps it).
    paths = torch.ops.pyext_C.attention_paths()
    best = paths[0]
    if "avx512" not in paths and not lse:  # (AMX CPUs list amx first, and avx512 too)
        return [f"the C++ {best} path is not faster than sdpa at every shape on CPU (measured); it runs "
                "when forced or measured faster"]
    return []


def _cpp(q, k, v, scale, mask, lse):
    bias = None if mask is None else mask_as_bias(mask)
    out, lse_out = torch.ops.pyext_C.attention(q, k, v, _scale(q, scale), "", bias, lse)
    return out, (lse_out if lse else None)


# ----------------------------------------------------------------------------- triton (CUDA)

def _triton_slower(q, k, v, scale, mask, lse):
    # On an H200, SDPA's fused kernels beat this one at every SD, SDXL, SD3 and Flux shape
    # (`python -m bench.gpu_kernels`, docs/benchmarks.md): the static order (measured dispatch's
    # fallback while a CUDA graph is captured) takes SDPA where it can answer. Masks and the
    # log-sum-exp were not measured. Elsewhere (fp32, head dims not multiples of 8, grouped heads)
    # SDPA may fall back to its O(seq^2) math kernel, so triton stays first there.
    fused = q.dtype != torch.float32 and q.shape[-1] % 8 == 0 and k.shape[1] == q.shape[1]
    if q.device.type == "cuda" and fused and mask is None and not lse:
        return ["SDPA's fused kernels are faster on the GPUs measured; it runs when forced or measured faster"]
    return []


def _triton(q, k, v, scale, mask, lse):
    from pyext.kernels.attention import attention_triton

    return attention_triton(q, k, v, _scale(q, scale), None if mask is None else mask_as_bias(mask), lse)


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


# The same three values in one C++ call when the extension has it (a few calls' overhead less).
_VALUE_BOUNDS = torch.ops.pyext_C.attention_value_bounds if has_kernel("attention_value_bounds") else None


def value_bounds(q, k, bias) -> tuple[float, float, float]:
    """(max |q|, max |k|, max of the float bias or -inf without one), NaN where one holds NaN."""
    if _VALUE_BOUNDS is not None:
        return tuple(_VALUE_BOUNDS(q, k, bias))
    return _amax_abs(q), _amax_abs(k), -math.inf if bias is None or not bias.numel() else bias.max().item()


def _sdpa_guard(q, k, v, scale, mask, lse):
    # torch's CPU SDPA returns zeros for rows whose softmax is NaN (a NaN in q, k or the mask, a
    # score that is +inf or overflows fp32). A bound on every score, a pass over q, k and a float
    # mask (small next to the attention), finds the inputs where that cannot happen; others go
    # elsewhere. -inf in a mask is a masked key, which SDPA handles.
    if q.numel() == 0 or k.numel() == 0:
        return []
    q_max, k_max, bias_max = value_bounds(q, k, None if mask is None or mask.dtype == torch.bool else mask)
    bound = q_max * k_max * q.shape[-1] * abs(_scale(q, scale)) + max(bias_max, 0.0)  # NaN stays NaN
    if not bound < 1e37:  # NaN compares False; 0 * inf is NaN; +inf in the bias makes it inf
        return ["q, k or the mask holds NaN/inf, or scores may overflow fp32: torch's CPU SDPA returns 0 "
                "where softmax gives NaN"]
    return []


def _sdpa(q, k, v, scale, mask, lse):
    if mask is not None and mask.dtype not in (torch.bool, q.dtype):
        mask = mask.to(q.dtype)  # SDPA takes a bias in q's dtype only
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if mask is not None:
        # A row whose every key is masked is 0 in this op; SDPA's GPU kernels give NaN or an average
        # of v there, its CPU kernels 0 * v (NaN where a masked key's v is NaN). One pass over the
        # mask, no host read.
        hidden = ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1, keepdim=True)
        out = out.masked_fill(hidden, 0.0)
    return out, None


# SDPA's cuDNN and flash kernels, each a backend of its own: SDPA takes one by a fixed priority, and
# which is fastest depends on the GPU and the shape, so measured dispatch times each. What each
# takes is torch's own filter (torch.backends.cuda.can_use_*_attention: GPU, cuDNN version, layout),
# asked once per call signature: torch's SDPA switches (sdpa_kernel, enable_*_sdp) as they were
# then hold for that signature.

def _sdpa_kernel_reasons(kernel: str, can_use):
    def reasons(q, k, v, scale, mask, lse):
        if can_use(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False), False):
            return []
        return [f"torch's SDPA rules its {kernel} kernel out for this input ({can_use.__name__})"]
    return reasons


@cache  # asked on every call (devices are checked after availability): no import-path search each time
def _xformers_unavailable():
    return None if importlib.util.find_spec("xformers") is not None else "xformers is not installed"


def _xformers(q, k, v, scale, mask, lse):
    import xformers.ops as xops

    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2), None


# What the backends take beyond dtypes and head dims, as sizes (`_sizes`): a mask (masked 1),
# the log-sum-exp (lse 1), query heads per k/v head (kv_groups).
NO_LSE = {"lse": (0,)}
NO_EXTRAS = {"masked": (0,), "lse": (0,), "kv_groups": (1,)}
dispatch.register("attention", Backend(
    "cpp", _cpp, unavailable=partial(kernel_missing, "attention"), slower=_cpp_slower, devices=("cpu",),
    dtypes=DTYPES, test_shapes=TEST_SHAPES + MASKED_SHAPES + LSE_SHAPES,
    doc="C++ flash attention (AVX-512 BF16 / AVX-512 / AVX2 / scalar), O(seq) memory; masks, grouped heads, lse"))
dispatch.register("attention", Backend(
    "triton", _triton, unavailable=triton_unavailable, advisory=interpreter_advisory, slower=_triton_slower,
    devices=triton_devices(),
    dtypes=triton_dtypes(DTYPES), limits={"head_dim": range(1, 257)},
    test_shapes=TEST_SHAPES + MASKED_SHAPES + LSE_SHAPES,
    notes={**TRITON_NOTES, "head_dim": "the kernel keeps a head's accumulator in registers"},
    doc="Triton flash attention, head dim split into power-of-two parts; masks, grouped heads, lse; "
        "cpu only under TRITON_INTERPRET=1"))

dispatch.register("attention", Backend(
    "sdpa", _sdpa, guard=_sdpa_guard, dtypes=DTYPES, limits=NO_LSE, test_shapes=TEST_SHAPES + MASKED_SHAPES,
    notes={"lse": "torch's SDPA does not return the log-sum-exp"},
    doc="torch.nn.functional.scaled_dot_product_attention"))
SDPA_KERNEL_SHAPES = ((1, 2, 9, 77, 40), (2, 1, 37, 45, 64), (1, 1, 1, 33, 128), (1, 2, 16, 5, 80, 2, None, True))


def _sdpa_kernel_backend(kernel: str, call, can_use) -> Backend:
    def run(q, k, v, scale, mask, lse):  # (no mask: the backend declares none)
        return call(q, k, v, _scale(q, scale), lse)

    return Backend(
        f"sdpa_{kernel}", run, reasons=_sdpa_kernel_reasons(kernel, can_use), devices=("cuda",),
        dtypes=(torch.bfloat16, torch.float16),
        limits={"head_dim": range(8, 257, 8), "masked": (0,), "kv_groups": (1,)},
        notes={torch.float32: "SDPA's fused kernels take half precision only",
               "head_dim": "multiples of 8 (SDPA pads others, a copy per call)",
               "masked": "pyext passes these kernels no mask", "kv_groups": "pyext passes equal head counts only"},
        test_shapes=SDPA_KERNEL_SHAPES, doc=f"SDPA's {kernel} kernel on its own (torch.nn.functional's choice aside)")


dispatch.register("attention", _sdpa_kernel_backend("cudnn", _compat.sdpa_cudnn,
                                                   torch.backends.cuda.can_use_cudnn_attention))
dispatch.register("attention", _sdpa_kernel_backend("flash", _compat.sdpa_flash,
                                                   torch.backends.cuda.can_use_flash_attention))

dispatch.register("attention", Backend(
    "xformers", _xformers, unavailable=_xformers_unavailable, devices=("cuda",), dtypes=DTYPES, limits=NO_EXTRAS,
    notes={"masked": "pyext passes xformers no mask", "lse": "pyext does not ask xformers for the log-sum-exp",
           "kv_groups": "pyext passes xformers equal head counts only"},
    test_shapes=TEST_SHAPES, doc="xformers.ops.memory_efficient_attention"))


def _reference(q, k, v, scale, mask, lse):
    out = attention_reference(q, k, v, scale, mask, lse)
    return out if lse else (out, None)


dispatch.register("attention", Backend(
    "reference", _reference, timed=False, dtypes=DTYPES, test_shapes=TEST_SHAPES + MASKED_SHAPES + LSE_SHAPES,
    doc="naive fp32 math; O(seq^2) memory; the test oracle"))

# Self-check (pyext.dispatch): a small input of the variant against the reference, within twice
# the error SDPA itself makes in that dtype at this size (fp32 accumulation, rounded outputs).
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


_LSE_TOLERANCE = 1e-3  # relative to max(1, |lse|): fp32 scores of the same rounded inputs


def _mask_kind(mask) -> str | None:
    return None if mask is None else "bool" if mask.dtype == torch.bool else "bias"


def _sample(q, k, v, scale, mask, lse):
    g = torch.Generator(device=q.device).manual_seed(0)

    def rand(heads, n):
        return torch.randn(1, heads, n, q.shape[-1], generator=g, device=q.device).to(q.dtype)

    kv_heads = 1 if k.shape[1] != q.shape[1] else 2
    sample_mask = None
    if mask is not None:
        sample_mask = torch.rand(1, 1 if mask.dtype == torch.bool else 2, 37, 45, generator=g, device=q.device) > 0.3
        sample_mask[..., 3, :] = False  # a row with every key masked
        if mask.dtype != torch.bool:
            noise = torch.randn(sample_mask.shape, generator=g, device=q.device)
            sample_mask = noise.masked_fill(~sample_mask, -math.inf).to(mask.dtype)
    return rand(2, 37), rand(kv_heads, 45), rand(kv_heads, 45), scale, sample_mask, lse


def _close(out, ref, args):
    (out, lse), (ref, ref_lse) = out, ref
    err = (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    if not err <= _CHECK_TOLERANCE[ref.dtype]:
        return f"max error {err:.3g} (tolerance {_CHECK_TOLERANCE[ref.dtype]:g})"
    if ref_lse is None:
        return None if lse is None else "returned a log-sum-exp that was not asked for"
    if lse is None or lse.shape != ref_lse.shape or lse.dtype != torch.float32:
        return f"log-sum-exp {dispatch.describe(lse)}, expected float32{list(ref_lse.shape)}"
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        return "log-sum-exp is -inf on other rows than the fully masked ones"
    finite = torch.isfinite(ref_lse)
    lse_err = ((lse[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp_min(1)).max().item() \
        if finite.any() else 0.0
    return None if lse_err <= _LSE_TOLERANCE else f"log-sum-exp error {lse_err:.3g} (tolerance {_LSE_TOLERANCE:g})"


def _example_mask(kind, batch, heads, seq_q, seq_kv, dtype, device):
    """A test shape's mask: key padding per batch (one sample with no key left), a float bias per
    head and position with masked entries, or per-row key sets with fully masked rows."""
    if kind == "keys":
        keep = torch.arange(seq_kv, device=device) < torch.tensor([seq_kv, 0], device=device)[:batch, None]
        return keep[:, None, None, :]
    if kind == "rows":
        rows = torch.arange(seq_q, device=device)[:, None] + 1 >= torch.arange(seq_kv, device=device) * 2
        rows[::3] = False
        return rows
    bias = torch.randn(1, heads, seq_q, seq_kv, device=device)
    return bias.masked_fill(torch.rand(bias.shape, device=device) < 0.3, -math.inf).to(dtype)


def _example(spec, dtype, device):
    batch, heads, seq_q, seq_kv, head_dim, kv_heads, mask, lse = (*spec, *(None, None, False)[len(spec) - 5:])
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, seq_q, head_dim, device=device).to(dtype)
    k, v = (torch.randn(batch, kv_heads, seq_kv, head_dim, device=device).to(dtype) for _ in range(2))
    m = None if mask is None else _example_mask(mask, batch, heads, seq_q, seq_kv, dtype, device)
    return q, k, v, None, m, lse


def _sizes(args) -> dict[str, int]:
    q, k, mask, lse = args[0], args[1], args[4], args[5]
    return {"head_dim": q.shape[-1], "masked": int(mask is not None), "lse": int(lse),
            "kv_groups": q.shape[1] // max(k.shape[1], 1)}


dispatch.define("attention", check=check_inputs, sample=lambda args: _sample(*args), close=_close,
                variant=lambda args: (str(args[0].dtype), args[0].shape[-1], _mask_kind(args[4]), args[5],
                                      args[1].shape[1] != args[0].shape[1]),
                sizes=_sizes, example=_example)


def _run(q, k, v, scale, backend, attn_mask, return_lse):
    args = (q, k, v, scale, attn_mask, return_lse)
    out, lse = dispatch.select("attention", args, backend).run(*args)
    # The output has empty_like(q)'s strides on every backend, as the fake kernel promises: q's
    # own when q is dense (as SDPA does, e.g. the (B, S, H, D)-transposed layout diffusers
    # passes), contiguous otherwise. A custom op may not return one of its inputs either.
    aliased = out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if aliased or out.stride() != like_strides(q):
        out = torch.empty_like(q).copy_(out)
    return out, lse


def _attention_kernel(q, k, v, scale=None, backend=None, attn_mask=None):
    return _run(q, k, v, scale, backend, attn_mask, False)[0]


def _attention_fake(q, k, v, scale=None, backend=None, attn_mask=None):
    dispatch.check("attention", (q, k, v, scale, attn_mask, False))
    return torch.empty_like(q)


def _attention_lse_kernel(q, k, v, scale=None, backend=None, attn_mask=None):
    out, lse = _run(q, k, v, scale, backend, attn_mask, True)
    return out, lse.contiguous()


def _attention_lse_fake(q, k, v, scale=None, backend=None, attn_mask=None):
    dispatch.check("attention", (q, k, v, scale, attn_mask, True))
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


SCHEMA_ARGS = "Tensor q, Tensor k, Tensor v, float? scale=None, str? backend=None, Tensor? attn_mask=None"
define(f"attention({SCHEMA_ARGS}) -> Tensor", _attention_kernel, _attention_fake)
define(f"attention_lse({SCHEMA_ARGS}) -> (Tensor, Tensor)", _attention_lse_kernel, _attention_lse_fake)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
              backend: Optional[str] = None, attn_mask: Optional[torch.Tensor] = None, return_lse: bool = False):
    """softmax(q @ k^T * scale + mask) @ v with scale defaulting to head_dim ** -0.5; the output
    in q's layout, or (output, lse) with return_lse: lse float32 (batch, heads, q length).

    k and v may have fewer heads than q (a divisor of q's: grouped-query heads). attn_mask
    broadcasts to (batch, heads, q length, kv length): boolean (True takes part, as SDPA's) or
    an additive bias in q's dtype or float32. A row with every key masked gives 0 and lse -inf.
    The op validates its inputs (`check_inputs`, the same for torch.ops.pyext.attention); here
    only what the op's schema cannot take is refused first."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        _fail(f"scale must be a finite float or None, got {scale!r}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        _fail(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if not isinstance(return_lse, bool):
        _fail(f"return_lse must be True or False, got {return_lse!r}")
    op = torch.ops.pyext.attention_lse if return_lse else torch.ops.pyext.attention
    return op(q, k, v, None if scale is None else float(scale), backend, attn_mask)
