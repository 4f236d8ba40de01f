"""pyext.ops.group_norm: the C++ kernel at every SIMD level against a float64 oracle (within twice
the error of plain PyTorch in the same dtype), a large mean over a small spread, determinism across
thread counts, layouts and strides, SiLU over the float range, special values, opcheck, bad
inputs, and the Triton kernels in Triton's interpreter."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pyext._ext import has_kernel
from pyext.dispatch import PyextError, select
from pyext.ops import group_norm
from tests.conftest import run_in_triton_interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cpp = pytest.mark.skipif(not has_kernel("group_norm"), reason="pyext._C without group_norm")
# Absolute error allowed on top of twice PyTorch's (where PyTorch happens to round exactly).
FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def broadcast(t, x):
    return t.reshape(*t.shape, *(1,) * (x.dim() - t.dim()))


def oracle(x, groups, weight=None, bias=None, shift=None, eps=1e-5, silu=False):
    """Two-pass GroupNorm (+ SiLU) in float64 of the same inputs."""
    h = x.double() + (0 if shift is None else broadcast(shift.double(), x))
    g = h.reshape(x.shape[0], groups, -1)
    mean = g.mean(-1, keepdim=True)
    y = ((g - mean) / ((g - mean).square().mean(-1, keepdim=True) + eps).sqrt()).reshape(x.shape)
    if weight is not None:
        y = y * broadcast(weight.double()[None], x) + broadcast(bias.double()[None], x)
    return y * torch.sigmoid(y) if silu else y


def plain_torch(x, groups, weight=None, bias=None, shift=None, eps=1e-5, silu=False):
    """What diffusers runs: the add, F.group_norm and F.silu in x's dtype."""
    h = x if shift is None else x + broadcast(shift, x)
    y = F.group_norm(h, groups, weight, bias, eps)
    return F.silu(y) if silu else y


def max_error(y, exact):
    return (y.double() - exact).abs().max().item()


def to_channels_last(x):
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


# (N, C, groups, spatial): one group, one channel per group and between; 0-D to 3-D spatial with
# odd sizes; the last spans several stats chunks and parallel tasks in both layouts.
CASES = [(1, 1, 1, (7, 9)), (2, 3, 3, (1, 1)), (3, 6, 3, ()), (3, 6, 2, (17, 23)), (2, 6, 6, (5,)),
         (1, 32, 8, (3, 5, 7)), (2, 64, 32, (7, 9)), (3, 96, 1, (17, 23)), (2, 96, 96, (3, 5, 7)),
         (1, 320, 32, (7, 9)), (2, 320, 32, (1, 1)), (1, 64, 16, (129,)), (2, 32, 4, (96, 97))]


def options(x):
    """(layout, weight/bias dtype or None, shift, silu) combinations for x."""
    layouts = ["contiguous"] + (["channels_last"] if x.dim() in (4, 5) else [])
    params = [None, x.dtype] + ([torch.float32] if x.dtype != torch.float32 else [])
    return [(lay, p, sh, si) for lay in layouts for p in params for sh in (False, True) for si in (False, True)]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpp_matches_float64_within_twice_torch(simd, case, dtype):
    n, c, groups, spatial = case
    x0 = (torch.randn(n, c, *spatial) * 3 + 1).to(dtype)
    for layout, params, with_shift, silu in options(x0):
        x = to_channels_last(x0) if layout == "channels_last" else x0
        weight = bias = shift = None
        if params is not None:
            weight, bias = (torch.randn(c) * 2).to(params), torch.randn(c).to(params)
        if with_shift:
            shift = torch.randn(n, c).to(dtype)
        args = (x, groups, weight, bias, shift, 1e-5, silu)
        y = group_norm(x, groups, weight, bias, 1e-5, "silu" if silu else None, shift, backend="cpp")
        exact = oracle(*args)
        err, torch_err = max_error(y, exact), max_error(plain_torch(*args), exact)
        where = (case, dtype, layout, params, with_shift, silu)
        assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride(), where
        assert err <= 2 * torch_err + FLOOR[dtype], (where, err, torch_err)
        if dtype == torch.float32:  # against the exact norm of x + shift as the kernel rounds it (in fp32)
            summed = oracle(x if shift is None else x + broadcast(shift, x), groups, weight, bias, None, 1e-5, silu)
            assert max_error(y, summed) <= 1e-5 * max(1.0, summed.abs().max().item()), (where, err)


@needs_cpp
@pytest.mark.parametrize("channels_last", [False, True])
def test_large_mean_small_spread(simd, channels_last):
    """x = 1000 + 0.01 * randn: E[x^2] - E[x]^2 in float32 cancels to noise; the kernel does not."""
    x = 1000 + 0.01 * torch.randn(2, 64, 24, 40)
    naive = (x.reshape(2, 32, -1).square().mean(-1) - x.reshape(2, 32, -1).mean(-1).square()).clamp_min(0)
    exact_var = x.double().reshape(2, 32, -1).var(-1, unbiased=False)
    assert ((naive.double() - exact_var).abs() / exact_var).max() > 0.5  # the naive formula fails here
    if channels_last:
        x = to_channels_last(x)
    assert max_error(group_norm(x, 32, backend="cpp"), oracle(x, 32)) < 2e-5
    # x + shift is rounded to fp32 once (the reference's semantics); exact from there on
    weight, bias, shift = torch.randn(64), torch.randn(64), torch.randn(2, 64)
    y = group_norm(x, 32, weight, bias, shift=shift, backend="cpp")
    assert max_error(y, oracle(x + shift[:, :, None, None], 32, weight, bias)) < 2e-5
    # a shift that cancels the large mean: x + shift is exact in fp32 there (Sterbenz)
    cancel = -1000 + 0.001 * torch.randn(2, 64)
    y = group_norm(x, 32, shift=cancel, backend="cpp")
    assert max_error(y, oracle(x, 32, shift=cancel)) < 2e-5


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_threads_do_not_change_the_result(dtype, channels_last):
    x = torch.randn(2, 64, 96, 80).to(dtype)
    if channels_last:
        x = to_channels_last(x)
    args = (x, 32, torch.randn(64).to(dtype), torch.randn(64).to(dtype), 1e-5, "silu", torch.randn(2, 64).to(dtype))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = group_norm(*args, backend="cpp")
        torch.set_num_threads(2)
        two = group_norm(*args, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       two.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_layouts_and_strides(backend):
    base = torch.randn(2, 8, 6, 10)
    volume = torch.randn(2, 8, 3, 4, 5)
    for x, layout in ((base, torch.contiguous_format), (to_channels_last(base), torch.channels_last),
                      (to_channels_last(volume), torch.channels_last_3d),
                      (base.transpose(2, 3), torch.contiguous_format),  # dense, neither layout
                      (base[:, :, ::2], torch.contiguous_format), (base.permute(0, 1, 3, 2)[..., 1:], torch.contiguous_format)):
        y = group_norm(x, 4, activation="silu", backend=backend)
        assert y.is_contiguous(memory_format=layout), (x.stride(), y.stride())
        assert max_error(y, oracle(x, 4, silu=True)) < 1e-5
    # the op itself keeps empty_like(x)'s strides for any x, as its fake kernel says
    x = base.transpose(2, 3)
    y = torch.ops.pyext.group_norm(x, 4, None, None, None, 1e-5, False, backend)
    assert y.stride() == torch.empty_like(x).stride() and max_error(y, oracle(x, 4)) < 1e-5
    empty = group_norm(torch.randn(0, 8, 3, 3), 4, backend=backend)
    assert empty.shape == (0, 8, 3, 3)


@needs_cpp
@pytest.mark.parametrize("channels_last", [False, True])
def test_silu_matches_torch_over_the_float_range(simd, channels_last):
    """The kernel's SiLU against torch's on the very same pre-activations: ramps scaled up to where
    e^-x overflows (x < -88.7: -0) and past, and small and subnormal results; in both layouts, which
    the AVX-512 unit computes with different code (9 channels: a partial vector per pixel)."""
    ramp = torch.linspace(-1, 1, 4001).expand(1, 9, -1).contiguous()
    if channels_last:
        ramp = ramp[..., None].contiguous(memory_format=torch.channels_last)
    weight = torch.tensor([1.0, 30, 60, 62, 65, 75, 1e3, 1e30, -80])
    pre = group_norm(ramp, 9, weight, torch.zeros(9), backend="cpp")
    assert pre.min() < -1e29 and ((pre < -88) & (pre > -105)).sum() > 50
    ours, want = group_norm(ramp, 9, weight, torch.zeros(9), activation="silu", backend="cpp"), F.silu(pre)
    torch.testing.assert_close(ours, want, rtol=4 * 2 ** -23, atol=1e-44)


@needs_cpp
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
def test_inf_and_nan_give_nan_in_their_group_like_torch(simd, channels_last, value):
    x = torch.randn(2, 8, 5, 6)
    x[1, 2, 3, 4] = value  # channel 2: group 1 of sample 1
    if channels_last:
        x = to_channels_last(x)
    for backend in ("cpp", "reference"):
        y = group_norm(x, 4, torch.randn(8), torch.randn(8), activation="silu", backend=backend)
        assert y[1, 2:4].isnan().all(), backend
        expected = plain_torch(x, 4, silu=True)
        assert expected[1, 2:4].isnan().all()  # torch does the same
        finite = torch.ones_like(y, dtype=torch.bool)
        finite[1, 2:4] = False
        assert y[finite].isfinite().all(), backend


# ----------------------------------------------------------------------------- dispatch, opcheck, errors

@needs_cpp
def test_automatic_choice_on_cpu_is_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    x = torch.randn(1, 8, 4, 4)
    assert select("group_norm", (x, 4, None, None, None, 1e-5, True)).name == "cpp"
    assert torch.allclose(group_norm(x, 4, activation="silu"), plain_torch(x, 4, silu=True), atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_opcheck(backend, channels_last):
    x = torch.randn(2, 6, 5, 7)
    if channels_last:
        x = to_channels_last(x)
    op = torch.ops.pyext.group_norm.default
    torch.library.opcheck(op, (x, 3, None, None, None, 1e-5, False, backend))
    torch.library.opcheck(op, (x, 3, torch.randn(6), torch.randn(6), torch.randn(2, 6), 1e-6, True, backend))
    torch.library.opcheck(op, (x.half(), 2, torch.randn(6), None, None, 1e-5, True, backend))


def _raises(match, x, *args, **kwargs):
    with pytest.raises(PyextError, match=match) as info:
        group_norm(x, *args, **kwargs)
    assert str(info.value).startswith("pyext.group_norm: ")


def test_bad_inputs_are_errors_naming_the_op():
    x = torch.randn(2, 6, 4, 4)
    _raises("does not divide the 6 channels.*multiple of num_groups", x, 4)
    _raises("num_groups must be a positive int", x, 0)
    _raises("num_groups must be a positive int", x, 2.0)
    _raises("float32/float16/bfloat16", x.int(), 2)
    _raises("float32/float16/bfloat16", x.double(), 2)
    _raises("float32/float16/bfloat16", "x", 2)
    _raises("at least 2 dims", torch.randn(6), 2)
    _raises(r"weight must be a \(6,\) tensor of x's dtype \(float16\) or float32", x.half(), 2,
            torch.ones(6, dtype=torch.bfloat16))
    _raises(r"weight must be a \(6,\) tensor", x, 2, torch.ones(3))
    _raises(r"bias must be a \(6,\) tensor", x, 2, None, torch.ones(6, 1))
    _raises(r"bias must be a \(6,\) tensor", x, 2, None, torch.ones(6, device="meta"))
    _raises(r"shift must be an \(N, C\) = \(2, 6\) tensor of x's dtype \(float32\)", x, 2, shift=torch.ones(2, 6, 1, 1))
    _raises(r"shift must be an \(N, C\)", x, 2, shift=torch.ones(2, 6).half())
    _raises(r"shift must be an \(N, C\)", x, 2, shift=torch.ones(2, 6, device="meta"))
    _raises("activation 'gelu' is not supported; use None or 'silu'", x, 2, activation="gelu")
    _raises("eps must be a finite number > 0", x, 2, eps=0.0)
    _raises("eps must be a finite number > 0", x, 2, eps=-1e-5)
    _raises("eps must be a finite number > 0", x, 2, eps=float("nan"))
    _raises("unknown backend 'fast'", x, 2, backend="fast")


def test_forced_triton_on_cpu_outside_the_interpreter_is_an_error():
    x = torch.randn(1, 4, 3, 3)
    with pytest.raises(PyextError, match="pyext.group_norm: backend 'triton' cannot run this input"):
        group_norm(x, 2, backend="triton")


# ----------------------------------------------------------------------------- Triton, in its interpreter

TRITON_SCRIPT = textwrap.dedent("""
    import json, torch
    from pyext.dispatch import select
    from pyext.ops import group_norm
    from tests.test_group_norm import oracle, plain_torch, to_channels_last
    torch.manual_seed(0)
    cases = []
    for (n, c, groups, spatial, cl, affine, with_shift, silu) in [
            ((2, 6, 3, (5, 7), True, True, True, True)), ((1, 32, 8, (9, 11), False, False, False, True)),
            ((3, 4, 2, (3, 5, 7), True, True, False, False)), ((2, 64, 32, (17, 23), False, True, True, True)),
            ((2, 40, 40, (13,), False, False, True, False)), ((1, 8, 4, (40, 37), True, False, True, True))]:
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(n, c, *spatial) * 3 + 1).to(dtype)
            x = to_channels_last(x) if cl else x
            params = torch.float32 if cl else dtype  # float32 weight/bias with float16 x, too
            weight, bias = (torch.randn(c).to(params), torch.randn(c).to(params)) if affine else (None, None)
            shift = torch.randn(n, c).to(dtype) if with_shift else None
            args = (x, groups, weight, bias, shift, 1e-5, silu)
            y = group_norm(x, groups, weight, bias, 1e-5, "silu" if silu else None, shift, backend="triton")
            exact = oracle(*args)
            cases.append(dict(case=[n, c, groups, list(spatial), cl, str(dtype)], layout_ok=y.stride() == x.stride(),
                              err=(y.double() - exact).abs().max().item(),
                              torch_err=(plain_torch(*args).double() - exact).abs().max().item()))
    x = 1000 + 0.01 * torch.randn(1, 16, 20, 30)
    hard = [(group_norm(xx, 8, backend="triton").double() - oracle(xx, 8)).abs().max().item()
            for xx in (x, to_channels_last(x))]
    picked = select("group_norm", (x, 8, None, None, None, 1e-5, False)).name
    try:
        group_norm(x.bfloat16(), 8, backend="triton")
        bf16 = "accepted"
    except ValueError as e:
        bf16 = str(e)
    print(json.dumps(dict(cases=cases, hard=hard, picked=picked, bf16=bf16)))
""")


@pytest.mark.slow
def test_triton_group_norm_in_interpreter():
    result = run_in_triton_interpreter(TRITON_SCRIPT, timeout=900)
    assert len(result["cases"]) == 12
    floor = {"torch.float32": FLOOR[torch.float32], "torch.float16": FLOOR[torch.float16]}
    for case in result["cases"]:
        assert case["layout_ok"], case
        assert case["err"] <= 2 * case["torch_err"] + floor[case["case"][-1]], case
    assert max(result["hard"]) < 2e-5, result["hard"]
    assert result["picked"] != "triton"
    assert "rounds float32 to bfloat16 toward zero" in result["bf16"]
