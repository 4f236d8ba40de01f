"""pyext.vae: patching, configuration, the "diffusers" and "tiles" methods, the lean mid-block
attention (small random VAEs)."""
import pytest
import torch

from pyext.dispatch import PyextError
from pyext.ops.tile_blend import edge_weights
from pyext.vae import TilingConfig, stages, tile_vae, tiled_run, untile_vae
from pyext.vae.geometry import equal_cores, grid, overlapping_cores
from pyext.vae.tiling import Plan

diffusers = pytest.importorskip("diffusers")


def _vae(dtype=torch.float32, seed=0):
    """A small AutoencoderKL: 4x down/up-sampling, 16-latent (64-pixel) tiles, one attention block."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(block_out_channels=(32, 64, 64), down_block_types=("DownEncoderBlock2D",) * 3,
                                  up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=8,
                                  layers_per_block=1, sample_size=64)
    return vae.eval().to(dtype)


def _psnr(a, b):
    mse = ((a.float() - b.float()) ** 2).mean()
    return float(10 * torch.log10((b.max() - b.min()).float() ** 2 / mse))


@pytest.fixture(scope="module")
def vae():
    return _vae()


@torch.no_grad()
@pytest.mark.parametrize("shape", [(1, 4, 40, 37), (2, 4, 33, 20)])
def test_diffusers_method_equals_diffusers_tiled_decode(vae, shape):
    z = torch.randn(shape)
    vae.enable_tiling()
    want = vae.decode(z).sample
    tile_vae(vae, method="diffusers")
    try:
        got = vae.decode(z).sample
    finally:
        untile_vae(vae)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@torch.no_grad()
def test_diffusers_method_equals_diffusers_tiled_encode(vae):
    x = torch.randn(1, 3, 150, 133)
    vae.enable_tiling()
    want = vae.encode(x).latent_dist.mean
    tile_vae(vae, TilingConfig(method="diffusers"))
    try:
        got = vae.encode(x).latent_dist.mean
        got_public = vae.tiled_encode(x).latent_dist.mean
    finally:
        untile_vae(vae)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_public, want, rtol=0, atol=1e-6)


@torch.no_grad()
def test_diffusers_method_refuses_tiles_that_give_the_wrong_size(vae):
    """72-px tiles (18 latent) with a quarter overlap: diffusers' tiled decode keeps 54 px of each
    tile where the tiles start every 52, so its output is too large. Method 'diffusers' refuses
    that, in tile_vae before anything changes and in tiled_run, and names sizes that fit."""
    z = torch.randn(1, 4, 45, 41)
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 72, 18
    try:
        assert vae.decode(z).sample.shape[-2:] != (180, 164)  # diffusers' own tiling: the wrong size
    finally:
        vae.tile_sample_min_size, vae.tile_latent_min_size = 64, 16
        vae.disable_tiling()
    before = dict(vars(vae))
    with pytest.raises(PyextError, match=r"pyext.tile_vae: method 'diffusers': tile_size=72 with overlap factor "
                                         r"0.25 .* wrong size; with this factor, tile_size 64 or 80 works"):
        tile_vae(vae, method="diffusers", tile_size=72)
    assert vars(vae) == before
    vae.tile_sample_min_size, vae.tile_latent_min_size = 72, 18
    try:
        with pytest.raises(PyextError, match="tile_size=72"):
            tiled_run(vae, z, "decode", TilingConfig(method="diffusers"))
    finally:
        vae.tile_sample_min_size, vae.tile_latent_min_size = 64, 16


@torch.no_grad()
def test_exact_is_the_default_and_the_untiled_decode(vae):
    z = torch.randn(1, 4, 40, 37)
    report = tile_vae(vae)
    try:
        assert report["patched"] and report["method"] == "exact" and report["use_tiling"]
        got = vae.decode(z).sample
        encoded = vae.encode(got).latent_dist.mean
    finally:
        untile_vae(vae)
    vae.disable_tiling()
    torch.testing.assert_close(got, vae.decode(z).sample, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(encoded, vae.encode(got).latent_dist.mean, rtol=1e-4, atol=1e-4)


def _in_memory_tiles(vae, z):
    """The "tiles" method without streaming: every tile kept, blended with a full weight image."""
    plan = Plan(vae, "decode", TilingConfig(method="tiles"))
    h = stages.run(plan.before, z)
    ctx = plan.context()
    rows, cols = (overlapping_cores(n, plan.tile_in, ctx, plan.overlap) for n in h.shape[-2:])
    f = plan.factor
    out = torch.zeros(z.shape[0], 3, z.shape[-2] * f, z.shape[-1] * f)
    wsum = torch.zeros(out.shape[-2:])

    def ramp(spans, i):
        before = spans[i - 1][1] - spans[i][0] if i > 0 else 0
        after = spans[i][1] - spans[i + 1][0] if i + 1 < len(spans) else 0
        return edge_weights((spans[i][1] - spans[i][0]) * f, max(before, 0) * f, max(after, 0) * f)

    for r, ys in enumerate(rows):
        for c, xs in enumerate(cols):
            w = ramp(rows, r)[:, None] * ramp(cols, c)[None, :]
            sy, sx = slice(ys[0] * f, ys[1] * f), slice(xs[0] * f, xs[1] * f)
            out[..., sy, sx] += plan.run_window(h, ys, xs, ctx) * w
            wsum[sy, sx] += w
    return out / wsum


@torch.no_grad()
def test_tiles_method_streams_what_an_in_memory_blend_gives(vae):
    z = torch.randn(1, 4, 44, 39)
    got = tiled_run(vae, z, "decode", TilingConfig(method="tiles"))
    torch.testing.assert_close(got, _in_memory_tiles(vae, z), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_tiles_method_is_closer_to_the_full_decode_than_diffusers():
    """Per-tile statistics, but the mid block on the whole latent and real neighbours around
    each tile: closer to the full decode than diffusers' tiling."""
    vae = _vae(seed=1)
    z = torch.randn(1, 4, 48, 48, generator=torch.Generator().manual_seed(1))
    full = vae.decode(z).sample
    vae.enable_tiling()
    theirs = _psnr(vae.decode(z).sample, full)
    ours = _psnr(tiled_run(vae, z, "decode", TilingConfig(method="tiles")), full)
    assert ours >= theirs + 3.0, (ours, theirs)


def test_grids():
    assert grid(10, 4, 3) == [(0, 4), (3, 7), (6, 10), (9, 10)]
    for n in range(1, 200, 7):
        for tile, unit in ((16, 1), (64, 8), (5, 8)):
            spans = equal_cores(n, tile, unit)
            assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(a % unit == 0 for a, _ in spans)
            assert max(b - a for a, b in spans) <= max(unit, tile)
            assert len(spans) == -(-n // max(unit, tile // unit * unit))  # the fewest that fit
        spans = overlapping_cores(n, 64, 7, 0.25, 8)
        assert all(b - a <= 48 for a, b in spans) and spans[-1][1] == n
        assert len(overlapping_cores(n, 16, 7, 0.25)) <= -(-n // 3)  # cores of 4, stride 3: not 1-px slivers


@torch.no_grad()
def test_small_images_decode_in_one_piece(vae):
    z = torch.randn(1, 4, 16, 12)
    want = vae.decoder(vae.post_quant_conv(z))
    tile_vae(vae)
    try:
        got = vae.decode(z).sample
    finally:
        untile_vae(vae)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.no_grad()
def test_untile_restores_behaviour_and_settings(vae):
    z = torch.randn(1, 4, 40, 40)
    vae.disable_tiling()
    before = {k: getattr(vae, k) for k in ("tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor")}
    report = tile_vae(vae, method="tiles", tile_size=48, overlap=0.5)
    assert report["patched"] and vae.use_tiling and vae.tile_latent_min_size == 12 and vae.tile_overlap_factor == 0.5
    assert "tiled_decode" in vae.__dict__ and "_tiled_encode" in vae.__dict__
    assert untile_vae(vae) and not untile_vae(vae)
    assert not any(k in vae.__dict__ for k in ("tiled_decode", "_tiled_encode", "tiled_encode", "_pyext_tiling"))
    assert {k: getattr(vae, k) for k in before} == before and not vae.use_tiling
    vae.enable_tiling()
    torch.testing.assert_close(vae.decode(z).sample, vae.tiled_decode(z).sample, rtol=0, atol=0)
    assert type(vae).tiled_decode is diffusers.AutoencoderKL.tiled_decode  # the class was never touched
    vae.disable_tiling()


@torch.no_grad()
def test_disable_tiling_after_tile_vae_is_honoured(vae):
    z = torch.randn(1, 4, 40, 40)
    tile_vae(vae)
    try:
        vae.disable_tiling()
        got = vae.decode(z).sample
    finally:
        untile_vae(vae)
    torch.testing.assert_close(got, vae.decoder(vae.post_quant_conv(z)), rtol=0, atol=0)


@torch.no_grad()
def test_slicing_decodes_one_image_at_a_time(vae):
    z = torch.randn(2, 4, 20, 18)
    tile_vae(vae, method="tiles")
    try:
        vae.enable_slicing()
        batched = vae.decode(z).sample
        vae.disable_slicing()
        single = torch.cat([vae.decode(z[i:i + 1]).sample for i in range(2)])
    finally:
        untile_vae(vae)
    torch.testing.assert_close(batched, single, rtol=0, atol=0)


@torch.no_grad()
def test_composes_with_accelerate_offload_hooks():
    """GroupNorm calls are intercepted by a TorchFunctionMode, not by replacing forwards, so
    accelerate's hooks on every module keep working and are left as they were."""
    accelerate = pytest.importorskip("accelerate")
    z = torch.randn(1, 4, 40, 40)
    hooked = _vae(seed=3)
    want = hooked.decoder(hooked.post_quant_conv(z))
    accelerate.cpu_offload(hooked, execution_device=torch.device("cpu"))
    norm = hooked.decoder.conv_norm_out
    assert hasattr(norm, "_hf_hook")
    forward_before = norm.__dict__.get("forward")
    tile_vae(hooked)
    got = hooked.decode(z).sample
    untile_vae(hooked)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert norm.__dict__.get("forward") is forward_before and "_old_forward" in norm.__dict__


def test_other_vae_classes_keep_diffusers_tiling():
    tiny = diffusers.AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                                     num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1))
    report = tile_vae(tiny)
    assert report["patched"] is False and "keeps diffusers' own tiling" in report["reason"]
    assert "tiled_decode" not in tiny.__dict__


def test_exact_needs_tiled_blocks_without_attention():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(16, 16), down_block_types=("AttnDownEncoderBlock2D",) * 2,
                                  up_block_types=("AttnUpDecoderBlock2D",) * 2, norm_num_groups=4)
    report = tile_vae(vae)
    assert report["patched"] is False and "without attention" in report["reason"]
    with pytest.raises(PyextError, match="method 'exact' needs a tiled part without attention"):
        tiled_run(vae, torch.zeros(1, 4, 40, 40), "decode")
    assert tile_vae(vae, method="tiles")["patched"]


@pytest.mark.parametrize("options,message", [
    (dict(method="fancy"), "method must be one of ('exact', 'tiles', 'diffusers'), got 'fancy'"),
    (dict(tile_size=30), "tile_size must be a multiple of this VAE's downsampling factor 4 pixels, got 30"),
    (dict(tile_size=0), "tile_size must be a positive int"),
    (dict(method="tiles", overlap=1.5), "overlap must be a fraction in [0, 1)"),
    (dict(overlap=0.25), "overlap applies to method 'tiles' or 'diffusers'"),
    (dict(context=4), "context applies to method 'tiles' only"),
    (dict(method="tiles", context=-1), "context must be a non-negative int"),
    (dict(enable="yes"), "enable must be True or False"),
    (dict(compact_state=1), "compact_state must be True or False, got 1"),
    (dict(method="tiles", compact_state=True), "compact_state applies to method 'exact' only"),
    (dict(method="tiles", state_dir="."), "state_dir applies to method 'exact' only"),
    (dict(state_dir="/no/such/directory"), "state_dir must be an existing directory, 'auto' or None, got '/no/such/directory'"),
    (dict(state_dir=3), "state_dir must be an existing directory, 'auto' or None, got 3"),
    (dict(state_dir=None, state_memory_mib=64), "state_memory_mib applies with state_dir only"),
    (dict(state_memory_mib=-1), "state_memory_mib must be a non-negative int (MiB), got -1"),
    (dict(state_memory_mib=1.5), "state_memory_mib must be a non-negative int (MiB), got 1.5"),
    (dict(exact_layers=2), "unknown option(s) ['exact_layers']; the options are"),
])
def test_bad_options_name_what_is_wrong(vae, options, message):
    with pytest.raises(PyextError, match="pyext.tile_vae: " + __import__("re").escape(message)):
        tile_vae(vae, **options)
    assert "_pyext_tiling" not in vae.__dict__


def test_config_and_options_do_not_mix(vae):
    with pytest.raises(PyextError, match="not both"):
        tile_vae(vae, TilingConfig(), method="tiles")
    with pytest.raises(PyextError, match="kind must be 'decode' or 'encode'"):
        tiled_run(vae, torch.zeros(1, 4, 8, 8), "decoder")
    with pytest.raises(Exception):  # frozen
        TilingConfig().method = "tiles"


@torch.no_grad()
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_attention_equals_the_layer(monkeypatch, heads, dtype):
    """The memory-lean mid-block attention (chunked queries through pyext.ops.attention, output
    over the normed input) is the layer's own forward up to rounding, with chunks that do not
    divide the token count."""
    from diffusers.models.attention_processor import Attention
    torch.manual_seed(0)
    attn = Attention(32, heads=heads, dim_head=32 // heads, rescale_output_factor=2.0, eps=1e-6, norm_num_groups=8,
                     residual_connection=True, bias=True, upcast_softmax=True, _from_deprecated_attn_block=True)
    attn = attn.eval().to(dtype)
    assert stages.lean_attention_unsupported(attn) is None
    x = torch.randn(2, 32, 7, 9, dtype=dtype)
    monkeypatch.setattr(stages, "QUERY_CHUNK", 10)  # 63 tokens: 7 chunks, the last of 3
    calls = []
    real = stages.ops.attention
    monkeypatch.setattr(stages.ops, "attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got, want = stages.lean_self_attention(attn, x.clone()), attn(x)
    assert len(calls) == 7
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    attn.set_processor(diffusers.models.attention_processor.AttnAddedKVProcessor())
    assert "processor" in stages.lean_attention_unsupported(attn)  # any other processor: the layer itself runs


@torch.no_grad()
def test_untiled_part_uses_lean_attention(vae, monkeypatch):
    calls = []
    real = stages.lean_self_attention
    monkeypatch.setattr(stages, "lean_self_attention", lambda a, x: calls.append(a) or real(a, x))
    tiled_run(vae, torch.randn(1, 4, 40, 40), "decode", TilingConfig(method="tiles"))
    assert calls and all(a is vae.decoder.mid_block.attentions[0] for a in calls)


@torch.no_grad()
def test_exact_run_tiles_the_mid_block_and_attends_over_the_folded_normed_input(vae, monkeypatch):
    """The exact run tiles every step, the mid block's resnets too; its attention runs once over
    the whole image with the normed tokens as both keys and values (channels wide, one tensor),
    in bands of at most QUERY_CHUNK queries, and the result is the untiled decode's."""
    from pyext.vae import exact
    z = torch.randn(1, 4, 40, 40)
    monkeypatch.setattr(stages, "QUERY_CHUNK", 100)  # bands of 2 of the 40 rows
    runs, attended = [], []
    real_run, real_attention = stages.run, exact.ops.attention
    monkeypatch.setattr(stages, "run", lambda steps, *t: runs.append(list(steps)) or real_run(steps, *t))
    monkeypatch.setattr(exact.ops, "attention", lambda q, k, v, **kw: attended.append((q, k, v)) or real_attention(q, k, v, **kw))
    got = tiled_run(vae, z, "decode")
    assert all(s.module is not vae.decoder.mid_block.attentions[0] for steps in runs for s in steps)
    mid = vae.decoder.mid_block.resnets[0]
    assert sum(any(mid.norm1 in list(s.module.modules()) for s in steps) for steps in runs) > 1
    channels = vae.decoder.mid_block.attentions[0].group_norm.num_channels
    assert attended and all(k is v and k.shape[-2:] == (40 * 40, channels) for _, k, v in attended)
    assert len(attended) == 20 and {q.shape[-2] for q, _, _ in attended} == {80}
    torch.testing.assert_close(got, vae.decoder(vae.post_quant_conv(z)), rtol=1e-4, atol=1e-4)
