"""The dynamic fp8 linear (activations quantized per row, fp8 x fp8 GEMM): the op against its
reference (tests/test_fuzz.py: against a float64 oracle), its accuracy against the plain layer, the layers' GEMM modes,
and optimize(fp8_gemm=...) against plain diffusers."""
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pyext
from pyext import dispatch
from pyext.dispatch import PyextError
from pyext.nn.fp8 import _GEMM_CHOICE, FP8Conv2d, FP8Linear
from pyext.offline import build_pipeline
from pyext.ops import fp8_linear, fp8_linear_dynamic, fp8_quantize
from pyext.reference.fp8 import quantize_rows
from tests.conftest import run_in_triton_interpreter


@pytest.fixture(autouse=True)
def fresh_dispatch(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    dispatch.reset()
    _GEMM_CHOICE.clear()
    yield
    dispatch.reset()
    _GEMM_CHOICE.clear()


def sqnr_db(out: torch.Tensor, exact: torch.Tensor) -> float:
    return 10 * torch.log10(exact.double().pow(2).mean() / (out.double() - exact.double()).pow(2).mean()).item()


def test_rows_are_scaled_to_their_own_amax_and_rounded_to_e4m3():
    x = torch.randn(6, 40) * torch.logspace(-3, 3, 6)[:, None]  # rows six decades apart
    q, sx = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and sx.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((6,), 448.0))  # each row's amax lands on 448
    back = q.float() * sx
    assert ((back - x).abs() <= 2.0 ** -4 * x.abs() + sx * 2.0 ** -10).all()  # half an e4m3 step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_quantization_is_the_fp32_formula_bit_for_bit(dtype):
    x = (torch.randn(67, 300) * torch.logspace(-8, 8, 67)[:, None]).to(dtype)
    x[3, 5], x[4, 9], x[5, 1], x[6] = float("nan"), float("inf"), -float("inf"), 0.0
    xf = x.float()
    inverse = torch.tensor(1 / 448.0, dtype=torch.float32)  # the fp32 reciprocal, as a GPU's division by a number
    want_sx = (xf.abs().amax(-1, keepdim=True) * inverse).clamp_min(torch.finfo(torch.float32).tiny)
    want_q = (xf / want_sx).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q, sx = quantize_rows(x)
    assert torch.equal(sx.nan_to_num(), want_sx.nan_to_num()) and torch.equal(sx.isnan(), want_sx.isnan())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_zero_and_non_finite_rows():
    w, s = fp8_quantize(torch.randn(32, 16))
    x = torch.randn(4, 16).bfloat16()
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 0] = float("inf")
    for backend in ("scaled_mm", "reference"):
        y = fp8_linear_dynamic(x, w, s, backend=backend)
        assert torch.isfinite(y[0]).all() and (y[1] == 0).all()
        assert y[2].isnan().all() and y[3].isnan().all()


TRITON_QUANTIZE = """
import json, torch
from pyext.kernels.fp8_quantize_rows import quantize_rows_triton, same_quantization
from pyext.ops import fp8_linear_dynamic, fp8_quantize
from pyext.reference.fp8 import quantize_rows
torch.manual_seed(0)
cases, differ = 0, []
def compare(x, what):
    global cases
    cases += 1
    if not same_quantization(quantize_rows_triton(x), quantize_rows(x)):
        differ.append(what)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for m, k in ((1, 1), (3, 7), (5, 130), (2, 257)):
        span = {torch.float32: 30, torch.bfloat16: 30, torch.float16: 4}[dtype]
        x = torch.randn(m, k) * torch.logspace(-span, span, k)
        compare(x.to(dtype), f"{dtype} {m}x{k}")
    bad = torch.randn(6, 19).to(dtype)
    bad[0, 3], bad[1, 0], bad[2, 7], bad[3] = float("nan"), float("inf"), -float("inf"), 0.0
    bad[4] = -0.0
    compare(bad, f"{dtype} NaN, inf, zero rows")
    # the dtype's subnormals, in a row whose amax is one of them
    tiny = torch.finfo(dtype).tiny
    compare((torch.linspace(-1, 1, 37) * tiny).to(dtype)[None], f"{dtype} subnormals")
# every finite e4m3 value at scale 1 (the row's amax is 448), the midpoints between neighbours
# (ties to even) and the fp32 values next to each midpoint, subnormals included
values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
values = values[values.isfinite()].sort().values
mid = (values[1:] + values[:-1]) / 2
row = torch.cat([values, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))])
compare(row[None], "ties")
compare(torch.tensor([[1e-45, -3e-39, 2.0 ** -140, 1e-30]]), "fp32 subnormal amax")
w, s = fp8_quantize(torch.randn(48, 32))
x = torch.randn(2, 5, 32).bfloat16()
same_gemm = torch.equal(fp8_linear_dynamic(x, w, s, backend="triton_scaled_mm"),
                        fp8_linear_dynamic(x, w, s, backend="scaled_mm"))
print(json.dumps(dict(cases=cases, differ=differ, same_gemm=same_gemm)))
"""


@pytest.mark.slow
def test_triton_row_quantization_is_quantize_rows_bit_for_bit():
    """The Triton kernel's codes and scales are PyTorch's (quantize_rows), in Triton's interpreter:
    every dtype, odd row lengths, magnitudes over 60 decades, NaN/inf/zero rows, rows of each
    dtype's subnormals, and every rounding tie of e4m3; so the op's GEMM is the same bit for bit."""
    result = run_in_triton_interpreter(TRITON_QUANTIZE)
    assert result["cases"] == 20 and result["differ"] == [] and result["same_gemm"]


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5), (0,)])
@pytest.mark.parametrize("k,n", [(16, 16), (48, 80), (96, 32)])
@pytest.mark.parametrize("per_channel,bias", [(True, True), (False, False)])
def test_scaled_mm_matches_the_reference(lead, k, n, per_channel, bias):
    g = torch.Generator().manual_seed(k * n)
    x = torch.randn(*lead, k, generator=g).bfloat16()
    w, s = fp8_quantize(torch.randn(n, k, generator=g), per_channel)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    out = fp8_linear_dynamic(x, w, s, b, backend="scaled_mm")
    ref = fp8_linear_dynamic(x, w, s, b, backend="reference")
    assert out.shape == (*lead, n) and out.dtype == torch.bfloat16
    scale = max([1.0, *ref.float().abs().flatten().tolist()])
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2 ** -7 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_close_to_the_plain_linear(dtype):
    """The activations' e4m3 rounding costs a few dB against the weight-only GEMM, no more."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g), torch.randn(128, generator=g)
    exact = F.linear(x.double(), w.double(), b.double())
    wq, s = fp8_quantize(w)
    dynamic = sqnr_db(fp8_linear_dynamic(x.to(dtype), wq, s, b.to(dtype)), exact)
    weight_only = sqnr_db(fp8_linear(x.to(dtype), wq, s, b.to(dtype)), exact)
    assert 25 < dynamic < weight_only < dynamic + 6


@pytest.mark.parametrize("backend", ["scaled_mm", "reference"])
def test_opcheck(backend):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 32, generator=g).bfloat16()
    w, s = fp8_quantize(torch.randn(48, 32, generator=g))
    for bias in (None, torch.randn(48, generator=g).bfloat16()):
        torch.library.opcheck(torch.ops.pyext.fp8_linear_dynamic, (x, w.view(torch.uint8), s, bias, backend))


def test_forced_backends_say_what_they_take():
    w, s = fp8_quantize(torch.randn(24, 40))
    with pytest.raises(PyextError, match="multiples of 16"):
        fp8_linear_dynamic(torch.randn(2, 40).bfloat16(), w, s, backend="scaled_mm")
    w, s = fp8_quantize(torch.randn(32, 32))
    with pytest.raises(PyextError, match="bfloat16 only"):
        fp8_linear_dynamic(torch.randn(2, 32).half(), w, s, backend="scaled_mm")
    with pytest.raises(PyextError, match="pyext.fp8_linear_dynamic: .*0 input features"):
        torch.ops.pyext.fp8_linear_dynamic(torch.randn(2, 0), w.view(torch.uint8)[:, :0], s, None, None)



def test_a_torch_whose_cpu_scaled_mm_lacks_row_wise_scales_is_named_when_it_is_forced(monkeypatch):
    """Older torch releases' CPU torch._scaled_mm refuses row-wise scales with an internal
    assert; forcing the backend there says so, and dispatch's own choice runs the reference."""
    from pyext.ops import fp8_dynamic

    def per_tensor_only(a, b, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    real = torch._scaled_mm
    w, s = fp8_quantize(torch.randn(32, 32))
    x = torch.randn(3, 32).bfloat16()
    expected = fp8_linear_dynamic(x, w, s, backend="reference")
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    fp8_dynamic._cpu_rowwise_missing.cache_clear()
    dispatch.reset()
    try:
        with pytest.raises(PyextError, match="scaled_mm.*per-tensor scales only"):
            fp8_linear_dynamic(x, w, s, backend="scaled_mm")
        torch.testing.assert_close(fp8_linear_dynamic(x, w, s), expected, atol=0, rtol=0)
    finally:
        fp8_dynamic._cpu_rowwise_missing.cache_clear()
        dispatch.reset()
    monkeypatch.undo()
    assert fp8_dynamic._cpu_rowwise_missing() is None  # this torch takes them

# ----------------------------------------------------------------------------- layers

def layer(gemm: str, in_features=64, out_features=32, dtype=torch.bfloat16):
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features).to(dtype)
    return plain, FP8Linear.from_linear(plain, gemm=gemm)


def test_a_dynamic_layer_runs_the_dynamic_op_and_a_weight_only_layer_does_not():
    x = torch.randn(3, 64).bfloat16()
    _, dyn = layer("dynamic")
    _, wo = layer("weight_only")
    assert torch.equal(dyn(x), fp8_linear_dynamic(x, dyn.fp8_weight, dyn.scale, dyn.bias))
    assert torch.equal(wo(x), fp8_linear(x, wo.fp8_weight, wo.scale, wo.bias))
    assert not torch.equal(dyn(x), wo(x))
    assert "gemm=dynamic" in repr(dyn)


@pytest.mark.parametrize("features,dtype", [((40, 32), torch.bfloat16), ((64, 32), torch.float32),
                                            ((64, 32), torch.float16)])
def test_layers_the_dynamic_gemm_cannot_take_stay_weight_only(features, dtype):
    _, dyn = layer("dynamic", *features, dtype=dtype)
    x = torch.randn(3, features[0]).to(dtype)
    assert torch.equal(dyn(x), fp8_linear(x, dyn.fp8_weight, dyn.scale, dyn.bias))


def test_measured_layers_time_both_once_per_shape_and_keep_the_faster():
    _, m = layer("measured")
    x = torch.randn(3, 64).bfloat16()
    first = m(x)
    [decision] = [d for d in dispatch.decisions() if d["op"] == "fp8_gemm"]
    assert set(decision["timings"]) == {"weight_only", "dynamic"}
    expected = fp8_linear_dynamic if decision["backend"] == "dynamic" else fp8_linear
    assert torch.equal(first, expected(x, m.fp8_weight, m.scale, m.bias))
    m(torch.randn(3, 64).bfloat16())
    assert len([d for d in dispatch.decisions() if d["op"] == "fp8_gemm"]) == 1  # same bucket: not timed again


def test_a_bad_gemm_mode_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(64, 128))
    with pytest.raises(PyextError, match="gemm='fast' is not an fp8 GEMM mode"):
        pyext.quantize_fp8(model, gemm="fast")
    assert type(model[0]) is nn.Linear
    with pytest.raises(PyextError, match="fp8_gemm"):
        pyext.OptimizeOptions(fp8_gemm="fast")


# ----------------------------------------------------------------------------- pipelines

def generate(pipe):
    return pipe("a photo", num_inference_steps=2, height=64, width=64, guidance_scale=5.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]


def psnr_db(a, b) -> float:
    return float(10 * np.log10(1.0 / np.mean((a.astype(np.float64) - b) ** 2)))


def test_optimize_with_dynamic_fp8_is_close_to_plain_diffusers():
    plain = build_pipeline("sd15", "tiny").to(torch.bfloat16)
    expected = generate(plain)
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype=torch.bfloat16, fp8="denoiser", fp8_gemm="dynamic")
    layers = [m for m in pipe.unet.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.gemm == "dynamic" for m in layers)
    assert "fp8 GEMM dynamic" in pyext.report(pipe).decision
    assert psnr_db(generate(pipe), expected) > 30


def test_the_reports_cpu_cost_is_measured_for_the_gemm_mode_that_runs():
    """A cost measured for weight-only fp8 is never reported for dynamic fp8 on the same shape."""
    from pyext import dispatch

    costs = lambda: {d["key"]: d["timings"] for d in dispatch.decisions() if d["op"] == "fp8_cost"}  # noqa: E731
    pyext.optimize(build_pipeline("sd15", "tiny"), dtype=torch.bfloat16, fp8="denoiser", fp8_gemm="weight_only")
    pyext.optimize(build_pipeline("sd15", "tiny"), dtype=torch.bfloat16, fp8="denoiser", fp8_gemm="dynamic")
    modes = {key.rsplit(" ", 1)[1] for key in costs()}
    assert {"weight_only", "dynamic"} <= modes, costs()


def test_the_reports_cpu_cost_leaves_out_the_layers_first_call(monkeypatch):
    """The layer's first call makes its GEMM's own measured choice: one-time work that is not what
    fp8 costs per call, and that the cost must leave out."""
    from pyext.techniques.weights import cpu_cost

    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    dispatch.reset()
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 96).to(torch.bfloat16))
    forward, calls = FP8Linear.forward, []

    def first_call_slow(self, x):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)
        return forward(self, x)

    monkeypatch.setattr(FP8Linear, "forward", first_call_slow)
    conv = FP8Conv2d.from_conv(torch.nn.Conv2d(8, 16, 3, padding=1).to(torch.bfloat16))
    cost = cpu_cost(torch.nn.Sequential(layer, conv))
    assert "largest fp8 linear (256x64x96" in cost and "largest fp8 convolution (2x8x32x32 -> 16, 3x3" in cost, cost
    timings = next(d["timings"] for d in dispatch.decisions() if d["op"] == "fp8_cost" and "x64x96" in d["key"])
    assert len(calls) > 1 and timings["fp8"] < 0.1, timings
    dispatch.reset()


def test_auto_is_weight_only_without_fp8_tensor_cores_and_a_second_optimize_changes_the_mode():
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype=torch.bfloat16, fp8="denoiser")
    layers = [m for m in pipe.unet.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.gemm == "weight_only" for m in layers)
    assert "fp8 GEMM weight_only" in pyext.report(pipe).decision
    pyext.optimize(pipe, dtype=torch.bfloat16, fp8="denoiser", fp8_gemm="dynamic")
    assert all(m.gemm == "dynamic" for m in pipe.unet.modules() if isinstance(m, FP8Linear))
    assert "fp8 GEMM dynamic" in pyext.report(pipe).decision
