"""What a diffusers user does around pyext.optimize, each step compared with plain diffusers
doing the same steps, on the tiny offline pipelines of SD1.5, SDXL, Flux and Wan.

Every row builds two pipelines from the same weights: `opt`, optimized by pyext, and `twin`,
plain diffusers holding the weights `opt` computes with (optimized then restored: for fp8
storage the dequantized weights, for lossless techniques the originals). Both then take the
same steps (a LoRA, a save, a compile, ...) and must give the same images to rounding: the
technique's own error is the same on both sides, so a missing or wrong step shows at full
size. LoRA rows also hold the LoRA's effect (images with minus without) to plain diffusers'
effect on the unquantized weights. docs/workflows.md is the table of these rows.
"""
import copy

import numpy as np
import pytest
import torch

import pyext
import pyext.nn.fp8 as fp8_module
from pyext import _compat, dispatch, graphs
from pyext.dispatch import PyextError
from pyext.offline import build_pipeline, run_example
from tests.test_graphs import RecordedGraph

pytestmark = [pytest.mark.slow, pytest.mark.independent]  # make test-fast leaves it out

ARCHS = ["sd15", "sdxl", "flux", "wan21"]
DENOISER = {"sd15": "unet", "sdxl": "unet", "flux": "transformer", "wan21": "transformer"}
# defaults: what optimize does on a CPU (prepack, fused norms, attention routing, channels-last);
# fp8: the same, with the denoiser's weights stored in fp8; captured: the defaults with the
# denoiser replayed from captured graphs (compile="capture", the default on CUDA; here the CPU
# stand-in for a CUDA graph of tests/test_graphs.py, which bakes in what a capture bakes in).
TECHNIQUES = {"defaults": dict(dtype="keep"), "fp8": dict(dtype="keep", fp8="denoiser"), "captured": dict(dtype="keep")}
SAME = 2e-3  # images in [0, 1]: what rounding and oneDNN's summation order leave between opt and twin


@pytest.fixture(autouse=True)
def setting(monkeypatch, tmp_path):
    monkeypatch.setattr(fp8_module, "MIN_NUMEL", 0)  # the tiny models' layers are below the size floor
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path / "dispatch"))
    dispatch.reset()
    yield
    dispatch.reset()


def run(pipe, arch: str, **kwargs) -> torch.Tensor:
    return run_example(pipe, arch, steps=2, **kwargs).float()


def pair(arch: str, techniques: str):
    """(opt, twin): pyext-optimized, and plain diffusers with the weights opt computes with."""
    opt = pyext.optimize(build_pipeline(arch, "tiny"), **TECHNIQUES[techniques])
    twin = pyext.optimize(build_pipeline(arch, "tiny"), **TECHNIQUES[techniques])
    pyext.restore(twin)
    if techniques == "captured":
        graphs.apply_capture(getattr(opt, DENOISER[arch]), RecordedGraph)
    return opt, twin


def assert_same(a: torch.Tensor, b: torch.Tensor, tol: float = SAME):
    assert a.shape == b.shape and torch.isfinite(a).all()
    assert (a - b).abs().max().item() <= tol


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    return 10 * np.log10(float(ref.pow(2).mean()) / max(float((out - ref).pow(2).mean()), 1e-30))


def make_lora(arch: str, path, seed: int, rank: int = 4) -> str:
    """A LoRA on the denoiser's attention projections, saved as diffusers saves LoRAs."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    src = build_pipeline(arch, "tiny")
    model = getattr(src, DENOISER[arch])
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    type(src).save_lora_weights(str(path), **{f"{DENOISER[arch]}_lora_layers": get_peft_model_state_dict(model)})
    return str(path)


# ----------------------------------------------------------------------------- LoRA

def lora_steps(pipe, arch: str, lora: str) -> list[torch.Tensor]:
    """Images: before, loaded, weighted 0.5, disabled, enabled, fused, unfused, unloaded."""
    images = [run(pipe, arch)]
    pipe.load_lora_weights(lora, adapter_name="a")
    images.append(run(pipe, arch))
    pipe.set_adapters(["a"], adapter_weights=[0.5])
    images.append(run(pipe, arch))
    pipe.disable_lora()
    images.append(run(pipe, arch))
    pipe.enable_lora()
    pipe.set_adapters(["a"], adapter_weights=[1.0])
    images.append(run(pipe, arch))
    pipe.fuse_lora()
    images.append(run(pipe, arch))
    pipe.unfuse_lora()
    images.append(run(pipe, arch))
    pipe.unload_lora_weights()
    images.append(run(pipe, arch))
    return images


@pytest.mark.parametrize("techniques", list(TECHNIQUES))
@pytest.mark.parametrize("arch", ARCHS)
def test_lora_after_optimize(arch, techniques, tmp_path):
    lora = make_lora(arch, tmp_path, seed=1)
    opt, twin = pair(arch, techniques)
    got, want = lora_steps(opt, arch, lora), lora_steps(twin, arch, lora)
    plain = lora_steps(build_pipeline(arch, "tiny"), arch, lora)
    effect = [g - got[0] for g in got]
    twin_effect = [w - want[0] for w in want]
    plain_effect = [p - plain[0] for p in plain]
    assert effect[1].abs().max() > 10 * SAME  # the LoRA acts
    if techniques == "captured":
        assert graphs.captured(getattr(opt, DENOISER[arch])).replays > 0
    exact = [1, 2, 3, 4] if techniques == "fp8" else range(1, 8)  # fp8: fusing stores the sums in fp8 again
    for i in exact:
        assert_same(got[i], want[i])
    assert effect[3].abs().max() <= SAME  # disabled
    # The effect, held to plain diffusers on unquantized weights: the fp8 error may blur it, not remove it.
    for i in (1, 2, 4):
        assert snr_db(effect[i], plain_effect[i]) >= 10
    if techniques == "fp8":
        # Fused, then unfused: each stores the changed weights in fp8 again, one more rounding each.
        assert snr_db(effect[5], twin_effect[5]) >= 15 and snr_db(effect[6], twin_effect[6]) >= 12
        assert (got[7] - got[0]).abs().max() <= 0.05
        assert any(isinstance(m, pyext.FP8Linear) for m in getattr(opt, DENOISER[arch]).modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_hotswap_after_optimize(arch, tmp_path):
    first, second = make_lora(arch, tmp_path / "a", seed=1), make_lora(arch, tmp_path / "b", seed=2)
    opt, twin = pair(arch, "fp8")
    images = {}
    for name, pipe in (("opt", opt), ("twin", twin)):
        pipe.enable_lora_hotswap(target_rank=8)
        pipe.load_lora_weights(first, adapter_name="a")
        before = run(pipe, arch)
        pipe.load_lora_weights(second, adapter_name="a", hotswap=True)
        images[name] = (before, run(pipe, arch))
    assert (images["opt"][1] - images["opt"][0]).abs().max() > 10 * SAME  # the swap changed the LoRA
    assert_same(images["opt"][0], images["twin"][0])
    assert_same(images["opt"][1], images["twin"][1])


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_hotswap_of_a_lora_loaded_before_optimize(arch, tmp_path):
    """A server's order: hotswap enabled and a default LoRA loaded, optimize once (fp8), then a
    swap per request. The twin: plain diffusers on the weights the optimized denoiser computes
    with (optimized, then restored), with the second LoRA loaded directly."""
    first, second = make_lora(arch, tmp_path / "a", seed=1), make_lora(arch, tmp_path / "b", seed=2)
    opt = build_pipeline(arch, "tiny")
    opt.enable_lora_hotswap(target_rank=8)
    opt.load_lora_weights(first, adapter_name="x")
    pyext.optimize(opt, **TECHNIQUES["fp8"])
    twin = copy.deepcopy(opt)
    pyext.restore(twin)
    twin.unload_lora_weights()
    twin.load_lora_weights(second, adapter_name="x")
    before = run(opt, arch)
    opt.load_lora_weights(second, adapter_name="x", hotswap=True)
    after = run(opt, arch)
    assert (after - before).abs().max() > 10 * SAME  # the swap changed the LoRA
    assert_same(after, run(twin, arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_optimize_after_a_lora_is_loaded(arch, tmp_path):
    lora = make_lora(arch, tmp_path, seed=1)
    pipes = {name: build_pipeline(arch, "tiny") for name in ("opt", "twin")}
    for pipe in pipes.values():
        pipe.load_lora_weights(lora, adapter_name="a")
        pyext.optimize(pipe, **TECHNIQUES["fp8"])
    pyext.restore(pipes["twin"])
    denoiser = getattr(pipes["opt"], DENOISER[arch])
    assert any(isinstance(m, pyext.FP8Linear) for m in denoiser.modules())
    assert not any(isinstance(m, pyext.FP8Linear) for n, m in denoiser.named_modules() if ".lora_" in n)
    assert_same(run(pipes["opt"], arch), run(pipes["twin"], arch))
    pipes["opt"].set_adapters(["a"], adapter_weights=[0.3])
    pipes["twin"].set_adapters(["a"], adapter_weights=[0.3])
    assert_same(run(pipes["opt"], arch), run(pipes["twin"], arch))
    for pipe in pipes.values():
        pipe.unload_lora_weights()
    assert_same(run(pipes["opt"], arch), run(pipes["twin"], arch))


# ----------------------------------------------------------------------------- optimize's defaults in bf16

# optimize's defaults where the CPU computes bf16 natively (bf16; forced here, on every CPU), alone and with fp8.
BF16 = {"bf16": dict(dtype=torch.bfloat16), "bf16_fp8": dict(dtype=torch.bfloat16, fp8="denoiser")}


def bf16_pair(arch: str, options: str):
    """(opt, twin, fp32): pyext in bf16; plain diffusers on the weights opt computes with, each
    component cast to opt's dtype for it; and that plain pipeline in fp32, whose distance to twin
    is plain diffusers' own bf16 rounding of the image."""
    opt = pyext.optimize(build_pipeline(arch, "tiny"), **BF16[options])
    fp32 = pyext.optimize(build_pipeline(arch, "tiny"), **BF16[options])
    pyext.restore(fp32)  # back to fp32, holding the bf16 (and fp8) rounded values
    twin = copy.deepcopy(fp32)
    for name, component in opt.components.items():
        if isinstance(component, torch.nn.Module):
            getattr(twin, name).to(component.dtype)
    return opt, twin, fp32


@pytest.mark.parametrize("options", list(BF16))
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_defaults_with_a_save_and_a_lora(arch, options, tmp_path):
    """In bf16 opt and twin round differently (pyext's kernels, oneDNN, torch's), so each image's
    RMS distance to the twin is held to twice plain diffusers' own bf16 rounding of it (the twin
    against fp32), and the LoRA's effect to the twin's as closely as plain diffusers' own rounding
    allows: a missing or wrong step gives an unrelated image or effect."""
    from diffusers import DiffusionPipeline

    lora = make_lora(arch, tmp_path / "lora", seed=1)
    opt, twin, fp32 = bf16_pair(arch, options)
    opt.save_pretrained(str(tmp_path / "saved"))
    reloaded = DiffusionPipeline.from_pretrained(str(tmp_path / "saved"), torch_dtype=torch.bfloat16)
    images = {}
    for name, pipe in (("opt", opt), ("twin", twin), ("fp32", fp32), ("reloaded", reloaded)):
        images[name] = [run(pipe, arch)]
        pipe.load_lora_weights(lora, adapter_name="a")
        images[name].append(run(pipe, arch))
        pipe.fuse_lora()
        images[name].append(run(pipe, arch))
    rms = lambda t: t.pow(2).mean().sqrt().item()
    for i in range(3):
        rounding = rms(images["twin"][i] - images["fp32"][i])
        # fp8: fusing stores the fused weights in fp8 again, one more rounding than the twin's bf16 sums
        factor = 4 if i == 2 and "fp8" in options else 2
        assert rms(images["opt"][i] - images["twin"][i]) <= factor * rounding
        assert rms(images["reloaded"][i] - images["twin"][i]) <= 2 * rounding
    effect = lambda name: images[name][1] - images[name][0]
    assert effect("twin").abs().max() > 10 * SAME  # the LoRA acts
    own = snr_db(effect("fp32"), effect("twin"))  # plain diffusers' bf16 rounding of the effect
    for name in ("opt", "reloaded"):
        assert snr_db(effect(name), effect("twin")) >= min(10, own - 3)


# ----------------------------------------------------------------------------- saving, compiling, optimizing again

@pytest.mark.parametrize("techniques", list(TECHNIQUES))
@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_reloads_in_plain_diffusers(arch, techniques, tmp_path):
    from diffusers import DiffusionPipeline

    opt, twin = pair(arch, techniques)
    opt.save_pretrained(str(tmp_path))
    reloaded = DiffusionPipeline.from_pretrained(str(tmp_path))
    assert not any("pyext" in type(m).__module__ for c in reloaded.components.values()
                   if isinstance(c, torch.nn.Module) for m in c.modules())
    assert_same(run(reloaded, arch), run(twin, arch))
    assert_same(run(opt, arch), run(twin, arch))  # saving changed nothing in the optimized pipeline


@pytest.mark.parametrize("arch", ["sd15", "flux", "wan21"])  # sdxl's UNet compiles as sd15's does
def test_users_torch_compile_after_optimize(arch):
    opt, twin = pair(arch, "fp8")
    den = DENOISER[arch]
    # aot_eager traces the fp8 ops' fake kernels too; on the UNets, dynamo alone meets the packed
    # layers, where tracing broke, in a fraction of the time.
    backend = "eager" if den == "unet" else "aot_eager"
    for pipe in (opt, twin):
        setattr(pipe, den, torch.compile(getattr(pipe, den), backend=backend))
        # (dynamo alone: aot_eager's group norm refuses the strides of plain diffusers' own VAE here)
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    assert_same(run(opt, arch), run(twin, arch))
    assert_same(run(opt, arch, seed=1), run(twin, arch, seed=1))  # compiled again for nothing: same graphs


@pytest.mark.parametrize("arch", ["sd15", "flux", "wan21", "sana"])  # sana: layers whose processor has no SDPA
def test_torch_compile_finds_no_more_graph_breaks_than_in_plain_diffusers(arch):
    """Each break splits the compiled denoiser and, with CUDA graphs, the captured step; and the
    compiled denoiser is not compiled again on later calls (a guard on state pyext's hooks change
    would do that). prepack off: prepacked CPU layers break the first compiled call once by
    design (they unpack)."""
    den = DENOISER.get(arch, "transformer")
    graphs = {}
    for name, options in (("plain", None), ("pyext", dict(dtype="keep", fp8="denoiser", prepack="off"))):
        pipe = build_pipeline(arch, "tiny")
        if options:
            pyext.optimize(pipe, **options)
        graphs[name] = []
        torch._dynamo.reset()

        def record(gm, inputs, found=graphs[name]):
            found.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm.forward

        # Compiled before any eager call, as a user does: the first calls find pyext's state as new.
        setattr(pipe, den, torch.compile(getattr(pipe, den), backend=record))
        run_example(pipe, arch, steps=3)
    assert len(graphs["pyext"]) <= len(graphs["plain"]), (len(graphs["pyext"]), len(graphs["plain"]))
    targets = [t for graph in graphs["pyext"] for t in graph]
    assert "pyext.fp8_linear" in targets and not any("scaled_dot_product" in t for t in targets)
    if arch != "sana":  # its tiny config has no SDPA layer
        assert "pyext.attention" in targets


@pytest.mark.parametrize("arch", ARCHS)
def test_optimize_twice_equals_one_call_with_the_later_options(arch):
    once = pyext.optimize(build_pipeline(arch, "tiny"), **TECHNIQUES["fp8"])
    twice = pyext.optimize(build_pipeline(arch, "tiny"), dtype="keep", prepack="off", attention="off")
    pyext.optimize(twice, **TECHNIQUES["fp8"])
    assert torch.equal(run(once, arch), run(twice, arch))
    first, second = pyext.report(once), pyext.report(twice)
    assert second.plan == first.plan and "fp8=denoiser" in second.plan
    assert [(e.component, e.technique, e.status) for e in second.entries] == \
        [(e.component, e.technique, e.status) for e in first.entries]
    image = run(twice, arch)
    with pytest.raises(PyextError, match="fp8: .* store fp8 weights, fp8='off' leaves them out"):
        pyext.optimize(twice, fp8="off", dtype="keep")
    with pytest.raises(PyextError, match="fp8_layers: the fp8 layers were chosen as 'linear\\+conv'"):
        pyext.optimize(twice, **TECHNIQUES["fp8"], fp8_layers="linear")
    assert torch.equal(run(twice, arch), image)  # refused before anything changed
    assert pyext.report(twice).plan == second.plan


# ----------------------------------------------------------------------------- training

# Gradients of plain diffusers and of the optimized UNet, per parameter, relative to the largest
# entry of each: what the dtype's rounding leaves between two summation orders.
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def hooked_norms(pipe) -> list:
    """Norms that optimize's defaults fuse with their SiLU on a CPU: the UNet's first and the VAE
    decoder's last resnet's."""
    return [pipe.unet.down_blocks[0].resnets[0].norm1, pipe.vae.decoder.up_blocks[-1].resnets[-1].norm2]


def hook(pipe) -> list:
    """Forward hooks that record each norm's first output and hand on a new tensor (o * 1.0), as
    feature extractors and adapters do."""
    seen = [[] for _ in hooked_norms(pipe)]
    for norm, out in zip(hooked_norms(pipe), seen):
        norm.register_forward_hook(lambda m, i, o, out=out: (out.append(o.detach().clone()), o * 1.0)[1])
    return seen


@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_see_what_plain_diffusers_modules_give(when):
    """Forward hooks on modules optimize changed (norms fused with their SiLU), registered before
    or after optimize, see plain diffusers' outputs, and the image is plain diffusers' with them."""
    opt, twin = build_pipeline("sd15", "tiny"), build_pipeline("sd15", "tiny")
    seen = hook(opt) if when == "before" else None
    pyext.optimize(opt, **TECHNIQUES["defaults"])
    assert any(e.technique == "fuse_norms" and e.status == "applied" for e in pyext.report(opt).entries)
    seen = seen or hook(opt)
    want = hook(twin)
    assert_same(run(opt, "sd15"), run(twin, "sd15"))
    for got, ref in zip(seen, want):
        # 1e-3: what pyext's attention and oneDNN's packed layers leave upstream on any CPU; a SiLU applied twice is O(1)
        assert len(got) == len(ref) and all((g - r).abs().max() <= 1e-3 * r.abs().max() for g, r in zip(got, ref))


def denoising_loss(unet) -> torch.Tensor:
    """One forward's denoising loss, the text embeddings without grad as in fine-tuning."""
    g = torch.Generator().manual_seed(0)
    c = unet.config
    latents = torch.randn(2, c.in_channels, c.sample_size, c.sample_size, generator=g).to(unet.dtype)
    text = torch.randn(2, 8, c.cross_attention_dim, generator=g).to(unet.dtype)
    pred = unet(latents, torch.tensor([10, 500]), encoder_hidden_states=text).sample
    return (pred.float() - latents.float()).pow(2).mean()


def train_step(unet) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one backward (those that got one), then one SGD step."""
    unet.requires_grad_(True)
    denoising_loss(unet).backward()
    grads = {name: p.grad for name, p in unet.named_parameters() if p.grad is not None}
    torch.optim.SGD(unet.parameters(), lr=0.1).step()
    return grads


def test_training_after_optimize_gives_plain_diffusers_gradients():
    """optimize's defaults (bf16 where the CPU computes it natively): every parameter plain
    diffusers trains gets its gradient, and the optimizer's step lands in the weights."""
    pipe = build_pipeline("sd15", "tiny")
    twin = copy.deepcopy(pipe)
    dtype = pyext.plan(pipe).decision.dtype
    pyext.optimize(pipe)
    if dtype is not None:
        twin.unet.to(dtype)
    want, got = train_step(twin.unet), train_step(pipe.unet)
    assert "mid_block.attentions.0.transformer_blocks.0.attn2.to_k.weight" in want  # K/V of the text: no input grad
    assert sorted(got) == sorted(want)
    tol = GRAD_TOL[twin.unet.dtype]
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=tol, atol=tol * float(grad.abs().max()), msg=name)
    trained = pipe.unet.state_dict()
    for name, value in twin.unet.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=tol, atol=tol * float(value.abs().max()), msg=name)


def test_training_fp8_layers_is_refused_with_the_way_out():
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), fp8="denoiser")
    frozen = {name: p.requires_grad for name, p in pipe.unet.named_parameters()}
    with pytest.raises(PyextError, match=r"requires_grad_\(True\).*in fp8.*does not train.*fp8=\"off\".*pyext.restore"):
        pipe.unet.requires_grad_(True)
    assert {name: p.requires_grad for name, p in pipe.unet.named_parameters()} == frozen  # nothing changed
    pyext.restore(pipe)
    assert len(train_step(pipe.unet)) == len(frozen)  # the way out: every parameter trains


def test_training_adapters_over_fp8_layers_gives_a_plain_twins_gradients():
    """LoRA training over frozen fp8 layers: where autograd records, an fp8 layer runs torch's op on
    its weight's values, so every adapter weight gets the gradient of a plain twin holding the same
    stored weights."""
    from peft import LoraConfig

    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), fp8="denoiser", dtype="keep")
    twin = copy.deepcopy(pipe)
    assert pyext.restore_fp8(twin.unet)  # plain layers on the dequantized weights
    grads = []
    for p in (pipe, twin):
        p.unet.requires_grad_(False)  # freezing, as adapter training does first, is no error
        torch.manual_seed(0)
        p.unet.add_adapter(LoraConfig(r=4, init_lora_weights="gaussian",
                                      target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        denoising_loss(p.unet).backward()
        grads.append({name: q.grad for name, q in p.unet.named_parameters() if q.grad is not None})
    got, want = grads
    assert want and sorted(got) == sorted(want) and all("lora" in name for name in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()), msg=name)


# ----------------------------------------------------------------------------- other steps

def _fuse_qkv(pipe, arch):
    getattr(pipe, DENOISER[arch]).fuse_qkv_projections()


def _model_offload(pipe, arch):
    pipe.enable_model_cpu_offload(device="cpu")


def _group_offload(pipe, arch):
    getattr(pipe, DENOISER[arch]).enable_group_offload(onload_device="cpu", offload_device="cpu",
                                                       offload_type="block_level", num_blocks_per_group=1)


def _native_attention_backend(pipe, arch):
    getattr(pipe, DENOISER[arch]).set_attention_backend("native")


def _vae_tiling(pipe, arch):
    pipe.vae.enable_tiling()


def _cache(config):
    def step(pipe, arch):
        if not hasattr(getattr(pipe, DENOISER[arch]), "enable_cache"):
            pytest.skip(f"{type(getattr(pipe, DENOISER[arch])).__name__} has no step cache in diffusers")
        getattr(pipe, DENOISER[arch]).enable_cache(config(pipe))
    return step


def _first_block_cache(pipe):
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.5)


def _taylorseer_cache(pipe):
    from diffusers.hooks import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)


def _pyramid_attention_broadcast(pipe):
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                           spatial_attention_timestep_skip_range=(0, 1000),
                                           current_timestep_callback=lambda: pipe.current_timestep)


def _mag_cache(pipe):
    from diffusers.hooks import MagCacheConfig

    return MagCacheConfig(num_inference_steps=2, mag_ratios=[1.0, 1.0], threshold=0.5)


# Each step on both pipelines, after optimize (and before it, where "before" is listed).
STEPS = {
    "fuse_qkv_projections": (_fuse_qkv, True),
    "model_offload": (_model_offload, True),
    "group_offload": (_group_offload, True),
    "set_attention_backend": (_native_attention_backend, True),
    "vae.enable_tiling": (_vae_tiling, True),
    "first_block_cache": (_cache(_first_block_cache), True),
    "taylorseer_cache": (_cache(_taylorseer_cache), True),
    "pyramid_attention_broadcast": (_cache(_pyramid_attention_broadcast), True),
    "mag_cache": (_cache(_mag_cache), True),
}


STILL_REPLAYED = {"fuse_qkv_projections", "set_attention_backend", "vae.enable_tiling"}


@pytest.mark.parametrize("order,techniques", [("after", "fp8"), ("before", "fp8"), ("after", "captured")])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_step_composes_with_optimize(arch, step, order, techniques):
    do, before_too = STEPS[step]
    if order == "before" and not before_too:
        pytest.skip(f"{step} is a step after optimize")
    if order == "after":
        opt, twin = pair(arch, techniques)
        do(opt, arch)
        do(twin, arch)
    else:
        opt, twin = build_pipeline(arch, "tiny"), build_pipeline(arch, "tiny")
        do(opt, arch)
        do(twin, arch)
        pyext.optimize(opt, **TECHNIQUES["fp8"])
        pyext.optimize(twin, **TECHNIQUES["fp8"])
        pyext.restore(twin)
    assert_same(run(opt, arch), run(twin, arch))
    if techniques == "captured":  # graphs replay unless hooks act per call (offload, step caches)
        denoiser = getattr(opt, DENOISER[arch])
        hooked = any(map(_compat.has_hooks, denoiser.modules()))
        assert not (hooked and step in STILL_REPLAYED)
        assert (graphs.captured(denoiser).replays > 0) == (not hooked)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("techniques", ["fp8", "captured"])
def test_shared_components_copies_and_casts(arch, techniques):
    opt, twin = pair(arch, techniques)
    reference = run(twin, arch)
    assert_same(run(type(opt).from_pipe(opt), arch), reference)  # components shared with another pipeline
    assert_same(run(type(opt)(**opt.components), arch), reference)
    copied = copy.deepcopy(opt)
    assert_same(run(copied, arch), reference)
    assert_same(run(opt, arch), reference)  # the original is untouched by its copy
    pyext.restore(copied)
    assert_same(run(opt, arch), reference)
    opt.to("cpu")
    assert_same(run(opt, arch), reference)
    opt.to(torch.bfloat16)
    twin.to(torch.bfloat16)
    # Both compute in bf16, through different kernels on a bf16-native CPU (pyext's fp8 GEMM and its
    # once-rounded GEGLU; oneDNN): against the float32 image, within twice plain diffusers' own bf16
    # error, and never an unrelated image.
    plain = run(twin, arch)
    rounding = (plain - reference).abs().max().item()
    assert_same(run(opt, arch), reference, tol=max(0.05, 2 * rounding))
    if techniques == "captured":  # graphs were replayed, not only eager calls
        assert graphs.captured(getattr(opt, DENOISER[arch])).replays > 0


def test_xformers_switch_behaves_as_in_plain_diffusers():
    opt, twin = pair("sd15", "fp8")
    errors = []
    for pipe in (opt, twin):
        try:
            pipe.enable_xformers_memory_efficient_attention()
            errors.append(None)
        except Exception as err:  # noqa: BLE001 - whatever plain diffusers raises here, pyext must too
            errors.append(type(err))
    assert errors[0] == errors[1]
    assert_same(run(opt, "sd15"), run(twin, "sd15"))


def ip_adapter(unet, image_dim: int = 32) -> dict:
    """A random IP-Adapter for a UNet, in the layout diffusers loads ("image_proj", "ip_adapter")."""
    g = torch.Generator().manual_seed(3)
    cross = unet.config.cross_attention_dim
    layers, key = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        block = name.split(".")
        if block[0] == "mid_block":
            width = unet.config.block_out_channels[-1]
        elif block[0] == "up_blocks":
            width = list(reversed(unet.config.block_out_channels))[int(block[1])]
        else:
            width = unet.config.block_out_channels[int(block[1])]
        for proj in ("to_k_ip", "to_v_ip"):
            layers[f"{key}.{proj}.weight"] = torch.randn(width, cross, generator=g) * 0.1
        key += 2
    image_proj = {"proj.weight": torch.randn(4 * cross, image_dim, generator=g) * 0.1,
                  "proj.bias": torch.zeros(4 * cross), "norm.weight": torch.ones(cross), "norm.bias": torch.zeros(cross)}
    return {"image_proj": image_proj, "ip_adapter": layers}


@pytest.mark.parametrize("order,techniques", [("after", "fp8"), ("before", "fp8"), ("after", "captured")])
def test_ip_adapter_load(order, techniques):
    weights = ip_adapter(build_pipeline("sd15", "tiny").unet)
    embeds = [torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))]
    if order == "after":
        opt, twin = pair("sd15", techniques)
        pipes = (opt, twin)
        for pipe in pipes:
            pipe.load_ip_adapter(copy.deepcopy(weights), subfolder=None, weight_name=None, image_encoder_folder=None)
    else:
        pipes = opt, twin = build_pipeline("sd15", "tiny"), build_pipeline("sd15", "tiny")
        for pipe in pipes:
            pipe.load_ip_adapter(copy.deepcopy(weights), subfolder=None, weight_name=None, image_encoder_folder=None)
            pyext.optimize(pipe, **TECHNIQUES["fp8"])
        pyext.restore(twin)
    with_image = [run(p, "sd15", ip_adapter_image_embeds=embeds) for p in pipes]
    assert_same(*with_image)
    for pipe in pipes:
        pipe.set_ip_adapter_scale(0.0)
    without = [run(p, "sd15", ip_adapter_image_embeds=embeds) for p in pipes]
    assert_same(*without)  # captured: the scale changed inside the processors, and the graphs with it
    assert (with_image[0] - without[0]).abs().max() > 10 * SAME  # the adapter acts
    if techniques == "captured":
        assert graphs.captured(opt.unet).replays > 0
