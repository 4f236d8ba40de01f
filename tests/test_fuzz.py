"""CI slice of the fuzz suite (tests/fuzz_cases.py): a fixed seed and a few cases per op, every
backend and SIMD level against the float64 oracle and the reference; `make fuzz` runs 1,000
cases per op with a new seed. Also opcheck on the layouts diffusers passes."""
import pytest
import torch

from pyext._ext import cpu_capabilities, has_kernel
from pyext.ops import fp8_quantize
from tests.fuzz_cases import FAILURES, FUZZERS, draw_case, repro, run_case

SEED = 13
CASES = {"fp8_quantize": 60, "fp8_upcast": 60, "fp8_linear": 60, "fp8_linear_dynamic": 60, "fp8_conv2d": 40, "attention": 30,
         "tile_blend_normalized": 50, "tile_blend_diffusers": 50}


@pytest.mark.parametrize("op", sorted(FUZZERS))
def test_fuzz_slice(op):
    outcomes, failures = [], []
    for i in range(CASES[op]):
        params = draw_case(op, SEED, i)
        outcome, detail = run_case(op, params)
        outcomes.append(outcome)
        if outcome in FAILURES:
            failures.append(f"{outcome}: {detail}\n  repro: {repro(op, params)}")
    assert not failures, "\n".join(failures)
    assert "ok" in outcomes and "clear_error" in outcomes  # the slice exercises both kinds of case


def backends(kernel):
    return ["reference"] + (["cpp"] if has_kernel(kernel) else [])


def test_opcheck_attention_layouts():
    """(B, S, H, D) memory seen as (B, H, S, D) (diffusers' processors), contiguous, and k/v
    broadcast over the batch, with and without a scale, on every CPU backend."""
    bshd = [torch.randn(2, s, 3, 40).transpose(1, 2) for s in (9, 77, 77)]
    layouts = [bshd, [t.contiguous() for t in bshd], [bshd[0], *[t[:1].expand(2, -1, -1, -1) for t in bshd[1:]]]]
    for backend in backends("attention") + ["sdpa"]:
        for q, k, v in layouts:
            torch.library.opcheck(torch.ops.pyext.attention.default, (q, k, v, 0.3, backend))


def test_opcheck_fp8_linear_layouts():
    """diffusers' activations: (B, S, C), (B, C) and a transposed (B, S, C) view."""
    w, s = fp8_quantize(torch.randn(24, 40))
    codes = w.view(torch.uint8)
    xs = [torch.randn(2, 7, 40), torch.randn(3, 40), torch.randn(2, 40, 7).transpose(1, 2)]
    for backend in backends("fp8_linear"):
        for x in xs:
            torch.library.opcheck(torch.ops.pyext.fp8_linear, (x.bfloat16(), codes, s, None, backend))


def test_opcheck_fp8_conv2d_layouts():
    """NCHW and channels-last activations; (out, in, kh, kw) and kernel-layout (channels-last) codes."""
    w, s = fp8_quantize(torch.randn(8, 6, 3, 3))
    codes = w.view(torch.uint8)
    x = torch.randn(2, 6, 7, 5, dtype=torch.bfloat16)
    conv = ["reference"] + (["cpp"] if "avx512_bf16" in cpu_capabilities() else [])
    for backend in conv:
        for xi in (x, x.contiguous(memory_format=torch.channels_last)):
            for wi in (codes, codes.contiguous(memory_format=torch.channels_last)):
                torch.library.opcheck(torch.ops.pyext.fp8_conv2d, (xi, wi, s, None, [1, 1], [1, 1], [1, 1], 1, backend))


def test_the_fuzz_catches_a_silent_wrong_answer(monkeypatch):
    """A reference backend that is off by 0.1% and drops NaN is reported (a case whose output it
    leaves unchanged, all zeros or inf, can pass)."""
    from pyext import dispatch

    reference = next(b for b in dispatch.ops()["fp8_upcast"].backends if b.name == "reference")
    honest = reference.run
    monkeypatch.setattr(reference, "run", lambda w, s, out: (honest(w, s, out), out.mul_(1.001).nan_to_num_(0.0)))
    outcomes = [run_case("fp8_upcast", draw_case("fp8_upcast", SEED, i))[0] for i in range(10)]
    assert outcomes.count("wrong") >= 6, outcomes
