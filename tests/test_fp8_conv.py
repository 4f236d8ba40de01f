"""fp8_conv2d (implicit-GEMM conv on fp8 codes) and FP8Conv2d's choice of path."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import PyextError, dispatch
from pyext._ext import EXT, cpu_capabilities
from pyext.nn import quantize_fp8
from pyext.ops import fp8_conv2d, fp8_quantize
from pyext.ops.fp8 import example_weight
from pyext.reference.fp8 import FP8, fp8_conv2d_reference, fp8_upcast_reference

CL = torch.channels_last
needs_fused = pytest.mark.skipif(EXT is None or "avx512_bf16" not in cpu_capabilities(),
                                 reason="the fused fp8 conv needs pyext._C on a CPU with AVX512_BF16")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, c, h, w, n, k, per_channel=True, bias=True):
    x = torch.randn(b, c, h, w, dtype=torch.bfloat16).contiguous(memory_format=CL)
    wq, s = fp8_quantize(torch.randn(n, c, k, k) / (c * k * k) ** 0.5, per_channel)
    return x, wq, s, torch.randn(n, dtype=torch.bfloat16) if bias else None


@needs_fused
@pytest.mark.parametrize("b,c,h,w,n,k,stride,padding", [
    (1, 2, 5, 7, 3, 3, 1, 1), (2, 6, 9, 8, 70, 3, 2, 1), (1, 8, 6, 6, 64, 1, 1, 0), (2, 10, 7, 5, 17, 3, 1, 0),
    (1, 4, 4, 4, 5, 2, 2, 1), (1, 12, 11, 13, 130, 3, 1, 2), (3, 64, 8, 8, 1, 3, 2, 0), (1, 320, 6, 5, 96, 3, 1, 1)])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_cpp_matches_exact_conv(b, c, h, w, n, k, stride, padding, per_channel, bias):
    x, wq, s, bb = make(b, c, h, w, n, k, per_channel, bias)
    y = fp8_conv2d(x, wq, s, bb, stride, padding, backend="cpp")
    ref = fp8_conv2d(x, wq, s, bb, stride, padding, backend="reference")
    exact = F.conv2d(x.double(), fp8_upcast_reference(wq, s, torch.float32).double(),
                     None if bb is None else bb.double(), stride, padding)
    assert y.shape == exact.shape and y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=CL)
    y_nchw = fp8_conv2d(x.contiguous(), wq, s, bb, stride, padding, backend="cpp")  # reordered inside
    assert torch.equal(y_nchw, y.contiguous()) and y_nchw.is_contiguous()
    # Error vs float64 within 2x the bf16 reference's own (plus bf16 output rounding headroom).
    assert rel_err(y, exact) <= 2 * rel_err(ref, exact) + 2e-3


@needs_fused
def test_cpp_padding_rows_are_zero_even_with_nonfinite_neighbours():
    """Zero padding must be zeros, not whatever sits next to the image in memory."""
    x, wq, s, _ = make(1, 4, 5, 5, 8, 3)
    big = torch.full((2, 4, 5, 5), float("inf"), dtype=torch.bfloat16).contiguous(memory_format=CL)
    big[1:] = x
    y = fp8_conv2d(big[1:], wq, s, None, 1, 1, backend="cpp")
    assert torch.isfinite(y).all()
    assert rel_err(y, fp8_conv2d_reference(x, wq, s, None, 1, 1)) < 1e-2


@needs_fused
def test_cpp_backend_says_why_it_cannot_run():
    x, wq, s, bb = make(1, 4, 6, 6, 8, 3)
    with pytest.raises(PyextError, match="bfloat16 only"):
        fp8_conv2d(x.float(), wq, s, None, 1, 1, backend="cpp")
    with pytest.raises(PyextError, match="groups must be 1"):
        fp8_conv2d(x, fp8_quantize(torch.randn(8, 2, 3, 3))[0], s, None, 1, 1, groups=2, backend="cpp")
    with pytest.raises(PyextError, match="input channels must be even"):
        x3, w3, s3, _ = make(1, 3, 6, 6, 8, 3)
        fp8_conv2d(x3, w3, s3, None, 1, 1, backend="cpp")
    # Without a forced backend, the same inputs fall back to the reference.
    torch.testing.assert_close(fp8_conv2d(x.float(), wq, s, None, 1, 1),
                               fp8_conv2d_reference(x.float(), wq, s, None, 1, 1))


def test_errors_name_the_op():
    x, wq, s, _ = make(1, 4, 6, 6, 8, 3)
    with pytest.raises(PyextError, match=r"pyext.fp8_conv2d: weight must be .* in = x.shape\[1\]"):
        fp8_conv2d(x[:, :2], wq, s)
    with pytest.raises(PyextError, match="padding must be an int or two ints"):
        fp8_conv2d(x, wq, s, padding="same")
    with pytest.raises(PyextError, match="larger than the padded input"):
        fp8_conv2d(x[:, :, :2], wq, s)
    with pytest.raises(PyextError, match="x must be a 4-D"):
        fp8_conv2d(x[0], wq, s)
    with pytest.raises(PyextError, match="bias must be"):
        fp8_conv2d(x, wq, s, torch.zeros(7, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_opcheck(backend):
    if backend == "cpp" and (EXT is None or "avx512_bf16" not in cpu_capabilities()):
        pytest.skip("no fused fp8 conv here")
    x, wq, s, bb = make(2, 6, 7, 5, 10, 3)
    codes = wq.view(torch.uint8)
    torch.library.opcheck(torch.ops.pyext.fp8_conv2d, (x, codes, s, bb, [2, 1], [1, 0], [1, 1], 1, backend))


def _conv_calls(model, x):
    model(x)  # dispatch's first choice for a signature self-checks the backend on a small input
    with torch.profiler.profile() as prof:
        y = model(x)
    counts = {e.key: e.count for e in prof.key_averages()}
    fused = counts.get("pyext_C::fp8_conv2d", 0) + counts.get("pyext_C::fp8_conv2d_brgemm", 0)  # (brgemm: AMX CPUs)
    return y, fused, counts.get("aten::convolution", 0)


@needs_fused
@torch.no_grad()  # as a pipeline calls it: a call autograd records runs torch's conv on the values
def test_module_takes_the_fused_path_on_its_kernel_layout_codes():
    torch.manual_seed(0)
    # a norm first: quantize_fp8 keeps the layer that holds a model's first parameter (its dtype is the model's)
    model = nn.Sequential(nn.GroupNorm(4, 16), nn.Conv2d(16, 32, 3, padding=1), nn.SiLU(),
                          nn.Conv2d(32, 16, 3, stride=2, padding=1))
    model = model.to(torch.bfloat16)
    x = torch.randn(2, 16, 12, 10, dtype=torch.bfloat16)
    ref = model(x)
    quantize_fp8(model, skip=(), )
    # (out, kh, kw, in) codes whatever the module's format: the fused path, channels-last output
    assert model[1].weight.is_contiguous(memory_format=CL) and not model[1].weight.is_contiguous()
    assert model[1].weight.shape == (32, 16, 3, 3)
    for inp in (x.contiguous(memory_format=CL), x):  # an NCHW input is reordered, as torch's conv does
        y_cl, fused, aten = _conv_calls(model, inp)
        assert fused == 2 and aten == 0 and y_cl.is_contiguous(memory_format=CL)
        assert rel_err(y_cl, ref) < 0.06  # fp8 weights: ~30 dB
    model.to(memory_format=torch.contiguous_format)  # (out, in, kh, kw) codes: the kernel reorders them
    assert model[1].weight.is_contiguous()
    y_nchw, fused, aten = _conv_calls(model, x)
    assert fused == 2 and aten == 0 and y_nchw.is_contiguous()
    assert rel_err(y_cl, y_nchw) < 1e-2
    model.to(memory_format=CL)
    assert model[1].weight.is_contiguous(memory_format=CL) and rel_err(model(x), y_cl) == 0


@pytest.mark.parametrize("channels_last_weight", [True, False])
@pytest.mark.parametrize("kernel", [1, 3])
def test_the_output_takes_torchs_memory_format_whatever_the_backend(kernel, channels_last_weight):
    """torch's conv reads the format from strides: a 1x1 weight made channels-last is contiguous
    both ways, yet gives channels-last outputs, which the next layer then reads without a reorder."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 5, 6, generator=g).bfloat16()
    codes, scale = example_weight((6, 8, kernel, kernel), True, "cpu", g)
    if channels_last_weight:  # as Module.to(memory_format=...) makes it (contiguous() keeps a 1x1's strides)
        codes = codes.to(memory_format=CL)
    plain = F.conv2d(x, torch.empty(codes.shape, dtype=torch.bfloat16).as_strided(codes.shape, codes.stride()),
                     padding=kernel // 2)
    op, args = dispatch.ops()["fp8_conv2d"], (x, codes, scale, None, [1, 1], [kernel // 2] * 2, [1, 1], 1)
    backends = [b.name for b in op.backends if b.unavailable() is None and not dispatch.input_reasons(op, b, args)]
    assert "reference" in backends and "upcast" in backends
    for backend in backends:
        y = fp8_conv2d(x, codes.view(FP8), scale, padding=kernel // 2, backend=backend)
        assert y.stride() == plain.stride(), backend


# ----------------------------------------------------------------------------- hardening: bad and extreme inputs

def test_zero_input_channels_is_a_clear_error():
    """The fused kernel divided by K = 0 (SIGFPE); torch's conv returns a wrongly shaped result."""
    x = torch.empty(1, 0, 5, 5, dtype=torch.bfloat16)
    w = torch.empty(4, 0, 3, 3, dtype=torch.float8_e4m3fn)
    for backend in (None, "reference"):
        with pytest.raises(PyextError, match="pyext.fp8_conv2d: x has 0 input channels"):
            fp8_conv2d(x, w, torch.ones(4), backend=backend)


@needs_fused
def test_cpp_kernel_refuses_zero_input_channels():
    x = torch.empty(1, 0, 5, 5, dtype=torch.bfloat16)
    w = torch.empty(4, 3, 3, 0, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no input channels"):
        torch.ops.pyext_C.fp8_conv2d(x, w, torch.ones(4), None, [1, 1], [0, 0])


@pytest.mark.parametrize("geometry,match", [
    (dict(groups=0), "groups must be a positive int dividing the 8 output channels"),
    (dict(groups=3), "groups must be a positive int dividing"),
    (dict(groups=1.0), "groups must be a positive int"),
    (dict(stride=0), "stride must be an int or two ints .* each >= 1; got 0"),
    (dict(stride=(1, 1, 1)), "stride must be an int or two ints"),
    (dict(stride=1.5), "stride must be an int or two ints"),
    (dict(padding=-1), "padding must be an int or two ints .* each >= 0"),
    (dict(padding=(1,)), "padding must be an int or two ints"),
    (dict(dilation=(1, 0)), "dilation must be an int or two ints"),
])
def test_bad_geometry_is_a_clear_error(geometry, match):
    x, wq, s, _ = make(1, 4, 6, 6, 8, 3)
    with pytest.raises(PyextError, match=f"pyext.fp8_conv2d: {match}"):
        fp8_conv2d(x, wq, s, **geometry)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e36])
def test_cpp_declines_scales_it_cannot_apply_after_the_dot_product(bad):
    """The fused kernel scales its accumulator, which is F.conv2d on the upcast weight only
    while |scale| * 448 is a finite bf16 and no weight underflows: other scales go to the reference."""
    x, wq, s, _ = make(1, 4, 6, 6, 8, 3)
    s[2] = bad
    op = dispatch.ops()["fp8_conv2d"]
    cpp = next(b for b in op.backends if b.name == "cpp")
    reasons = dispatch.input_reasons(op, cpp, (x, wq.view(torch.uint8), s, None, [1, 1], [1, 1], [1, 1], 1))
    assert any("scales must be finite" in r for r in reasons)
    y, ref = fp8_conv2d(x, wq, s, None, 1, 1), fp8_conv2d_reference(x, wq, s, None, 1, 1)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())


@needs_fused
def test_the_module_choice_goes_through_measured_dispatch(monkeypatch):
    """FP8Conv2d asks dispatch, which times the fused kernel against the upcast into a reused
    buffer on the first call of a shape and keeps the faster; forgetting the choices forgets it."""
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    dispatch.reset()
    model = nn.Sequential(nn.GroupNorm(4, 16), nn.Conv2d(16, 32, 3, padding=1)).to(torch.bfloat16)
    quantize_fp8(model, skip=())
    conv = model[1]
    x = torch.randn(1, 16, 9, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    y = conv(x)
    made = [d for d in dispatch.decisions() if d["op"] == "fp8_conv2d"]
    # brgemm is a candidate too where the CPU has AMX
    timed = {"cpp", "upcast", "reference"} | ({"brgemm"} if torch.ops.pyext_C.fp8_brgemm_available() else set())
    assert any(set(d["timings"]) == timed for d in made), [d["timings"] for d in made]
    assert rel_err(y, fp8_conv2d(x, conv.fp8_weight, conv.scale, conv.bias.to(x.dtype), 1, 1, backend="upcast")) < 1e-2
    dispatch.reset()
