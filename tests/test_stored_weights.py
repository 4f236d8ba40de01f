"""Weights stored differently (fp8 codes, oneDNN's packed layout) read as their values to every reader
but pyext's kernels, and take writes: each check compares with a plain layer holding the values."""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext.dispatch import PyextError
from pyext.nn import FP8Conv2d, FP8Linear, quantize_fp8
from pyext.nn.fp8 import FP8Weight
from pyext.nn.packed import PackedWeight, pack
from pyext.nn.stored import stored_bytes

LAYERS = {
    "linear": lambda: nn.Linear(40, 24),
    "conv": lambda: nn.Conv2d(6, 8, 3, padding=1),
}
DTYPES = (torch.float32, torch.bfloat16)


def fp8_layer(kind: str, dtype: torch.dtype, seed: int = 0, keep_original: bool = False):
    torch.manual_seed(seed)
    plain = LAYERS[kind]().to(dtype)
    return (FP8Linear.from_linear(plain, keep_original=keep_original) if kind == "linear"
            else FP8Conv2d.from_conv(plain, keep_original=keep_original))


def sample_input(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (5, layer.in_features) if isinstance(layer, nn.Linear) else (2, layer.in_channels, 7, 9)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_weight_reads_as_its_values(kind, dtype):
    layer = fp8_layer(kind, dtype)
    w, values = layer.weight, layer.dequantized_weight()
    assert isinstance(w, FP8Weight) and w.dtype == dtype and w.shape == values.shape and w.is_floating_point()
    for read in (lambda t: t * 1, lambda t: t.float(), lambda t: t.sum(0), lambda t: t.clone(), lambda t: t[1:3],
                 lambda t: t.flatten(1).t(), lambda t: t.to(torch.float16), lambda t: t.abs().max()):
        got, want = read(w), read(values)
        assert torch.equal(got, want)
    assert torch.equal(w, values) and torch.allclose(w, values)
    assert not isinstance(w.clone(), FP8Weight) and not isinstance(w.to(torch.float16), FP8Weight)  # copies are plain


@pytest.mark.parametrize("kind", LAYERS)
def test_fp8_weight_keeps_one_byte_per_weight_and_its_forward_reads_no_values(kind, monkeypatch):
    layer = fp8_layer(kind, torch.bfloat16)
    w = layer.weight
    assert stored_bytes(w) == w.numel() + 4 * w.shape[0]
    held = [t for t in (*layer.parameters(), *layer.buffers()) if not isinstance(t, FP8Weight)]
    assert sum(t.numel() for t in held) == w.shape[0]  # the bias only: no dense copy of the weight
    x = sample_input(layer, torch.bfloat16)
    want = layer(x)
    monkeypatch.setattr(FP8Weight, "values", lambda self: pytest.fail("the forward materialized the weight"))
    with torch.no_grad():
        assert torch.equal(layer(x), want)


@pytest.mark.parametrize("kind", LAYERS)
def test_fp8_state_dict_copies_deepcopy_and_pickles_read_as_values(kind):
    layer = fp8_layer(kind, torch.float32)
    values = layer.dequantized_weight()
    plain = LAYERS[kind]()
    plain.load_state_dict(layer.state_dict())  # what from_unet, EMA and model merging do
    assert torch.equal(plain.weight, values) and torch.equal(plain.bias, layer.bias)
    with torch.no_grad():
        plain.weight.zero_().copy_(layer.weight)
    assert torch.equal(plain.weight, values)
    twin = copy.deepcopy(layer)
    assert isinstance(twin.weight, FP8Weight) and isinstance(twin.weight, nn.Parameter)
    assert twin.weight.codes.data_ptr() != layer.weight.codes.data_ptr() and torch.equal(twin.weight, values)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()))  # weights_only, torch's default
    assert isinstance(state["weight"], FP8Weight) and torch.equal(state["weight"], values)
    torch.save(layer, buf := io.BytesIO())
    again = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    x = sample_input(layer, torch.float32)
    assert torch.equal(again(x), layer(x))


def test_fp8_module_casts_keep_codes_and_tensor_casts_give_values():
    layer = fp8_layer("conv", torch.float32)
    codes = layer.weight.codes.clone()
    values = layer.dequantized_weight(torch.bfloat16)
    assert torch.equal(layer.weight.to(torch.bfloat16), values)  # a reader's cast: values, plain
    layer.to(torch.bfloat16)  # the layer's cast: its compute dtype, the same codes
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight.codes, codes)
    assert torch.equal(layer.weight, values)
    moved = layer.weight.to("meta")
    assert isinstance(moved, FP8Weight) and moved.codes.device.type == "meta"


@pytest.mark.parametrize("kind", LAYERS)
def test_writes_quantize_the_new_values(kind):
    layer, source = fp8_layer(kind, torch.float32, keep_original=True), LAYERS[kind]()
    expected = fp8_layer(kind, torch.float32)
    expected.load_state_dict(source.state_dict())
    with torch.no_grad():
        layer.weight.copy_(source.weight)
    assert torch.equal(layer.weight.codes, expected.weight.codes) and torch.equal(layer.scale, expected.scale)
    assert layer.kept_original() is None  # the original no longer describes the weight
    delta = torch.randn(layer.weight.shape) * 0.01
    want = FP8Weight.quantize(layer.dequantized_weight() + delta, per_channel=True)
    layer.weight.data += delta  # PEFT's merge
    assert isinstance(layer.weight, FP8Weight) and torch.equal(layer.weight, want.values())
    with pytest.raises(PyextError, match="shape"):
        layer.weight.data = torch.zeros(3)


def test_a_write_into_a_slice_reaches_the_weight():
    layer = fp8_layer("linear", torch.float32)
    before = layer.dequantized_weight()
    rows = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer.weight[2:5].copy_(rows)  # what LoRA hotswap does to its layers
        layer.weight[:, 0].fill_(0.0)
    after = layer.dequantized_weight()
    assert (after[:, 0] == 0).all()
    torch.testing.assert_close(after[2:5, 1:], rows[:, 1:], rtol=0.07, atol=1e-3)  # fp8 rounding of the new rows
    torch.testing.assert_close(after[5:, 1:], before[5:, 1:], rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("kind", LAYERS)
def test_a_trained_fp8_weight_gets_the_plain_layers_gradient(kind):
    layer = fp8_layer(kind, torch.float32)
    plain = LAYERS[kind]()
    plain.load_state_dict(layer.state_dict())
    x = sample_input(layer, torch.float32)
    layer.weight.requires_grad_(True)  # the fast path steps aside: torch's op on the values
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad)


def test_packed_weight_takes_the_same_reads_and_writes():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Linear(8, 8))
    twin = copy.deepcopy(model)
    assert pack(model).packed
    w = model[0].weight
    assert isinstance(w, PackedWeight) and torch.equal(w, twin[0].weight) and torch.equal(w[1:3], twin[0].weight[1:3])
    with torch.no_grad():
        w[1:3].mul_(2.0)
        twin[0].weight[1:3].mul_(2.0)
    x = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), twin[0](x))
    assert torch.equal(model[0].weight, twin[0].weight)


def test_controlnet_from_an_fp8_unet_holds_its_values():
    from diffusers import ControlNetModel, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8).eval()
    assert quantize_fp8(unet).converted
    controlnet = ControlNetModel.from_unet(unet)
    state = controlnet.state_dict()
    for name, value in unet.state_dict().items():
        if name in state:
            assert torch.equal(state[name], value), name
    assert any(isinstance(v, FP8Weight) for v in unet.state_dict().values())
    assert not any(isinstance(v, FP8Weight) for v in state.values())  # a plain model holding the values


@pytest.mark.parametrize("kind", LAYERS)
def test_a_trained_bias_gets_its_gradient_from_the_kernels_output(kind):
    """Only the bias requires grad (a frozen fp8 weight, an input without grad): pyext's kernel runs,
    its output is the one without autograd, and the bias gets a plain layer's gradient."""
    layer = fp8_layer(kind, torch.float32)
    plain = LAYERS[kind]()
    plain.load_state_dict(layer.state_dict())
    x = sample_input(layer, torch.float32)
    with torch.no_grad():
        want = layer(x)
    assert layer.bias.requires_grad and not layer.weight.requires_grad
    y = layer(x)
    assert torch.equal(y, want)
    y.square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad, rtol=1e-4, atol=1e-4)
