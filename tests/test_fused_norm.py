"""GroupNorm + SiLU fused in diffusers' ResnetBlock2D (pyext.nn.fused_norm, fuse_norms technique): the
same outputs, norms that callers and hooks see as plain, the probe, report and undo."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pyext
from pyext.dispatch import PyextError
from pyext.nn import fused_norm
from pyext.nn.fused_norm import fuse_norms, is_fused, norm_silu, unfuse_norms
from pyext.offline import build_pipeline


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """The tiny test models' activations are under the size where fusing pays; run the op anyway."""
    monkeypatch.setattr(fused_norm, "MIN_FUSED_NUMEL", 0)


def generate(pipe):
    return pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def fused_blocks(model):
    return [m for m in model.modules() if is_fused(m)]


def test_fused_blocks_give_the_plain_outputs_and_unfuse():
    pipe = build_pipeline("sd15", "tiny")
    latents = torch.randn(1, pipe.vae.config.latent_channels, 9, 7)
    with torch.no_grad():
        plain = pipe.vae.decode(latents).sample
        before = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
        report = fuse_norms(pipe.vae)
        fused = pipe.vae.decode(latents).sample
    assert report.swapped and not report.skipped
    # every block: the encoder's "default" ones and the decoder's "group" ones
    assert len(fused_blocks(pipe.vae)) == len(report.swapped) == sum(
        type(m).__name__ == "ResnetBlock2D" for m in build_pipeline("sd15", "tiny").vae.modules())
    assert all(type(b.norm1) is nn.GroupNorm and type(b.nonlinearity) is nn.SiLU for b in fused_blocks(pipe.vae))
    assert (fused - plain).abs().max() <= 1e-4 * plain.abs().max()
    assert pipe.vae.state_dict().keys() == before.keys()
    assert len(unfuse_norms(pipe.vae)) == len(report.swapped)
    assert not fused_blocks(pipe.vae)
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(latents).sample, plain)


def resnet(temb_channels=None, out_channels=8, **kwargs):
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    return ResnetBlock2D(in_channels=8, out_channels=out_channels, temb_channels=temb_channels, groups=2,
                         **kwargs).eval()


def test_a_fused_norm_called_or_hooked_gives_what_groupnorm_gives():
    """Its norms stay plain GroupNorms: a direct call, and hooks registered before or after fusing,
    see F.group_norm's output; a hook that returns a new tensor or edits it in place changes the
    block's output exactly as it does in the plain block."""
    x, temb = torch.randn(2, 8, 6, 5), torch.randn(2, 16)
    plain, fused = resnet(16), resnet(16)
    fuse_norms(fused)
    assert is_fused(fused)
    with torch.no_grad():
        assert torch.equal(fused.norm1(x), F.group_norm(x, 2, fused.norm1.weight, fused.norm1.bias, fused.norm1.eps))
        for hook in (lambda m, i, o: o * 1.0, lambda m, i, o: o.mul_(2.0)):
            handles = [b.norm1.register_forward_hook(hook) for b in (plain, fused)]
            assert torch.equal(fused(x, temb), plain(x, temb))
            for h in handles:
                h.remove()
        seen = []
        fused.norm2.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        fused(x, temb)
    h = fused.conv1(F.silu(fused.norm1(x))) + fused.time_emb_proj(F.silu(temb))[:, :, None, None]
    assert torch.allclose(seen[0], fused.norm2(h))


@pytest.mark.parametrize("shape", [{}, {"out_channels": 16, "output_scale_factor": 2.0}], ids=["same", "shortcut"])
def test_the_residual_add_goes_into_a_packed_conv2_unless_it_is_hooked(shape, monkeypatch):
    """With conv2's weight packed for oneDNN (optimize fuses, then packs) the fused block adds the
    residual, or its 1x1 shortcut's output, in conv2's call; a hook on conv2 sees conv2's own output
    (the block calls it as itself) and changes the block's output as in the plain block."""
    from pyext import _compat
    from pyext.nn.packed import pack

    x, temb = torch.randn(2, 8, 6, 5).contiguous(memory_format=torch.channels_last), torch.randn(2, 16)
    plain, fused = resnet(16, **shape), resnet(16, **shape)
    fuse_norms(fused)
    pack(fused)
    assert is_fused(fused) and (fused.conv_shortcut is not None) == bool(shape)
    calls = []
    binary = _compat.mkldnn_conv_add
    monkeypatch.setattr(_compat, "mkldnn_conv_add", lambda *a: (calls.append(1), binary(*a))[1])
    with torch.no_grad():
        want = plain(x, temb)
        assert (fused(x, temb) - want).abs().max() <= 1e-4 * want.abs().max() and len(calls) == 1
        seen = []
        for b in (plain, fused):
            b.conv2.register_forward_hook(lambda m, i, o: (seen.append(o.clone()), o * 2.0)[1])
        want = plain(x, temb)
        got = fused(x, temb)
    assert len(calls) == 1 and (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (seen[1] - seen[0]).abs().max() <= 1e-4 * seen[0].abs().max()  # conv2's output, without the residual


def test_a_torch_function_mode_sees_the_plain_blocks_calls():
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 8, 6, 5)
    plain, fused = resnet(), resnet()
    fuse_norms(fused)
    with torch.no_grad(), Calls() as a:
        plain(x, None)
    with torch.no_grad(), Calls() as b:
        fused(x, None)
    assert a.names.count("group_norm") == 2 and b.names == a.names


def test_the_probe_leaves_a_block_plain_where_the_fused_output_differs(monkeypatch):
    monkeypatch.setattr(fused_norm, "group_norm", lambda x, *a, **k: torch.zeros_like(x))
    block = resnet()
    report = fuse_norms(nn.Sequential(block))
    assert not report.swapped and "differs" in report.skipped["0"] and not is_fused(block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stride, padding, kernel", [(1, 1, 3), (2, 1, 3), (2, 0, 3), (1, 0, 1)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_probes_im2col_convolution_gives_conv2ds_output(dtype, stride, padding, kernel, layout):
    from pyext import _compat

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 7, 5, generator=g).to(dtype).contiguous(memory_format=layout)
    w = (torch.randn(5, 6, kernel, kernel, generator=g) / 4).to(dtype).contiguous(memory_format=layout)
    b = torch.randn(5, generator=g).to(dtype)
    exact = F.conv2d(x.double(), w.double(), b.double(), stride, padding)
    got = _compat.im2col_conv2d(x, w, b, (stride, stride), (padding, padding))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and got.shape == exact.shape
    assert (got.double() - exact).abs().max() <= tol * exact.abs().max()


@pytest.mark.parametrize("kind", ["plain", "down", "up", "shortcut"])
def test_the_probe_runs_every_convolution_by_im2col_and_gives_the_forwards_back(kind, monkeypatch):
    """Both probe forwards call each of the block's convolutions through im2col_conv2d; afterwards
    no conv holds a forward of its own, also where the probe raised."""
    from pyext import _compat

    block = {"plain": lambda: resnet(16), "down": lambda: resnet(16, down=True),
             "up": lambda: resnet(16, up=True), "shortcut": lambda: resnet(16, output_scale_factor=2.0,
                                                                            use_in_shortcut=True)}[kind]()
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    calls = []
    real = _compat.im2col_conv2d
    monkeypatch.setattr(_compat, "im2col_conv2d", lambda x, w, *a: calls.append(w) or real(x, w, *a))
    report = fuse_norms(nn.Sequential(block))
    assert report.swapped == ["0"] and is_fused(block)
    assert sorted(map(id, calls)) == sorted(2 * [id(c.weight) for c in convs])
    assert not any("forward" in c.__dict__ for c in convs)
    unfuse_norms(block)

    def broken(*args):
        raise RuntimeError("no")
    monkeypatch.setattr(_compat, "im2col_conv2d", broken)
    report = fuse_norms(nn.Sequential(block))
    assert "could not run" in report.skipped["0"] and not is_fused(block)
    assert not any("forward" in c.__dict__ for c in convs)


def test_blocks_with_their_own_forward_or_other_parts_are_not_fused():
    from diffusers.models.resnet import ResnetBlock2D

    class Scaled(ResnetBlock2D):
        def forward(self, x, temb):
            return super().forward(x * 2, temb)

    torch.manual_seed(0)
    own = Scaled(in_channels=8, out_channels=8, temb_channels=None, groups=2)
    other_act = resnet(non_linearity="mish")
    scale_shift = resnet(16, time_embedding_norm="scale_shift")
    report = fuse_norms(nn.Sequential(own, other_act, scale_shift))
    assert not report.swapped and not fused_blocks(nn.Sequential(own, other_act, scale_shift))


def test_a_group_norm_block_without_a_time_embedding_fuses_and_gives_the_plain_output():
    """A VAE decoder's blocks: time_embedding_norm "group" and no time embedding, norm2 right after
    conv1 as in a "default" block."""
    plain, block = resnet(time_embedding_norm="group"), resnet(time_embedding_norm="group")
    x = torch.randn(2, 8, 6, 5)
    assert fuse_norms(block).swapped == [""] and is_fused(block)
    with torch.no_grad():
        assert (block(x, None) - plain(x, None)).abs().max() <= 1e-5 * plain(x, None).abs().max()


def test_training_falls_back_to_torch_ops_with_gradients():
    block = resnet(16)
    fuse_norms(block)
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    block(x, torch.randn(2, 16)).sum().backward()
    assert x.grad is not None and block.norm1.weight.grad is not None and block.norm2.weight.grad is not None


def test_meta_parameters_stay_plain_and_unsupported_dtypes_run_torchs_ops():
    with torch.device("meta"):
        meta = resnet()
    assert "meta" in fuse_norms(nn.Sequential(meta)).skipped["0"]
    block, plain = resnet(), resnet()
    fuse_norms(block)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(block.double()(x, None), plain.double()(x, None))


def test_norm_silu_calls_the_op_above_the_size_rule_and_torch_below(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_norm, "group_norm", lambda *a, **k: calls.append(a[0].numel()) or torch.zeros_like(a[0]))
    monkeypatch.setattr(fused_norm, "MIN_FUSED_NUMEL", 100)
    norm = nn.GroupNorm(2, 4)
    with torch.no_grad():
        norm_silu(norm, torch.randn(1, 4, 5, 5))  # 100 elements: the op
        small = torch.randn(1, 4, 2, 3)
        assert torch.allclose(norm_silu(norm, small), F.silu(F.group_norm(small, 2, norm.weight, norm.bias)))
    assert calls == [100]


def test_optimize_fuses_on_cpu_reports_and_restores():
    pipe = build_pipeline("sd15", "tiny")
    ref = generate(pipe)
    pyext.optimize(pipe, dtype="keep", prepack="off")
    entries = {(e.component, e.technique): e for e in pyext.report(pipe).entries}
    assert entries["unet", "fuse_norms"].status == "applied" and entries["vae", "fuse_norms"].status == "applied"
    assert entries["text_encoder", "fuse_norms"].status == "skipped"
    assert np.abs(generate(pipe) - ref).max() <= 1e-4
    pyext.restore(pipe)
    assert not fused_blocks(pipe.unet)
    assert np.abs(generate(pipe) - ref).max() == 0
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", fuse_norms="off")
    entry = next(e for e in pyext.report(pipe).entries if e.component == "unet" and e.technique == "fuse_norms")
    assert entry.status == "skipped" and "fuse_norms='off'" in entry.detail
    with pytest.raises(PyextError, match="fuse_norms"):
        pyext.optimize(build_pipeline("sd15", "tiny"), fuse_norms="yes")
