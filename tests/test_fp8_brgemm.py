"""The fp8 linear and convolution on torch's brgemm micro-kernel (csrc/fp8/fp8_gemm_cpu_brgemm.cpp),
and the armed fast path that runs the chosen C++ backend without entering Python.

What does not depend on the micro-kernel (the decode into the VNNI layout, blocks of rows, panels
of channels, the epilogue's scale, bias and rounding) runs on every machine with the stand-in, a
plain loop over the same layout. Where torch's brgemm has an AMX kernel for bf16 (its
cpublas::could_pack), the real micro-kernel runs against the stand-in too.
"""
import pytest
import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import has_kernel
from pyext.ops.fp8 import example_weight, fp8_linear
from pyext.reference.fp8 import FP8

pytestmark = pytest.mark.skipif(not has_kernel("fp8_linear_brgemm"), reason="pyext._C is not built")

# (rows, in features, out features): one row, a block of rows and its tail (32), one panel and its
# tail (64), K from one VNNI pair to a width diffusion uses; up to 64 rows the GEMM multiplies
# w x^T, above it x w^T, its panels decoded in groups of up to four (520 channels: 4 + 4 + 1), all
# of them at once where they fit in 1 MiB, else a group at a time (K 2560: groups of three).
# K past 4096 codes: the small-M GEMM decodes rows a chunk at a time (two chunks and a tail);
# K past 8192: the larger one decodes its groups a chunk of K at a time.
SHAPES = [(1, 2, 1), (3, 40, 7), (31, 96, 64), (32, 130, 65), (33, 64, 130), (64, 66, 70), (65, 2, 64),
          (70, 320, 200), (130, 64, 520), (100, 2560, 520), (5, 1280, 96), (7, 8200, 70), (66, 8258, 130)]
# Chunks of K with more rows than their fp32 sums may hold at once: two runs of blocks per chunk.
CHUNKED_RUNS = (530, 8258, 260)


def brgemm(x, w, scale, bias, **switches):
    return torch.ops.pyext_C.fp8_linear_brgemm(x, w, scale, bias, **switches)


def amx_brgemm() -> bool:
    return bool(torch.ops.pyext_C.fp8_brgemm_available())


def case(m, k, n, per_channel, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, scale = example_weight((n, k), per_channel, "cpu", g)
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    return x, w, scale, bias


def exact_product(x, w, scale, bias):
    """fp64 of what the GEMM computes before its last rounding: bf16 x times the decoded weight."""
    weight = w.view(FP8).double() * scale.double().reshape(-1, 1)
    y = x.double() @ weight.T
    return y + bias.double() if bias is not None else y


def assert_rounded_from(out, exact):
    """Within one bf16 rounding of the fp64 product, plus fp32 summation's error over K."""
    err = (out.double() - exact).abs()
    allowed = 2.0 ** -8 * exact.abs() + 1e-5 * exact.abs().max().clamp_min(1.0)
    assert out.dtype == torch.bfloat16 and bool((err <= allowed).all()), float((err - allowed).max())


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("per_channel,with_bias", [(True, True), (False, False), (True, False)])
def test_the_stand_in_path_gives_the_rounded_product(m, k, n, per_channel, with_bias):
    x, w, scale, bias = case(m, k, n, per_channel, with_bias)
    out = brgemm(x, w, scale, bias, stand_in=True)
    assert out.shape == (m, n)
    assert_rounded_from(out, exact_product(x, w, scale, bias))


def test_chunks_of_k_over_runs_of_blocks_give_the_rounded_product():
    """One thread, so that one task holds all 17 blocks of rows (runs of 16 and 1)."""
    x, w, scale, bias = case(*CHUNKED_RUNS, True, True, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        outs = [brgemm(x, w, scale, bias, stand_in=True)] + ([brgemm(x, w, scale, bias)] if amx_brgemm() else [])
    finally:
        torch.set_num_threads(before)
    for out in outs:
        assert_rounded_from(out, exact_product(x, w, scale, bias))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_simd_and_scalar_packers_write_the_same_panels(m, k, n):
    """Through the stand-in, which sums in a fixed order: equal panels give equal bits (AVX-512
    CPUs pack with the SIMD packer by default; elsewhere both runs take the scalar one)."""
    x, w, scale, bias = case(m, k, n, True, True, seed=1)
    w[0, 0] = 0x7F  # a NaN code: its row decodes to NaN, in both packers alike
    simd = brgemm(x, w, scale, bias, stand_in=True)
    scalar = brgemm(x, w, scale, bias, stand_in=True, scalar=True)
    assert torch.equal(simd.view(torch.int16), scalar.view(torch.int16))
    assert bool(simd[:, 0].isnan().all()) and not bool(simd[:, 1:].isnan().any())


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("m,k,n", [(40, 96, 200), (200, 96, 200), (200, 96, 256), (100, 64, 64)])
def test_the_split_over_threads_gives_the_bits_of_one_thread(m, k, n, threads):
    """Tasks take shares of the panels (five panels over two threads: the rows instead; one panel:
    the rows); each output is the same sum whatever task computes it."""
    x, w, scale, bias = case(m, k, n, True, True, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = brgemm(x, w, scale, bias, stand_in=True)
        torch.set_num_threads(threads)
        split = brgemm(x, w, scale, bias, stand_in=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int16), split.view(torch.int16))


def test_batched_input_keeps_its_leading_dimensions():
    x, w, scale, bias = case(12, 40, 9, True, True)
    out = brgemm(x.reshape(3, 4, 40), w, scale, bias, stand_in=True)
    assert out.shape == (3, 4, 9) and torch.equal(out.reshape(12, 9), brgemm(x, w, scale, bias, stand_in=True))


def test_scales_that_do_not_fuse_take_the_upcast_path():
    """A scale whose decoded weights overflow bf16: the op's meaning (upcast, then GEMM) is inf
    weights, which the fused epilogue cannot give; the kernel takes the upcast path."""
    x, w, scale, bias = case(5, 40, 7, True, False)
    scale[2] = 3e37
    out = brgemm(x, w, scale, bias, stand_in=True)
    expected = fp8_linear(x, w.view(FP8), scale, bias, backend="reference")
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert torch.allclose(out[finite].float(), expected[finite].float(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not has_kernel("fp8_linear_brgemm") or not amx_brgemm(),
                    reason="torch's brgemm has no AMX bf16 kernel on this CPU")
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_torchs_brgemm_matches_the_stand_in(m, k, n):
    x, w, scale, bias = case(m, k, n, True, True, seed=2)
    out = brgemm(x, w, scale, bias)
    assert_rounded_from(out, exact_product(x, w, scale, bias))
    stand_in = brgemm(x, w, scale, bias, stand_in=True)
    assert ((out.float() - stand_in.float()).abs() <= 2.0 ** -7 * stand_in.float().abs() + 1e-4).all()


def test_the_backend_refuses_odd_in_features_and_says_why():
    op = dispatch.ops()["fp8_linear"]
    backend = next(b for b in op.backends if b.name == "brgemm")
    x, w, scale, _ = case(3, 33, 8, True, False)
    assert any("odd" in r for r in dispatch.input_reasons(op, backend, (x, w, scale, None)))
    x, w, scale, _ = case(3, 34, 8, True, False)
    assert dispatch.input_reasons(op, backend, (x, w, scale, None)) == []
    missing = backend.unavailable()
    assert (missing is None) == amx_brgemm()
    if missing:
        assert "AMX" in missing


def test_without_amx_the_real_path_is_an_error_not_a_wrong_answer():
    if amx_brgemm():
        pytest.skip("this CPU has torch's AMX brgemm")
    x, w, scale, bias = case(3, 40, 7, True, True)
    with pytest.raises(RuntimeError, match="brgemm"):
        brgemm(x, w, scale, bias)


# (batch, in channels, height, width, out channels, kernel, stride, padding): a 1x1 conv; 3x3 with
# padding whose rows cross blocks of 32 output pixels; stride 2 with an odd width; a panel's tail
# (70 channels); padding larger than the kernel reaches (output pixels of bias only); a 1-pixel row;
# K = 9 x 1024 past 8192, decoded a tap at a time. Stride 1 with short output rows runs in grid mode
# (the 1x1, the large padding, the 1-pixel rows, 8x8 and the 5x6 rows: blocks across output rows
# and images); the last shape is the same K on rows of 33 pixels, blocks within a row.
CONV_SHAPES = [(1, 8, 6, 6, 64, 1, 1, 0), (2, 6, 5, 40, 16, 3, 1, 1), (1, 4, 9, 11, 70, 3, 2, 1),
               (1, 2, 4, 5, 3, 3, 1, 3), (2, 10, 1, 1, 5, 1, 1, 0), (1, 320, 8, 8, 130, 3, 1, 1),
               (2, 1024, 5, 6, 260, 3, 1, 1), (1, 1024, 3, 33, 70, 3, 1, 1)]


def conv_case(b, c, h, w, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, h, w, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
    codes, scale = example_weight((n, c, k, k), True, "cpu", g)
    return x, codes, scale, torch.randn(n, generator=g).bfloat16()


def conv_brgemm(x, codes, scale, bias, stride, padding, **switches):
    return torch.ops.pyext_C.fp8_conv2d_brgemm(x, codes.permute(0, 2, 3, 1), scale, bias, [stride] * 2,
                                               [padding] * 2, **switches)


def exact_conv(x, codes, scale, bias, stride, padding):
    weight = codes.view(FP8).double() * scale.double().reshape(-1, 1, 1, 1)
    return F.conv2d(x.double(), weight, bias.double(), stride, padding)


@pytest.mark.parametrize("b,c,h,w,n,k,stride,padding", CONV_SHAPES)
def test_the_stand_in_convolution_gives_the_rounded_product(b, c, h, w, n, k, stride, padding):
    x, codes, scale, bias = conv_case(b, c, h, w, n, k)
    out = conv_brgemm(x, codes, scale, bias, stride, padding, stand_in=True)
    exact = exact_conv(x, codes, scale, bias, stride, padding)
    assert out.shape == exact.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert_rounded_from(out, exact)
    scalar = conv_brgemm(x, codes, scale, bias, stride, padding, stand_in=True, scalar=True)
    assert torch.equal(out.view(torch.int16), scalar.view(torch.int16))


def test_the_convolution_backend_refuses_what_its_layout_cannot_take_and_says_why():
    op = dispatch.ops()["fp8_conv2d"]
    backend = next(b for b in op.backends if b.name == "brgemm")
    x, codes, scale, bias = conv_case(1, 3, 6, 6, 4, 3)
    reasons = dispatch.input_reasons(op, backend, (x, codes, scale, bias, [1, 1], [1, 1], [1, 1], 1))
    assert any("even" in r for r in reasons)
    x, codes, scale, bias = conv_case(1, 4, 6, 6, 4, 3)
    assert dispatch.input_reasons(op, backend, (x, codes, scale, bias, [1, 1], [1, 1], [2, 2], 1))
    assert (backend.unavailable() is None) == amx_brgemm()


@pytest.mark.skipif(not has_kernel("fp8_linear_brgemm") or not amx_brgemm(),
                    reason="torch's brgemm has no AMX bf16 kernel on this CPU")
@pytest.mark.parametrize("b,c,h,w,n,k,stride,padding", CONV_SHAPES)
def test_torchs_brgemm_convolution_matches_the_stand_in(b, c, h, w, n, k, stride, padding):
    x, codes, scale, bias = conv_case(b, c, h, w, n, k, seed=3)
    out = conv_brgemm(x, codes, scale, bias, stride, padding)
    assert_rounded_from(out, exact_conv(x, codes, scale, bias, stride, padding))


def _python_dispatches(monkeypatch) -> list:
    """Records each call of fp8_linear that reaches pyext's Python dispatch."""
    calls, select = [], dispatch.select

    def counting(op_name, args, backend=None):
        if op_name == "fp8_linear":
            calls.append(backend)
        return select(op_name, args, backend)
    monkeypatch.setattr(dispatch, "select", counting)
    return calls


def test_an_armed_signature_runs_its_backend_without_entering_python(monkeypatch):
    x, w, scale, bias = case(6, 40, 24, True, True)
    dispatch.reset()
    calls = _python_dispatches(monkeypatch)
    first = torch.ops.pyext.fp8_linear(x, w, scale, bias)
    chosen = dispatch.select("fp8_linear", (x, w, scale, bias)).name
    calls.clear()
    again = torch.ops.pyext.fp8_linear(x, w, scale, bias)
    assert torch.equal(first, again)
    assert calls == ([] if chosen in ("cpp", "brgemm") else [None]), chosen
    torch.ops.pyext.fp8_linear(x[:5], w, scale, bias)  # another signature: Python again
    assert len(calls) == (1 if chosen in ("cpp", "brgemm") else 2)
    dispatch.reset()


def test_arming_a_backend_the_cpu_cannot_run_falls_back_to_python_dispatch(monkeypatch):
    """A signature armed with brgemm on a CPU without AMX: the kernel refuses, the signature is
    disarmed and the Python dispatch answers (where AMX is, brgemm itself answers)."""
    x, w, scale, bias = case(6, 40, 24, True, True)
    dispatch.reset()
    expected = torch.ops.pyext.fp8_linear(x, w, scale, bias, "reference")
    torch.ops.pyext_C.fp8_linear_arm(x, w, scale, bias, "brgemm")
    calls = _python_dispatches(monkeypatch)
    out = torch.ops.pyext.fp8_linear(x, w, scale, bias)
    assert calls == ([] if amx_brgemm() else [None])
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    # Disarmed: the next call runs what the Python dispatch chose (and armed), not the failing kernel.
    chosen = dispatch.select("fp8_linear", (x, w, scale, bias)).name
    assert torch.equal(torch.ops.pyext.fp8_linear(x, w, scale, bias), torch.ops.pyext.fp8_linear(x, w, scale, bias, chosen))
    with pytest.raises(RuntimeError, match="no armable backend 'triton'"):
        torch.ops.pyext_C.fp8_linear_arm(x, w, scale, bias, "triton")
    dispatch.reset()
