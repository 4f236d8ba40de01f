
"""The Triton fp8 linear kernel, run by Triton's interpreter on CPU in a subprocess
(TRITON_INTERPRET must be set before triton is imported). fp16/fp32 activations:
the interpreter's bf16 dot is broken, the bf16 path is for GPUs."""
import textwrap

import pytest


pytestmark = pytest.mark.slow  # make test runs it; make test-fast leaves it out
from tests.conftest import run_in_triton_interpreter

SCRIPT = textwrap.dedent("""
    import json, torch
    from pyext.ops import fp8_linear, fp8_quantize
    from pyext.reference.fp8 import fp8_upcast_reference
    import torch.nn.functional as F
    torch.manual_seed(0)
    out = []
    for (m, n, k) in [(1, 7, 16), (5, 33, 40), (70, 48, 96), (3, 130, 72)]:
        for per_channel in (True, False):
            for bias in (False, True):
                x = torch.randn(m, k, dtype=torch.float16)
                w, s = fp8_quantize(torch.randn(n, k) / k ** 0.5, per_channel)
                b = torch.randn(n, dtype=torch.float16) if bias else None
                y = fp8_linear(x, w, s, b, backend="triton")
                exact = F.linear(x.double(), fp8_upcast_reference(w, s, torch.float32).double(),
                                 None if b is None else b.double())
                ref16 = F.linear(x.float(), fp8_upcast_reference(w, s, torch.float16).float(),
                                 None if b is None else b.float()).half()
                err = lambda a: ((a.double() - exact).norm() / exact.norm()).item()
                out.append(dict(shape=[m, n, k], err=err(y), torch_err=err(ref16), shape_ok=list(y.shape) == [m, n]))
    # Scales whose products leave fp16's range or underflow it: the kernel scales each decoded
    # weight before rounding it, as the upcast does, so it agrees with the reference there too.
    from pyext.kernels.fp8_linear import fp8_linear_triton
    from pyext.reference.fp8 import fp8_linear_reference
    special = []
    for scale in (200.0, 3e-7, 1e-30):
        x = torch.randn(4, 32, dtype=torch.float16)
        w, _ = fp8_quantize(torch.randn(6, 32))
        s = torch.full((6,), scale)
        codes = w.view(torch.uint8)
        y, ref = fp8_linear_triton(x, codes, s, None), fp8_linear_reference(x, codes, s)
        same_inf = bool(((y.isinf() == ref.isinf()) & (y.isnan() == ref.isnan())).all())
        finite = ref.isfinite()
        diff, size = (y.float() - ref.float())[finite].abs(), ref.float()[finite].abs()
        err = (diff.max() / size.max().clamp_min(1e-30)).item() if finite.any() else 0.0
        special.append(dict(scale=scale, same_inf=same_inf, err=err))
    x = torch.randn(2, 3, 40, dtype=torch.float32)
    w, s = fp8_quantize(torch.randn(8, 40))
    try:
        fp8_linear(x, w, s, backend="triton")
        f32 = "accepted"
    except ValueError as e:
        f32 = str(e)
    print(json.dumps(dict(cases=out, f32=f32, special=special)))
""")


def test_triton_fp8_linear_in_interpreter():
    result = run_in_triton_interpreter(SCRIPT, timeout=600)
    for case in result["cases"]:
        assert case["shape_ok"], case
        assert case["err"] <= 2 * case["torch_err"] + 1e-3, case
    assert "float32 activations are not supported by the Triton kernel" in result["f32"]
    for case in result["special"]:
        assert case["same_inf"] and case["err"] <= 4e-3, case
