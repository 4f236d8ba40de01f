"""pyext.offline: pipelines from bundled configs, random seeded weights, no downloads."""
import pytest
import torch

from pyext import PyextError, offline

PROMPT = "a photo of an astronaut riding a horse on mars"


def _run(pipe, arch, seed=0):
    extra = {"max_sequence_length": 32} if arch in ("sd3", "flux") else {}
    return pipe(PROMPT, height=64, width=64, num_inference_steps=2, output_type="pt",
                generator=torch.Generator().manual_seed(seed), **extra).images


def _modules(pipe):
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


@pytest.mark.parametrize("arch", offline.ARCHS)
def test_tiny_pipeline_makes_a_finite_image(arch):
    pipe = offline.build_pipeline(arch, "tiny")
    image = _run(pipe, arch)
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all()
    assert image.std() > 0  # not a constant (e.g. all-black) image
    assert sum(offline.count_parameters(m) for m in _modules(pipe).values()) < 5_000_000


@pytest.mark.parametrize("arch", offline.ARCHS)
def test_weights_are_seeded(arch):
    a, b, c = (offline.build_pipeline(arch, "tiny", seed=s) for s in (0, 0, 1))
    for name, module in _modules(a).items():
        sa, sb, sc = (m.state_dict() for m in (module, _modules(b)[name], _modules(c)[name]))
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{name}: same seed, different weights"
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point()), f"{name}: seed ignored"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_is_applied_and_callers_rng_untouched(dtype):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pipe = offline.build_pipeline("sd15", "tiny", dtype=dtype)
    assert torch.equal(torch.rand(3), expected)  # building did not consume or reseed the caller's stream
    assert all(p.dtype == dtype for m in _modules(pipe).values() for p in m.parameters())
    assert torch.get_default_dtype() == torch.float32


# Published parameter counts of the real checkpoints (millions), to 0.1%.
FULL_COUNTS = {
    "sd15": {"unet": 859.52, "text_encoder": 123.06, "vae": 83.65},
    "sdxl": {"unet": 2567.46, "text_encoder": 123.06, "text_encoder_2": 694.66, "vae": 83.65},
    "sd3": {"transformer": 2028.33, "text_encoder": 123.65, "text_encoder_2": 694.66},
    "flux": {"transformer": 11901.41, "text_encoder_2": 4762.31},
}


@pytest.mark.parametrize("arch", offline.ARCHS)
def test_full_architectures_have_the_published_sizes(arch):
    pipe = offline.build_pipeline(arch, "full", device="meta")
    modules = _modules(pipe)
    for name, millions in FULL_COUNTS[arch].items():
        assert offline.count_parameters(modules[name]) / 1e6 == pytest.approx(millions, rel=1e-3), name


def test_full_sd15_component_shapes():
    pipe = offline.build_pipeline("sd15", "full", device="meta")
    assert tuple(pipe.unet.config.block_out_channels) == (320, 640, 1280, 1280)
    assert pipe.unet.config.cross_attention_dim == 768
    te = pipe.text_encoder.config
    assert (te.hidden_size, te.num_hidden_layers, te.num_attention_heads, te.hidden_act) == (768, 12, 12, "quick_gelu")
    assert pipe.vae.config.scaling_factor == 0.18215
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    assert pipe.safety_checker is None


def test_full_flux_in_fp32_is_refused_and_bad_names_are_named():
    with pytest.raises(PyextError, match="bfloat16"):
        offline.build_pipeline("flux", "full")
    with pytest.raises(PyextError, match="supported archs"):
        offline.build_pipeline("sd2", "tiny")
    with pytest.raises(PyextError, match="dtype"):
        offline.build_pipeline("sd15", "tiny", dtype=torch.int8)


def test_clip_tokenizer_is_byte_level():
    tok = offline.build_pipeline("sd15", "tiny").tokenizer
    ids = tok("mars é", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[0] == 512 and 513 in ids  # bos, eos as in the configs
    assert tok.decode(ids, skip_special_tokens=True).strip() == "mars é"  # every byte round-trips


@pytest.mark.parametrize("arch", offline.ARCHS)
def test_save_and_load_pipeline_round_trip(arch, tmp_path):
    pipe = offline.build_pipeline(arch, "tiny", seed=3)
    pipe.save_pretrained(tmp_path)
    loaded = offline.load_pipeline(str(tmp_path))
    assert type(loaded) is type(pipe)
    for name, module in _modules(pipe).items():
        saved, back = module.state_dict(), _modules(loaded)[name].state_dict()
        assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved), name
    # Same weights, same images; up to float rounding only: a weight read from a file can
    # sit at another memory alignment, which may change a GEMM's summation order (~1e-7).
    torch.testing.assert_close(_run(pipe, arch), _run(loaded, arch), rtol=0, atol=1e-5)
