"""winograd_conv3x3 (F(4x4, 3x3) on the CPU) against a float64 convolution, its speed rule, its
non-finite fallback, opcheck, bad inputs, and its use by the prepacked Conv2d layers."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import EXT, has_kernel
from pyext.dispatch import PyextError
from pyext.nn import packed
from pyext.ops import winograd_conv3x3
from pyext.ops.winograd import winograd_reason

CL = torch.channels_last
EPS32 = 2.0 ** -24
needs_cpp = pytest.mark.skipif(not has_kernel("winograd_conv3x3"), reason="pyext._C without winograd_conv3x3")


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request, monkeypatch):
    """Runs a test on each CPU build of the transforms (the glue reads PYEXT_CPU_SIMD per call)."""
    if EXT is None or request.param not in EXT.cpu_capabilities():
        pytest.skip(f"no {request.param} kernel here")
    monkeypatch.setenv("PYEXT_CPU_SIMD", request.param)
    return request.param


def make(n, cin, cout, h, w, channels_last=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cin, h, w, generator=g)
    x = x.contiguous(memory_format=CL if channels_last else torch.contiguous_format)
    weight = torch.randn(cout, cin, 3, 3, generator=g) / (3 * cin ** 0.5)
    return x, weight, torch.randn(cout, generator=g) if bias else None


def assert_within_rounding(y, x, weight, bias):
    """Each output within 200 fp32 roundings of the sum of its terms' magnitudes (a direct fp32
    convolution is within ~Ci*9; a wrong tile, channel or edge is off by the whole magnitude)."""
    exact = F.conv2d(x.double(), weight.double(), None if bias is None else bias.double(), padding=1)
    magnitude = F.conv2d(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs(),
                         padding=1)
    assert y.shape == exact.shape and y.dtype == torch.float32
    err = (y.double() - exact).abs()
    worst = (err / (magnitude * EPS32).clamp_min(1e-300)).max().item()
    assert worst <= 200, f"error {worst:.1f} roundings of the terms' magnitude"


SHAPES = [(1, 1, 1, 1, 1), (1, 3, 5, 7, 9), (2, 64, 70, 13, 6), (1, 130, 33, 5, 17), (3, 63, 65, 4, 4),
          (1, 16, 16, 1, 23), (2, 8, 128, 9, 8), (1, 32, 32, 40, 37)]


@needs_cpp
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_a_float64_convolution(simd, shape, channels_last, bias):
    x, weight, b = make(*shape, channels_last=channels_last, bias=bias)
    y = winograd_conv3x3(x, weight, b, backend="cpp")
    assert y.is_contiguous(memory_format=CL)
    assert_within_rounding(y, x, weight, b)


@needs_cpp
def test_every_weight_layout_gives_the_same_result():
    x, weight, b = make(2, 40, 24, 11, 10)
    hwio = weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)  # what the packed layers store
    assert torch.equal(winograd_conv3x3(x, weight, b, backend="cpp"), winograd_conv3x3(x, hwio, b, backend="cpp"))


@needs_cpp
@pytest.mark.parametrize("shape", [(1, 300, 70, 23, 29), (2, 257, 97, 17, 9), (1, 128, 32, 8, 96)])
def test_gemm_blocks_and_panel_edges(simd, shape):
    """The AVX-512 unit's own GEMM: input channels over several passes (128 each) and a partial
    last one, a last panel of output channels padded (70 = 32 + 32 + 6), tile counts that leave
    a partial block of rows (12 per block)."""
    x, weight, b = make(*shape)
    assert_within_rounding(winograd_conv3x3(x, weight, b, backend="cpp"), x, weight, b)


@needs_cpp
def test_tiles_are_chunked_without_seams():
    """Enough tiles for several chunks of the workspace (8 MiB of V and M per chunk)."""
    x, weight, b = make(1, 96, 96, 150, 150)
    assert_within_rounding(winograd_conv3x3(x, weight, b, backend="cpp"), x, weight, b)


@needs_cpp
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 3e38])
def test_non_finite_values_stay_where_a_direct_convolution_puts_them(value):
    x, weight, b = make(1, 8, 6, 13, 11)
    x[0, 3, 6, 5] = value
    x[0, 1, 0, 10] = -value
    y = winograd_conv3x3(x, weight, b, backend="cpp")
    direct = F.conv2d(x, weight, b, padding=1)
    assert torch.equal(y.isnan(), direct.isnan()) and torch.equal(y.isinf(), direct.isinf())
    torch.testing.assert_close(y[direct.isfinite()], direct[direct.isfinite()], rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(channels_last, bias):
    x, weight, b = make(2, 5, 7, 9, 6, channels_last=channels_last, bias=bias)
    torch.library.opcheck(torch.ops.pyext.winograd_conv3x3, (x, weight, b, None))
    torch.library.opcheck(torch.ops.pyext.winograd_conv3x3, (x, weight, b, "cpp"))


@pytest.mark.parametrize("call, message", [
    (lambda x, w, b: winograd_conv3x3(x[0], w, b), "floating (batch, channels, height, width)"),
    (lambda x, w, b: winograd_conv3x3(x.long(), w, b), "floating"),
    (lambda x, w, b: winograd_conv3x3(x, torch.randn(4, 3, 5, 5), b), "only 3x3 kernels"),
    (lambda x, w, b: winograd_conv3x3(x, w[:, :2], b), "(out, 3, 3, 3)"),
    (lambda x, w, b: winograd_conv3x3(x, w.double(), b), "torch.float32 tensor (out, 3, 3, 3)"),
    (lambda x, w, b: winograd_conv3x3(x, w, b[:2]), "bias must be a torch.float32 tensor (4,)"),
])
def test_bad_inputs_are_refused_with_what_is_supported(call, message):
    x, weight, b = make(1, 3, 4, 5, 5)
    with pytest.raises(PyextError, match="pyext.winograd_conv3x3") as err:
        call(x, weight, b)
    assert message in str(err.value)


def test_the_speed_rule():
    # Measured faster (README, "CPU runtimes"): the UNet's 32x32 and 16x16 levels at 256 px, the VAE's big levels.
    assert winograd_reason(2, 320, 320, 32, 32) is None
    assert winograd_reason(2, 640, 640, 16, 16) is None
    assert winograd_reason(1, 128, 128, 256, 256) is None
    assert "too few" in winograd_reason(2, 320, 640, 4, 4)
    assert winograd_reason(2, 1920, 640, 16, 16) is None  # 0.70x: its 168 MiB transform fits the workspace
    assert winograd_reason(2, 1280, 1280, 16, 16) is None  # 0.73x at 225 MiB, the largest that fits
    assert "too few" in winograd_reason(2, 1280, 1280, 8, 8)  # measured 2.0x slower
    assert "MiB" in winograd_reason(2, 2560, 1280, 32, 32)  # 450 MiB transformed
    assert "MiB" in winograd_reason(2, 5120, 320, 64, 64)  # 225 MiB of weight, but 50 MiB of tiles on top


def test_the_rule_mirrors_the_workspace_arithmetic():
    # The rule's workspace arithmetic copies the C++ op's constants: a drift would send layers to
    # a fresh buffer per call (or keep them from Winograd) without any test noticing.
    import re
    from pathlib import Path

    from pyext.ops import winograd

    source = (Path(__file__).parents[1] / "csrc/winograd/winograd_ops.cpp").read_text()

    def constant(name):
        value, shift = re.search(rf"{name} = (\d+)(?: << (\d+))?;", source).groups()
        return int(value) << int(shift or 0)

    assert constant("kChunkBytes") == winograd.CHUNK_BYTES
    assert constant("kMinChunkTiles") == winograd.MIN_CHUNK_TILES
    header = (Path(__file__).parents[1] / "csrc/winograd/winograd_cpu.h").read_text()
    assert int(re.search(r"kPanel = (\d+);", header).group(1)) == winograd.PANEL
    assert "under 32" in winograd_reason(1, 128, 3, 256, 256)  # the VAE's conv_out, 1.9x slower
    assert "under 32" in winograd_reason(1, 4, 512, 32, 32)


@needs_cpp
def test_static_dispatch_follows_the_rule():
    op = dispatch.ops()["winograd_conv3x3"]
    fast = make(2, 64, 64, 32, 32)
    slow = make(2, 1280, 1280, 2, 2)
    assert dispatch.select(op.name, fast, None).name == "cpp"
    assert dispatch.select(op.name, slow, None).name == "reference"
    assert dispatch.select(op.name, slow, "cpp").name == "cpp"  # forcing overrides the rule


# ----------------------------------------------------------------------------- prepacked layers

def packed_conv(cin=64, cout=48):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1)).eval().to(memory_format=CL)
    plain = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1)).eval().to(memory_format=CL)
    plain.load_state_dict(model.state_dict())
    packed.pack(model)
    return model, plain


@needs_cpp
def test_a_packed_layer_takes_winograd_where_the_rule_says_and_onednn_elsewhere():
    model, plain = packed_conv()
    conv = model[0]
    original = plain[0].weight.detach().clone()
    with torch.no_grad():
        big = torch.randn(1, 64, 32, 32).contiguous(memory_format=CL)
        y = model(big)
        assert conv.weight.packed.winograd
        assert y.is_contiguous(memory_format=CL)
        assert_within_rounding(y, big, original, plain[0].bias.detach())
        # The weight is held once, plain, in the (3, 3, in, out) order the transform reads.
        assert conv.weight.packed.tensor.permute(2, 3, 1, 0).is_contiguous()
        assert conv.weight.packed.tensor.untyped_storage().nbytes() == original.numel() * 4
        assert torch.equal(model.state_dict()["0.weight"], original)

        small = torch.randn(1, 64, 8, 8).contiguous(memory_format=CL)  # 64 pixels: oneDNN's
        torch.testing.assert_close(model(small), plain(small), rtol=1e-5, atol=1e-5)
        assert not conv.weight.packed.winograd
        nchw = torch.randn(1, 64, 32, 32)
        y = model(nchw)
        assert conv.weight.packed.winograd and y.is_contiguous()  # the input's layout, as F.conv2d gives
        assert_within_rounding(y, nchw, original, plain[0].bias.detach())
    packed.unpack(model)
    assert torch.equal(model[0].weight, original)


@needs_cpp
def test_a_weight_written_while_on_winograd_is_used_and_read_back():
    model, plain = packed_conv()
    x = torch.randn(1, 64, 32, 32).contiguous(memory_format=CL)
    with torch.no_grad():
        model(x)
        assert model[0].weight.packed.winograd
        new = torch.randn_like(plain[0].weight)
        model.load_state_dict({"0.weight": new, "0.bias": plain[0].bias})
        assert torch.equal(model[0].weight.detach().clone(), new)
        assert_within_rounding(model(x), x, new, plain[0].bias.detach())


@needs_cpp
def test_a_workspace_is_used_when_it_fits_and_the_op_keeps_none_of_its_own():
    from pyext.ops import winograd

    x, weight, bias = make(1, 64, 64, 32, 32)
    own = winograd_conv3x3(x, weight, bias, backend="cpp")  # a buffer of its own, freed after the call
    workspace = winograd.Workspace()
    buffer = workspace.get(winograd.workspace_bytes(1, 64, 64, 32, 32) // 4).fill_(float("nan"))
    with winograd.using_workspace(workspace):
        assert torch.equal(winograd_conv3x3(x, weight, bias, backend="cpp"), own)
    assert workspace.get(0) is buffer and not buffer.isnan().all()  # worked in, not grown
    small = torch.full((10,), float("nan"))
    assert torch.equal(torch.ops.pyext_C.winograd_conv3x3(x, weight, bias, small), own)
    assert small.isnan().all()  # too small: left alone


@needs_cpp
def test_a_packed_model_shares_one_workspace_and_frees_it_when_unpacked():
    import copy
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)).eval()
    model.to(memory_format=CL)
    packed.pack(model)
    workspace = model[0]._workspace
    assert model[1]._workspace is workspace
    with torch.no_grad():
        model(torch.randn(1, 64, 32, 32).contiguous(memory_format=CL))
    assert model[0].weight.packed.winograd and workspace.get(0).numel() > 0
    twin = copy.deepcopy(model)
    assert twin[0]._workspace is workspace
    gone = weakref.ref(workspace)
    del workspace, twin
    packed.unpack(model)
    gc.collect()
    assert gone() is None and not hasattr(model[0], "_workspace")
