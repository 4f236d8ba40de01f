"""pyext.vae.tile_video_vae: diffusers' tiling on the video VAEs, its linear blend fused."""
import pytest
import torch

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
    tiles = dict(tile_sample_min_height=32, tile_sample_min_width=24)
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
