"""pyext.vae.tile_video_vae: diffusers' tiling on the video VAEs, its linear blend fused."""
import pytest
import torch

from pyext.dispatch import PyextError
from pyext.offline import load_config
from pyext.vae import tile_video_vae, untile_video_vae, video

diffusers = pytest.importorskip("diffusers")

VIDEO_VAES = {"cogvideox": "AutoencoderKLCogVideoX", "wan21": "AutoencoderKLWan", "ltx": "AutoencoderKLLTXVideo",
              "hunyuanvideo": "AutoencoderKLHunyuanVideo"}


def _tiny(arch):
    spec = load_config(arch, "tiny")["components"]["vae"]
    assert spec["class"] == VIDEO_VAES[arch]
    torch.manual_seed(0)
    return getattr(diffusers, spec["class"])(**spec["config"]).eval()


@pytest.mark.parametrize("arch", list(VIDEO_VAES))
def test_video_vaes_get_their_tiling_with_the_fused_blend(arch):
    vae = _tiny(arch)
    report = tile_video_vae(vae)
    assert report["patched"] and report["fused_blends"] == ["blend_v", "blend_h"] and vae.use_tiling
    assert untile_video_vae(vae) and not vae.use_tiling and "blend_v" not in vae.__dict__
    assert not untile_video_vae(vae)


@pytest.mark.parametrize("e", [1, 3, 40])
def test_fused_blends_are_diffusers_numbers(e):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 3, 2, 9, 7, generator=gen), torch.randn(1, 3, 2, 9, 7, generator=gen)
    for name in ("blend_v", "blend_h"):
        want = getattr(diffusers.AutoencoderKLCogVideoX, name)(None, a.clone(), b.clone(), e)
        assert torch.equal(video.FUSED[name](a.clone(), b.clone(), e), want)


def test_a_blend_of_another_kind_is_not_replaced():
    """AutoencoderKL's blend_v ramps dim 2 (rows of a 4-D tile): on the 5-D probe it is not the
    linear row blend, so the probe keeps it."""
    torch.manual_seed(0)
    kl = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4)
    assert not video._is_linear_blend(kl, "blend_v")


@torch.no_grad()
def test_tiled_cogvideox_decode_is_diffusers_own(monkeypatch):
    vae = _tiny("cogvideox")
    z = torch.randn(1, 4, 2, 12, 10, generator=torch.Generator().manual_seed(1))
    tiles = dict(tile_sample_min_height=48, tile_sample_min_width=40)
    vae.enable_tiling(**tiles)
    want = vae.decode(z).sample
    vae.disable_tiling()
    calls = []
    for name, fn in list(video.FUSED.items()):
        monkeypatch.setitem(video.FUSED, name, lambda a, b, e, fn=fn: calls.append(e) or fn(a, b, e))
    tile_video_vae(vae, **tiles)
    calls.clear()  # the probe's calls
    got = vae.decode(z).sample
    assert calls  # the tiles were blended by the fused op
    assert torch.equal(got, want)


def _settings(vae):
    return {k: v for k, v in vars(vae).items() if k.startswith(("use_tiling", "tile_"))}


@torch.no_grad()
@pytest.mark.parametrize("height,width", [(48, 40), (96, 80), (16, 16), (32, 24), (40, 48), (64, 56)])
def test_tile_settings_that_would_give_the_wrong_size_are_refused(height, width):
    """tiling_mismatch agrees with what diffusers' CogVideoX tiling does: where it finds no
    mismatch the tiled decode and encode have the untiled sizes; where it does, diffusers' own
    tiled output has another size, and tile_video_vae refuses, the VAE as it was."""
    vae = _tiny("cogvideox")
    z = torch.randn(1, 4, 2, 13, 11, generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, 3, 5, 104, 88, generator=torch.Generator().manual_seed(2))
    untiled = (vae.decode(z).sample.shape, vae.encode(x).latent_dist.mean.shape)
    tiles = dict(tile_sample_min_height=height, tile_sample_min_width=width)
    vae.enable_tiling(**tiles)
    why = video.tiling_mismatch(vae)
    try:
        theirs = (vae.decode(z).sample.shape, vae.encode(x).latent_dist.mean.shape)
    except RuntimeError as e:  # an edge tile of the mis-strided encode too small for a conv
        theirs = str(e)
    vae.disable_tiling()
    assert (why is None) == (theirs == untiled), (why, theirs, untiled)
    before = _settings(vae)
    if why is None:
        tile_video_vae(vae, **tiles)
        assert (vae.decode(z).sample.shape, vae.encode(x).latent_dist.mean.shape) == untiled
        return
    with pytest.raises(PyextError, match=r"pyext.tile_video_vae: tile_sample_min_(height|width)=\d+ .* wrong size; "
                                         r".* works"):
        tile_video_vae(vae, **tiles)
    assert _settings(vae) == before and "blend_v" not in vars(vae)


def test_stride_tiled_vaes_never_mismatch():
    """Wan's tiling sets a stride: no overlap factor to disagree with."""
    vae = _tiny("wan21")
    vae.enable_tiling(tile_sample_min_height=40, tile_sample_min_width=56)
    assert video.tiling_mismatch(vae) is None


@torch.no_grad()
@pytest.mark.parametrize("sample_size", [32, 36, 40])
def test_two_d_overlap_factor_tiling_is_checked_by_its_one_tile_size(sample_size):
    """VAEs with one square tile size (tile_sample_min_size, AutoencoderKL's convention) are
    checked alike: the mismatch found is the one diffusers' tiled decode shows."""
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), norm_num_groups=4, sample_size=sample_size).eval()
    z = torch.randn(1, 4, 45, 41, generator=torch.Generator().manual_seed(1))
    untiled = vae.decode(z).sample.shape
    vae.enable_tiling()
    assert (video.tiling_mismatch(vae) is None) == (vae.decode(z).sample.shape == untiled)
    assert (video.tiling_mismatch(vae) is None) == (sample_size != 36)
