"""fp8 (e4m3fn) weight storage: quantize, upcast and a linear that dequantises on the fly.

Public functions validate their inputs (clear errors naming the op) and call the
`torch.ops.pyext.*` custom ops, which pick a backend through `pyext.dispatch`.
The reference backend (pyext.reference.fp8) is the semantics every other backend must match
bit for bit (upcast) or to the compute dtype's rounding (linear: upcast, then GEMM).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import EXT, cuda_kernel_missing, has_kernel, kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.ops._alias import apart_from
from pyext.ops._library import define
from pyext.kernels import interpreter_advisory, triton_devices, triton_unavailable
from pyext.ops._triton import TRITON_NOTES, triton_dtypes
from pyext.reference.fp8 import FP8, FP8_MAX, fp8_linear_reference, fp8_upcast_reference

FP8_MIN_SUBNORMAL = 2.0 ** -9  # the smallest nonzero e4m3 magnitude
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- validation

def _fail(op: str, msg: str) -> None:
    raise PyextError(f"pyext.{op}: {msg}")


def check_fp8(op: str, w) -> None:
    """What the public functions take: an fp8 weight, passed to the ops as its uint8 codes."""
    if not isinstance(w, torch.Tensor) or w.dtype != FP8:
        _fail(op, f"weight must be a torch.float8_e4m3fn tensor (from fp8_quantize), got "
              f"{getattr(w, 'dtype', type(w).__name__)}")


def check_public(op: str, x, w, scale, bias) -> None:
    """What the public linear and conv functions refuse before their op: a weight that is not fp8
    (they pass its uint8 view), and non-tensors where the op's schema takes tensors."""
    check_fp8(op, w)
    for name, t in (("x", x), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        _fail(op, f"bias must be a tensor or None, got {type(bias).__name__}")


def check_codes(op: str, w: torch.Tensor, scale: torch.Tensor) -> None:
    """The ops' weight: e4m3 codes as uint8 (`w_fp8.view(torch.uint8)`), output channels first,
    with 1 (per-tensor) or one float32 scale per output channel on the same device."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8:
        _fail(op, f"weight must be the uint8 view of e4m3 codes (w_fp8.view(torch.uint8)), got "
              f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() < 1:
        _fail(op, "weight must have at least one dimension (output channels first)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        _fail(op, f"scale must be a float32 tensor, got {getattr(scale, 'dtype', type(scale).__name__)}")
    if scale.numel() not in (1, w.shape[0]) or scale.dim() > 1:
        _fail(op, f"scale must hold 1 (per-tensor) or weight.shape[0]={w.shape[0]} (per-channel) values, "
              f"got shape {tuple(scale.shape)}")
    if scale.device != w.device:
        _fail(op, f"weight is on {w.device} but scale is on {scale.device}")


def _check_dtype(op: str, dtype, what: str) -> None:
    if dtype not in COMPUTE_DTYPES:
        _fail(op, f"{what} must be one of bfloat16, float16, float32; got {dtype}")


def check_upcast(w, scale, out) -> None:
    """The validation of torch.ops.pyext.fp8_upcast(_out) and fp8_upcast."""
    check_codes("fp8_upcast", w, scale)
    if not isinstance(out, torch.Tensor) or out.shape != w.shape or not out.is_contiguous() or out.device != w.device:
        _fail("fp8_upcast", f"out must be a contiguous tensor of shape {tuple(w.shape)} on {w.device}, got "
              f"{dispatch.describe(out)}")
    _check_dtype("fp8_upcast", out.dtype, "out.dtype")


def check_linear(x, w, scale, bias, op: str = "fp8_linear") -> None:
    """The validation of torch.ops.pyext.fp8_linear and fp8_linear (and, by name, of the dynamic linear)."""
    check_codes(op, w, scale)
    if not isinstance(x, torch.Tensor):
        _fail(op, f"x must be a tensor, got {type(x).__name__}")
    _check_dtype(op, x.dtype, "x.dtype")
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        _fail(op, f"x.shape[-1] must equal weight.shape[1] for a 2-D weight; got x {tuple(x.shape)}, "
              f"weight {tuple(w.shape)}")
    if x.device != w.device:
        _fail(op, f"x is on {x.device} but weight is on {w.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (w.shape[0],)
                             or bias.dtype != x.dtype or bias.device != x.device):
        _fail(op, f"bias must be {x.dtype}[{w.shape[0]}] on {x.device}, got {dispatch.describe(bias)}")


# ----------------------------------------------------------------------------- quantize

def fp8_quantize(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to e4m3 with per-output-channel (dim 0) or per-tensor fp32 scales.

    Returns (w_fp8, scale) with w ~= w_fp8 * scale. Non-finite weights are an error:
    fp8 storage of NaN/inf would turn into silent garbage at inference.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dtype == FP8:
        _fail("fp8_quantize", f"expected a floating-point weight (fp32/fp16/bf16), got "
              f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() < 1 or w.numel() == 0:
        _fail("fp8_quantize", f"expected a non-empty weight with at least one dimension, got shape {tuple(w.shape)}")
    if w.device.type == "meta":
        _fail("fp8_quantize", "the weight is a meta tensor (shapes only); quantizing needs its values: "
              "load the weights first")
    wf = w.detach().float()
    finite = torch.isfinite(wf)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        _fail("fp8_quantize", f"weight has {int((~finite).sum())} non-finite values (first at index {bad}); "
              "fp8 storage needs finite weights")
    amax = wf.abs().reshape(wf.shape[0], -1).amax(1) if per_channel else wf.abs().amax().reshape(1)
    scale = _scales(amax)
    q = (wf / scale.reshape(-1, *[1] * (w.dim() - 1))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 per channel; 1 for all-zero channels.

    Below fp32's smallest normal, amax / 448 would be a subnormal that has lost bits, or 0
    (whose codes are inf/NaN). There the scale is rounded up to a power of two, no smaller
    than 2^-140 (the smallest code, 2^-9, times it is fp32's smallest subnormal), so
    w / scale and codes * scale stay exact.
    """
    small = torch.exp2(torch.ceil(torch.log2(amax.double() / FP8_MAX)).clamp_min(-140)).float()
    scale = torch.where(amax / FP8_MAX < torch.finfo(torch.float32).tiny, small, amax / FP8_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def scales_fuse_exactly(scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether applying `scale` after the dot product (what the fused GEMMs do) gives the op's
    meaning, upcast to `dtype` then GEMM, to rounding: every decoded weight times its scale must
    be a finite `dtype` value, and no nonzero one may underflow (a subnormal scale: the upcast
    weight is then 0, and an inf activation gives NaN there, inf after the fused GEMM). False
    for NaN/inf scales. Reads the scales (a sync on a GPU)."""
    s, info = scale.abs(), torch.finfo(dtype)
    return bool(((s * FP8_MAX <= info.max) & ((s == 0) | (s * FP8_MIN_SUBNORMAL >= info.tiny))).all())


# ----------------------------------------------------------------------------- backends

def _upcast_ext(w, scale, out):
    torch.ops.pyext_C.fp8_upcast_out(w, scale, out)


def _upcast_ref(w, scale, out):
    out.copy_(fp8_upcast_reference(w, scale, out.dtype))


# (rows, cols, per-channel scale) the op tests run every backend on: rows of 16-byte chunks and one
# scale over a multiple of 16 codes (the CUDA kernel's vector path), odd rows that end in SIMD tails
# (and the CUDA kernel's per-element path), rows long enough for the AVX-512 lookup-table path.
UPCAST_TEST_SHAPES = ((6, 48, True), (4, 20, False), (5, 33, True), (3, 700, False), (1, 1, True))

dispatch.register("fp8_upcast", Backend(
    "cuda", _upcast_ext, unavailable=partial(cuda_kernel_missing, "fp8_upcast_out"), devices=("cuda",),
    dtypes=COMPUTE_DTYPES, test_shapes=UPCAST_TEST_SHAPES, doc="CUDA C++ kernel, 16-byte vector loads"))
dispatch.register("fp8_upcast", Backend(
    "cpp", _upcast_ext, unavailable=partial(kernel_missing, "fp8_upcast_out"), devices=("cpu",),
    dtypes=COMPUTE_DTYPES, test_shapes=UPCAST_TEST_SHAPES,
    doc="C++ AVX-512/AVX2/scalar kernel chosen at run time, at::parallel_for"))
dispatch.register("fp8_upcast", Backend(
    "reference", _upcast_ref, dtypes=COMPUTE_DTYPES, test_shapes=UPCAST_TEST_SHAPES,
    doc="PyTorch ops; the semantics and test oracle"))


def _linear_triton(x, w, scale, bias):
    from pyext.kernels.fp8_linear import fp8_linear_triton

    return fp8_linear_triton(x, w, scale, bias)


def _linear_cpp(x, w, scale, bias):
    return torch.ops.pyext_C.fp8_linear(x, w, scale, bias)


def _linear_brgemm(x, w, scale, bias):
    return torch.ops.pyext_C.fp8_linear_brgemm(x, w, scale, bias)


def brgemm_missing(kernel: str = "fp8_linear_brgemm") -> str | None:
    """Why the extension's `kernel` on torch's brgemm cannot run here, or None."""
    missing = kernel_missing(kernel)
    if missing is None and not torch.ops.pyext_C.fp8_brgemm_available():
        return "torch's brgemm micro-kernel has no AMX bf16 kernel here (a CPU without AMX, or oneDNN off)"
    return missing


# What torch's brgemm backends (linear and conv) do not take, by dtype.
BRGEMM_NOTES = {torch.float16: "torch's fp16 brgemm needs AMX-FP16", torch.float32: "bf16 activations only"}


def _odd_k(x, w, scale, bias) -> list[str]:
    return [f"in features {w.shape[1]} are odd; brgemm's VNNI layout pairs them"] if w.shape[1] % 2 else []


def _linear_upcast_cublas(x, w, scale, bias):
    weight = torch.empty(w.shape, dtype=x.dtype, device=w.device)  # the caching allocator: no page faults
    _upcast_ext(w, scale, weight)
    return F.linear(x, weight, bias)


# (rows of x, in features, out features, per-channel scale, bias) the op tests run every backend on.
LINEAR_TEST_SHAPES = ((5, 40, 7, True, True), (1, 33, 70, False, False), (70, 96, 48, True, False))
# brgemm's: even in features; blocks of rows and panels of channels, whole and with tails.
BRGEMM_TEST_SHAPES = ((5, 40, 7, True, True), (70, 96, 130, True, False), (33, 2, 64, False, True))

# brgemm first: where it runs (AMX CPUs) it was faster than cpp at every shape measured (docs/benchmarks.md).
dispatch.register("fp8_linear", Backend(
    "brgemm", _linear_brgemm, unavailable=brgemm_missing, reasons=_odd_k, devices=("cpu",),
    dtypes=(torch.bfloat16,), test_shapes=BRGEMM_TEST_SHAPES,
    notes=BRGEMM_NOTES,
    doc="C++ on AMX CPUs: 64-channel panels decoded once per thread into the VNNI layout of torch's "
        "oneDNN brgemm, scale and bias in the fp32 epilogue"))
dispatch.register("fp8_linear", Backend(
    "cpp", _linear_cpp, unavailable=partial(kernel_missing, "fp8_linear"), devices=("cpu",),
    dtypes=COMPUTE_DTYPES, test_shapes=LINEAR_TEST_SHAPES,
    doc="C++: bf16 on AVX512_BF16 CPUs: a GEMM that decodes fp8 in its packing step; small layers: "
        "a plain loop over the upcast weight; otherwise weight tiles upcast into a cache-sized buffer, "
        "torch GEMM per tile"))
dispatch.register("fp8_linear", Backend(
    "upcast_cublas", _linear_upcast_cublas, unavailable=partial(cuda_kernel_missing, "fp8_upcast_out"),
    devices=("cuda",), dtypes=COMPUTE_DTYPES, test_shapes=LINEAR_TEST_SHAPES,
    doc="the CUDA upcast kernel into a fresh weight, then cuBLAS (the same two calls, made by hand, "
        "beat the Triton GEMM on an H200: docs/benchmarks.md)"))
dispatch.register("fp8_linear", Backend(
    "triton", _linear_triton, unavailable=triton_unavailable, advisory=interpreter_advisory,
    devices=triton_devices(), dtypes=triton_dtypes((torch.bfloat16, torch.float16)), test_shapes=LINEAR_TEST_SHAPES,
    notes={**TRITON_NOTES, torch.float32: "float32 activations are not supported by the Triton kernel"},
    doc="Triton GEMM that dequantises fp8 weight tiles in its main loop"))
dispatch.register("fp8_linear", Backend(
    "reference", fp8_linear_reference, dtypes=COMPUTE_DTYPES, test_shapes=LINEAR_TEST_SHAPES,
    doc="F.linear on the upcast weight"))


# ----------------------------------------------------------------------------- self-check samples
# (pyext.dispatch runs each backend once on these before choosing it automatically on a device)

def sample_codes(shape, device, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 codes (uint8, no NaN codes) of `shape`."""
    magnitude = torch.randint(0, 0x7F, shape, generator=g, device=device, dtype=torch.uint8)
    sign = torch.randint(0, 2, shape, generator=g, device=device, dtype=torch.uint8) << 7
    return magnitude | sign


def sample_scale(like: torch.Tensor, channels: int, g: torch.Generator) -> torch.Tensor:
    """Positive fp32 scales, per channel or per tensor as `like` is."""
    per_tensor = like.numel() == 1
    values = torch.rand(1 if per_tensor else channels, generator=g, device=like.device).add_(0.5).mul_(2e-3)
    return values.reshape(like.shape) if per_tensor else values


def relative_close(tolerance: dict):
    """A dispatch `close` for outputs whose error scales with their magnitude."""
    def close(out, ref, args):
        err = (out.float() - ref.float()).abs().max().item()
        allowed = tolerance[ref.dtype] * max(1.0, ref.float().abs().max().item())
        return None if err <= allowed else f"max error {err:.3g} (allowed {allowed:.3g})"
    return close


# Upcast is exact on every backend; the linear, to the compute dtype's rounding of a K-long sum.
LINEAR_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _sample_upcast(w, scale, out):
    g = torch.Generator(device=w.device).manual_seed(0)
    codes = sample_codes((5, 33), w.device, g)
    return codes, sample_scale(scale, 5, g), torch.empty(5, 33, dtype=out.dtype, device=out.device)


def _exact(out, ref, args):
    same = torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    return None if same else "bits differ from the reference"


def _sample_linear(x, w, scale, bias):
    g = torch.Generator(device=x.device).manual_seed(0)
    k = x.shape[-1]
    sample_x = torch.randn(5, k, generator=g, device=x.device).to(x.dtype)
    sample_bias = None if bias is None else torch.randn(7, generator=g, device=x.device).to(bias.dtype)
    return sample_x, sample_codes((7, k), x.device, g), sample_scale(scale, 7, g), sample_bias


def example_weight(shape, per_channel: bool, device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of an op test's weight: random finite codes, scales per channel or per tensor."""
    like = torch.empty(shape[0] if per_channel else 1, device=device)
    return sample_codes(shape, device, g), sample_scale(like, shape[0], g)


def _example_upcast(spec, dtype, device):
    rows, cols, per_channel = spec
    g = torch.Generator(device=device).manual_seed(0)
    return *example_weight((rows, cols), per_channel, device, g), torch.empty(rows, cols, dtype=dtype, device=device)


def example_linear(spec, dtype, device):
    """Args of a linear op test's shape (rows, in, out, per-channel scale, bias)."""
    m, k, n, per_channel, bias = spec
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return x, *example_weight((n, k), per_channel, device, g), b


dispatch.define("fp8_upcast", check=check_upcast, sample=lambda args: _sample_upcast(*args), close=_exact, pure=False,
                output=lambda args, returned: args[2], variant=lambda args: (str(args[2].dtype),),
                dtype=lambda args: args[2].dtype, example=_example_upcast)
dispatch.define("fp8_linear", check=check_linear, sample=lambda args: _sample_linear(*args),
                close=relative_close(LINEAR_TOLERANCE),
                variant=lambda args: (str(args[0].dtype), args[0].shape[-1], args[2].numel() == 1, args[3] is None),
                example=example_linear)


# ----------------------------------------------------------------------------- custom ops
# The ops take the weight as its uint8 codes (`w_fp8.view(torch.uint8)`): kernels read
# bytes, and torch's op checkers (opcheck, schema checks) cannot compare float8 tensors.

def _upcast_out_kernel(w, scale, out, backend=None):
    chosen = dispatch.select("fp8_upcast", (w, scale, out), backend)  # validates the args first
    w, scale = apart_from([out], w, scale)
    chosen.run(w, scale, out)


def _upcast_out_fake(w, scale, out, backend=None):
    dispatch.check("fp8_upcast", (w, scale, out))


def _upcast_kernel(w, scale, dtype, backend=None):
    _check_dtype("fp8_upcast", dtype, "dtype")
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    dispatch.select("fp8_upcast", (w, scale, out), backend).run(w, scale, out)
    return out


def _upcast_fake(w, scale, dtype, backend=None):
    _check_dtype("fp8_upcast", dtype, "dtype")
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    dispatch.check("fp8_upcast", (w, scale, out))
    return out


# Backends the extension's kernel of pyext::fp8_linear also runs (csrc/fp8/fp8_linear_entry.h):
# the C++ CPU kernels, and on CUDA the upcast kernel followed by torch's linear.
_RUN_BY_THE_EXTENSION = ("cpp", "brgemm", "upcast_cublas")


def _linear_kernel(x, w, scale, bias=None, backend=None):
    args = (x, w, scale, bias)
    chosen = dispatch.select("fp8_linear", args, backend)
    out = chosen.run(*args)
    if backend is None and chosen.name in _RUN_BY_THE_EXTENSION:  # later calls like this one skip Python
        dispatch.when_kept("fp8_linear", args, chosen, lambda: torch.ops.pyext_C.fp8_linear_arm(*args, chosen.name))
    return out


def _linear_fake(x, w, scale, bias=None, backend=None):
    dispatch.check("fp8_linear", (x, w, scale, bias))
    return x.new_empty((*x.shape[:-1], w.shape[0]))


define("fp8_upcast_out(Tensor w, Tensor scale, Tensor(a2!) out, str? backend=None) -> ()", _upcast_out_kernel,
       _upcast_out_fake)
define("fp8_upcast(Tensor w, Tensor scale, ScalarType dtype, str? backend=None) -> Tensor", _upcast_kernel,
       _upcast_fake)
define("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, str? backend=None) -> Tensor",
       _linear_kernel, _linear_fake, entry="fp8_linear_dispatch")
if has_kernel("fp8_linear_disarm"):
    dispatch.on_forget(torch.ops.pyext_C.fp8_linear_disarm)


# ----------------------------------------------------------------------------- the layers' call
# The extension calls the linear ops through torch's dispatcher from C++ (csrc/fp8/fp8_python.cpp):
# torch.ops' boxed call from Python costs about as much as a small layer's GEMM. torch.compile
# cannot trace that C function, and it leaves calls that need a __torch_function__ to torch.ops.
_TYPED_CALLS = {name: getattr(EXT, name, None) for name in ("fp8_linear", "fp8_linear_dynamic")}


def call_linear(op: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """torch.ops.pyext.<op>(x, w, scale, bias) for op "fp8_linear" or "fp8_linear_dynamic", the
    same call made through the extension where it is built and torch.compile is not tracing."""
    typed = _TYPED_CALLS[op]
    if typed is not None and not torch.compiler.is_compiling():
        out = typed(x, w, scale, bias)
        if out is not None:
            return out
    return getattr(torch.ops.pyext, op)(x, w, scale, bias, None)


# ----------------------------------------------------------------------------- public API
# The ops validate their inputs (check_upcast, check_linear); the public functions take the
# weight as float8_e4m3fn and refuse first only what the ops' schemas cannot take.

def fp8_upcast(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Decode an fp8 weight to `dtype` (or into `out`): round(fp32(w) * scale), exact.

    NaN codes stay NaN with their sign. Pass `out` (contiguous, same shape) to
    reuse a buffer: a fresh large output costs page faults on every call.
    """
    check_fp8("fp8_upcast", w)
    if not isinstance(scale, torch.Tensor):
        _fail("fp8_upcast", f"scale must be a float32 tensor, got {type(scale).__name__}")
    if out is None:
        if not isinstance(dtype, torch.dtype):
            _fail("fp8_upcast", f"dtype must be one of bfloat16, float16, float32; got {dtype!r}")
        return torch.ops.pyext.fp8_upcast(w.view(torch.uint8), scale, dtype, backend)
    if not isinstance(out, torch.Tensor):
        _fail("fp8_upcast", f"out must be a contiguous tensor of shape {tuple(w.shape)}, got {type(out).__name__}")
    torch.ops.pyext.fp8_upcast_out(w.view(torch.uint8), scale, out, backend)
    return out


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
               backend: Optional[str] = None) -> torch.Tensor:
    """F.linear(x, fp8_upcast(w, scale, x.dtype), bias) without materialising the upcast weight.

    That is the meaning on every backend, non-finite or huge scales included: the Triton GEMM
    scales each decoded tile before its dot product; the C++ GEMMs apply the scale to the fp32
    accumulator, which agrees to rounding while |scale| * 448 is a finite x.dtype value, and take
    an upcast path for other scales.
    """
    check_public("fp8_linear", x, w, scale, bias)
    if backend is None:
        return call_linear("fp8_linear", x, w.view(torch.uint8), scale, bias)
    return torch.ops.pyext.fp8_linear(x, w.view(torch.uint8), scale, bias, backend)
