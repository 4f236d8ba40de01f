"""Weights packed once for oneDNN (pyext.nn.packed, prepack technique): same outputs as the plain
layers, one copy of the weights, exact unpacking, and the module's other uses keep working."""
import io

import numpy as np
import pytest
import torch
import torch.nn as nn

import pyext
from pyext import _compat
from pyext.dispatch import PyextError
from pyext.nn import packed
from pyext.nn.packed import PackedWeight, pack, unpack
from pyext.offline import build_pipeline

DTYPES = [torch.float32] + ([torch.bfloat16] if _compat.cpu_has_native_bf16() else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the output's scale: other accumulation orders

# (in, out, kernel, stride, padding, dilation, groups, bias, input H x W): odd sizes included
CONVS = [(8, 16, 3, 1, 1, 1, 1, True, (9, 7)), (16, 16, 3, 2, 1, 1, 1, True, (8, 8)),
         (6, 10, 1, 1, 0, 1, 1, False, (5, 11)), (12, 12, 3, 1, 2, 2, 1, True, (10, 10)),
         (8, 8, 3, 1, 1, 1, 2, True, (6, 6)), (3, 5, (3, 1), 1, (1, 0), 1, 1, True, (7, 4))]
# (in, out, bias, leading dims); fp32 Linears of up to CONV_LINEAR_MAX_IN inputs run as 1x1 convolutions
LINEARS = [(40, 48, True, (3, 7)), (13, 5, False, (2,)), (64, 130, True, (1, 2, 3)), (2600, 9, True, (5,)),
           (1, 3, True, ())]


@pytest.fixture(autouse=True)
def pack_every_linear(monkeypatch):
    """Small fp32 Linears of over CONV_LINEAR_MAX_IN inputs stay plain by default (BLAS is faster): pack them."""
    monkeypatch.setattr(packed, "BLAS_LINEAR_BYTES", 0)


def test_which_fp32_linears_are_packed(monkeypatch):
    monkeypatch.undo()
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(3000, 64), nn.Linear(4096, 4096, bias=False)).eval()
    report = pack(model)
    assert report.packed == ["0", "2"] and "BLAS" in report.skipped["1"]
    assert not isinstance(model[1].weight, PackedWeight)
    with torch.no_grad():
        model[0](torch.randn(5, 64))
        model[2](torch.randn(5, 4096))
    assert model[0].weight.packed.input_shape == (1, 64, 5, 1)  # a 1x1 convolution over 5 rows
    assert model[2].weight.packed.tensor.is_mkldnn and model[2].weight.packed.input_shape is None  # oneDNN's GEMM


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def count_fast_calls(monkeypatch):
    calls = {"conv": 0, "linear": 0}
    conv, linear = _compat.mkldnn_conv, _compat.mkldnn_linear
    monkeypatch.setattr(_compat, "mkldnn_conv", lambda *a: (calls.__setitem__("conv", calls["conv"] + 1), conv(*a))[1])
    monkeypatch.setattr(_compat, "mkldnn_linear",
                        lambda *a: (calls.__setitem__("linear", calls["linear"] + 1), linear(*a))[1])
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CONVS, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_matches_plain_and_unpacks_exactly(spec, dtype, channels_last, monkeypatch):
    cin, cout, k, s, p, d, g, bias, hw = spec
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, s, p, d, g, bias).to(dtype).eval().requires_grad_(False)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv.to(memory_format=fmt)
    x = torch.randn(2, cin, *hw, dtype=dtype).contiguous(memory_format=fmt)
    ref, weight = conv(x), conv.weight.detach().clone()
    calls = count_fast_calls(monkeypatch)
    assert pack(conv).packed == [""]
    assert isinstance(conv.weight, PackedWeight)
    # Plain until the first call gives the input shape its layout is packed for (once).
    assert conv.weight.packed.input_shape is None and not conv.weight.packed.winograd
    assert "plain until its first call" in repr(conv.weight)
    assert rel_err(conv(x), ref) <= TOL[dtype]
    assert calls["conv"] == 1  # oneDNN on the packed weight, not the plain path
    assert conv.weight.packed.input_shape == tuple(x.shape)
    x2 = torch.randn(3, cin, hw[0] + 2, hw[1] + 1, dtype=dtype)  # a new shape repacks, still right
    assert rel_err(conv(x2), nn.functional.conv2d(x2, weight, conv.bias, s, p, d, g)) <= TOL[dtype]
    assert conv.weight.packed.input_shape == tuple(x2.shape)
    unpack(conv)
    assert type(conv.weight) is nn.Parameter and torch.equal(conv.weight, weight)
    assert conv.weight.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CONVS, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_add_fuses_the_add_where_oneDNN_can_take_it(spec, dtype, channels_last, monkeypatch):
    """conv_add(conv, x, other) is other + conv(x): one oneDNN call with the add as its post-op, the
    sum rounded once (as close to float64's as the two calls' at least), for channels-last x and
    `other` of the output's shape and groups 1; the two calls otherwise (another layout, a
    broadcast, groups, a plain weight, a Winograd one)."""
    cin, cout, k, s, p, d, g, bias, hw = spec
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, s, p, d, g, bias).to(dtype).eval().requires_grad_(False)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, cin, *hw, dtype=dtype).contiguous(memory_format=fmt)
    other = torch.randn_like(conv(x)).contiguous(memory_format=fmt)
    plain = packed.conv_add(conv, x, other)  # a plain weight: the two calls
    assert torch.equal(plain, other + conv(x))
    exact = nn.functional.conv2d(x.double(), conv.weight.double(), None if conv.bias is None else conv.bias.double(),
                                 s, p, d, g) + other.double()
    fused = []
    binary = _compat.mkldnn_conv_add
    monkeypatch.setattr(_compat, "mkldnn_conv_add", lambda *a: (fused.append(1), binary(*a))[1])
    pack(conv)
    out = packed.conv_add(conv, x, other)
    fusable = channels_last and g == 1
    assert len(fused) == fusable and out.dtype == dtype and out.shape == plain.shape
    scale = exact.abs().max().item()
    if fusable:  # one rounding: as close as the two calls'
        assert out.stride() == conv(x).stride()  # the layer's own output layout
        assert (out.double() - exact).abs().max().item() <= (plain.double() - exact).abs().max().item() + TOL[dtype] / 8 * scale
    assert rel_err(out, plain) <= TOL[dtype]
    other_layout = other.contiguous(memory_format=torch.contiguous_format if channels_last else torch.channels_last)
    if not other_layout.is_contiguous(memory_format=torch.channels_last):  # (a 1x1 output is both)
        assert rel_err(packed.conv_add(conv, x, other_layout), plain) <= TOL[dtype] and len(fused) == fusable
    assert rel_err(packed.conv_add(conv, x, other[:1]), other[:1] + conv(x)) <= TOL[dtype]  # a broadcast
    assert len(fused) == fusable
    with torch.enable_grad():
        assert packed.conv_add(conv, x, other.clone().requires_grad_(True)).requires_grad
    assert len(fused) == fusable


def test_conv_add_on_a_winograd_weight_is_the_two_calls(monkeypatch):
    monkeypatch.setattr(packed, "_winograd_suits", lambda *a: True)
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, 1, 1).eval().requires_grad_(False)
    x = torch.randn(1, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    other = torch.randn(1, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    want = other + conv(x)
    pack(conv)
    fused = []
    monkeypatch.setattr(_compat, "mkldnn_conv_add", lambda *a: fused.append(1))
    out = packed.conv_add(conv, x, other)
    assert conv.weight.packed.winograd and not fused and rel_err(out, want) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", LINEARS, ids=str)
def test_linear_matches_plain(spec, dtype, monkeypatch):
    fin, fout, bias, lead = spec
    torch.manual_seed(0)
    lin = nn.Linear(fin, fout, bias).to(dtype).eval()
    x = torch.randn(*lead, fin, dtype=dtype)
    ref, weight = lin(x), lin.weight.detach().clone()
    calls = count_fast_calls(monkeypatch)
    pack(lin)
    with torch.no_grad():
        out = lin(x)
        assert out.shape == ref.shape and rel_err(out, ref) <= TOL[dtype]
        as_conv = dtype == torch.float32 and fin <= packed.CONV_LINEAR_MAX_IN
        assert calls["conv" if as_conv else "linear"] == 1
        x2 = torch.randn(7, 2, fin, dtype=dtype)  # another row count: a 1x1 convolution repacks
        assert rel_err(lin(x2), nn.functional.linear(x2, weight, lin.bias)) <= TOL[dtype]
        assert lin.weight.packed.input_shape == ((1, fin, 14, 1) if as_conv else None)
        assert lin(x2[:0]).shape == (0, 2, fout)  # no rows: the plain path
    assert torch.equal(lin.state_dict()["weight"], weight)
    unpack(lin)
    assert torch.equal(lin.weight, weight) and lin.weight.requires_grad  # thawed as it was


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 5)).eval()


def test_one_copy_state_dict_load_and_save():
    model = small_model()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    pack(model)
    state = model.state_dict()
    assert all(type(v) is torch.Tensor and torch.equal(v, plain[k]) for k, v in state.items())
    x = torch.randn(2, 4, 6, 6)
    doubled = {k: v * 2 for k, v in plain.items()}
    model.load_state_dict(doubled)  # an in-place write must reach the packed weight
    assert isinstance(model[0].weight, PackedWeight)
    twin = small_model()
    twin.load_state_dict(doubled)
    assert rel_err(model(x), twin(x)) <= TOL[torch.float32]
    from safetensors.torch import load, save
    assert all(torch.equal(v, doubled[k]) for k, v in load(save(model.state_dict())).items())
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert all(torch.equal(v, doubled[k]) for k, v in torch.load(buffer).items())


def test_a_trained_weight_gets_the_gradient_of_a_plain_layer():
    """oneDNN's kernels record no autograd graph: a weight that requires grad takes the plain
    path even where the input needs none (cross-attention's K/V of text embeddings)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.Linear(6, 3, bias=False))
    twin = copy.deepcopy(model)
    pack(model)
    model.requires_grad_(True)
    model.to(memory_format=torch.channels_last)  # repacked: still trained
    x = torch.randn(2, 4, 6, 6)
    for m in (model, twin):
        m(x).square().sum().backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) <= TOL[torch.float32], name
    assert isinstance(model[0].weight, PackedWeight)  # the step wrote into the packed weight
    with torch.no_grad():
        assert rel_err(model(x), twin(x)) <= TOL[torch.float32]


def test_pickling_a_packed_module_says_what_to_do_instead():
    import copy

    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep")
    with pytest.raises(PyextError, match=r"prepack.*cannot be pickled.*state_dict.*pyext\.restore.*prepack=\"off\""):
        torch.save(pipe.unet, io.BytesIO())
    weight = pipe.unet.conv_in.weight
    assert copy.copy(weight).packed is weight.packed  # a shallow copy shares the packed weight, as before
    torch.save(pipe.unet.state_dict(), io.BytesIO())
    pyext.restore(pipe)
    torch.save(pipe.unet, io.BytesIO())


_ONE_COPY = """
import gc, torch, torch.nn as nn
from pyext.nn import packed
from pyext.nn.packed import pack

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

warm = nn.Linear(4096, 64)
packed.BLAS_LINEAR_BYTES = 0  # packed as the measured layer is, into oneDNN's GEMM layout
pack(warm)
with torch.no_grad():
    warm(torch.randn(2, 4096))  # oneDNN's one-time set-up (its JIT kernels, pools) is not the weight's
gc.collect()
before = rss()
layer = nn.Linear(4096, 4096, bias=False)  # 64 MiB: large allocations go straight back to the OS
pack(layer)
gc.collect()
print(rss() - before)
"""


def test_one_copy_of_the_weights_is_held():
    # In a fresh interpreter: what earlier tests left in the allocator must not count.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    held = int(subprocess.run([sys.executable, "-c", _ONE_COPY], capture_output=True, text=True, check=True,
                              env=env).stdout.split()[-1])
    one_copy = 4096 * 4096 * 4
    assert held < 1.5 * one_copy, f"{held / 2**20:.0f} MiB held for a {one_copy / 2**20:.0f} MiB weight"


def test_reads_and_casts_see_the_plain_weight():
    model = small_model()
    weight = model[0].weight.detach().clone()
    pack(model)
    w = model[0].weight
    assert w.shape == weight.shape and w.dtype == weight.dtype
    assert torch.equal(w * 1, weight) and torch.equal(w[1], weight[1]) and w.sum().item() == weight.sum().item()
    packed_tensor = model[0].weight.packed.tensor
    model.to("cpu").float()  # changes nothing: the packed weight stays as it is
    assert model[0].weight.packed.tensor is packed_tensor
    model.to(torch.float64)  # unpacked, cast, and left plain: float64 is not packed
    assert type(model[0].weight) is nn.Parameter and torch.equal(model[0].weight, weight.double())
    assert model[0](torch.randn(1, 4, 5, 5, dtype=torch.float64)).dtype == torch.float64
    model.to(torch.float32)  # packable again: packed again, values intact
    assert isinstance(model[0].weight, PackedWeight) and torch.equal(model[0].weight * 1, weight)
    model.to(memory_format=torch.channels_last)
    assert isinstance(model[0].weight, PackedWeight) and model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert unpack(model) == ["0", "2", "4"]
    assert type(model[0]) is nn.Conv2d and type(model[4]) is nn.Linear and torch.equal(model[0].weight, weight)


def test_deepcopy_copies_the_packed_weight():
    import copy

    model = small_model()
    pack(model)
    twin = copy.deepcopy(model)
    assert isinstance(twin[0].weight, PackedWeight) and isinstance(twin[0].weight, nn.Parameter)
    assert twin[0].weight.packed is not model[0].weight.packed
    x = torch.randn(2, 4, 6, 6)
    assert torch.equal(twin(x), model(x))
    with torch.no_grad():
        twin[0].weight.mul_(2)  # the copy is its own: the original does not change
    assert not torch.equal(twin[0].weight * 1, model[0].weight * 1)


def test_a_linear_packed_before_its_first_call_holds_its_own_copy():
    import copy

    lin = nn.Linear(6, 3).eval()
    original = lin.weight
    pack(lin)  # plain until a call gives the row count
    twin = copy.deepcopy(lin)
    with torch.no_grad():
        twin.weight.mul_(2)
        lin.load_state_dict({"weight": torch.ones(3, 6), "bias": torch.zeros(3)})
    assert not torch.equal(original, torch.ones(3, 6))  # the caller's tensor is not the packed one
    assert torch.equal(lin.weight * 1, torch.ones(3, 6)) and not torch.equal(twin.weight * 1, torch.ones(3, 6))


def test_skip_reasons():
    conv = nn.Conv2d(4, 4, 3, padding="same")
    assert "padding" in packed.skip_reason(conv)
    assert "dtype" in packed.skip_reason(nn.Linear(4, 4).half()) or "not packed" in packed.skip_reason(
        nn.Linear(4, 4).half())
    assert packed.skip_reason(nn.Conv3d(2, 2, 1)) == "not a plain Conv2d/Linear"
    lin = nn.Linear(4, 4)
    pack(lin)
    assert packed.skip_reason(lin) == "already packed" and isinstance(lin, nn.Linear)


def generate(pipe, steps=2):
    return pipe("a cat", height=64, width=64, num_inference_steps=steps, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def test_optimize_packs_on_cpu_reports_and_restores_exactly():
    pipe = build_pipeline("sd15", "tiny")
    ref = generate(pipe)
    pyext.optimize(pipe, dtype="keep")
    entries = {(e.component, e.technique): e for e in pyext.report(pipe).entries}
    assert entries["unet", "prepack"].status == "applied" and entries["vae", "prepack"].status == "applied"
    assert entries["text_encoder", "prepack"].status == "skipped"
    assert any(isinstance(m.weight, PackedWeight) for m in pipe.unet.modules() if isinstance(m, nn.Conv2d))
    assert np.abs(generate(pipe) - ref).max() <= 1e-4
    pyext.restore(pipe)
    assert not any(isinstance(p, PackedWeight) for p in pipe.unet.parameters())
    assert np.abs(generate(pipe) - ref).max() == 0


def test_optimize_prepack_off_and_compile_skip_say_why():
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", prepack="off")
    assert not any(isinstance(p, PackedWeight) for p in pipe.unet.parameters())
    with pytest.raises(PyextError, match="prepack"):
        pyext.optimize(build_pipeline("sd15", "tiny"), prepack="yes")
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", compile="trace")
    entry = next(e for e in pyext.report(pipe).entries if e.component == "unet" and e.technique == "prepack")
    assert entry.status == "skipped" and "trace" in entry.detail


def test_lora_on_packed_layers(tmp_path):
    from test_optimize import make_lora

    lora = make_lora(tmp_path)
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep")
    twin = build_pipeline("sd15", "tiny")
    plain = generate(pipe)
    pipe.load_lora_weights(lora, adapter_name="a")
    twin.load_lora_weights(lora, adapter_name="a")
    with_lora = generate(pipe)
    assert np.abs(with_lora - plain).max() > 0.01  # the LoRA really acts
    assert np.abs(with_lora - generate(twin)).max() <= 1e-4
    pipe.fuse_lora()  # PEFT writes the merged weight in place: it must reach the packed copy
    assert np.abs(generate(pipe) - with_lora).max() <= 1e-4
    pipe.unfuse_lora()
    assert np.abs(generate(pipe) - with_lora).max() <= 1e-4
    pipe.unload_lora_weights()
    assert np.abs(generate(pipe) - plain).max() <= 1e-5
    assert any(isinstance(p, PackedWeight) for p in pipe.unet.parameters())


def test_compile_on_cpu_freezes_the_denoisers_forward_and_restore_gives_the_eager_one(monkeypatch):
    """compile="compile" with inductor on a CPU compiles the denoiser's forward, frozen (see
    frozen_forward); another backend compiles the module in place."""
    from pyext.techniques import compile as technique

    calls = []
    monkeypatch.setattr(technique.torch, "compile", lambda fn, **kw: (calls.append(kw), fn)[1])
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(("in place", kw)))
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", compile="compile")
    assert calls == [{"backend": "inductor"}] and "forward" in vars(pipe.unet)
    entry = next(e for e in pyext.report(pipe).entries if e.technique == "compile")
    assert entry.status == "applied" and "freezing" in entry.detail
    assert "unet: compile: eager again" in pyext.restore(pipe) and "forward" not in vars(pipe.unet)
    calls.clear()
    pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", compile="compile", compile_backend="aot_eager")
    assert calls == [("in place", {"backend": "aot_eager"})]


@pytest.mark.parametrize("setting,autotune", [("auto", True), ("on", True), ("off", False)])
def test_compile_autotune_on_cpu_reaches_inductors_config(monkeypatch, setting, autotune):
    """compile_autotune: "auto" and "on" compile a CPU denoiser with inductor's GEMM autotuning, "off"
    without (the setting inductor reads when the frozen forward compiles)."""
    import contextlib

    from pyext.techniques import compile as technique

    seen = []
    monkeypatch.setattr(technique.torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(_compat, "inductor_freezing", lambda tune=False: seen.append(tune) or contextlib.nullcontext())
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", compile="compile", compile_autotune=setting)
    entry = next(e for e in pyext.report(pipe).entries if e.technique == "compile")
    assert ("timed on this machine" in entry.detail) == autotune
    generate(pipe)
    assert seen and set(seen) == {autotune}
    with pytest.raises(PyextError, match="compile_autotune"):
        pyext.optimize(build_pipeline("sd15", "tiny"), compile="compile", compile_autotune=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_forward_with_gemm_autotuning_computes_as_eager(dtype):
    """Whichever GEMM inductor's timing keeps for each linear (its C++ template or oneDNN's), the
    compiled forward gives the eager one's values."""
    from pyext import _state
    from pyext.techniques.compile import FROZEN, frozen_forward

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 48)).to(dtype).eval()
    x = torch.randn(40, 64).to(dtype)
    with torch.no_grad():
        expected = net(x)
        frozen_forward(net, autotune=True)
        out = net(x)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    _state.restore_attributes(net, FROZEN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_forward_packs_the_weights_for_onednn_and_computes_as_eager(dtype):
    """Inductor freezes the weights of a compiled forward (not of a module compiled in place, nor
    through torch.compile's options): its convolutions run on weights packed for oneDNN, bf16
    ones where oneDNN computes bf16 (elsewhere inductor leaves them to torch's convolution)."""
    from pyext import _state
    from pyext.techniques.compile import FROZEN, frozen_forward

    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 8, 3, padding=1)).to(dtype).eval()
    x = torch.randn(2, 8, 12, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        expected = net(x)
        frozen_forward(net)
        net(x)
        with torch.profiler.profile() as prof:
            out = net(x)
    packed = any("_convolution_pointwise" in e.key for e in prof.key_averages())
    assert packed == (dtype == torch.float32 or _compat.cpu_has_native_bf16())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    _state.restore_attributes(net, FROZEN)
    assert "forward" not in vars(net)
