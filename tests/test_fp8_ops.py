"""fp8 ops: exactness against the reference, errors, dispatch and opcheck."""
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from pyext import PyextError, dispatch
from pyext.ops import fp8_linear, fp8_quantize, fp8_upcast
from pyext.ops.fp8 import FP8, call_linear, scales_fuse_exactly
from pyext.reference.fp8 import fp8_linear_reference, fp8_upcast_reference
from pyext._ext import EXT, cuda_kernel_missing
from torch.overrides import TorchFunctionMode
from tests.conftest import needs_ext, run_in_triton_interpreter

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def all_codes(rows=3, repeat=3):
    """Every e4m3 code (NaN included), repeated to odd row lengths so SIMD tails are exercised."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, repeat)[:, : 256 * repeat - 5]
    return codes.view(FP8)


def same_bits(a, b):
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


SCALE_KINDS = ["one", "per_channel", "per_tensor", "negative", "tiny", "huge"]


def scales_of(kind: str) -> torch.Tensor:
    """Scales for 3 rows, or one for the tensor."""
    return {
        "one": torch.ones(3),
        "per_channel": torch.rand(3) * 4 + 1e-3,
        "per_tensor": torch.tensor([0.37]),
        "negative": torch.tensor([-0.37, -1.0, -0.0]),  # the lookup-table path flips signs: check it
        "tiny": torch.full((3,), 1e-40),  # products land in fp32 subnormals
        "huge": torch.full((3,), 3e37),  # past the SIMD kernels' exact range: scalar path, overflow to inf
        "nan": torch.tensor([float("nan"), 1.0, -float("nan")]),
        "inf": torch.tensor([float("inf"), 1.0, -float("inf")]),
    }[kind]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
def test_upcast_bit_exact_all_codes(simd, dtype, scale_kind):
    w = all_codes()
    scale = scales_of(scale_kind)
    out = fp8_upcast(w, scale, dtype, backend="cpp")
    assert same_bits(out, fp8_upcast_reference(w, scale, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1024, 763])  # rows of 16-code chunks (the vector path), and not
@pytest.mark.parametrize("scale_kind", SCALE_KINDS + ["nan", "inf"])
def test_cuda_upcast_gives_the_cpu_kernels_bits_for_every_code(dtype, cols, scale_kind):
    """The CUDA kernel against the CPU kernel on every code, NaN codes among finite ones in the
    same 16-byte chunk, under every kind of scale. NaN bits too, except where GPU and CPU
    arithmetic make different NaNs (an infinite scale times a zero code)."""
    if not torch.cuda.is_available() or cuda_kernel_missing("fp8_upcast_out"):
        pytest.skip("needs a GPU and the CUDA kernels")
    w = torch.arange(256, dtype=torch.uint8).repeat(3, 4)[:, :cols].view(FP8)
    scale = scales_of(scale_kind)
    out = fp8_upcast(w.cuda(), scale.cuda(), dtype, backend="cuda").cpu()
    ref = fp8_upcast(w, scale, dtype, backend="cpp")
    if scale_kind == "inf":
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan) and same_bits(out[~nan], ref[~nan])
    else:
        assert same_bits(out, ref)


def special_fp32() -> torch.Tensor:
    """fp32 values that probe the narrowing to bf16/fp16: ties (to even, down and up) and their
    fp32 neighbours, fp16 / bf16 / fp32 subnormals, the largest finites and the ties that overflow
    to inf, zeros, infs, and NaNs (quiet, signalling, with payloads, both signs)."""
    v = torch.tensor([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2**-14, 2**-24, 2**-25, 3 * 2**-25,
                      65504.0, 65512.0, 65520.0, 65536.0, 2**-133, 2**-134, 3 * 2**-134, 1e-40,
                      (2 - 2**-7) * 2.0**127, (2 - 2**-8) * 2.0**127, (2 - 2**-23) * 2.0**127])
    v = torch.cat([v, torch.nextafter(v, torch.full_like(v, math.inf)), torch.nextafter(v, torch.zeros_like(v))])
    nans = torch.tensor([0x7FC00000, 0x7FC00001, 0x7FA00000, 0x7F800001, 0x7FFFFFFF, 0xFFC12345 - 2**32],
                        dtype=torch.int32).view(torch.float32)
    return torch.cat([v, -v, torch.tensor([0.0, -0.0, math.inf, -math.inf]), nans])


def narrowed(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' rounding (csrc/common/half_rounding.h): torch's own round-to-nearest-even cast,
    and for NaN a quiet NaN keeping the sign and the top payload bits (torch's NaN bits vary)."""
    bits = f.view(torch.int32)
    nan = ((bits >> 16) | 0x40) if dtype == torch.bfloat16 else ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
    return torch.where(f.isnan(), nan.to(torch.int16), f.to(dtype).view(torch.int16)).view(dtype)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_narrows_like_torch(simd, dtype):
    """Code 1.0 times a per-row scale is the scale itself, so each row shows how the kernel (its
    SIMD body, its tail, the AVX-512 lookup table from 640 codes on) rounds that fp32 value."""
    scale = special_fp32()
    w = torch.full((scale.numel(), 700), 0x38, dtype=torch.uint8).view(FP8)  # e4m3 1.0
    out = fp8_upcast(w, scale, dtype, backend="cpp")
    assert same_bits(out, narrowed(scale, dtype)[:, None].expand(out.shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_pytorch_cast_except_nan_bits(dtype):
    w = torch.arange(256, dtype=torch.uint8).view(FP8)
    ref = fp8_upcast_reference(w, torch.ones(1), dtype)
    torch_cast = w.to(dtype)
    nan = w.float().isnan()
    assert nan.sum() == 2 and ref[nan].isnan().all()
    assert same_bits(ref[~nan], torch_cast[~nan])
    # NaN codes keep their sign, which PyTorch's bf16 path does not always do
    assert (ref[nan].view(INT_VIEW[dtype]) < 0).tolist() == [False, True]


@needs_ext
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 1), (5, 300), (64, 3, 3, 3), (130, 17), (4, 1031)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upcast_shapes_and_out(simd, shape, dtype):
    w, scale = fp8_quantize(torch.randn(shape) * 3)
    ref = fp8_upcast_reference(w, scale, dtype)
    assert same_bits(fp8_upcast(w, scale, dtype, backend="cpp"), ref)
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert fp8_upcast(w, scale, out=out, backend="cpp") is out
    assert same_bits(out, ref)
    # an output that starts off a 64-byte line (and off 4 bytes), as a slice of a larger buffer can
    n = w.numel()
    buf = torch.full((n + 1,), float("nan"), dtype=dtype)
    out = buf[1:].view(shape)
    fp8_upcast(w, scale, out=out, backend="cpp")
    assert same_bits(out, ref) and buf[0].isnan()


@needs_ext
def test_upcast_non_contiguous_weight():
    w, scale = fp8_quantize(torch.randn(40, 64))
    wt = w.t()  # per-channel scale follows dim 0 of the tensor passed in
    s = torch.rand(64) + 0.1
    assert not wt.is_contiguous()
    assert same_bits(fp8_upcast(wt, s, torch.bfloat16, backend="cpp"), fp8_upcast_reference(wt, s, torch.bfloat16))


def test_quantize_round_trip_error_and_scales():
    w = torch.randn(96, 80) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different magnitude
    for per_channel in (True, False):
        q, s = fp8_quantize(w, per_channel)
        assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == ((96,) if per_channel else (1,))
        back = fp8_upcast_reference(q, s, torch.float32)
        rel = (back - w).norm(dim=1) / w.norm(dim=1)
        if per_channel:  # e4m3 has 3 mantissa bits: < 2^-4 relative error per element
            assert rel.max() < 0.0625
    assert (fp8_quantize(w, True)[1] < fp8_quantize(w, False)[1]).any()
    q, s = fp8_quantize(torch.zeros(4, 8))
    assert torch.equal(s, torch.ones(4)) and (q.float() == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_rejects_non_finite(bad):
    w = torch.randn(4, 8)
    w[2, 3] = bad
    with pytest.raises(PyextError, match=r"pyext.fp8_quantize: weight has 1 non-finite.*\[2, 3\]"):
        fp8_quantize(w)


def test_upcast_errors_name_op_and_support():
    w, s = fp8_quantize(torch.randn(4, 8))
    with pytest.raises(PyextError, match="pyext.fp8_upcast: weight must be a torch.float8_e4m3fn"):
        fp8_upcast(torch.randn(4, 8), s)
    with pytest.raises(PyextError, match="scale must hold 1 .* or weight.shape\\[0\\]=4"):
        fp8_upcast(w, torch.ones(3))
    with pytest.raises(PyextError, match="scale must be a float32"):
        fp8_upcast(w, s.half())
    with pytest.raises(PyextError, match="dtype must be one of bfloat16, float16, float32"):
        fp8_upcast(w, s, torch.int32)
    with pytest.raises(PyextError, match="out must be a contiguous tensor of shape"):
        fp8_upcast(w, s, out=torch.empty(8, 4).t())
    with pytest.raises(PyextError, match="weight is on cpu but scale is on meta"):
        fp8_upcast(w, s.to("meta"))


def test_forced_backend_reasons():
    w, s = fp8_quantize(torch.randn(4, 8))
    with pytest.raises(PyextError, match="backend 'cuda' cannot run this input: .*(cuda|CUDA)"):
        fp8_upcast(w, s, backend="cuda")
    with pytest.raises(PyextError, match="unknown backend 'nope'; backends are: cuda, cpp, reference"):
        fp8_upcast(w, s, backend="nope")
    assert same_bits(fp8_upcast(w, s, backend="reference"), fp8_upcast_reference(w, s, torch.bfloat16))


def test_no_backend_error_lists_every_reason():
    def never(*args):
        return ["never takes anything"]

    dispatch.register("_test_op", dispatch.Backend("a", None, never))
    dispatch.register("_test_op", dispatch.Backend("b", None, never, lambda: "not built"))
    with pytest.raises(PyextError, match=r"(?s)pyext._test_op: no backend.*float32\[2\].*a: never takes.*b: not built"):
        dispatch.select("_test_op", (torch.zeros(2),))
    dispatch._OPS.pop("_test_op")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@needs_ext
@pytest.mark.parametrize("x_shape", [(1, 33), (13, 7), (7, 64), (2, 5, 96), (300, 130)])
@pytest.mark.parametrize("n", [1, 17, 520])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cpp_matches_reference(simd, x_shape, n, dtype, bias):
    k = x_shape[-1]
    x = torch.randn(x_shape, dtype=dtype)
    w, s = fp8_quantize(torch.randn(n, k) / k**0.5)
    b = torch.randn(n, dtype=dtype) if bias else None
    y = fp8_linear(x, w, s, b, backend="cpp")
    ref = fp8_linear_reference(x, w, s, b)
    assert y.shape == (*x_shape[:-1], n) and y.dtype == dtype
    exact = F.linear(x.double(), fp8_upcast_reference(w, s, torch.float32).double(), None if b is None else b.double())
    # Our error vs float64 must be on the order of plain F.linear's own error in this dtype.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert rel_err(y, exact) <= 2 * rel_err(ref, exact) + tol


@pytest.mark.parametrize("device,kept", [pytest.param("cpu", "cpp", marks=needs_ext),
                                          pytest.param("cuda", "upcast_cublas", marks=pytest.mark.cuda)])
def test_kept_choice_runs_without_the_python_dispatch(monkeypatch, device, kept):
    """Once dispatch keeps a backend the extension's kernel also runs (the C++ kernel on CPU, the
    upcast kernel and cuBLAS on CUDA) as the automatic choice for a call signature, later calls
    with that signature run from torch's dispatcher alone, with the same result. Any other call
    goes through pyext.dispatch: another shape or strides, a forced backend, inputs that need
    autograd, and every call after the kept choices are dropped."""
    if device == "cuda" and (not torch.cuda.is_available() or cuda_kernel_missing("fp8_upcast_out")):
        pytest.skip("needs a GPU and the CUDA kernels")
    monkeypatch.setenv("PYEXT_DISPATCH", "static")  # the backends' order: the CUDA one comes before Triton
    entered = []
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda *args, **kw: entered.append(args[0]) or select(*args, **kw))
    dispatch.reset()
    w, s = fp8_quantize(torch.randn(24, 40, device=device))
    codes, x, b = w.view(torch.uint8), torch.randn(3, 40, device=device), torch.randn(24, device=device)
    op = torch.ops.pyext.fp8_linear
    with torch.no_grad():
        first = op(x, codes, s, b, None)
        again = op(x, codes, s, b, None)
        assert entered == ["fp8_linear"]
        assert torch.equal(again, first) and torch.equal(op(x, codes, s, b, kept), first)
        assert rel_err(first, fp8_linear_reference(x, w, s, b)) <= 1e-5
        op(torch.randn(40, 3, device=device).t(), codes, s, b, None)  # the same shape, other strides
        op(x, codes, s, None, None)  # no bias
        assert len(entered) == 4
        dispatch.reset()
        op(x, codes, s, b, None)
        assert len(entered) == 5
    y = op(x.clone().requires_grad_(), codes, s, b, None)
    assert len(entered) == 6
    with pytest.raises(PyextError, match="has no backward"):
        y.sum().backward()
    dispatch.reset()


class _Subclass(torch.Tensor):
    pass


class _SeenCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@needs_ext
@pytest.mark.parametrize("op", ["fp8_linear", "fp8_linear_dynamic"])
def test_layers_typed_call_is_the_torch_ops_call(op):
    """The fp8 layers call their op through the extension (call_linear), not torch.ops: the same
    op through torch's dispatcher, so the same bits (before and after dispatch keeps a choice),
    the op's own errors, the refusal of a backward; from several threads at once too. A call
    that needs a __torch_function__ (a tensor subclass, a mode) is left to torch.ops."""
    typed, torch_op = getattr(EXT, op), getattr(torch.ops.pyext, op)
    w, s = fp8_quantize(torch.randn(32, 48))
    codes = w.view(torch.uint8)
    bf16 = torch.bfloat16
    cases = [(torch.randn(3, 48, dtype=bf16), torch.randn(32, dtype=bf16)), (torch.randn(2, 5, 48), None),
             (torch.randn(48, 3, dtype=bf16).t(), None), (torch.randn(0, 48), torch.randn(32))]
    dispatch.reset()
    with torch.no_grad():
        for x, b in cases:
            for _ in range(2):  # the second call finds dispatch's kept choice
                assert torch.equal(typed(x, codes, s, b), torch_op(x, codes, s, b, None))
        with ThreadPoolExecutor(2) as pool:  # the call lets go of the GIL; a kernel in Python takes it back
            outs = list(pool.map(lambda c: typed(c[0], codes, s, c[1]), cases * 8))
        assert all(torch.equal(o, torch_op(x, codes, s, b, None)) for o, (x, b) in zip(outs, cases * 8))
    with pytest.raises(PyextError, match=rf"pyext.{op}: x.shape\[-1\] must equal weight.shape\[1\]"):
        typed(torch.randn(2, 47), codes, s, None)
    with pytest.raises(TypeError, match=r"takes \(x, w, scale, bias\), got 3 arguments"):
        typed(cases[0][0], codes, s)
    y = typed(torch.randn(3, 48, requires_grad=True), codes, s, None)
    with pytest.raises(PyextError, match="has no backward"):
        y.sum().backward()

    x = cases[1][0]
    assert typed(x.as_subclass(_Subclass), codes, s, None) is None
    with _SeenCalls() as mode:
        assert typed(x, codes, s, None) is None
        y = call_linear(op, x, codes, s, None)
    assert torch.equal(y, torch_op(x, codes, s, None, None)) and torch_op in mode.seen
    dispatch.reset()


@needs_ext
def test_fp8_layers_and_public_functions_take_the_typed_call(monkeypatch):
    import pyext.ops.fp8 as fp8_ops
    from pyext.nn import FP8Linear
    from pyext.ops import fp8_linear_dynamic

    made = []
    for op in ("fp8_linear", "fp8_linear_dynamic"):
        typed = fp8_ops._TYPED_CALLS[op]
        monkeypatch.setitem(fp8_ops._TYPED_CALLS, op, lambda *a, op=op, typed=typed: made.append(op) or typed(*a))
    plain = torch.nn.Linear(32, 16).bfloat16()
    w, s = fp8_quantize(plain.weight.detach())
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        FP8Linear.from_linear(plain)(x)
        FP8Linear.from_linear(plain, gemm="dynamic")(x)
        fp8_linear(x, w, s)
        fp8_linear_dynamic(x, w, s)
        fp8_linear(x, w, s, backend="reference")  # a forced backend: torch.ops
    assert made == ["fp8_linear", "fp8_linear_dynamic", "fp8_linear", "fp8_linear_dynamic"]


@needs_ext
@pytest.mark.parametrize("m,k,n", [(4, 32, 32), (3, 33, 165), (4, 32, 129)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_linear_cpp_small_layers_either_side_of_the_direct_loop(m, k, n, dtype, per_channel):
    """Layers of up to 2^14 multiply-adds are a plain loop, larger ones torch's GEMM: both
    agree with the reference to the dtype's rounding, odd sizes and NaN codes included."""
    x = torch.randn(1, m, k, dtype=dtype)
    w, s = fp8_quantize(torch.randn(n, k) / k**0.5, per_channel=per_channel)
    w.view(torch.uint8)[1, 3] = 0x7F  # a NaN code: its output column is NaN
    b = torch.randn(n, dtype=dtype)
    y = fp8_linear(x, w, s, b, backend="cpp")
    ref = fp8_linear_reference(x, w, s, b)
    assert y.shape == (1, m, n) and torch.equal(y.isnan(), ref.isnan()) and bool(y[..., 1].isnan().all())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    ok = ~ref.isnan()
    assert rel_err(y[ok], ref[ok]) <= tol
    with pytest.raises(RuntimeError, match="bias must have x's dtype"):  # the raw kernel's own guard
        torch.ops.pyext_C.fp8_linear(x, w.view(torch.uint8), s, b.double())


@needs_ext
def test_linear_cpp_tiles_wide_weights():
    """N and K large enough for several weight tiles, per-tensor scale."""
    x = torch.randn(3, 2048, dtype=torch.bfloat16)
    w, s = fp8_quantize(torch.randn(1000, 2048) / 45, per_channel=False)
    y = fp8_linear(x, w, s, backend="cpp")
    assert rel_err(y, fp8_linear_reference(x, w, s)) < 1e-2


def test_linear_errors():
    w, s = fp8_quantize(torch.randn(16, 8))
    with pytest.raises(PyextError, match=r"pyext.fp8_linear: x.shape\[-1\] must equal weight.shape\[1\]"):
        fp8_linear(torch.randn(2, 9), w, s)
    with pytest.raises(PyextError, match="pyext.fp8_linear: x.dtype must be one of"):
        fp8_linear(torch.randn(2, 8).double(), w, s)
    with pytest.raises(PyextError, match=r"bias must be torch.float32\[16\]"):
        fp8_linear(torch.randn(2, 8), w, s, torch.randn(15))
    with pytest.raises(PyextError, match="backend 'triton' cannot run this input"):
        fp8_linear(torch.randn(2, 8), w, s, backend="triton")


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_opcheck(backend):
    if backend == "cpp" and EXT is None:
        pytest.skip("pyext._C is not built")
    w, s = fp8_quantize(torch.randn(24, 40))
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    codes = w.view(torch.uint8)
    torch.library.opcheck(torch.ops.pyext.fp8_upcast, (codes, s, torch.bfloat16, backend))
    torch.library.opcheck(torch.ops.pyext.fp8_upcast_out, (codes, s, torch.empty(24, 40), backend))
    torch.library.opcheck(torch.ops.pyext.fp8_linear, (x, codes, s, torch.randn(24, dtype=torch.bfloat16), backend))


def test_compiles_fullgraph():
    w, s = fp8_quantize(torch.randn(24, 40))

    def f(x):
        return fp8_linear(x, w, s) + fp8_upcast(w, s, torch.float32).sum()

    x = torch.randn(5, 40)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x))


@needs_ext
@pytest.mark.parametrize("n,k,tile_rows,expected_gemms", [(64, 64, -1, 1), (17, 33, -1, 1), (1000, 64, 256, 4),
                                                           (1000, 64, 300, 4), (5, 64, 300, 1)])
def test_linear_cpp_tiles_evenly(n, k, tile_rows, expected_gemms):
    """The upcast-and-GEMM path (tile_rows != 0; the fused GEMM calls no torch GEMM): a small
    weight is one GEMM; a forced tile width splits N into even tiles (a regression: an
    off-by-a-ratio tile count once split every layer into one-row GEMMs)."""
    x = torch.randn(3, k, dtype=torch.bfloat16)
    w, s = fp8_quantize(torch.randn(n, k))
    with torch.profiler.profile() as prof:
        y = torch.ops.pyext_C.fp8_linear(x, w.view(torch.uint8), s, None, tile_rows)
    gemms = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
    assert gemms == expected_gemms
    assert rel_err(y, fp8_linear_reference(x, w, s)) < 1e-2


@needs_ext
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upcast_large_outputs_stream_exactly(simd, per_channel, dtype):
    """Outputs over 48 MiB take the non-temporal-store path; odd row length misaligns the rows."""
    w, scale = fp8_quantize(torch.randn(2100, 12601) * 3, per_channel)
    out = torch.empty(w.shape, dtype=dtype)
    fp8_upcast(w, scale, out=out, backend="cpp")
    assert same_bits(out, fp8_upcast_reference(w, scale, dtype))


def finite_codes_weight(n):
    """(n, 254) weight whose rows are rotations of every finite e4m3 code."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return torch.stack([codes.roll(i) for i in range(n)]).view(FP8)


@needs_ext
@pytest.mark.parametrize("per_channel", [True, False])
def test_linear_cpp_decodes_every_code_exactly(simd, per_channel):
    """x = identity picks single weights out: y must be exactly the upcast weight (the fused
    bf16 GEMM decodes codes itself, subnormals included, and scales in its epilogue)."""
    w = finite_codes_weight(70)
    s = torch.rand(70 if per_channel else 1) * 3 + 1e-3
    x = torch.eye(254, dtype=torch.bfloat16)
    y = fp8_linear(x, w, s, backend="cpp")
    assert torch.equal(y, fp8_upcast_reference(w, s, torch.bfloat16).t())


@needs_ext
def test_linear_cpp_propagates_nan_codes(simd):
    codes = fp8_quantize(torch.randn(70, 41))[0].view(torch.uint8).clone()
    codes[3, 5], codes[66, 40] = 0x7F, 0xFF  # the two NaN codes, one in the last (odd) k column
    x = torch.randn(9, 41, dtype=torch.bfloat16)
    y = fp8_linear(x, codes.view(FP8), torch.ones(70), backend="cpp")
    nan_cols = y.isnan().all(0)
    assert nan_cols[3] and nan_cols[66] and nan_cols.sum() == 2 and not y[:, ~nan_cols].isnan().any()


# ----------------------------------------------------------------------------- hardening: bad and extreme inputs

def test_quantize_tiny_channels_get_finite_codes_and_exact_scales():
    """Channels whose amax / 448 is below fp32's smallest normal: the scale was 0 (NaN codes)
    or a subnormal that had lost bits; now a power of two keeps the round trip exact."""
    w = torch.tensor([[1e-44, 0.0, -3e-45], [1e-40, -3e-41, 0.0], [4e-36, 1e-37, -2e-36], [1.0, 0.5, -0.25]])
    q, s = fp8_quantize(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not (q.view(torch.uint8) & 0x7F == 0x7F).any()  # no NaN codes
    assert (torch.log2(s[:3]) == torch.log2(s[:3]).round()).all()  # powers of two
    back = fp8_upcast_reference(q, s, torch.float32)
    assert torch.equal(back[0], w[0])  # 1e-44 = 7 * 2^-149: an exact code times 2^-140
    assert ((back - w).abs() <= w.abs() / 16 + s[:, None] / 1024).all()


def test_quantize_meta_weight_is_a_clear_error():
    with pytest.raises(PyextError, match="pyext.fp8_quantize: the weight is a meta tensor"):
        fp8_quantize(torch.empty(4, 8, device="meta"))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_upcast_out_sharing_the_weights_bytes(backend, dtype):
    """out's storage holds the weight's codes: the op reads them as they were before writing."""
    if backend == "cpp" and EXT is None:
        pytest.skip("pyext._C is not built")
    w, s = fp8_quantize(torch.randn(4, 8))
    expected = fp8_upcast(w, s, dtype, backend="reference")
    out = torch.empty(4, 8, dtype=dtype)
    alias = out.view(-1).view(torch.uint8)[:32].view(FP8).view(4, 8)
    alias.copy_(w)
    fp8_upcast(alias, s, out=out, backend=backend)
    assert same_bits(out, expected)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_raw_upcast_out_refuses_another_shape(backend):
    if backend == "cpp" and EXT is None:
        pytest.skip("pyext._C is not built")
    w, s = fp8_quantize(torch.randn(4, 8))
    with pytest.raises(PyextError, match=r"pyext.fp8_upcast: out must be a contiguous tensor of shape \(4, 8\)"):
        torch.ops.pyext.fp8_upcast_out(w.view(torch.uint8), s, torch.empty(8, 4), backend)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_with_no_input_features(backend, bias):
    if backend == "cpp" and EXT is None:
        pytest.skip("pyext._C is not built")
    w, s = torch.empty(5, 0, dtype=FP8), torch.ones(5)
    b = torch.randn(5) if bias else None
    y = fp8_linear(torch.empty(2, 3, 0), w, s, b, backend=backend)
    assert torch.equal(y, (b if bias else torch.zeros(5)).expand(2, 3, 5))


def test_scales_fuse_exactly():
    assert scales_fuse_exactly(torch.tensor([1e-30, 0.0, -2.0, 7e35]), torch.bfloat16)
    # 1e-40: a subnormal scale, under which small decoded weights upcast to 0 (an inf activation
    # times 0 is NaN there, inf after a GEMM that scales its accumulator)
    for bad in (float("nan"), float("inf"), 1e36, 1e-40):
        assert not scales_fuse_exactly(torch.tensor([1.0, bad]), torch.bfloat16)
    assert not scales_fuse_exactly(torch.tensor([200.0]), torch.float16)  # 448 * 200 > 65504


NON_FINITE_SCALES = [float("nan"), float("inf"), -float("inf"), 1e36]


@needs_ext
@pytest.mark.parametrize("bad", NON_FINITE_SCALES)
def test_linear_means_upcast_then_gemm_for_any_scale(simd, bad):
    """Every backend gives F.linear on the upcast weight, where NaN/inf/huge scales make
    NaN and inf entries (the fused GEMM used to scale its accumulator instead)."""
    w, s = fp8_quantize(torch.randn(40, 64))
    s[[3, 17]] = bad
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = fp8_linear_reference(x, w, s)
    for backend in ("cpp", None):
        y = fp8_linear(x, w, s, backend=backend)
        assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
        finite = expected.isfinite()
        assert rel_err(y[finite], expected[finite]) < 1e-2


def test_triton_linear_means_upcast_then_gemm_for_any_scale():
    """The Triton kernel also scales its accumulator: non-finite scales take the upcast path."""
    result = run_in_triton_interpreter("""
import json, torch
from pyext.ops import fp8_linear, fp8_quantize
from pyext.reference.fp8 import fp8_linear_reference
torch.manual_seed(0)
w, s = fp8_quantize(torch.randn(32, 32))
x = torch.randn(4, 32, dtype=torch.float16)
same = []
for bad in (float("nan"), float("inf"), 1000.0):
    s2 = s.clone(); s2[5] = bad
    y, ref = fp8_linear(x, w, s2, backend="triton"), fp8_linear_reference(x, w, s2)
    same.append(bool(torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())))
print(json.dumps(same))
""")
    assert result == [True, True, True]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_code_times_nan_scale_keeps_the_codes_nan(simd, dtype):
    """NaN * NaN may return either operand: the op defines the code's NaN (its sign kept)."""
    w = torch.tensor([[0x7F, 0xFF, 0x38], [0xFF, 0x01, 0x7F]], dtype=torch.uint8).view(FP8)
    nan_codes = (w.view(torch.uint8) & 0x7F) == 0x7F
    codes_own = fp8_upcast_reference(w, torch.ones(1), dtype)
    for s in (torch.tensor([float("nan")]), torch.tensor([float("nan"), -float("nan")])):
        out = fp8_upcast(w, s, dtype, backend="cpp")
        assert same_bits(out, fp8_upcast_reference(w, s, dtype))
        assert same_bits(out[nan_codes], codes_own[nan_codes])
