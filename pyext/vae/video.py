"""diffusers' own tiling for the other VAEs (the 3-D video VAEs of CogVideoX, Wan, LTX-Video and
HunyuanVideo among them), with the linear spatial blend done by pyext's fused tile_blend op.

Their tiled decode and encode blend each tile with the one above and the one to the left by
one Python-level op per overlap row or column (blend_v / blend_h). pyext keeps their tiling as
it is and replaces just those two methods on the instance, where a probe shows the class's
method is that linear blend: the fused op computes the same numbers (same rounding) in one
kernel per blend. Their temporal blend (blend_t) stays theirs.
"""
from __future__ import annotations

import torch

from pyext import _state
from pyext.ops.tile_blend import tile_blend_diffusers

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


def tile_video_vae(vae, **tiling) -> dict:
    """diffusers' enable_tiling(**tiling) on this VAE, its linear blend_v / blend_h fused
    (instance only)."""
    if not hasattr(vae, "enable_tiling"):
        return {"patched": False, "class": type(vae).__name__, "reason": f"{type(vae).__name__} has no tiling"}
    vae.enable_tiling(**tiling)
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
