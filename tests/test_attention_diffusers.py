"""pyext.attention: diffusers pipelines computing their attention with pyext.ops.attention.

Tiny offline pipelines (random weights), 64x64, 2 steps, fixed generator. backend="reference"
(fp32 math that materialises the scores) is used where the op must visibly differ from torch's
SDPA kernel; a spy on pyext.attention._pyext_attention proves the op really ran.
"""
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import (Attention, AttnProcessor, AttnProcessor2_0, FusedAttnProcessor2_0,
                                                  IPAdapterAttnProcessor2_0)

import pyext.attention as pa
from pyext import PyextError, _state, dispatch, offline

PROMPT = "a photo of an astronaut riding a horse on mars"
# fp32: reference vs SDPA differ by rounding order only (measured max |diff| ~3e-6 on [0, 1] images).
ATOL_FP32 = 5e-5
MAIN = {"sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}


def _images(pipe, arch):
    extra = {"max_sequence_length": 32} if arch in ("sd3", "flux") else {}
    return pipe(PROMPT, height=64, width=64, num_inference_steps=2, output_type="pt",
                generator=torch.Generator().manual_seed(0), **extra).images


def _models(pipe):
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, pa._attention_classes())}


def _processors(pipe):
    return {(c, n): m.processor for c, model in _models(pipe).items() for n, m in _layers(model).items()}


def _hook_counts(pipe):
    return {(c, n): (len(m._forward_pre_hooks), len(m._forward_hooks))
            for c, model in _models(pipe).items() for n, m in model.named_modules()}


@pytest.fixture
def spy(monkeypatch):
    """Records (backend, q.shape) of every call of pyext's op made by pyext.attention."""
    calls = []
    real = pa._pyext_attention

    def recording(q, k, v, scale=None, backend=None, attn_mask=None):
        calls.append((backend, tuple(q.shape), threading.get_ident()))
        return real(q, k, v, scale=scale, backend=backend, attn_mask=attn_mask)

    monkeypatch.setattr(pa, "_pyext_attention", recording)
    return calls


# ---------------------------------------------------------------- same images, every pipeline
# The image families this file's helpers call; routing in every family is tests/test_families.py's.
@pytest.mark.parametrize("arch", ["sd15", "sdxl", "sd3", "flux"])
def test_pipeline_matches_sdpa_and_remove_restores_it(arch, spy):
    pipe = offline.build_pipeline(arch, "tiny")
    expected = _images(pipe, arch)
    processors, hooks = _processors(pipe), _hook_counts(pipe)

    report = pa.apply(pipe, backend="reference")
    main, vae = report.components[MAIN[arch]], report.components["vae"]
    assert main.patched == len(_layers(getattr(pipe, MAIN[arch]))) > 0 and not main.skipped
    assert vae.patched == 2  # encoder and decoder mid-block attention
    assert all("transformers model" in report.components[c].skipped["*"] for c in _models(pipe) if "text" in c)

    got = _images(pipe, arch)
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)
    assert not torch.equal(got, expected)  # the reference math really replaced SDPA's kernel
    state = pa.status(pipe)
    assert len(spy) == state["pyext_calls"] > 0 and state["fallbacks"] == 0
    assert {backend for backend, _, _ in spy} == {"reference"}
    assert state["components"]["vae"]["pyext_calls"] == 1  # decode; no encode in text-to-image
    assert state["components"][MAIN[arch]]["pyext_calls"] == 2 * main.patched  # 2 steps, CFG batched
    assert _processors(pipe) == processors  # nothing replaced while patched

    restored = pa.remove(pipe)
    assert len(restored) == report.patched
    assert all(a is b for a, b in zip(_processors(pipe).values(), processors.values()))
    assert _hook_counts(pipe) == hooks
    assert not any(_state.get(m, pa.STATE) for model in _models(pipe).values() for m in model.modules())
    calls = len(spy)
    assert torch.equal(_images(pipe, arch), expected)
    assert len(spy) == calls


def _cpu_backends():
    # Not triton: its CPU interpreter is far too slow for a pipeline (the op's own tests cover it).
    return [b.name for b in dispatch.ops()["attention"].backends
            if not b.unavailable() and "cpu" in b.devices and b.name != "triton"]


@pytest.mark.parametrize("backend", [None, *_cpu_backends()])
def test_every_cpu_backend_is_passed_through(backend, spy):
    pipe = offline.build_pipeline("sd15", "tiny")
    expected = _images(pipe, "sd15")
    pa.apply(pipe, backend=backend)
    # fp32; a fast kernel may use another exp/summation order than the reference: 4x the margin.
    torch.testing.assert_close(_images(pipe, "sd15"), expected, atol=4 * ATOL_FP32, rtol=0)
    assert spy and {b for b, _, _ in spy} == {backend}


def test_bf16_pipeline():
    pipe = offline.build_pipeline("sd15", "tiny", dtype=torch.bfloat16)
    expected = _images(pipe, "sd15").float()
    pa.apply(pipe, backend="sdpa")  # the same kernel through pyext: the plumbing itself is lossless
    assert torch.equal(_images(pipe, "sd15").float(), expected)
    pa.apply(pipe, backend="reference")
    diff = (_images(pipe, "sd15").float() - expected).abs()
    assert pa.status(pipe)["pyext_calls"] > 0
    # bf16 pipeline: q/k/v/out rounded to bf16 (ulp 2^-8) and amplified by 2 steps + VAE;
    # measured max 0.06, mean 0.005 on [0, 1] images.
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.01


# ---------------------------------------------------------------- fallbacks
def _attention_layer(dtype=torch.float32):
    torch.manual_seed(0)
    return Attention(query_dim=32, cross_attention_dim=16, heads=2, dim_head=16).to(dtype).eval()


@pytest.mark.parametrize("backend", [None, "reference"])
def test_masked_calls_run_pyext_as_plain_sdpa_does(spy, backend):
    attn = _attention_layer()
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 3:] = False
    with torch.no_grad():
        expected_masked, expected = attn(x, ctx, attention_mask=mask), attn(x, ctx)
        pa.apply(attn, backend=backend)
        torch.testing.assert_close(attn(x, ctx, attention_mask=mask), expected_masked, atol=1e-6, rtol=0)
        torch.testing.assert_close(attn(x, ctx), expected, atol=1e-6, rtol=0)
    comp = pa.status(attn)["components"]["Attention"]
    assert comp["fallbacks"] == {} and comp["pyext_calls"] == 2
    assert [c[:2] for c in spy] == [(backend, (2, 2, 5, 16))] * 2


def test_unet_encoder_attention_mask_runs_pyext_in_every_layer():
    pipe = offline.build_pipeline("sd15", "tiny")
    unet = pipe.unet
    sample = torch.randn(1, 4, 8, 8)
    ctx = torch.randn(1, 77, unet.config.cross_attention_dim)
    keep = torch.ones(1, 77)
    keep[:, 40:] = 0  # diffusers' encoder_attention_mask: 1 keeps a token, 0 drops it
    with torch.no_grad():
        expected = unet(sample, 10, encoder_hidden_states=ctx, encoder_attention_mask=keep).sample
        pa.apply(unet, backend="reference")
        out = unet(sample, 10, encoder_hidden_states=ctx, encoder_attention_mask=keep).sample
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    comp = pa.status(unet)["components"]["UNet2DConditionModel"]
    assert comp["fallbacks"] == {} and comp["pyext_calls"] == len(_layers(unet))


def test_autograd_falls_back_and_trains():
    attn = _attention_layer()
    pa.apply(attn, backend="reference")
    attn(torch.randn(1, 4, 32), torch.randn(1, 3, 16)).sum().backward()
    assert attn.to_q.weight.grad is not None
    (reason, n), = pa.status(attn)["components"]["Attention"]["fallbacks"].items()
    assert reason.startswith("autograd") and n == 1


def test_input_the_op_refuses_falls_back_with_its_reason():
    attn = _attention_layer(torch.float64)  # pyext.ops.attention takes fp16/bf16/fp32 only
    x, ctx = torch.randn(1, 4, 32, dtype=torch.float64), torch.randn(1, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = attn(x, ctx)
        pa.apply(attn)
        assert torch.equal(attn(x, ctx), expected)
    (reason, n), = pa.status(attn)["components"]["Attention"]["fallbacks"].items()
    assert "pyext.attention" in reason and "float64" in reason and n == 1


def test_exception_in_forward_leaves_no_mode_behind(spy):
    attn = _attention_layer()
    pa.apply(attn)
    with pytest.raises(RuntimeError), torch.no_grad():
        attn(torch.randn(1, 4, 31), torch.randn(1, 3, 16))  # wrong width: to_q fails inside the forward
    assert torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        attn(torch.randn(1, 4, 32), torch.randn(1, 3, 16))
    assert len(spy) == 1 and torch._C._len_torch_function_stack() == 0


# ---------------------------------------------------------------- isolation
def _diffusers_and_torch_functions():
    """id of every function and class in diffusers' and torch's module globals."""
    return {(name, key): id(value) for name, mod in list(sys.modules.items())
            if name.split(".")[0] in ("diffusers", "torch")
            for key, value in list(vars(mod).items()) if callable(value)}


def test_no_global_side_effects(spy):
    before = _diffusers_and_torch_functions()
    a = offline.build_pipeline("sd15", "tiny")
    b = offline.build_pipeline("sd15", "tiny")
    b_expected = _images(b, "sd15")
    pa.apply(a, backend="reference")
    _images(a, "sd15")
    calls = len(spy)
    assert calls > 0
    # b was built separately: untouched, and running it (after and during a's patch) never reaches pyext
    assert torch.equal(_images(b, "sd15"), b_expected) and len(spy) == calls
    assert not any(_state.get(m, pa.STATE) or m._forward_pre_hooks or m._forward_hooks
                   for model in _models(b).values() for m in model.modules())
    assert pa.status(b)["patched"] == 0
    pa.remove(a)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.nn.modules.module._global_forward_hooks and not torch.nn.modules.module._global_forward_pre_hooks
    after = _diffusers_and_torch_functions()
    assert [k for k in before.keys() & after.keys() if before[k] != after[k]] == []  # nothing swapped
    with warnings.catch_warnings():  # reading deprecated torch attributes warns
        warnings.simplefilter("ignore")
        assert not any(getattr(v, "__module__", None) == pa.__name__ for name, mod in list(sys.modules.items())
                       if name.split(".")[0] in ("diffusers", "torch") for v in list(vars(mod).values()))


def test_another_thread_is_not_routed_while_a_patched_layer_runs(spy):
    """Thread 1 sits inside a patched layer's forward while thread 2 runs an unpatched layer."""
    inside, done = threading.Event(), threading.Event()

    class Waiting(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, *args, **kwargs):
            inside.set()
            assert done.wait(30)
            return super().__call__(attn, hidden_states, *args, **kwargs)

    patched, plain = _attention_layer(), _attention_layer()
    patched.set_processor(Waiting())
    pa.apply(patched)
    x, ctx = torch.randn(1, 4, 32), torch.randn(1, 3, 16)
    result = {}

    def run_patched():
        with torch.no_grad():
            result["patched"] = patched(x, ctx)

    worker = threading.Thread(target=run_patched)
    worker.start()
    assert inside.wait(30)
    with torch.no_grad():
        result["plain"] = plain(x, ctx)  # mode is live in the worker thread right now
    done.set()
    worker.join(30)
    assert [t for _, _, t in spy] == [worker.ident]  # only the patched layer's thread reached pyext
    torch.testing.assert_close(result["patched"], result["plain"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- API behaviour
def test_apply_is_idempotent_and_switches_backend(spy):
    pipe = offline.build_pipeline("sd15", "tiny")
    pa.apply(pipe, backend="reference")
    hooks = _hook_counts(pipe)
    report = pa.apply(pipe, backend="sdpa")
    assert _hook_counts(pipe) == hooks and report.backend == "sdpa"
    assert all(h == (1, 1) for (c, n), h in hooks.items() if n in _layers(_models(pipe)[c]))
    _images(pipe, "sd15")
    assert len(spy) == pa.status(pipe)["pyext_calls"] == 17 and {b for b, _, _ in spy} == {"sdpa"}
    assert len(pa.remove(pipe)) == report.patched and pa.remove(pipe) == []


def test_bad_arguments_are_named():
    with pytest.raises(PyextError, match="unknown backend 'nope'; backends are: .*reference"):
        pa.apply(_attention_layer(), backend="nope")
    with pytest.raises(PyextError, match="pyext.attention: expected a diffusers pipeline"):
        pa.apply("unet")


def test_fuse_qkv_projections_stays_on_pyext(spy):
    pipe = offline.build_pipeline("sd15", "tiny")
    pa.apply(pipe, backend="reference")
    unfused = _images(pipe, "sd15")
    originals = dict(pipe.unet.attn_processors)
    calls = len(spy)
    pipe.fuse_qkv_projections()
    assert all(isinstance(p, FusedAttnProcessor2_0) for p in pipe.unet.attn_processors.values())
    assert pa.status(pipe)["components"]["unet"]["patched"] == len(_layers(pipe.unet))
    fused = _images(pipe, "sd15")
    assert len(spy) == 2 * calls  # every fused layer still ran pyext's op
    torch.testing.assert_close(fused, unfused, atol=ATOL_FP32, rtol=0)
    pipe.unfuse_qkv_projections()
    assert all(pipe.unet.attn_processors[k] is p for k, p in originals.items())


def test_set_attn_processor_is_reported_and_followed(spy):
    pipe = offline.build_pipeline("sd15", "tiny")
    pa.apply(pipe, backend="reference")
    n = len(_layers(pipe.unet))
    pipe.unet.set_default_attn_processor()  # installs AttnProcessor: bmm + softmax, no SDPA
    unet = pa.status(pipe)["components"]["unet"]
    assert unet["patched"] == 0 and len(unet["skipped"]) == n
    assert set(unet["skipped"].values()) == {"processor AttnProcessor does not call SDPA"}
    _images(pipe, "sd15")
    unet = pa.status(pipe)["components"]["unet"]
    assert unet["pyext_calls"] == 0 and unet["fallbacks"] == {
        "no SDPA call (processor AttnProcessor does not call SDPA)": 2 * n}
    assert [shape[1] for _, shape, _ in spy] == [1]  # only the VAE decoder (1 head) reached pyext

    pipe.unet.set_attn_processor(AttnProcessor2_0())
    assert pa.status(pipe)["components"]["unet"]["patched"] == n
    _images(pipe, "sd15")
    assert pa.status(pipe)["components"]["unet"]["pyext_calls"] == 2 * n
    pipe.unet.set_attn_processor(AttnProcessor())
    assert pa.status(pipe)["patched"] == 2  # the VAE only


def test_ip_adapter_processor_installed_later_is_routed(spy):
    """What load_ip_adapter installs (IPAdapterAttnProcessor2_0, random weights here): both the
    text and the image-prompt attention reach pyext."""
    attn = _attention_layer()
    pa.apply(attn, backend="reference")
    torch.manual_seed(1)
    attn.set_processor(IPAdapterAttnProcessor2_0(hidden_size=32, cross_attention_dim=16, num_tokens=(4,)))
    x, ctx, image_tokens = torch.randn(1, 5, 32), torch.randn(1, 7, 16), torch.randn(1, 4, 16)
    with torch.no_grad():
        got = attn(x, encoder_hidden_states=(ctx, [image_tokens]))
        pa.remove(attn)
        expected = attn(x, encoder_hidden_states=(ctx, [image_tokens]))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert [shape for _, shape, _ in spy] == [(1, 2, 5, 16), (1, 2, 5, 16)]


def test_flux_dispatcher_backend_is_followed():
    pipe = offline.build_pipeline("flux", "tiny")
    pa.apply(pipe)
    n = len(_layers(pipe.transformer))
    for module in _layers(pipe.transformer).values():
        module.set_attention_backend("_native_math")  # still torch SDPA: still routed
    assert pa.status(pipe)["components"]["transformer"]["patched"] == n
    for module in _layers(pipe.transformer).values():
        module.set_attention_backend("flex")  # torch flex_attention: not SDPA, cannot be routed
    skipped = pa.status(pipe)["components"]["transformer"]["skipped"]
    assert len(skipped) == n and set(skipped.values()) == {"diffusers attention backend 'flex' does not call SDPA"}


def test_deepcopy_of_a_patched_model_is_patched_independently(spy):
    import copy

    attn = _attention_layer()
    pa.apply(attn, backend="reference")
    twin = copy.deepcopy(attn)
    x, ctx = torch.randn(1, 4, 32), torch.randn(1, 3, 16)
    with torch.no_grad():
        twin(x, ctx)
    assert pa.status(twin)["pyext_calls"] == 1 and pa.status(attn)["pyext_calls"] == 0
    pa.remove(twin)
    with torch.no_grad():
        attn(x, ctx)
    assert pa.status(attn)["pyext_calls"] == 1 and len(spy) == 2


def test_a_copied_model_s_layers_know_the_copy():
    """Each layer keeps the model it is in (its context parallelism is the model's): a deepcopy
    or a pickle of the model refers to itself, not to the original."""
    import copy
    import io

    model = offline.build_pipeline("sd3", "tiny").transformer
    pa.apply(model)
    name = next(iter(_layers(model)))
    assert _state.get(_layers(model)[name], pa.STATE).model() is model
    twin = copy.deepcopy(model)
    assert _state.get(_layers(twin)[name], pa.STATE).model() is twin
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _state.get(_layers(loaded)[name], pa.STATE).model() is loaded


def test_torch_compile_traces_the_pyext_op_in_one_graph():
    attn = _attention_layer()
    x, ctx = torch.randn(1, 4, 32), torch.randn(1, 3, 16)
    with torch.no_grad():
        expected = attn(x, ctx)
    pa.apply(attn, backend="reference")
    targets = []

    def record_graph(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        out = torch.compile(attn, backend=record_graph, fullgraph=True)(x, ctx)
    assert "pyext.attention" in targets and not any("scaled_dot_product" in t for t in targets)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert torch._C._len_torch_function_stack() == 0
