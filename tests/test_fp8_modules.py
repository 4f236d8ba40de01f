"""FP8Linear / FP8Conv2d and quantize_fp8 on layers and a tiny offline UNet."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pyext
from pyext.nn import FP8Conv2d, FP8Linear, quantize_fp8, restore_fp8
from pyext.nn.fp8 import FP8Weight
from pyext.nn.stored import stored_bytes
from pyext.reference.fp8 import fp8_upcast_reference


def test_linear_layer_keeps_interface_and_matches_dequantized():
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    f = FP8Linear.from_linear(lin)
    assert isinstance(f, nn.Linear) and f.in_features == 64 and f.out_features == 48
    assert isinstance(f.weight, FP8Weight) and f.weight.codes.dtype == torch.uint8
    assert f.weight.dtype == torch.bfloat16 and f.weight.shape == lin.weight.shape
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    w = fp8_upcast_reference(f.fp8_weight, f.scale, torch.bfloat16)
    torch.testing.assert_close(f(x), F.linear(x, w, lin.bias), rtol=1.6e-2, atol=1e-2)
    # fp8 storage error vs the original layer stays small for this well-scaled layer
    assert ((f(x) - lin(x)).float().norm() / lin(x).float().norm()) < 0.06


@pytest.mark.parametrize("cfg", [dict(kernel_size=3, padding=1), dict(kernel_size=1),
                                 dict(kernel_size=3, stride=2, padding=1, groups=2)])
def test_conv_layer_matches_dequantized(cfg):
    conv = nn.Conv2d(8, 16, **cfg)
    f = FP8Conv2d.from_conv(conv)
    assert isinstance(f, nn.Conv2d) and f.stride == conv.stride and f.groups == conv.groups
    x = torch.randn(2, 8, 9, 11)
    w = fp8_upcast_reference(f.fp8_weight, f.scale, torch.float32)
    torch.testing.assert_close(f(x), conv._conv_forward(x, w, conv.bias))


def test_dtype_casts_keep_codes_and_scales():
    f = FP8Linear.from_linear(nn.Linear(32, 16))
    codes, scale = f.weight.codes.clone(), f.scale.clone()
    f.to(torch.bfloat16)
    assert f.compute_dtype == torch.bfloat16 and f.bias.dtype == torch.bfloat16 and f.weight.dtype == torch.bfloat16
    assert torch.equal(f.weight.codes, codes) and torch.equal(f.scale, scale)
    assert f(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
    f.half()
    assert f.compute_dtype == torch.float16 and torch.equal(f.scale, scale)


def test_channels_last_conv():
    conv = FP8Conv2d.from_conv(nn.Conv2d(4, 8, 3, padding=1))
    # The codes are (out, kh, kw, in) rows, as the fp8 conv GEMM reads them, and stay so.
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    x = torch.randn(1, 4, 6, 6)
    ref = conv(x)
    conv.to(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    torch.testing.assert_close(conv(x.to(memory_format=torch.channels_last)), ref)
    torch.testing.assert_close(conv(x), ref)


def test_state_dict_round_trip_without_requantizing():
    f = FP8Linear.from_linear(nn.Linear(32, 16))
    buf = io.BytesIO()
    torch.save(f.state_dict(), buf)
    g = FP8Linear.from_linear(nn.Linear(32, 16))
    g.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    x = torch.randn(3, 32)
    assert torch.equal(f(x), g(x))


def tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8,
    ).eval()


def unet_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 8, 8, generator=g, dtype=dtype), torch.tensor([10]),
            torch.randn(2, 7, 32, generator=g, dtype=dtype))


@torch.no_grad()
def test_quantize_tiny_unet():
    unet = tiny_unet()
    before = sum(stored_bytes(p) for p in unet.parameters())
    ref = unet(*unet_inputs(torch.float32)).sample
    report = quantize_fp8(unet)
    assert report.converted and report.bytes_after < 0.3 * report.bytes_before
    names = dict(unet.named_modules())
    # defaults keep first/last layers, norms and the time embedding in full precision
    for kept in ("conv_in", "conv_out", "time_embedding.linear_1"):
        assert type(names[kept]) in (nn.Conv2d, nn.Linear) and kept in report.skipped
    assert all(isinstance(names[n], (FP8Linear, FP8Conv2d)) for n in report.converted)
    after = sum(stored_bytes(p) for p in unet.parameters())
    assert after < before
    out = unet(*unet_inputs(torch.float32)).sample
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()) < 0.1
    assert unet.dtype == torch.float32  # diffusers still sees the compute dtype
    assert quantize_fp8(unet).converted == []  # idempotent


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_adaptive_norms_modulation_linears_are_converted_and_embedders_kept(arch):
    """An adaptive norm's modulation linear (`norm*.linear`) is converted (per-channel scales keep
    its precision, unlike layerwise casting's unscaled cast, whose "norm" pattern the model names);
    the embedders stay in full precision."""
    from pyext.offline import build_pipeline

    transformer = build_pipeline(arch, "tiny").transformer
    modulation = [n for n, m in transformer.named_modules() if n.endswith("norm1.linear") or n == "norm_out.linear"]
    assert modulation and "norm" in pyext._compat.skip_layerwise_casting_patterns(transformer)
    report = quantize_fp8(transformer)
    assert not any("skip pattern" in report.skipped.get(n, "") for n in modulation)
    assert any(n.endswith("norm1.linear") for n in report.converted)  # norm_out's is below MIN_NUMEL at tiny size
    embedders = [n for n in report.skipped if "embed" in n]
    assert embedders and not any("embed" in n for n in report.converted)


@torch.no_grad()
def test_linear_layers_only_keep_every_convolution_and_the_planner_counts_the_same_bytes():
    """layers="linear" converts the linears and keeps every Conv2d, saying why; the planner's fp8
    weight bytes follow the same rule, and an unknown kind is refused before anything changes."""
    from typing import get_args

    from pyext import planner
    from pyext.nn.fp8 import LAYER_KINDS, skip_patterns
    from pyext.options import FP8Layers

    assert set(LAYER_KINDS) == set(get_args(FP8Layers))
    estimates = {}
    for layers in LAYER_KINDS:
        unet = tiny_unet()
        before = sum(stored_bytes(t) for t in unet.state_dict().values())
        estimates[layers] = planner._weight_bytes(unet, 4, skip_patterns(unet), layers)[1]
        report = quantize_fp8(unet, layers=layers)
        after = sum(stored_bytes(t) for t in unet.parameters()) + sum(stored_bytes(t) for t in unet.buffers())
        assert before > after and abs(estimates[layers] - after) <= 0.01 * after, (layers, estimates[layers], after)
        convs = [n for n, m in unet.named_modules() if isinstance(m, nn.Conv2d)]
        converted_convs = [n for n in convs if isinstance(dict(unet.named_modules())[n], FP8Conv2d)]
        if layers == "linear":
            assert not converted_convs and all(n in report.skipped for n in convs)
            assert sum("a Conv2d (layers 'linear')" in report.skipped[n] for n in convs) >= len(convs) - 2  # (conv_in, conv_out)
            assert report.converted and all(isinstance(dict(unet.named_modules())[n], FP8Linear) for n in report.converted)
        else:
            assert converted_convs
    assert estimates["linear"] > estimates["linear+conv"]
    unet = tiny_unet()
    with pytest.raises(pyext.PyextError, match=r"layers='conv'.*'linear\+conv', 'linear'"):
        quantize_fp8(unet, layers="conv")
    assert not any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in unet.modules())


@torch.no_grad()
def test_quantize_skip_patterns_and_restore():
    unet = tiny_unet()
    ref = unet(*unet_inputs(torch.float32)).sample
    report = quantize_fp8(unet, skip=(r"attn",), keep_original=True)
    assert not any("attn" in n for n in report.converted)
    assert any("attn" in n for n in report.skipped)
    restored = restore_fp8(unet)
    assert sorted(restored) == sorted(report.converted)
    assert not any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in unet.modules())
    torch.testing.assert_close(unet(*unet_inputs(torch.float32)).sample, ref)  # originals were kept: exact


@torch.no_grad()
def test_tiny_unet_bf16_channels_last():
    unet = tiny_unet().to(torch.bfloat16)
    ref = unet(*unet_inputs(torch.bfloat16)).sample.float()
    quantize_fp8(unet)
    unet.to(memory_format=torch.channels_last)
    x, t, e = unet_inputs(torch.bfloat16)
    out = unet(x.to(memory_format=torch.channels_last), t, e).sample.float()
    assert ((out - ref).norm() / ref.norm()) < 0.1


def test_package_exports():
    assert pyext.quantize_fp8 is quantize_fp8 and pyext.FP8Linear is FP8Linear


def test_conv_workspace_is_per_thread():
    """Two threads running fp8 convs at once must not overwrite each other's upcast weights."""
    import threading

    convs = [FP8Conv2d.from_conv(nn.Conv2d(16, 16, 3, padding=1)) for _ in range(2)]
    x = torch.randn(1, 16, 12, 12)
    refs = [c(x) for c in convs]
    errors = []

    def work(i):
        for _ in range(30):
            if not torch.equal(convs[i](x), refs[i]):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors



def test_conv_upcast_buffer_is_shared_on_cpu_only():
    """A captured CUDA graph keeps the addresses it writes: off the CPU each upcast weight gets a
    tensor of its own from the caching allocator, never the shared buffer, which grows by being
    replaced (and freed) when a larger layer comes."""
    from pyext.ops.fp8_conv import workspace

    a, b = (workspace(8, torch.float32, torch.device("cpu")) for _ in range(2))
    assert a._base is not None and a._base is b._base  # the control: CPU layers share the thread's buffer
    assert all(workspace(8, torch.float32, torch.device("meta"))._base is None for _ in range(2))

@pytest.mark.parametrize("make", [lambda: nn.Linear(32, 24), lambda: nn.Conv2d(6, 8, 3, padding=1)])
def test_plain_state_dicts_load_quantized_and_dense_ones_save(make):
    """load_state_dict of a plain layer's state quantizes it (codes, never a float cast into uint8);
    inside dense_state_dict() the layer's state is the plain layer it computes as."""
    from pyext.nn.fp8 import dense_state_dict, plain_layer

    torch.manual_seed(0)
    source, target = make(), make()
    layer = FP8Linear.from_linear(target) if isinstance(target, nn.Linear) else FP8Conv2d.from_conv(target)
    layer.load_state_dict(source.state_dict())
    expected = FP8Linear.from_linear(source) if isinstance(source, nn.Linear) else FP8Conv2d.from_conv(source)
    assert torch.equal(layer.weight.codes, expected.weight.codes) and torch.equal(layer.scale, expected.scale)
    with dense_state_dict():
        state = layer.state_dict()
    assert set(state) == {"weight", "bias"} and state["weight"].is_floating_point() and state["weight"].is_contiguous()
    plain = make()
    plain.load_state_dict(state)
    x = torch.randn(2, 32) if isinstance(plain, nn.Linear) else torch.randn(1, 6, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain_layer(layer)(x), layer(x), rtol=1e-5, atol=1e-5)
    state = layer.state_dict()  # outside: the fp8 weight itself, which reads as its values (offload moves it)
    assert set(state) == {"weight", "bias"} and isinstance(state["weight"], FP8Weight)
    assert torch.equal(state["weight"], layer.dequantized_weight())
