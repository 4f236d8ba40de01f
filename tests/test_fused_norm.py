"""GroupNorm + SiLU fused in ResnetBlock2D-shaped blocks (pyext.nn.fused_norm, fuse_norms technique):
the same outputs, the probe that refuses a block where the pair is not adjacent, report and undo."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import pyext
from pyext.dispatch import PyextError
from pyext.nn import fused_norm
from pyext.nn.fused_norm import GroupNormSiLU, SiLUAfterFusedNorm, fuse_norms, unfuse_norms
from pyext.offline import build_pipeline


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """The tiny test models' activations are under the size where fusing pays; run the op anyway."""
    monkeypatch.setattr(fused_norm, "MIN_FUSED_NUMEL", 0)


def generate(pipe):
    return pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def test_fused_blocks_give_the_plain_outputs_and_unfuse():
    pipe = build_pipeline("sd15", "tiny")
    latents = torch.randn(1, pipe.vae.config.latent_channels, 9, 7)
    with torch.no_grad():
        plain = pipe.vae.decode(latents).sample
        before = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
        report = fuse_norms(pipe.vae)
        fused = pipe.vae.decode(latents).sample
    assert report.fused and not report.skipped
    assert sum(type(m) is GroupNormSiLU for m in pipe.vae.modules()) == len(report.fused)
    assert any(type(m) is SiLUAfterFusedNorm for m in pipe.vae.modules())
    assert (fused - plain).abs().max() <= 1e-4 * plain.abs().max()
    assert pipe.vae.state_dict().keys() == before.keys()
    assert len(unfuse_norms(pipe.vae)) == len(report.fused)
    assert not any(type(m) in (GroupNormSiLU, SiLUAfterFusedNorm) for m in pipe.vae.modules())
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(latents).sample, plain)


class _ScaledBetween(nn.Module):
    """ResnetBlock2D's attributes, but something between norm1 and the nonlinearity."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(2, 4), nn.GroupNorm(2, 4)
        self.nonlinearity = nn.SiLU()

    def forward(self, x, temb=None):
        h = self.nonlinearity(self.norm1(x) * 2)  # not adjacent: fusing would apply SiLU before the scale
        return self.nonlinearity(self.norm2(h))


def test_the_probe_refuses_a_block_whose_norm_does_not_feed_its_silu():
    model = nn.Sequential(_ScaledBetween())
    x = torch.randn(2, 4, 5, 5)
    ref = model(x)
    report = fuse_norms(model)
    assert not report.fused and "differs" in report.skipped["0"]
    assert type(model[0].norm1) is nn.GroupNorm and type(model[0].nonlinearity) is nn.SiLU
    assert torch.equal(model(x), ref)


def test_training_falls_back_to_torch_ops_with_gradients():
    model = nn.Sequential(_Adjacent())
    fuse_norms(model)
    assert type(model[0].norm1) is GroupNormSiLU
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and model[0].norm1.weight.grad is not None


class _Adjacent(_ScaledBetween):
    def forward(self, x, temb=None):
        return self.nonlinearity(self.norm2(self.nonlinearity(self.norm1(x))))


def test_shared_silu_meta_parameters_and_unsupported_dtypes_stay_plain():
    shared = nn.Sequential(_Adjacent(), _Adjacent())
    shared[1].nonlinearity = shared[0].nonlinearity
    report = fuse_norms(shared)
    assert not report.fused and all("shared" in r for r in report.skipped.values())
    with torch.device("meta"):
        meta = nn.Sequential(_Adjacent())
    assert "meta" in fuse_norms(meta).skipped["0"]
    model = nn.Sequential(_Adjacent())
    fuse_norms(model)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        y = model.double()(x)  # float64: torch's ops, as a plain GroupNorm takes it
    model[0].norm1.__class__ = model[0].norm2.__class__ = nn.GroupNorm
    model[0].nonlinearity.__class__ = nn.SiLU
    assert torch.allclose(y, model(x))


def test_fused_norms_call_the_op_above_the_size_rule_and_torch_below(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_norm, "group_norm", lambda *a, **k: calls.append(a[0].numel()) or torch.zeros_like(a[0]))
    monkeypatch.setattr(fused_norm, "MIN_FUSED_NUMEL", 100)
    norm = nn.GroupNorm(2, 4)
    norm.__class__ = GroupNormSiLU
    with torch.no_grad():
        norm(torch.randn(1, 4, 5, 5))  # 100 elements: the op
        small = torch.randn(1, 4, 2, 3)
        assert torch.allclose(norm(small), torch.nn.functional.silu(nn.functional.group_norm(small, 2)))
    assert calls == [100]


def test_silu_after_fused_norm_applies_silu_to_anything_unmarked():
    act = nn.SiLU()
    act.__class__ = SiLUAfterFusedNorm
    x = torch.randn(3, 5)
    assert torch.equal(act(x), torch.nn.functional.silu(x))


def test_optimize_fuses_on_cpu_reports_and_restores():
    pipe = build_pipeline("sd15", "tiny")
    ref = generate(pipe)
    pyext.optimize(pipe, dtype="keep", prepack="off")
    entries = {(e.component, e.technique): e for e in pyext.report(pipe).entries}
    assert entries["unet", "fuse_norms"].status == "applied" and entries["vae", "fuse_norms"].status == "applied"
    assert entries["text_encoder", "fuse_norms"].status == "skipped"
    assert np.abs(generate(pipe) - ref).max() <= 1e-4
    pyext.restore(pipe)
    assert not any(type(m) is GroupNormSiLU for m in pipe.unet.modules())
    assert np.abs(generate(pipe) - ref).max() == 0
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep", fuse_norms="off")
    entry = next(e for e in pyext.report(pipe).entries if e.component == "unet" and e.technique == "fuse_norms")
    assert entry.status == "skipped" and "fuse_norms='off'" in entry.detail
    with pytest.raises(PyextError, match="fuse_norms"):
        pyext.optimize(build_pipeline("sd15", "tiny"), fuse_norms="yes")
