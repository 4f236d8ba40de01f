"""pyext.ops.tile_blend: kernels vs the PyTorch reference, vs diffusers' blend loops,
bad inputs and opcheck (the CUDA kernel compiles in tests/test_kernels_compile.py)."""

import pytest
import torch

from pyext._ext import EXT, has_kernel
from pyext.dispatch import PyextError
from pyext.ops.tile_blend import (
    MODE_DIFFUSERS, MODE_NORMALIZED, edge_weights, tile_blend_diffusers, tile_blend_normalized,
    tile_blend_reference,
)
from tests.test_fp8_ops import narrowed, special_fp32

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cpp = pytest.mark.skipif(not has_kernel("tile_blend"), reason="pyext._C without tile_blend")


@pytest.fixture(params=["scalar", "avx512"])
def simd(request, monkeypatch):
    """Runs a test on each CPU kernel build (the C++ glue reads PYEXT_CPU_SIMD per call)."""
    if EXT is None or request.param not in EXT.cpu_capabilities():
        pytest.skip(f"no {request.param} kernel here")
    monkeypatch.setenv("PYEXT_CPU_SIMD", request.param)
    return request.param


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# (th, tw, out_h, out_w, y, x, overlaps top/bottom/left/right): odd sizes, edges, corners,
# overlaps covering the whole tile, 1-pixel tiles.
NORMALIZED_CASES = [
    (17, 23, 40, 50, 0, 0, (0, 5, 0, 7)),        # top-left corner
    (17, 23, 40, 50, 23, 27, (5, 0, 7, 0)),      # bottom-right corner
    (9, 31, 30, 31, 10, 0, (3, 4, 0, 0)),        # left+right edge, full width
    (8, 8, 8, 8, 0, 0, (8, 8, 8, 8)),            # overlaps as large as the tile
    (1, 1, 3, 3, 1, 1, (1, 0, 0, 1)),
    (33, 65, 64, 96, 31, 31, (13, 0, 16, 0)),
]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NORMALIZED_CASES)
def test_normalized_matches_reference(simd, case, dtype):
    th, tw, H, W, y, x, ov = case
    tile = _rand(2, 3, th, tw, dtype=dtype)
    out = _rand(2, 3, H, W, dtype=dtype)
    expected = out.clone()
    tile_blend_normalized(tile, out, y, x, ov, backend="cpp")
    tile_blend_normalized(tile, expected, y, x, ov, backend="reference")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def widened(x: torch.Tensor) -> torch.Tensor:
    """x as fp32, NaN payloads kept (torch widens every fp16 NaN to 0x7fffffff)."""
    if x.dtype != torch.float16:
        return x.float()
    bits = x.view(torch.int16).int()
    nan = ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x3FF) << 13)
    return torch.where(x.isnan(), nan.view(torch.float32), x.float())


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_normalized_rounds_special_values_like_torch(simd, dtype):
    """out + tile * w over special values (subnormals, the largest finites, inf, NaN; ramp weights
    and sums that land on ties and past the overflow threshold) rounds as the kernels' shared
    scalar helpers say: torch's round-to-nearest-even cast, NaN with its sign and payload."""
    values = special_fp32().to(dtype)
    tile = torch.stack([values.roll(r) for r in range(6)]).reshape(1, 1, 6, -1)
    out = torch.stack([values.roll(-5 * r) for r in range(6)]).reshape(tile.shape)
    out[tile.isnan() & out.isnan()] = 1  # one NaN operand at a time: NaN + NaN may give either
    overlaps = (3, 0, 20, 7)  # weighted rows and columns at the edges, plain sums inside
    w = edge_weights(6, *overlaps[:2])[:, None] * edge_weights(tile.shape[-1], *overlaps[2:])[None, :]
    expected = narrowed(widened(out) + widened(tile) * w, dtype)
    tile_blend_normalized(tile, out, 0, 0, overlaps, backend="cpp")
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


# (th, tw, above_rows, left_cols, crop, keep_bottom, keep_right, out_h, out_w, y, x)
DIFFUSERS_CASES = [
    (24, 24, 0, 0, (18, 18), 6, 6, 40, 40, 0, 0),      # first tile: no neighbours
    (24, 24, 6, 0, (18, 18), 6, 6, 40, 40, 18, 0),     # left column
    (24, 24, 0, 6, (18, 18), 6, 6, 40, 40, 0, 18),     # top row
    (24, 24, 6, 6, (18, 18), 6, 6, 40, 40, 18, 18),    # interior, both ramps (corner)
    (5, 24, 6, 6, (5, 18), 5, 6, 40, 40, 35, 18),      # last row shorter than the extent
    (13, 7, 6, 6, (13, 7), 6, 6, 40, 40, 20, 33),      # odd sizes, last column narrower
    (31, 29, 9, 11, (20, 19), 9, 11, 60, 70, 7, 9),
]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DIFFUSERS_CASES)
def test_diffusers_matches_reference(simd, case, dtype):
    th, tw, ra, lc, crop, kb, kr, H, W, y, x = case
    tile = _rand(1, 4, th, tw, dtype=dtype)
    above = _rand(1, 4, ra, tw, dtype=dtype) if ra else None
    left = _rand(1, 4, th, lc, dtype=dtype) if lc else None
    out, expected = torch.zeros(1, 4, H, W, dtype=dtype), torch.zeros(1, 4, H, W, dtype=dtype)
    got = tile_blend_diffusers(tile, out, y, x, crop, above, left, kb, kr, backend="cpp")
    want = tile_blend_diffusers(tile, expected, y, x, crop, above, left, kb, kr, backend="reference")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_diffusers_mode_equals_diffusers_blend_loops(backend, dtype):
    """The fused op reproduces AutoencoderKL.blend_v + blend_h + crop exactly."""
    from diffusers import AutoencoderKL

    blend_v, blend_h = AutoencoderKL.blend_v, AutoencoderKL.blend_h
    th, tw, e = 21, 19, 6
    a_full, l_full, tile = (_rand(1, 3, th, tw, dtype=dtype) for _ in range(3))
    want = blend_h(None, l_full, blend_v(None, a_full, tile.clone(), e), e)
    out = torch.zeros(1, 3, 40, 40, dtype=dtype)
    bottom, right = tile_blend_diffusers(tile, out, 3, 5, (th - e, tw - e), a_full[..., -e:, :], l_full[..., -e:],
                                         e, e, backend=backend)
    torch.testing.assert_close(out[..., 3:3 + th - e, 5:5 + tw - e], want[..., :th - e, :tw - e], rtol=0, atol=0)
    torch.testing.assert_close(bottom, want[..., -e:, :], rtol=0, atol=0)
    torch.testing.assert_close(right, want[..., -e:], rtol=0, atol=0)


def test_normalized_weights_sum_to_one_over_an_overlap():
    ov = 7
    a, b = edge_weights(20, 0, ov), edge_weights(15, ov, 0)
    torch.testing.assert_close(a[-ov:] + b[:ov], torch.ones(ov))


@needs_cpp
def test_threads_do_not_change_the_result():
    tile, base = _rand(1, 3, 70, 90), _rand(1, 3, 100, 100)
    outs = []
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = base.clone()
            tile_blend_normalized(tile, out, 10, 5, (9, 9, 9, 9), backend="cpp")
            outs.append(out)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------- bad input

def test_tile_past_the_output_is_an_error():
    with pytest.raises(PyextError, match=r"pyext.tile_blend: a 16x16 tile at \(y=10, x=0\) extends past"):
        tile_blend_normalized(_rand(1, 3, 16, 16), torch.zeros(1, 3, 20, 20), 10, 0)
    with pytest.raises(PyextError, match="extends past"):
        tile_blend_diffusers(_rand(1, 3, 16, 16), torch.zeros(1, 3, 20, 20), 0, 8, crop=(16, 16))


def test_wrong_channels_is_an_error():
    with pytest.raises(PyextError, match="batch, channels"):
        tile_blend_normalized(_rand(1, 4, 8, 8), torch.zeros(1, 3, 20, 20), 0, 0)
    with pytest.raises(PyextError, match="above must be"):
        tile_blend_diffusers(_rand(1, 3, 8, 8), torch.zeros(1, 3, 20, 20), 0, 0, above=_rand(1, 4, 2, 8))


def test_overlap_larger_than_tile_is_an_error():
    with pytest.raises(PyextError, match="larger than the 8x8 tile"):
        tile_blend_normalized(_rand(1, 3, 8, 8), torch.zeros(1, 3, 20, 20), 0, 0, (9, 0, 0, 0))
    with pytest.raises(PyextError, match="keep_bottom"):
        tile_blend_diffusers(_rand(1, 3, 8, 8), torch.zeros(1, 3, 20, 20), 0, 0, keep_bottom=9)


def test_dtype_device_and_layout_errors():
    with pytest.raises(PyextError, match="float32/float16/bfloat16"):
        tile_blend_normalized(torch.zeros(1, 3, 4, 4, dtype=torch.float64), torch.zeros(1, 3, 8, 8), 0, 0)
    with pytest.raises(PyextError, match="out must be a torch.float16"):
        tile_blend_normalized(_rand(1, 3, 4, 4, dtype=torch.float16), torch.zeros(1, 3, 8, 8), 0, 0)
    with pytest.raises(PyextError, match="contiguous"):
        tile_blend_normalized(_rand(1, 3, 4, 4), torch.zeros(1, 3, 8, 8).transpose(-1, -2), 0, 0)
    with pytest.raises(PyextError, match="non-negative"):
        tile_blend_normalized(_rand(1, 3, 4, 4), torch.zeros(1, 3, 8, 8), -1, 0)


def test_unknown_backend_is_an_error():
    with pytest.raises(PyextError, match="unknown backend"):
        tile_blend_normalized(_rand(1, 3, 4, 4), torch.zeros(1, 3, 8, 8), 0, 0, backend="nope")


# ----------------------------------------------------------------------------- opcheck, CUDA build

@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_opcheck(backend):
    tile = _rand(1, 3, 12, 10)
    empty = tile.new_empty(1, 3, 0, 0)
    torch.library.opcheck(torch.ops.pyext.tile_blend.default,
                          (tile, torch.zeros(1, 3, 20, 20), 4, 6, MODE_NORMALIZED, [3, 0, 2, 0], None, None,
                           empty, empty.clone(), backend))
    torch.library.opcheck(torch.ops.pyext.tile_blend.default,
                          (tile, torch.zeros(1, 3, 20, 20), 4, 6, MODE_DIFFUSERS, [9, 7],
                           _rand(1, 3, 3, 10), _rand(1, 3, 12, 3), tile.new_empty(1, 3, 3, 10),
                           tile.new_empty(1, 3, 12, 3), backend))


def test_reference_is_the_op_semantics_directly():
    """tile_blend_reference writes only the window it owns (nothing outside changes)."""
    out = torch.full((1, 1, 10, 10), 7.0)
    e = out.new_empty(1, 1, 0, 0)
    tile_blend_reference(torch.ones(1, 1, 3, 4), out, 2, 3, MODE_NORMALIZED, [0, 0, 0, 0], None, None, e, e)
    assert torch.all(out[..., 2:5, 3:7] == 8.0) and int((out == 7.0).sum()) == 100 - 12


# ----------------------------------------------------------------------------- hardening: bad and extreme inputs

@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_normalized_tile_that_is_a_view_of_out(backend, dtype):
    """The tile is read as it was before the op writes over it (the kernel used to read rows
    it had already written)."""
    out = _rand(1, 1, 12, 12, dtype=dtype)
    tile = out[..., 1:9, :]  # contiguous: the op reads it in place
    expected = out.clone()
    tile_blend_normalized(tile.clone(), expected, 2, 0, (3, 2, 3, 2), backend="reference")
    tile_blend_normalized(tile, out, 2, 0, (3, 2, 3, 2), backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_diffusers_above_strip_that_is_a_view_of_written_rows(backend, dtype):
    out = _rand(1, 1, 16, 10, dtype=dtype)
    tile = _rand(1, 1, 8, 10, dtype=dtype)
    expected = out.clone()
    want = tile_blend_diffusers(tile, expected, 4, 0, above=out[..., 3:7, :].clone(), keep_bottom=2,
                                backend="reference")
    got = tile_blend_diffusers(tile, out, 4, 0, above=out[..., 3:7, :], keep_bottom=2, backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_written_tensors_that_share_memory_are_an_error():
    tile = _rand(1, 1, 4, 4)
    out = torch.zeros(1, 1, 8, 8)
    with pytest.raises(PyextError, match="pyext.tile_blend: out and bottom share memory"):
        torch.ops.pyext.tile_blend(tile, out, 0, 0, MODE_DIFFUSERS, [4, 4], None, None, out[..., :2, :4],
                                   tile.new_empty(1, 1, 4, 0), "reference")


@needs_cpp
def test_self_check_on_arguments_with_nan_and_inf_keeps_the_kernel(tmp_path, monkeypatch):
    """The self-check runs on the call's own arguments: NaN and inf in them (a diverged image), which
    kernel and reference carry to the same places, must not mark the kernel unusable (that mark is
    kept per device across processes); a NaN where the reference has a number still fails."""
    from pyext import dispatch
    from pyext.ops import tile_blend as blend

    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "_CACHES", {})  # this test's caches only, put back whatever it asserts
    op = dispatch.ops()["tile_blend"]
    args = list(blend._example(blend.TEST_SHAPES[0], torch.float32, "cpu"))
    args[0][0, 0, 3, 4], args[0][0, 1, 5, 6], args[0][0, 2, 7, 8] = float("nan"), float("inf"), -float("inf")
    args = tuple(args)
    ref = dispatch.run_on_copy(op, dispatch.reference(op), args)
    assert any(not t.isfinite().all() for t in ref)
    assert op.close(dispatch.run_on_copy(op, next(b for b in op.backends if b.name == "cpp"), args), ref, args) is None
    assert dispatch.select("tile_blend", args).name == "cpp" and dispatch.unusable() == []
    broken = tuple(t.clone() for t in ref)
    broken[0].view(-1)[0] = float("nan")
    assert op.close(broken, ref, args) is not None
