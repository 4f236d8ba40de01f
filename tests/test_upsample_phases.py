"""Nearest 2x upsampling + 3x3 convolution as phases (pyext.nn.upsample, upsample_phases technique):
the plain block's outputs in every layout and dtype, the fall-backs where the phases could be seen,
weights that change, the measured choice, report and undo."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pyext
from pyext import dispatch
from pyext.dispatch import PyextError
from pyext.nn import packed
from pyext.nn.upsample import interleave, is_phased, phase_upsamplers, phase_weight, phased, unphase_upsamplers
from pyext.offline import build_pipeline

CL = torch.channels_last


@pytest.fixture(autouse=True)
def measured_dispatch(monkeypatch):
    """The suite dispatches statically (tests/conftest.py), where the blocks stay plain: these tests
    are of the measured choice."""
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")


def upsampler(channels=8, out_channels=None, bias=True, name="conv", dtype=torch.float32):
    from diffusers.models.upsampling import Upsample2D

    torch.manual_seed(0)
    return Upsample2D(channels, use_conv=True, out_channels=out_channels, bias=bias, name=name).to(dtype).eval()


def choose(monkeypatch, backend):
    """Every shape's decision, known or measured, is `backend`."""
    monkeypatch.setattr(dispatch, "known_choice", lambda *a: {"backend": backend})
    monkeypatch.setattr(dispatch, "measured_choice", lambda *a, **k: {"backend": backend})


def exact(block, x):
    """The plain block in fp64: nearest 2x upsampling, then the conv."""
    conv = block.conv if block.name == "conv" else block.Conv2d_0
    up = F.interpolate(x.double(), scale_factor=2.0, mode="nearest")
    return F.conv2d(up, conv.weight.double(), None if conv.bias is None else conv.bias.double(), padding=1)


@pytest.mark.parametrize("n,c,o,h,w", [(1, 1, 1, 1, 1), (2, 3, 5, 4, 7), (1, 8, 8, 5, 5), (3, 16, 4, 2, 9)])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("bias", [True, False])
def test_the_phases_are_the_upsampled_convolution_in_fp64(n, c, o, h, w, fmt, bias):
    block = upsampler(c, o, bias).double()
    x = torch.randn(n, c, h, w, dtype=torch.float64).contiguous(memory_format=fmt)
    with torch.no_grad():
        out = phased(block, x)
    assert out.shape == (n, o, 2 * h, 2 * w)
    assert out.is_contiguous(memory_format=fmt if c > 1 else torch.contiguous_format)
    torch.testing.assert_close(out, exact(block, x), rtol=1e-12, atol=1e-12)


def test_the_phase_weight_sums_the_taps_each_phase_reads():
    w = torch.arange(9.0).reshape(1, 1, 3, 3)  # rows [0 1 2], [3 4 5], [6 7 8]
    k = phase_weight(w)
    assert k.shape == (4, 1, 2, 2)
    assert k[0, 0].tolist() == [[0, 1 + 2], [3 + 6, 4 + 5 + 7 + 8]]  # phase (0, 0): taps 0 | 1 + 2 per axis
    assert k[3, 0].tolist() == [[0 + 1 + 3 + 4, 2 + 5], [6 + 7, 8]]  # phase (1, 1): taps 0 + 1 | 2


def test_interleave_places_each_phase_window():
    z = torch.arange(2 * 4 * 3 * 4, dtype=torch.float32).reshape(2, 4, 3, 4)  # 1 channel, H = 2, W = 3
    out = interleave(z, torch.contiguous_format)
    for a in (0, 1):
        for b in (0, 1):
            assert torch.equal(out[:, 0, a::2, b::2], z[:, 2 * a + b, a:a + 2, b:b + 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pack", [False, True])
def test_in_each_dtype_the_phases_err_at_most_twice_the_plain_block(dtype, pack):
    """Against fp64, over several inputs: the phase weights' rounding (bf16, fp16) adds about one
    rounding of the output; the oneDNN-packed path where prepack packed the conv."""
    if pack and packed.dtype_reason(dtype):
        pytest.skip(packed.dtype_reason(dtype))
    block = upsampler(32, dtype=dtype)
    if pack:
        packed.pack(block)
    plain_err = phase_err = 0.0
    for seed in range(4):
        x = torch.randn(2, 32, 9, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x = x.contiguous(memory_format=CL)
        with torch.no_grad():
            ref = exact(block, x)
            plain_err += (block(x).double() - ref).pow(2).mean().item()
            phase_err += (phased(block, x).double() - ref).pow(2).mean().item()
    assert phase_err ** 0.5 <= 2 * plain_err ** 0.5 + 1e-12


def generate(pipe):
    return pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def phased_blocks(model):
    return [m for m in model.modules() if is_phased(m)]


@pytest.mark.parametrize("choice", ["plain", "phases"])
def test_a_phased_block_gives_the_plain_output_on_either_choice(monkeypatch, choice):
    """Whichever the measurement keeps, the block's output is the plain one's (within fp32 rounding)."""
    choose(monkeypatch, choice)
    block, plain = upsampler(8, name="Conv2d_0"), upsampler(8, name="Conv2d_0")
    assert phase_upsamplers(nn.Sequential(block)) == ["0"] and is_phased(block)
    x = torch.randn(2, 8, 5, 6)
    with torch.no_grad():
        torch.testing.assert_close(block(x), plain(x), rtol=1e-5, atol=1e-5)
    assert block.state_dict().keys() == plain.state_dict().keys()
    assert unphase_upsamplers(nn.Sequential(block)) == ["0"] and type(block) is type(plain)
    assert not [k for k in block.__dict__ if "phases" in k]


def test_a_copy_of_a_packed_phased_block_makes_its_own_phases(monkeypatch):
    """The cache holds oneDNN's layout, which has no storage: a copy carries no cache."""
    import copy

    choose(monkeypatch, "phases")
    block = upsampler(8)
    packed.pack(block)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        out = block(x)
        twin = copy.deepcopy(block)
        assert torch.equal(twin(x), out)


def test_the_choice_is_measured_per_shape_and_kept():
    block = upsampler(8)
    phase_upsamplers(block)
    with torch.no_grad():
        block(torch.randn(1, 8, 4, 4))
        block(torch.randn(1, 8, 4, 4))
        block(torch.randn(1, 8, 3, 5))
    keys = [d["key"] for d in dispatch.decisions() if d["op"] == "upsample_conv"]
    assert sum("(1, 8, 4, 4)" in k for k in keys) == 1 and sum("(1, 8, 3, 5)" in k for k in keys) == 1
    assert all(set(d["timings"]) <= {"plain", "phases"} for d in dispatch.decisions() if d["op"] == "upsample_conv")


def test_each_path_runs_once_before_a_shape_is_measured_and_not_once_it_is_known(monkeypatch):
    """A packed conv packs for a new input shape on its first call, the phases make their weight:
    neither may land in the timing that decides between them."""
    from pyext.nn import upsample

    calls = []
    monkeypatch.setattr(upsample, "phased", lambda block, x: calls.append("phases") or torch.zeros(1))
    monkeypatch.setattr(dispatch, "measured_choice",
                        lambda what, key, device, runs, **k: calls.append("measure") or {"backend": "phases"})
    monkeypatch.setattr(dispatch, "known_choice", lambda *a: None)
    block = upsampler(8)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        block(x)
        assert calls == ["phases", "measure", "phases"]
        calls.clear()
        monkeypatch.setattr(dispatch, "known_choice", lambda *a: {"backend": "phases"})
        block(x)
    assert calls == ["phases"]  # known: neither a warm-up nor a measurement


def test_where_the_phases_could_be_seen_the_block_runs_plainly(monkeypatch):
    """A hook on the conv sees the upsampled input; gradients reach the weight; an output size is
    honoured: each time through Upsample2D's own forward."""
    choose(monkeypatch, "phases")
    block, plain = upsampler(8), upsampler(8)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    seen = []
    handle = block.conv.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        block(x)
    handle.remove()
    assert seen == [(1, 8, 8, 8)]
    block(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(block.conv.weight.grad, plain.conv.weight.grad)
    with torch.no_grad():
        assert block(x, output_size=(12, 12)).shape[-2:] == (12, 12)


def test_weights_made_in_inference_mode_run_the_plain_block_or_phases_from_their_store(monkeypatch):
    """Plain inference tensors keep no version counter, so a change to them could not be seen: the
    plain block. Packed ones (prepack's wrapper versions the writes) give the phases their values
    from the store, under inference_mode too."""
    choose(monkeypatch, "phases")
    with torch.inference_mode():
        block, plain, bare = upsampler(8, bias=False), upsampler(8, bias=False), upsampler(8, bias=False)
    phase_upsamplers(bare)
    packed.pack(block)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(bare(x), plain(x), rtol=0, atol=0)
    assert not [k for k in bare.__dict__ if "phases" in k]  # no phase weights were made
    with torch.inference_mode():
        torch.testing.assert_close(block(x), plain(x), rtol=1e-5, atol=1e-5)
    assert [k for k in block.__dict__ if "phases" in k]


def test_without_measurement_the_block_runs_plainly(monkeypatch):
    monkeypatch.setenv("PYEXT_DISPATCH", "static")
    monkeypatch.setattr(dispatch, "measured_choice", lambda *a, **k: pytest.fail("measured in static dispatch"))
    block, plain = upsampler(8), upsampler(8)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        assert torch.equal(block(x), plain(x))


@pytest.mark.parametrize("pack", [False, True])
def test_a_changed_weight_makes_new_phases(monkeypatch, pack):
    choose(monkeypatch, "phases")
    block, other = upsampler(8), upsampler(8)
    with torch.no_grad():
        other.conv.weight.mul_(-0.5)
    if pack:
        packed.pack(block)
    phase_upsamplers(block)
    x = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        block(x)
        block.load_state_dict(other.state_dict())  # in place: the weight's version moves
        torch.testing.assert_close(block(x), other(x), rtol=1e-5, atol=1e-5)
        block.conv.weight = nn.Parameter(torch.zeros_like(block.conv.weight))  # a new tensor
        torch.testing.assert_close(block(x), block.conv.bias.view(1, -1, 1, 1).expand(1, 8, 8, 8))


def test_optimize_phases_the_vae_reports_and_restores():
    pipe = build_pipeline("sd15", "tiny")
    ref = generate(pipe)
    pyext.optimize(pipe, dtype="keep")
    entries = {(e.component, e.technique): e for e in pyext.report(pipe).entries}
    assert entries["vae", "upsample_phases"].status == "applied" and phased_blocks(pipe.vae)
    assert entries["unet", "upsample_phases"].status == "skipped" and not phased_blocks(pipe.unet)
    assert np.abs(generate(pipe) - ref).max() <= 1e-3
    pyext.restore(pipe)
    assert not phased_blocks(pipe.vae)
    assert np.abs(generate(pipe) - ref).max() == 0
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", upsample_phases="off")
    entry = next(e for e in pyext.report(pipe).entries if e.component == "vae" and e.technique == "upsample_phases")
    assert entry.status == "skipped" and "upsample_phases='off'" in entry.detail and not phased_blocks(pipe.vae)
    with pytest.raises(PyextError, match="upsample_phases"):
        pyext.optimize(build_pipeline("sd15", "tiny"), upsample_phases="yes")
