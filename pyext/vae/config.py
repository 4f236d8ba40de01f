"""TilingConfig: every option of a tiled VAE run, checked once when it is made."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pyext.dispatch import PyextError
from pyext.vae import spill

METHODS = ("exact", "tiles", "diffusers")
AUTO = "auto"  # TilingConfig.state_dir: where the run decides (pyext.vae.exact.placement)


def fail(msg: str) -> None:
    raise PyextError(f"pyext.tile_vae: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TilingConfig:
    """How pyext tiles an AutoencoderKL decode or encode.

    method:
      "exact": the untiled decode's numbers to rounding, each layer run once. Tiles abut
        without overlap; before each GroupNorm its whole-image statistics are gathered from all
        tiles, and the whole image's state is kept on the host in between (pinned on a GPU: the
        device holds one tile). See pyext.vae.exact.
      "tiles": each tile with its own GroupNorm statistics, the mid block on the whole latent
        and `context` real neighbours around each tile, blended over `overlap`: the memory of
        one tile and no host staging, but not exact.
      "diffusers": diffusers' own tiled numbers (its grid, blend and per-tile mid block),
        streamed into one output instead of keeping every tile.
    tile_size: output-side tile in pixels (sets tile_sample_min_size and tile_latent_min_size);
      None keeps the VAE's. It must be a multiple of the VAE's downsampling factor (checked by
      tile_vae, which knows the VAE).
    overlap: tile_overlap_factor for "tiles" and "diffusers"; None keeps the VAE's.
    context: "tiles" only: latent pixels of real neighbourhood run around each tile and
      cropped off again; None: the tiled part's receptive field.
    compact_state: "exact" only: keep a float32 run's whole-image state between GroupNorms in
      float16 with power-of-two scales (pyext.vae.state): half the host memory, at the cost of
      float16 rounding of that state (about 2^-12 relative per value instead of fp32's; the
      docs/benchmarks.md has the measured PSNR).
    state_dir: "exact" only: keep that state in an unlinked file in this directory instead,
      written and read with direct I/O (pyext.vae.spill), so that memory holds one tile's
      working set, a few pieces of the state and the output, whatever the image size; the
      numbers are those of the state in memory. The directory must allow O_DIRECT, must not
      be in memory (tmpfs, ramfs: refused), and must have room for two whole-image states.
      None: in memory (pinned host memory on a GPU). "auto" (default): in memory, unless
      pyext.memory's vae_state_on_disk is set: then on a CPU, where the host memory is the
      device's, a file in the temporary directory (spill.default_dir) once the largest state
      outgrows exact.AUTO_MEMORY_TILES widest tiles; in memory on a GPU, or where no directory
      has direct I/O and room. (A directory named auto: "./auto".)
    state_memory_mib: with state_dir: MiB of that state kept in memory rather than written to
      the file (its first chunks, which the next segment reads first and frees soonest): less
      disk traffic for that much memory. 0 (default): all of it goes to the file.
    distributed: "exact" only: split each segment's tiles across the ranks of torch.distributed's
      default process group, which every rank must have initialized (torchrun), each rank calling
      the decode with the same input. The ranks exchange the GroupNorm moments and the tiles'
      outputs, so each returns the whole output, that of one process's run bit for bit
      (pyext.vae.distributed). The whole-image attention's query bands are dealt out as the
      tiles are; state_dir "auto" keeps the state in memory. Each rank holds the whole state, as one process does, and
      its share of a row of tile outputs until the row is exchanged.
    enable: also turn the VAE's use_tiling on.
    """

    method: str = "exact"
    tile_size: Optional[int] = None
    overlap: Optional[float] = None
    context: Optional[int] = None
    compact_state: bool = False
    state_dir: Optional[str] = AUTO
    state_memory_mib: int = 0
    distributed: bool = False
    enable: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            fail(f"method must be one of {METHODS}, got {self.method!r}")
        if self.tile_size is not None and (not _is_int(self.tile_size) or self.tile_size < 1):
            fail(f"tile_size must be a positive int (pixels) or None, got {self.tile_size!r}")
        if self.overlap is not None:
            if self.method == "exact":
                fail(f"overlap applies to method 'tiles' or 'diffusers'; exact tiles do not overlap (got {self.overlap!r})")
            if isinstance(self.overlap, bool) or not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap < 1:
                fail(f"overlap must be a fraction in [0, 1) or None, got {self.overlap!r}")
        if self.context is not None:
            if self.method != "tiles":
                fail(f"context applies to method 'tiles' only, got context={self.context!r} with method={self.method!r}")
            if not _is_int(self.context) or self.context < 0:
                fail(f"context must be a non-negative int (latent pixels) or None, got {self.context!r}")
        if not isinstance(self.compact_state, bool):
            fail(f"compact_state must be True or False, got {self.compact_state!r}")
        if self.compact_state and self.method != "exact":
            fail(f"compact_state applies to method 'exact' only (the state it keeps), got method={self.method!r}")
        if self.state_dir not in (None, AUTO):
            if self.method != "exact":
                fail(f"state_dir applies to method 'exact' only (the state it keeps), got method={self.method!r}")
            if not isinstance(self.state_dir, (str, os.PathLike)) or not os.path.isdir(self.state_dir):
                fail(f"state_dir must be an existing directory, {AUTO!r} or None, got {self.state_dir!r}")
            why = spill.unsupported(self.state_dir)
            if why:
                fail(f"state_dir {str(self.state_dir)!r}: {why}; give a directory on a disk file system (ext4, xfs)")
        if not _is_int(self.state_memory_mib) or self.state_memory_mib < 0:
            fail(f"state_memory_mib must be a non-negative int (MiB), got {self.state_memory_mib!r}")
        if self.state_memory_mib and self.state_dir is None:
            fail("state_memory_mib applies with state_dir only (without it the whole state is in memory)")
        if not isinstance(self.distributed, bool):
            fail(f"distributed must be True or False, got {self.distributed!r}")
        if self.distributed and self.method != "exact":
            fail(f"distributed applies to method 'exact' only, got method={self.method!r}")
        if not isinstance(self.enable, bool):
            fail(f"enable must be True or False, got {self.enable!r}")
