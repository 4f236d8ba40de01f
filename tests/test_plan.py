"""pyext.plan: what optimize would do, decided before anything changes, and what optimize then does."""
import typing

import pytest
import torch

import pyext
from pyext.decision import Decision
from pyext.dispatch import PyextError
from pyext.offline import build_pipeline


def fingerprint(pipe) -> dict:
    """Every component's module types, and its parameters' and buffers' dtypes, devices and values."""
    out = {}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            out[name] = ([type(m).__name__ for m in module.modules()],
                         {k: (v.dtype, v.device, v.clone()) for k, v in module.state_dict().items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n][0] == b[n][0] and a[n][1].keys() == b[n][1].keys()
        and all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a[n][1].values(), b[n][1].values()))
        for n in a)


def test_plan_changes_nothing():
    pipe = build_pipeline("sd15", "tiny")
    before = fingerprint(pipe)
    planned = pyext.plan(pipe, fp8="denoiser", dtype=torch.bfloat16)
    assert same(fingerprint(pipe), before)
    assert pyext.report(pipe).plan == "not optimized by pyext"
    assert planned.decision.fp8 == "denoiser" and planned.decision.dtype == torch.bfloat16
    assert "pyext plan for StableDiffusionPipeline" in str(planned)


def test_the_decision_is_typed():
    hints = typing.get_type_hints(Decision)
    for name in ("fp8", "fp8_gemm", "offload"):
        assert typing.get_origin(hints[name]) is typing.Literal, name
    planned = pyext.plan(build_pipeline("sd15", "tiny"))
    for name in ("fp8", "fp8_gemm", "offload"):
        assert getattr(planned.decision, name) in typing.get_args(hints[name])
    assert all(s.action in ("apply", "skip") for s in planned.steps)


@pytest.mark.parametrize("arch,options", [
    ("sd15", {}), ("sd15", {"fp8": "denoiser", "compile": "trace"}), ("sdxl", {"fp8": "all", "prepack": "off"}),
    ("flux", {"attention": "off", "vae_tiling": "on"}), ("wan21", {"dtype": "keep", "compile": "cudagraphs"}),
])
def test_optimize_does_what_the_plan_says(arch, options):
    """Each step of the plan has its entry in the report: a skip with the plan's very reason, an
    apply as applied, already, or skipped for what the technique found inside."""
    pipe = build_pipeline(arch, "tiny")
    planned = pyext.plan(pipe, **options)
    pyext.optimize(pipe, **options)
    entries = {(e.component, e.technique): e for e in pyext.report(pipe).entries}
    assert set(entries) == {(s.component, s.technique) for s in planned.steps}
    for step in planned.steps:
        entry = entries[(step.component, step.technique)]
        if step.action == "skip":
            assert (entry.status, entry.detail) == ("skipped", step.why), step
    assert any(s.action == "apply" for s in planned.steps)


def test_plan_refuses_what_optimize_refuses_and_sees_an_earlier_optimize():
    pipe = build_pipeline("sd15", "tiny")
    with pytest.raises(PyextError, match="fp8_gemm"):
        pyext.plan(pipe, fp8_gemm="fast")
    pyext.optimize(pipe, dtype=torch.bfloat16)
    with pytest.raises(PyextError, match="dtype"):
        pyext.plan(pipe, dtype=torch.float16)  # the first call's cast cannot be undone exactly
    assert pyext.plan(pipe, dtype=torch.bfloat16).decision.dtype == torch.bfloat16


# Tiny configs: Flux and Wan split their sequence without a mask (Ulysses where their heads
# divide), LTX's text mask takes the ring, SD3 splits by pyext's plan, a UNet has no split.
@pytest.mark.parametrize("arch,split", [("flux", "ulysses"), ("wan21", "ulysses"), ("ltx", "ring"), ("sd3", "ulysses"),
                                        ("sd15", "none")])
def test_a_plan_for_two_devices_says_how_the_sequence_splits_and_counts_one_device(arch, split):
    from pyext import planner

    pipe = build_pipeline(arch, "tiny")
    one, two = pyext.plan(pipe).decision, pyext.plan(pipe, devices=2).decision
    assert one.sequence.devices == 1 and one.sequence.split == "none"
    assert two.sequence.devices == 2 and two.sequence.split == split and two.sequence.reason, two.sequence
    assert ("_cp_plan" in two.sequence.reason) == (split == "none")
    whole, shared = (planner.component_sizes(two.components, two.geometry, split_ways=ways) for ways in (1, 2))
    for a, b in zip(whole, shared):  # each device holds every weight and half the denoiser's tokens
        assert a.weight_bytes == b.weight_bytes
        assert b.activation_bytes == (a.activation_bytes // 2 if a.role == "denoiser" else a.activation_bytes)
    if split == "ring" or arch == "sd3":  # pyext computes the ring, and SD3's split attention
        off = pyext.plan(pipe, devices=2, attention="off").decision.sequence
        assert "attention='off'" in off.reason and (off.split == "none") == (arch == "sd3")
    if split == "none":
        with pytest.raises(PyextError, match="declares no sequence split .* supported: .*SD3Transformer2DModel"):
            pyext.context_parallel_plan(pipe.unet)
    else:
        assert pyext.context_parallel_plan(pipe.transformer)
    if split == "none":
        assert two.plan.peak_bytes == one.plan.peak_bytes
    else:
        assert two.plan.peak_bytes <= one.plan.peak_bytes and two.sequence.ways == 2
        assert f"{split} over 2 devices" in str(pyext.plan(pipe, devices=2))


def test_the_split_follows_heads_tokens_and_what_is_enabled():
    from types import SimpleNamespace

    from pyext import planner

    pipe = build_pipeline("flux", "tiny")
    model = pipe.transformer
    heads = model.config.num_attention_heads
    latents = planner.latent_channels(pyext.plan(pipe).decision.components)
    assert model.config.in_channels == 4 * latents  # Flux packs 2x2 latents into a token
    geo = planner.Geometry(128, 128, text_tokens=heads * 8)  # 16x16 latents: 64 tokens
    assert planner.sequence_split(model, geo, heads, latents).split == "ulysses"
    assert planner.sequence_split(model, geo, 2 * heads, latents).split == "ring"  # the heads do not divide
    odd = planner.sequence_split(model, planner.Geometry(80, 80, text_tokens=64), 2, latents)  # 25 tokens
    assert odd.split == "none" and "25 image tokens" in odd.reason
    text = planner.sequence_split(model, planner.Geometry(128, 128, text_tokens=7), 2, latents)
    assert text.split == "none" and "7 text tokens" in text.reason
    # context parallelism already enabled on the denoiser: its degree and kind, and the option must agree
    model._parallel_config = SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2, ulysses_degree=1))
    try:
        decision = pyext.plan(pipe).decision
        assert (decision.sequence.devices, decision.sequence.split) == (2, "ring")
        with pytest.raises(PyextError, match="devices=4"):
            pyext.plan(pipe, devices=4)
    finally:
        model._parallel_config = None


def test_captured_graphs_memory_counts_in_resident_plans_and_gives_way_before_anything_slower():
    """A denoiser replaying captured CUDA graphs keeps its activations reserved while the VAE
    decodes. A budget that fits the resident plan but not its graphs' memory keeps the plan and
    drops the graphs (compile="auto" then stays eager, and says why)."""
    import dataclasses

    from pyext import planner
    from pyext.techniques.compile import Compile

    pipe = build_pipeline("sd15", "tiny")
    d = pyext.plan(pipe).decision
    sizes = planner.component_sizes(d.components, d.geometry)
    kept_bytes = sum(c.activation_bytes for c in sizes if c.role == "denoiser")
    eager = planner.plan(d.components, d.geometry, None)
    kept = planner.plan(d.components, d.geometry, None, graphs=True)
    assert (eager.name, eager.graphs, kept.name, kept.graphs) == ("resident", False, "resident+cuda_graphs", True)
    weights = sum(c.weight_bytes for c in sizes)
    assert eager.peak_bytes < kept.peak_bytes and kept.peak_bytes >= weights + kept_bytes + max(
        c.activation_bytes for c in sizes if c.role == "vae")
    tight = planner.plan(d.components, d.geometry, (eager.peak_bytes + kept.peak_bytes) // 2, graphs=True)
    assert (tight.name, tight.offload, tight.graphs, tight.peak_bytes) == ("resident", "off", False, eager.peak_bytes)
    on_gpu = dataclasses.replace(d, device=torch.device("cuda", 0))
    assert Compile()._why_not("unet", pipe.unet, dataclasses.replace(on_gpu, plan=kept)) is None
    why = Compile()._why_not("unet", pipe.unet, dataclasses.replace(on_gpu, plan=tight))
    assert "would not fit" in why and "compile='capture'" in why
