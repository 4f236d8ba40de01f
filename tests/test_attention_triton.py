"""The Triton flash-attention kernel, run by Triton's interpreter on CPU in a subprocess
(TRITON_INTERPRET must be set before triton is imported, and other test modules may
already have imported it here). fp16/fp32 only: the interpreter's bf16 dot is broken.
Tolerance as in test_attention_op.py: <= 2x the error of same-dtype PyTorch math + eps."""
import textwrap

import pytest

from tests.conftest import run_in_triton_interpreter

pytestmark = pytest.mark.slow  # make test runs it; make test-fast leaves it out

SCRIPT = textwrap.dedent("""
    import json, torch
    from pyext.dispatch import select
    from pyext.ops import attention
    torch.manual_seed(0)

    def oracle(q, k, v, scale):
        return torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1) @ v.double()

    cases = []
    # SD1.5 / SDXL / Flux head dims exactly, odd ones through the masked last part.
    for d in (40, 64, 80, 128, 160, 8, 33, 72, 100):
        for (sq, skv) in ((1, 77), (97, 77), (50, 33)):
            for dtype in (torch.float16, torch.float32):
                q, k, v = (torch.randn(1, 2, s, d).to(dtype) for s in (sq, skv, skv))
                if d == 80 and sq == 97:  # strided (batch, seq, heads, dim) views, as diffusers passes them
                    q = torch.randn(1, sq, 2, d).to(dtype).transpose(1, 2)
                scale = d ** -0.5 if d != 33 else 0.3
                out = attention(q, k, v, scale=None if d != 33 else 0.3, backend="triton")
                exact = oracle(q, k, v, scale)
                plain = torch.softmax((q @ k.transpose(-1, -2)) * scale, -1) @ v
                cases.append(dict(d=d, sq=sq, skv=skv, dtype=str(dtype), shape_ok=out.shape == q.shape,
                                  dtype_ok=out.dtype == dtype,
                                  err=(out.double() - exact).abs().max().item(),
                                  torch_err=(plain.double() - exact).abs().max().item()))
    q = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    picked = select("attention", (q, q, q, None, None, False)).name  # the interpreter is never chosen automatically
    try:
        attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), backend="triton")
        bf16 = "accepted"
    except ValueError as e:
        bf16 = str(e)
    # Every key of the first blocks scores -inf (fp32 overflow), later ones are finite: a finite answer.
    q = torch.full((1, 1, 2, 4), 1e20)
    k = torch.rand(1, 1, 300, 4) + 0.1
    k[0, 0, :256] *= -1e20
    v = torch.randn(1, 1, 300, 4)
    out, ref = attention(q, k, v, backend="triton"), attention(q, k, v, backend="reference")
    neg_inf = dict(finite=bool(torch.isfinite(out).all()), err=(out - ref).abs().max().item())
    print(json.dumps(dict(cases=cases, picked=picked, bf16=bf16, neg_inf=neg_inf)))
""")

EPS = {"torch.float16": 1e-4, "torch.float32": 1e-6}


def test_triton_attention_in_interpreter():
    result = run_in_triton_interpreter(SCRIPT, timeout=900)
    assert len(result["cases"]) == 9 * 3 * 2
    for case in result["cases"]:
        assert case["shape_ok"] and case["dtype_ok"], case
        assert case["err"] <= 2 * case["torch_err"] + EPS[case["dtype"]], case
    assert result["picked"] != "triton"
    assert "bf16 tl.dot wrongly" in result["bf16"]
    assert result["neg_inf"]["finite"] and result["neg_inf"]["err"] < 1e-5, result["neg_inf"]


def test_head_dim_parts_cover_exactly():
    pytest.importorskip("triton")
    from pyext.kernels.attention import head_dim_parts, waste

    assert head_dim_parts(40) == (32, 16, 0)  # 32 + 8, the 8 masked inside a 16-wide part
    assert head_dim_parts(80) == (64, 16, 0)
    assert head_dim_parts(160) == (64, 64, 32) and head_dim_parts(256) == (128, 128, 0)
    assert head_dim_parts(64) == (64, 0, 0) and head_dim_parts(128) == (128, 0, 0)
    for d in range(1, 257):
        parts = head_dim_parts(d)
        used = [p for p in parts if p]
        assert all(p >= 16 and p & (p - 1) == 0 for p in used), (d, parts)
        assert sum(used) >= d and sum(used[:-1]) < d, (d, parts)  # only the last part may stick out
    assert waste(40) == pytest.approx(8 / 48) and waste(128) == 0
    assert head_dim_parts(0) is None and head_dim_parts(257) is None


def test_launch_configs_are_judged_against_a_float64_slice_reference():
    """What measured dispatch checks each Triton launch config against: right outputs pass, NaN
    rows and fully masked rows included; a wrong output does not."""
    import torch

    from pyext.kernels.attention import _slice_problem
    from pyext.reference.attention import attention_reference, mask_as_bias

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(2, 4, 300, 40, dtype=dtype) for _ in range(3))
        q[0, 0, 3, 0] = float("nan")
        keep = torch.rand(2, 1, 1, 300) < 0.5
        keep[0] = False  # the first sample: no key left
        out = attention_reference(q, k, v, attn_mask=keep)
        bias = mask_as_bias(keep).float()
        assert _slice_problem(out, q, k, v, 40 ** -0.5, bias) is None
        assert _slice_problem(attention_reference(q, k, v), q, k, v, 40 ** -0.5, None) is None
        assert "max error" in _slice_problem(out + 0.1, q, k, v, 40 ** -0.5, bias)
