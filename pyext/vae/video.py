"""diffusers' own tiling for the other VAEs (the 3-D video VAEs of CogVideoX, Wan, LTX-Video and
HunyuanVideo among them), with the linear spatial blend done by pyext's fused tile_blend op.

Their tiled decode and encode blend each tile with the one above and the one to the left by
one Python-level op per overlap row or column (blend_v / blend_h). pyext keeps their tiling as
it is and replaces just those two methods on the instance, where a probe shows the class's
method is that linear blend: the fused op computes the same numbers (same rounding) in one
kernel per blend. Their temporal blend (blend_t) stays theirs.

Some of them (CogVideoX's among them) derive the stride between tiles and the part of each tile
they keep from the tile size and an overlap factor separately, rounding each on its own; where
the two disagree, the tiles' kept parts overlap or leave gaps, and the tiled video comes out the
wrong size (tiling_mismatch). tile_video_vae refuses such tile settings.
"""
from __future__ import annotations

from typing import Optional

import torch

from pyext import _state
from pyext.dispatch import PyextError
from pyext.ops.tile_blend import tile_blend_diffusers
from pyext.vae.geometry import diffusers_tiling_mismatch

STATE = "video_tiling"  # pyext._state key: the names of the methods replaced
_PROBE_EXTENT = 3


def blend_v(a: torch.Tensor, b: torch.Tensor, blend_extent: int) -> torch.Tensor:
    """b's first rows ramped from a's last rows to b's own, as diffusers' blend_v (in place)."""
    e = min(a.shape[-2], b.shape[-2], blend_extent)
    if e <= 0:
        return b
    b = b.contiguous()
    tile_blend_diffusers(b[..., :e, :].contiguous(), b, 0, 0, (e, b.shape[-1]), above=a[..., -e:, :])
    return b


def blend_h(a: torch.Tensor, b: torch.Tensor, blend_extent: int) -> torch.Tensor:
    """b's first columns ramped from a's last columns to b's own, as diffusers' blend_h (in place)."""
    e = min(a.shape[-1], b.shape[-1], blend_extent)
    if e <= 0:
        return b
    b = b.contiguous()
    tile_blend_diffusers(b[..., :e].contiguous(), b, 0, 0, (b.shape[-2], e), left=a[..., -e:])
    return b


FUSED = {"blend_v": blend_v, "blend_h": blend_h}


def _is_linear_blend(vae, name: str) -> bool:
    """Whether the class's `name` method gives what the fused one gives, on a small probe."""
    method = getattr(type(vae), name, None)
    if method is None:
        return False
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1, 2, 2, 5, 6, generator=gen) for _ in range(2))
    try:
        want = method(vae, a.clone(), b.clone(), _PROBE_EXTENT)
    except Exception:  # a blend with another signature: not the linear one
        return False
    return torch.equal(FUSED[name](a.clone(), b.clone(), _PROBE_EXTENT), want)


def tiling_mismatch(vae) -> Optional[str]:
    """Why this VAE's tiled decode or encode would come out the wrong size with its tile settings,
    or None. Only VAEs that tile by an overlap factor (tile_overlap_factor[_height/_width]) can
    mismatch; those that set a stride (Wan, LTX-Video, HunyuanVideo) keep the stride by design."""
    for axis in ("height", "width"):
        tile = getattr(vae, f"tile_sample_min_{axis}", getattr(vae, "tile_sample_min_size", None))
        latent = getattr(vae, f"tile_latent_min_{axis}", getattr(vae, "tile_latent_min_size", None))
        factor = getattr(vae, f"tile_overlap_factor_{axis}", getattr(vae, "tile_overlap_factor", None))
        if not isinstance(tile, int) or not isinstance(latent, int) or factor is None or latent < 1:
            continue
        why = diffusers_tiling_mismatch(f"tile_sample_min_{axis}", tile, latent, factor)
        if why is not None:
            return why
    return None


_TILE_SETTINGS = ("use_tiling", "tile_")  # the instance attributes enable_tiling sets


def tile_video_vae(vae, **tiling) -> dict:
    """diffusers' enable_tiling(**tiling) on this VAE, its linear blend_v / blend_h fused
    (instance only). Tile settings with which the tiled output would be the wrong size
    (tiling_mismatch) raise PyextError, the VAE as it was."""
    if not hasattr(vae, "enable_tiling"):
        return {"patched": False, "class": type(vae).__name__, "reason": f"{type(vae).__name__} has no tiling"}
    before = {k: v for k, v in vae.__dict__.items() if k.startswith(_TILE_SETTINGS)}
    vae.enable_tiling(**tiling)
    why = tiling_mismatch(vae)
    if why is not None:
        for k in [k for k in vae.__dict__ if k.startswith(_TILE_SETTINGS)]:
            del vae.__dict__[k]
        vae.__dict__.update(before)
        raise PyextError(f"pyext.tile_video_vae: {why}")
    fused = [name for name in FUSED if _is_linear_blend(vae, name)]
    for name in fused:
        vae.__dict__[name] = FUSED[name]
    _state.put(vae, STATE, fused)
    return {"patched": True, "class": type(vae).__name__, "tiling": "diffusers", "fused_blends": fused}


def untile_video_vae(vae) -> bool:
    """Undo tile_video_vae: diffusers' blend methods back, tiling off. False if not tiled."""
    fused = _state.pop(vae, STATE)
    if fused is None:
        return False
    for name in fused:
        vae.__dict__.pop(name, None)
    vae.disable_tiling()
    return True
