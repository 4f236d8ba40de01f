"""Every private upstream name pyext uses resolves in the installed diffusers/accelerate/torch.

A rename upstream fails here, by name, instead of silently turning a technique off."""
import torch

from pyext import _compat


def test_private_names_resolve():
    assert _compat.check_names() == {}
    assert _compat.SDPA is torch.nn.functional.scaled_dot_product_attention


def test_private_attributes_are_where_pyext_reads_them(tmp_path):
    import accelerate
    from diffusers import AutoencoderKL

    from pyext.offline import build_pipeline

    pipe = build_pipeline("sd15", "tiny")
    pipe.enable_model_cpu_offload(device="cpu")
    assert _compat.pipeline_model_hooks(pipe) and _compat.pipeline_offload_device(pipe) is not None
    assert _compat.has_accelerate_hook(pipe.unet) and hasattr(pipe.unet, _compat.ACCELERATE_OLD_FORWARD)
    pipe.remove_all_hooks()
    pipe.unet.enable_group_offload(onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)
    config = _compat.group_offload_config(pipe.unet)
    assert config is not None and _compat.has_diffusers_hooks(pipe.unet)
    _compat.remove_group_offload(pipe.unet)
    assert _compat.group_offload_config(pipe.unet) is None
    _compat.apply_group_offload(pipe.unet, config)
    assert _compat.group_offload_config(pipe.unet) is not None
    assert callable(getattr(AutoencoderKL, _compat.VAE_TILED_ENCODE))
    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    assert hasattr(conv, _compat.CONV_PADDING)
    linear = torch.nn.Linear(2, 2)
    linear.compile()
    assert _compat.is_compiled_in_place(linear)
    _compat.uncompile_in_place(linear)
    assert not _compat.is_compiled_in_place(linear)
    assert _compat.compiled_original(torch.compile(linear)) is linear
    assert accelerate.__version__


def test_context_parallel_attributes_are_where_pyext_reads_them():
    from diffusers import ContextParallelConfig
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from pyext.offline import build_pipeline

    model = build_pipeline("flux", "tiny").transformer
    assert "hidden_states" in _compat.context_parallel_plan(model)[""]
    assert hasattr(model, _compat.PARALLEL_CONFIG) and _compat.context_parallel_degrees(model) is None
    processor = FluxAttnProcessor()
    assert _compat.knows_context_parallelism(processor) and _compat.context_parallel_groups(processor) is None
    assert {_compat.RING_MESH, _compat.ULYSSES_MESH} <= set(ContextParallelConfig.__dataclass_fields__)
    # SD3's joint attention calls SDPA itself: enable_parallelism gives it no config
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    assert not _compat.knows_context_parallelism(JointAttnProcessor2_0())
    plan = _compat.diffusers_cp_plan([("transformer_blocks.0", "hidden_states")], ["proj_out"])
    assert plan["transformer_blocks.0"]["hidden_states"].split_dim == 1 and plan["proj_out"].gather_dim == 1
    config = object()
    setattr(processor, _compat.PARALLEL_CONFIG, config)
    restore = _compat.take_parallel_config(processor)
    assert getattr(processor, _compat.PARALLEL_CONFIG) is None
    restore()
    assert getattr(processor, _compat.PARALLEL_CONFIG) is config
    # Wan keeps cross-attention local (its text is not split); Flux splits its joint attention
    assert _compat.splits_self_attention_only(WanAttnProcessor()) and not _compat.splits_self_attention_only(processor)


def test_model_metadata():
    from diffusers import WanTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    wan = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    assert "time_embedder" in _compat.keep_in_fp32_modules(wan, torch.bfloat16)
    assert _compat.keep_in_fp32_modules(wan, torch.float32) == []
    assert "norm" in _compat.skip_layerwise_casting_patterns(wan)
    t5 = T5EncoderModel(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64))
    assert _compat.keep_in_fp32_modules(t5, torch.float16) == ["wo"]
    assert _compat.keep_in_fp32_modules(t5, torch.bfloat16) == []  # transformers keeps them for fp16 only


@torch.no_grad()
def test_vae_steps_are_the_diffusers_forwards():
    """pyext.vae.stages re-implements AutoencoderKL's Decoder/Encoder forwards as steps: run in
    order (the resnets also as their two halves back to back), they must give diffusers' own decode
    and encode."""
    from diffusers import AutoencoderKL

    from pyext.vae import stages

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        layers_per_block=2).eval()
    z, x = torch.randn(1, 4, 9, 11), torch.randn(1, 3, 18, 22)
    for kind, inp, want in (("decode", z, vae.decode(z).sample), ("encode", x, vae.encode(x).latent_dist.parameters)):
        steps = stages.steps_of(vae, kind)
        for variant in (steps, [stages.whole_resnet(s) for s in steps]):
            torch.testing.assert_close(stages.run(variant, inp), want, rtol=1e-5, atol=1e-5)


def test_diffusers_hook_registry_still_ties_a_deepcopy_to_the_original():
    """Why attention routing and VAE tiling keep torch's own hooks (docs/decisions.md): a model
    hooked through diffusers' HookRegistry deep-copies into a model that computes with the
    original's weights. When this fails, upstream changed, and that choice can be revisited."""
    import copy

    from diffusers.hooks import HookRegistry, ModelHook

    linear = torch.nn.Linear(3, 3)
    HookRegistry.check_if_exists_or_initialize(linear).register_hook(ModelHook(), "probe")
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.randn(2, 3)
    assert torch.equal(twin(x), linear(x)) and linear(x).abs().sum() > 0
