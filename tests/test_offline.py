"""pyext.offline: pipelines from bundled configs, random seeded weights, no downloads."""
import pytest
import torch

from pyext import PyextError, offline


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run as fast on one thread, and two threads on two shared cores stall in
    OpenMP barriers whenever another process holds a core (a 0.1 s run then takes 5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _modules(pipe):
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


def _expected_shape(arch):
    call = offline.example_call(arch)
    image = (3, call["height"], call["width"])
    return (1, call["num_frames"], *image) if "num_frames" in call else (1, *image)


@pytest.fixture(scope="module")
def tiny():
    """arch -> (the tiny pipeline of random seed 0, its run_example output): built once for the module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            pipe = offline.build_pipeline(arch, "tiny")
            cache[arch] = pipe, offline.run_example(pipe, arch)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", offline.ARCHS)
def test_tiny_pipeline_makes_a_finite_deterministic_output(arch, tiny):
    pipe, out = tiny(arch)
    assert out.shape == _expected_shape(arch)
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() <= 1
    assert out.std() > 0  # not a constant (e.g. all-black) output
    assert torch.equal(offline.run_example(pipe, arch), out)  # same seed, same output
    assert sum(offline.count_parameters(m) for m in _modules(pipe).values()) < 5_000_000


@pytest.mark.parametrize("arch", ["sd15", "sdxl", "sd3", "flux"])
def test_run_example_is_the_plain_call(arch, tiny):
    pipe, out = tiny(arch)
    extra = {"max_sequence_length": 32} if arch in ("sd3", "flux") else {}
    plain = pipe(offline.PROMPT, height=64, width=64, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(0), **extra).images
    assert torch.equal(plain, out)


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


@pytest.mark.parametrize("arch", [a for a in offline.ARCHS if "full" in offline.SIZES[a]])
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


def test_cogvideox_bench_is_cogvideox_2b_with_a_two_layer_t5_xxl():
    pipe = offline.build_pipeline("cogvideox", "bench", device="meta")
    tr, vae, t5 = pipe.transformer.config, pipe.vae.config, pipe.text_encoder.config
    # CogVideoX-2b's published configs (the 5b differs in layers, heads, RoPE and VAE scaling).
    assert (tr.num_layers, tr.num_attention_heads, tr.attention_head_dim) == (30, 30, 64)
    assert (tr.in_channels, tr.patch_size, tr.sample_frames, tr.sample_height, tr.sample_width) == (16, 2, 49, 60, 90)
    assert (tr.text_embed_dim, tr.time_embed_dim, tr.max_text_seq_length) == (4096, 512, 226)
    assert not tr.use_rotary_positional_embeddings
    assert (tuple(vae.block_out_channels), vae.latent_channels, vae.layers_per_block) == ((128, 256, 256, 512), 16, 3)
    assert vae.scaling_factor == 1.15258426
    assert (t5.d_model, t5.d_ff, t5.num_heads, t5.d_kv, t5.vocab_size, t5.num_layers) == (4096, 10240, 64, 64, 32128, 2)
    # ~1.69B: the 2b transformer's size (its bf16 weights are a 3.4 GB file); no exact published count checked.
    assert offline.count_parameters(pipe.transformer) == pytest.approx(1.69e9, rel=5e-3)
    assert sum(offline.count_parameters(m) for m in _modules(pipe).values()) * 4 < 10e9  # fp32 weights
    call = offline.example_call("cogvideox", "bench")
    assert (call["num_frames"] - 1) % vae.temporal_compression_ratio == 0  # 4k+1 frames
    assert call["height"] % 16 == 0 and call["width"] % 16 == 0
    assert call["max_sequence_length"] == tr.max_text_seq_length  # its text positions are fixed


def test_refusals_name_what_exists():
    with pytest.raises(PyextError, match="bfloat16"):
        offline.build_pipeline("flux", "full")
    with pytest.raises(PyextError, match="supported archs"):
        offline.build_pipeline("sd2", "tiny")
    with pytest.raises(PyextError, match=r"'full' for arch 'cogvideox'; it has \('tiny', 'bench'\)"):
        offline.load_config("cogvideox", "full")
    with pytest.raises(PyextError, match=r"'bench' for arch 'sd15'; it has \('tiny', 'full'\)"):
        offline.build_pipeline("sd15", "bench")
    with pytest.raises(PyextError, match="dtype"):
        offline.build_pipeline("sd15", "tiny", dtype=torch.int8)


def test_clip_tokenizer_is_byte_level():
    tok = offline.build_pipeline("sd15", "tiny").tokenizer
    ids = tok("mars é", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[0] == 512 and 513 in ids  # bos, eos as in the configs
    assert tok.decode(ids, skip_special_tokens=True).strip() == "mars é"  # every byte round-trips


# flux_tiny's T5 embeds 128 ids but the T5 tokenizer has 192 (a capital after a space, e.g.
# "▁E", is id 128+): kept as is, since resizing the embedding would change flux's seeded weights.
_FLUX_T5_VOCAB = pytest.mark.xfail(strict=True, reason="flux_tiny T5 vocab_size 128 < 192 tokenizer ids")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=_FLUX_T5_VOCAB) if a == "flux" else a for a in offline.ARCHS])
def test_every_token_id_fits_its_text_encoder(arch):
    parts = offline.build_pipeline(arch, "tiny", device="meta").components
    for name in [n for n, part in parts.items() if "tokenizer" in n and part is not None]:
        tok, encoder = parts[name], parts[name.replace("tokenizer", "text_encoder")]
        assert len(tok) <= encoder.get_input_embeddings().num_embeddings, name
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # where both define one, they agree
            ids = getattr(tok, special), getattr(encoder.config, special, None)
            assert None in ids or ids[0] == ids[1], (name, special, ids)


@pytest.mark.parametrize("arch,kind", [("qwenimage", "Qwen2Tokenizer"), ("hunyuanvideo", "TokenizersBackend")])
def test_word_bpe_tokenizers_keep_the_templates_token_counts(arch, kind, tiny):
    pipe, _ = tiny(arch)
    tok = pipe.tokenizer
    assert type(tok).__name__ == kind
    if arch == "qwenimage":  # the pipeline drops its template's first 34 tokens (the system turn)
        template, crop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    else:  # HunyuanVideo crops its default template's first 95 tokens
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
        template, crop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    ids = tok(template.format(offline.PROMPT)).input_ids
    assert len(tok(template.split("{}")[0]).input_ids) == crop
    # What is left after the crop starts with the prompt, one token per word.
    words = len(offline.PROMPT.split())
    assert tok.decode(ids[crop:crop + words]).strip() == offline.PROMPT
    assert tok.decode(tok("zebra é 42").input_ids, skip_special_tokens=True) == "zebra é 42"  # unknown words: bytes


# diffusers 0.42 records Stable Cascade's VQGAN in model_index.json as ["diffusers", "PaellaVQModel"],
# a class diffusers no longer exports (it moved to the deprecated Wuerstchen pipelines), so
# from_pretrained cannot load the folder it saved, not even with the VQGAN passed in.
_UNLOADABLE = pytest.mark.skip(reason="diffusers cannot load the PaellaVQModel it saves")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=_UNLOADABLE) if a == "stable_cascade" else a
                                  for a in offline.ARCHS])
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
    torch.testing.assert_close(offline.run_example(pipe, arch), offline.run_example(loaded, arch), rtol=0, atol=1e-5)
