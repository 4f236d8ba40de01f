"""No host reads of tensor values on the GPU paths: a read (`item`, `bool`, `tolist`, `float`,
`int`) of a CUDA tensor waits for the GPU and breaks CUDA-graph capture.

Every backend that runs on CUDA runs here with those reads trapped: the Triton ones on CPU
tensors in Triton's interpreter, the PyTorch ones on CPU tensors. So do the routing hooks and
dispatch of an optimized pipeline's denoiser step. Reads that run for CPU inputs only (the
backends' value guards) are left out by forcing the backend. On a GPU, an optimized pipeline's
step runs with torch's sync debug mode set to raise.
"""
import contextlib
import textwrap

import pytest
import torch

import pyext
from pyext import dispatch
from pyext.offline import build_pipeline
from tests.conftest import run_in_triton_interpreter

READS = ("item", "__bool__", "tolist", "__float__", "__int__")


@contextlib.contextmanager
def host_reads_trapped():
    """Every tensor value read raises inside the block (Python-level reads: what our code can do)."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def trap(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name} on {self.device} {tuple(self.shape)}")
        return read

    for name in READS:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def cuda_backends():
    for name, op in dispatch.ops().items():
        if name.startswith("_test"):
            continue
        for b in op.backends:
            if "cuda" in b.devices and b.name != "triton" and "cpu" in b.devices:
                yield pytest.param(name, b.name, id=f"{name}-{b.name}")


@pytest.fixture
def no_value_guards(monkeypatch):
    """Dispatch as on a GPU, where it asks no guard about values; its choices made so are
    forgotten before and after, so no CPU call elsewhere keeps a choice without its guard."""
    monkeypatch.setattr(dispatch, "asks_guard", lambda backend, args: False)
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.mark.parametrize("op_name,backend", list(cuda_backends()))
def test_backends_that_run_on_cuda_read_no_values(op_name, backend, no_value_guards):
    """The PyTorch backends that also serve CUDA (reference, sdpa), through the op's validation
    and dispatch, on each of their declared cases; value guards left out, as dispatch asks them
    for CPU inputs only."""
    op = dispatch.ops()[op_name]
    chosen = next(b for b in op.backends if b.name == backend)
    for spec in chosen.test_shapes:
        args = op.example(spec, chosen.dtypes[0], "cpu")
        dispatch.select(op_name, args, backend)  # a first call: the choice is then cached, as after warm-up
        with host_reads_trapped():
            dispatch.select(op_name, args, backend).run(*args)


TRITON_SCRIPT = textwrap.dedent("""
    import json, torch
    from pyext import dispatch
    from pyext.kernels import interpreter_advisory
    from tests.test_host_reads import host_reads_trapped
    dispatch.asks_guard = lambda backend, args: False  # as on a GPU: value guards are for CPU inputs only
    problems, cases = [], 0
    for name, op in dispatch.ops().items():
        for b in op.backends:
            if b.advisory is not interpreter_advisory:  # the Triton backends
                continue
            for spec in b.test_shapes:
                dtype = torch.float16 if torch.float16 in b.dtypes else b.dtypes[0]
                args = op.example(spec, dtype, "cpu")
                dispatch.select(name, args, b.name)
                cases += 1
                try:
                    with host_reads_trapped():
                        dispatch.select(name, args, b.name).run(*args)
                except AssertionError as e:
                    problems.append(f"{name} {spec}: {e}")
    print(json.dumps(dict(cases=cases, problems=problems)))
""")


@pytest.mark.slow
def test_triton_backends_read_no_values():
    result = run_in_triton_interpreter(TRITON_SCRIPT)
    assert result["cases"] >= 6 and result["problems"] == []


def test_trap_catches_a_read():
    with pytest.raises(AssertionError, match="host read: Tensor.__bool__"):
        with host_reads_trapped():
            bool(torch.ones(1) > 0)


@pytest.mark.parametrize("arch,gemm", [("sd15", "weight_only"), ("flux", "weight_only"), ("flux", "dynamic")])
def test_an_optimized_denoiser_step_reads_no_values(arch, gemm, monkeypatch, tmp_path, no_value_guards):
    """The routing hooks, the fp8 layers (in bf16 for the dynamic GEMM) and dispatch's cached path
    in one denoiser forward (the attention backend forced, and value guards left out: the CPU
    backends' guards are CPU-only by design)."""
    import pyext.nn.fp8 as fp8_module

    monkeypatch.setattr(fp8_module, "MIN_NUMEL", 0)
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    pipe = pyext.optimize(build_pipeline(arch, "tiny"), dtype=torch.bfloat16 if gemm == "dynamic" else "keep",
                          fp8="denoiser", fp8_gemm=gemm, attention="reference", prepack="off", fuse_norms="off")
    fp8_layers = [m for m in pipe.components[("unet" if arch == "sd15" else "transformer")].modules()
                  if isinstance(m, pyext.FP8Linear)]
    assert fp8_layers and all(m.gemm == gemm for m in fp8_layers)
    calls = []
    denoiser = pipe.unet if arch == "sd15" else pipe.transformer
    denoiser.register_forward_hook(lambda m, a, kw, out: calls.append((a, kw)), with_kwargs=True)
    denoiser.register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
    pyext.offline.run_example(pipe, arch, steps=1)
    args, kwargs = calls[0]
    with torch.no_grad():
        denoiser(*args, **kwargs)  # warm: every signature chosen once
        with host_reads_trapped():
            denoiser(*args, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["sd15", "flux"])
def test_an_optimized_step_on_a_gpu_waits_for_nothing_on_the_host(arch):
    """One eager denoiser step of an optimized pipeline (every kernel and routing hook pyext puts
    in it) with every host sync an error: torch's sync debug mode sees the reads of tensor values
    in C++ too. Eager: a replayed graph makes no host call at all (test_graphs checks that)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pipe = pyext.optimize(build_pipeline(arch, "tiny", dtype=torch.bfloat16, device="cuda"), compile="off")
    pyext.offline.run_example(pipe, arch, steps=1)  # warm: dispatch chooses (it may time backends) once
    denoiser = pipe.unet if arch == "sd15" else pipe.transformer
    calls = []
    handle = denoiser.register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
    pyext.offline.run_example(pipe, arch, steps=1)
    handle.remove()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            denoiser(*calls[0][0], **calls[0][1])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
def test_sdpa_kernel_backends_read_no_values(backend):
    """SDPA's CUDA kernels, each a backend of its own, on fake CUDA tensors (torch's shape
    functions of those kernels stand in for them: no GPU needed): on each declared case the call
    reads no value and returns q's shape and dtype, and the log-sum-exp, float32 (batch, heads,
    q length), exactly when asked for; torch's filter is asked for what the backend takes. The
    values are checked on a GPU (test_dispatch's declared cases, test_attention_op's layouts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = dispatch.ops()["attention"]
    chosen = next(b for b in op.backends if b.name == backend)
    for spec in chosen.test_shapes:
        with FakeTensorMode():
            q, k, v, scale, mask, lse = args = op.example(spec, torch.bfloat16, "cuda")
            refused = dispatch.input_reasons(op, chosen, args)  # torch's own filter; no CUDA here: a refusal
            with host_reads_trapped():
                out, out_lse = chosen.run(*args)
        assert torch.cuda.is_available() or "can_use_" in refused[0], refused
        assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda"), spec
        assert (out_lse is not None) == lse, spec
        if lse:
            assert (out_lse.shape, out_lse.dtype) == (q.shape[:3], torch.float32), spec
