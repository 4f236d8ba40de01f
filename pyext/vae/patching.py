"""tile_vae / untile_vae: pyext's tiling on one AutoencoderKL instance, and back."""
from __future__ import annotations

import dataclasses
import types

from pyext import _compat, _state
from pyext.vae.config import TilingConfig, fail
from pyext.vae.geometry import diffusers_tiling_mismatch
from pyext.vae.tiling import tiled_run

STATE = "tiling"  # pyext._state key on a tiled VAE
_PATCHED = ("tiled_decode", _compat.VAE_TILED_ENCODE, "tiled_encode")
_SETTINGS = ("tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor", "use_tiling")


def _is_autoencoder_kl(vae) -> bool:
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        return False
    return isinstance(vae, AutoencoderKL)


def _config(config, options) -> TilingConfig:
    if config is not None:
        if options:
            fail(f"pass a TilingConfig or keyword options, not both (got config and {sorted(options)})")
        if not isinstance(config, TilingConfig):
            fail(f"config must be a pyext.vae.TilingConfig, got {type(config).__name__}")
        return config
    known = [f.name for f in dataclasses.fields(TilingConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        fail(f"unknown option(s) {unknown}; the options are {known}")
    return TilingConfig(**options)


def tile_vae(vae, config: TilingConfig | None = None, **options) -> dict:
    """Make this AutoencoderKL instance decode/encode large images with pyext's tiling.

    `config` (or the same fields as keywords, see TilingConfig): the default is the exact
    method. Patches the instance's tiled_decode / _tiled_encode / tiled_encode (never the class,
    never forward, so accelerate offload hooks keep working); diffusers' _decode / _encode
    still decide when to tile (use_tiling and an input larger than a tile), and decode() /
    encode() still split the batch when use_slicing is on. Returns a report dict; other VAE
    classes, and the exact method on a VAE whose tiled blocks have attention, are left alone
    (they keep diffusers' own tiling) and the report says why.
    """
    config = _config(config, options)
    if not _is_autoencoder_kl(vae):
        return {"patched": False, "class": type(vae).__name__,
                "reason": "pyext tiling supports AutoencoderKL only; this VAE keeps diffusers' own tiling"}
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if config.tile_size is not None and config.tile_size % factor:
        fail(f"tile_size must be a multiple of this VAE's downsampling factor {factor} pixels, got {config.tile_size}")
    if config.method == "diffusers":  # its grid as diffusers' own: refused where that gives the wrong size
        tile = vae.tile_sample_min_size if config.tile_size is None else config.tile_size
        latent = vae.tile_latent_min_size if config.tile_size is None else config.tile_size // factor
        overlap = vae.tile_overlap_factor if config.overlap is None else config.overlap
        why = diffusers_tiling_mismatch("tile_size", tile, latent, overlap)
        if why is not None:
            fail(f"method 'diffusers': {why}")
    if config.method == "exact":
        from pyext.vae import stages
        tiled = [s for kind in ("decode", "encode") for s in stages.split(stages.steps_of(vae, kind), kind)[1]]
        if stages.has_attention(tiled):
            return {"patched": False, "class": type(vae).__name__,
                    "reason": "method 'exact' needs up/down blocks without attention; this VAE keeps diffusers' own "
                              "tiling (method 'tiles' or 'diffusers' would tile it)"}
    if _state.get(vae, STATE) is not None:
        untile_vae(vae)
    state = {"saved": {name: vae.__dict__.get(name) for name in _PATCHED},
             "settings": {k: getattr(vae, k) for k in _SETTINGS}}
    if config.tile_size is not None:
        vae.tile_sample_min_size, vae.tile_latent_min_size = config.tile_size, config.tile_size // factor
    if config.overlap is not None:
        vae.tile_overlap_factor = config.overlap
    if config.enable:
        vae.use_tiling = True

    def tiled_decode(self, z, return_dict=True):
        from diffusers.models.autoencoders.vae import DecoderOutput
        dec = tiled_run(self, z, "decode", config)
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    def _tiled_encode(self, x):
        return tiled_run(self, x, "encode", config)

    def tiled_encode(self, x, return_dict=True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        posterior = DiagonalGaussianDistribution(_tiled_encode(self, x))
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    for name, fn in zip(_PATCHED, (tiled_decode, _tiled_encode, tiled_encode)):
        vae.__dict__[name] = types.MethodType(fn, vae)
    _state.put(vae, STATE, state)
    return {"patched": True, "class": type(vae).__name__, **dataclasses.asdict(config),
            **{k: getattr(vae, k) for k in _SETTINGS}, "use_slicing": getattr(vae, "use_slicing", False)}


def untile_vae(vae) -> bool:
    """Undo tile_vae on this instance (methods and tile settings); False if it was not tiled."""
    state = _state.pop(vae, STATE)
    if state is None:
        return False
    for name, old in state["saved"].items():
        if old is None:
            vae.__dict__.pop(name, None)
        else:
            vae.__dict__[name] = old
    for k, v in state["settings"].items():
        setattr(vae, k, v)
    return True
