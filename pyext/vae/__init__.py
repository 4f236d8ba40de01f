"""Tiled VAE decode and encode for diffusers' AutoencoderKL.

    from pyext.vae import tile_vae, untile_vae, TilingConfig
    tile_vae(pipe.vae)                            # exact (the default method)
    tile_vae(pipe.vae, method="tiles", tile_size=256)
    untile_vae(pipe.vae)

A tiled run differs from the untiled one in three places, and the exact method removes each:
the mid block's attention spans the whole latent (it runs once over the whole image, its keys
and values folded into the normed input: exact._attend); tile
borders see zero padding instead of their neighbours (each tile runs with its receptive
field of real neighbours, cropped off again); and each tile would normalise with its own
GroupNorm statistics (the whole image's are gathered from all tiles between layers: exact).

The package, one job per module:
  config     TilingConfig, the options, checked once
  stages     the decoder / encoder as steps (resnets cut in halves), receptive fields, the lean
             and the folded mid-block attention
  statistics whole-image GroupNorm moments merged over tiles; GroupNorm calls that use them
  geometry   tile grids, windows, how spans map through the network
  exact      the exact run: segments between GroupNorms over abutting tiles, the whole-image attention
  state      the whole-image state between segments, banded on the host, optionally compact
  spill      that state in a direct-I/O temporary file instead (TilingConfig.state_dir)
  distributed  the ranks that share an exact run's tiles (TilingConfig.distributed)
  streaming  overlapping tiles blended into one output (methods "tiles" and "diffusers")
  tiling     tiled_run: one decode or encode with a config
  patching   tile_vae / untile_vae on an AutoencoderKL instance
  video      diffusers' tiling for the other (video) VAEs, their linear blend fused
"""
from pyext.vae.config import METHODS, TilingConfig
from pyext.vae.patching import tile_vae, untile_vae
from pyext.vae.tiling import tiled_run
from pyext.vae.video import tile_video_vae, untile_video_vae

__all__ = ["METHODS", "TilingConfig", "tile_vae", "tile_video_vae", "tiled_run", "untile_vae", "untile_video_vae"]
