"""pyext.ops.geglu and the fuse_geglu technique: the C++ kernel at every SIMD level against a float64
oracle (within twice the error of plain PyTorch in the same dtype), its erf over the float range,
special values, strides, threads, opcheck, bad inputs, the Triton kernel in Triton's interpreter;
then diffusers' GEGLU fused: the same outputs, the plain path wherever fusing could be seen, the
probe, report, undo and a pipeline's images."""
import copy
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

import pyext
from pyext._ext import has_kernel
from pyext.dispatch import PyextError, select
from pyext.nn.geglu import fuse_geglu, fused_geglu, is_fused, unfuse_geglu
from pyext.offline import build_pipeline
from pyext.ops import geglu
from tests.conftest import run_in_triton_interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cpp = pytest.mark.skipif(not has_kernel("geglu"), reason="pyext._C without geglu")
# Absolute error allowed on top of twice PyTorch's, relative to the output's largest magnitude.
FLOOR = {torch.float32: 1e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def oracle(x):
    a, g = x.double().chunk(2, dim=-1)
    return a * 0.5 * g * (1 + torch.special.erf(g / math.sqrt(2)))


def plain_torch(x):
    """What diffusers' GEGLU runs after its projection, in x's dtype."""
    a, g = x.chunk(2, dim=-1)
    return a * F.gelu(g)


def max_error(y, exact):
    return (y.double() - exact).abs().max().item() if exact.numel() else 0.0


# (rows..., 2 * D): one value, odd D below and above a SIMD register, a row wider than an item
# of the parallel loop (4096), several dims, no rows.
SHAPES = [(1, 2), (3, 6), (5, 2 * 17), (2, 3, 2 * 33), (7, 2 * 203), (2, 2 * 4100), (0, 8), (4, 0)]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpp_matches_float64_within_twice_torch(simd, shape, dtype):
    x = (torch.randn(shape) * 3).to(dtype)
    y, exact = geglu(x, backend="cpp"), oracle(x)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2) and y.is_contiguous()
    scale = max(1.0, exact.abs().max().item()) if exact.numel() else 1.0
    assert max_error(y, exact) <= 2 * max_error(plain_torch(x), exact) + FLOOR[dtype] * scale


@needs_cpp
def test_erf_over_the_float_range(simd):
    """gelu(g) (a = 1) in float32 for gates from 0 to beyond where erf rounds to 1, each sign:
    within torch's own error of the exact value."""
    g = torch.cat([torch.linspace(-12, 12, 200_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38])])
    x = torch.cat([torch.ones_like(g), g]).reshape(2, -1).t().reshape(-1, 2)  # rows (a, g)
    y, exact = geglu(x, backend="cpp"), oracle(x)
    # relative to max(1, |g|): torch's fp32 gelu rounds g / 2 * (1 + erf) at g's magnitude
    rel = lambda out: ((out.double() - exact).abs() / g.double().abs().clamp_min(1)[:, None]).max().item()  # noqa: E731
    assert rel(y) <= max(2 * rel(F.gelu(g)[:, None]), 2e-7)


@needs_cpp
def test_inf_and_nan_give_what_torch_gives(simd):
    vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 2.0, -2.0])
    a, g = torch.meshgrid(vals, vals, indexing="ij")
    for dtype in DTYPES:
        x = torch.stack([a.reshape(-1), g.reshape(-1)], dim=1).to(dtype)
        y, plain = geglu(x, backend="cpp"), plain_torch(x)
        assert torch.equal(y.isnan(), plain.isnan()), dtype
        assert torch.equal(y.isinf(), plain.isinf()) and torch.equal(y[y.isinf()], plain[plain.isinf()]), dtype


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_strided_inputs(backend):
    base = torch.randn(4, 6, 40)
    for x in (base[:, ::2], base.transpose(0, 1), base[..., 2:], base[::2, :, :18]):
        assert torch.allclose(geglu(x, backend=backend), plain_torch(x), atol=1e-6), x.stride()


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_do_not_change_the_result(dtype):
    x = torch.randn(64, 2 * 5000).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = geglu(x, backend="cpp")
        torch.set_num_threads(2)
        two = geglu(x, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_cpp
def test_automatic_choice_on_cpu_is_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, 8)
    assert select("geglu", (x,)).name == "cpp"


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_opcheck(backend):
    op = torch.ops.pyext.geglu.default
    for x in (torch.randn(2, 5, 14), torch.randn(3, 8).half(), torch.randn(7, 2 * 33).bfloat16(), torch.randn(0, 4)):
        torch.library.opcheck(op, (x, backend))


def _raises(match, x, **kwargs):
    with pytest.raises(PyextError, match=match) as info:
        geglu(x, **kwargs)
    assert str(info.value).startswith("pyext.geglu: ")


def test_bad_inputs_are_errors_naming_the_op():
    _raises(r"last dim must be even \(values and gates, 2 \* D\), got shape \(3, 5\)", torch.randn(3, 5))
    _raises("last dim must be even", torch.tensor(1.0))
    _raises("float32/float16/bfloat16", torch.ones(3, 4, dtype=torch.int32))
    _raises("float32/float16/bfloat16", torch.randn(3, 4).double())
    _raises("float32/float16/bfloat16", "x")
    _raises("unknown backend 'fast'", torch.randn(3, 4), backend="fast")
    with pytest.raises(PyextError, match="pyext.geglu: backend 'triton' cannot run this input"):
        geglu(torch.randn(3, 4), backend="triton")


TRITON_SCRIPT = textwrap.dedent("""
    import json, torch
    from pyext.dispatch import select
    from pyext.ops import geglu
    from tests.test_geglu import oracle, plain_torch
    torch.manual_seed(0)
    cases = []
    for shape in [(1, 2), (3, 2 * 17), (2, 3, 2 * 130), (5, 2 * 300), (0, 8)]:
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(shape) * 3).to(dtype)
            y, exact = geglu(x, backend="triton"), oracle(x)
            err = lambda t: (t.double() - exact).abs().max().item() if exact.numel() else 0.0
            cases.append(dict(case=[list(shape), str(dtype)], shape_ok=list(y.shape) == list(exact.shape),
                              err=err(y), torch_err=err(plain_torch(x)), scale=exact.abs().max().item() if exact.numel() else 1))
    picked = select("geglu", (torch.randn(3, 8),)).name
    try:
        geglu(torch.randn(3, 8).bfloat16(), backend="triton")
        bf16 = "accepted"
    except ValueError as e:
        bf16 = str(e)
    print(json.dumps(dict(cases=cases, picked=picked, bf16=bf16)))
""")


@pytest.mark.slow
def test_triton_geglu_in_interpreter():
    result = run_in_triton_interpreter(TRITON_SCRIPT, timeout=600)
    assert len(result["cases"]) == 10
    for case in result["cases"]:
        dtype = getattr(torch, case["case"][-1].removeprefix("torch."))
        assert case["shape_ok"], case
        assert case["err"] <= 2 * case["torch_err"] + FLOOR[dtype] * max(1.0, case["scale"]), case
    assert result["picked"] != "triton"
    assert "rounds float32 to bfloat16 toward zero" in result["bf16"]


# ----------------------------------------------------------------------------- diffusers' GEGLU, fused

def make_geglu(dim_in=24, dim_out=20, dtype=torch.float32):
    from diffusers.models.activations import GEGLU

    torch.manual_seed(0)
    return GEGLU(dim_in, dim_out).to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_geglu_gives_the_plain_output_closer_to_float64(dtype):
    module, x = make_geglu(dtype=dtype), torch.randn(3, 5, 24).to(dtype)
    with torch.no_grad():
        plain = module(x)
        projected = module.proj(x)
        assert fuse_geglu(module).swapped == [""] and is_fused(module)
        fused = module(x)
    exact = oracle(projected)
    assert fused.dtype == plain.dtype and fused.shape == plain.shape
    assert max_error(fused, exact) <= max_error(plain, exact) + FLOOR[dtype] * exact.abs().max().item()
    assert list(module.state_dict()) == ["proj.weight", "proj.bias"]


def test_the_plain_path_wherever_fusing_could_be_seen(monkeypatch):
    module, x = make_geglu(), torch.randn(2, 24)
    fuse_geglu(module)
    calls = []
    monkeypatch.setattr(pyext.nn.geglu, "geglu", lambda h: calls.append(h) or plain_torch(h))
    with torch.no_grad():
        module(x)
    assert len(calls) == 1
    # a gelu replaced on the instance is called, as GEGLU calls its own
    seen = []
    module.gelu = lambda gate: seen.append(gate) or F.gelu(gate)
    with torch.no_grad():
        module(x)
    assert len(seen) == 1 and len(calls) == 1
    del module.gelu

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watch():
        module(x)
    assert F.gelu in seen and len(calls) == 1
    # autograd: the plain path, and the gradients reach the projection
    module(x).square().sum().backward()
    assert module.proj.weight.grad is not None and len(calls) == 1
    # GEGLU's deprecated `scale` goes to its own forward
    with torch.no_grad(), pytest.warns(FutureWarning):
        module(x, scale=1.0)
    assert len(calls) == 1


def test_probe_leaves_plain_what_it_cannot_fuse_and_undo():
    module = make_geglu()
    module.register_forward_hook(lambda *a: None)
    report = fuse_geglu(module)
    assert not report.swapped and "hooks" in report.skipped[""] and not is_fused(module)
    broken = make_geglu()
    broken.proj = torch.nn.Linear(24, 40, bias=False)  # a projection that fits, and one that does not:
    assert fuse_geglu(broken).swapped == [""]
    odd = make_geglu()
    odd.proj = torch.nn.Linear(24, 39)
    report = fuse_geglu(odd)
    assert not report.swapped and "the probe could not run" in report.skipped[""] and not is_fused(odd)
    assert unfuse_geglu(broken) == [""] and not is_fused(broken)


def test_a_deep_copy_stays_fused():
    module = make_geglu()
    fuse_geglu(module)
    twin = copy.deepcopy(module)
    x = torch.randn(2, 24)
    with torch.no_grad():
        assert type(twin) is fused_geglu() and torch.equal(twin(x), module(x))


def test_fused_geglu_compiles(monkeypatch):
    module, x = make_geglu(), torch.randn(2, 7, 24)
    fuse_geglu(module)
    with torch.no_grad():
        expected = module(x)
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        assert torch.allclose(compiled(x), expected, atol=1e-6)


def generate(pipe, **kwargs):
    return pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).images


def test_optimize_fuses_the_denoisers_geglu_reports_and_undoes():
    pipe = build_pipeline("sd15", "tiny")
    plain = generate(pipe)
    n = sum(type(m).__name__ == "GEGLU" for m in pipe.unet.modules())
    assert n
    pyext.optimize(pipe, dtype=torch.float32, prepack="off", fuse_norms="off", upsample_phases="off")
    entry = {(e.component, e.technique): e for e in pyext.report(pipe).entries}[("unet", "fuse_geglu")]
    assert entry.status == "applied" and f"{n} GEGLU" in entry.detail
    assert sum(is_fused(m) for m in pipe.unet.modules()) == n
    assert abs(generate(pipe) - plain).max() < 1e-4
    pyext.restore(pipe)
    assert not any(is_fused(m) for m in pipe.unet.modules())


def test_fuse_geglu_leaves_a_compiled_denoiser_to_the_compiler():
    pipe = build_pipeline("sd15", "tiny")
    steps = {(s.component, s.technique): s for s in pyext.plan(pipe, compile="compile").steps}
    assert steps["unet", "fuse_geglu"].action == "skip" and "compiler fuses" in steps["unet", "fuse_geglu"].why
    steps = {(s.component, s.technique): s for s in pyext.plan(pipe, compile="trace").steps}
    assert steps["unet", "fuse_geglu"].action == "apply"


def test_fuse_geglu_option():
    pipe = build_pipeline("sd15", "tiny")
    pyext.optimize(pipe, dtype=torch.float32, fuse_geglu="off")
    entry = {(e.component, e.technique): e for e in pyext.report(pipe).entries}[("unet", "fuse_geglu")]
    assert entry.status == "skipped" and "fuse_geglu='off'" in entry.detail
    with pytest.raises(PyextError, match="fuse_geglu"):
        pyext.optimize(build_pipeline("sd15", "tiny"), fuse_geglu="yes")
