"""The family matrix: pyext.optimize on every diffusers family pyext builds offline.

For each family (tiny random configs, generated tokenizers, 2 steps):
- defaults give the output of the same pipeline after a plain `.to(torch.bfloat16)`, within
  bf16 rounding (defaults compute in bf16 where the CPU does so natively, else in fp32): the RMS difference to it is at most twice what bf16 itself moves the fp32
  output (plus 2e-3 for 8-bit output quantisation);
- fp8="denoiser" converts layers in every denoiser and the output stays close to fp32
  (20 dB, or within 3 dB of plain bf16 where bf16 itself is below 23 dB);
- restore after keep_original_weights=True gives the fp32 output bit for bit;
- attention is routed in every layer whose processor ends in SDPA, and pyext computes it;
- model offload works enabled before or after optimize (the orders alternate over families).
"""
import pytest
import torch

import pyext
import pyext.nn.fp8 as fp8_module
from pyext import attention, offline, offload
from pyext.decision import auto_dtype
from pyext.families import find_components

ARCHS = offline.ARCHS


def rms(a, b) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def psnr(a, b) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return 99.0 if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


@pytest.fixture(autouse=True)
def small_layers_in_fp8(monkeypatch):
    """Tiny models' layers are below the fp8 size floor; convert them anyway so fp8 is exercised."""
    monkeypatch.setattr(fp8_module, "MIN_NUMEL", 0)


_REFS = {}


def references(arch):
    """(fp32 output, plain bf16 output) of the arch, computed once."""
    if arch not in _REFS:
        fp32 = offline.run_example(offline.build_pipeline(arch), arch)
        bf16 = offline.run_example(offline.build_pipeline(arch).to(torch.bfloat16), arch)
        assert torch.isfinite(fp32).all() and torch.isfinite(bf16).all()
        _REFS[arch] = fp32, bf16
    return _REFS[arch]


def assert_within_bf16_rounding(out, arch, what):
    fp32, bf16 = references(arch)
    assert out.shape == bf16.shape and torch.isfinite(out).all(), what
    bound = 2 * rms(bf16, fp32) + 2e-3
    assert rms(out, bf16) <= bound, f"{what}: rms vs plain bf16 {rms(out, bf16):.2e} > {bound:.2e}"


def applied(pipe, technique):
    return {e.component for e in pyext.report(pipe).entries if e.technique == technique and e.status == "applied"}


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_match_plain_bf16_and_route_attention(arch):
    pipe = pyext.optimize(offline.build_pipeline(arch))
    denoisers = find_components(pipe).denoisers
    assert denoisers, "no denoiser found"
    report = str(pyext.report(pipe))
    if auto_dtype(torch.device("cpu")) != torch.float32:
        assert set(denoisers) <= applied(pipe, "dtype"), report
    else:  # no bf16 weight anywhere
        assert all(p.dtype == torch.float32 for m in denoisers.values() for p in m.parameters()
                   if p.is_floating_point()), report
    assert_within_bf16_rounding(offline.run_example(pipe, arch), arch, report)
    status = attention.status(pipe)["components"]
    for name, module in find_components(pipe).modules.items():
        layers = attention.attention_layers(module)
        routable = [n for n, m in layers.items() if attention.route_problem(m) is None]
        comp = status[name]
        assert comp["patched"] == len(routable), (name, comp)
        if routable and name in denoisers:  # pyext computes every call, masked ones included
            routed_fallbacks = {why for why in comp["fallbacks"] if not why.startswith("no SDPA call")}
            assert comp["pyext_calls"] > 0 and not routed_fallbacks, (name, comp)
            assert name in applied(pipe, "attention"), report


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_converts_every_denoiser_and_restore_is_exact(arch):
    fp32, _ = references(arch)
    pipe = pyext.optimize(offline.build_pipeline(arch), fp8="denoiser", keep_original_weights=True)
    denoisers = find_components(pipe).denoisers
    assert set(denoisers) <= applied(pipe, "fp8"), str(pyext.report(pipe))
    for module in denoisers.values():
        assert any(isinstance(m, (pyext.FP8Linear, pyext.FP8Conv2d)) for m in module.modules())
    out = offline.run_example(pipe, arch)
    # Close: above 20 dB against fp32, or, where a tiny random model is chaotic enough that plain
    # bf16 itself lands below 23 dB (Stable Cascade's two stages: 11.5 dB), within 3 dB of bf16's.
    floor = min(20.0, psnr(references(arch)[1], fp32) - 3)
    assert torch.isfinite(out).all() and psnr(out, fp32) > floor, (psnr(out, fp32), floor)
    pyext.restore(pipe)
    assert not any(isinstance(m, (pyext.FP8Linear, pyext.FP8Conv2d)) for m in pipe.components.values()
                   if isinstance(m, torch.nn.Module) for m in m.modules())
    assert torch.equal(offline.run_example(pipe, arch), fp32)


# Each family in one order, the orders alternating over the matrix (both orders and every
# offload mode are tested on SD1.5 in test_optimize.py): half the runs, the same coverage of code.
ORDERS = [(arch, ("offload_first", "optimize_first")[i % 2]) for i, arch in enumerate(ARCHS)]


@pytest.mark.parametrize("arch,order", ORDERS)
def test_model_offload_in_either_order(arch, order):
    pipe = offline.build_pipeline(arch)
    if order == "offload_first":
        pipe.enable_model_cpu_offload(device="cpu")
    pyext.optimize(pipe, dtype=torch.bfloat16)  # the cast path on every family, whatever the CPU
    if order == "optimize_first":
        pipe.enable_model_cpu_offload(device="cpu")
    assert offload.detect(pipe).mode == "model"
    assert_within_bf16_rounding(offline.run_example(pipe, arch), arch, order)
