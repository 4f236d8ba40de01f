"""What pyext may do to the process's memory beyond the pipeline it is given.

pyext is a library inside someone else's process. `optimize` changes the pipeline, and then gives
back the memory its own work freed (release_after_optimize, on unless turned off); a tiled decode
only allocates the tensors it needs, through torch's allocator. Nothing else of the process's
allocator, heap settings or memory mappings changes. A process that is pyext's own (a bench, a
batch job that decodes large images on a CPU) may turn on more, here and only here:

    pyext.memory.configure(vae_block_pool=True)
    with pyext.memory.using(vae_state_on_disk=True):
        ...

release_after_optimize (default on): after `optimize`, hand the heap's free pages back to the OS
    (glibc's malloc_trim) and ask the kernel to reclaim the pages of memory-mapped weight files
    that no weight uses any more (madvise MADV_PAGEOUT: clean pages are dropped, a written one is
    swapped or written back, never lost). Otherwise the fp32 weights that a cast or a packing
    replaced stay resident as file pages, and the freed copies as heap (docs/optimize.md). The heap
    is trimmed again while the first calls pack convolutions for their input shapes
    (pyext.nn.packed). Off: the process's heap and mappings are left exactly as they were.
vae_block_pool: while an exact tiled decode runs on a CPU, torch's CPU tensors of 64 KiB or
    more come from a pool that keeps freed blocks for the next tiles (it replaces torch's CPU
    allocator for the whole process during the decode), and the heap is trimmed between its
    segments: fewer page faults per tile (docs/vae.md).
vae_state_on_disk: an exact tiled decode on a CPU whose whole-image state is larger than a
    few tiles keeps it in an O_DIRECT temporary file (TilingConfig.state_dir="auto"), read and
    written by a few I/O threads that end with the decode; otherwise the state is in memory.
    An explicit TilingConfig(state_dir=...) is the user's own request and always honoured.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from pyext.dispatch import PyextError


@dataclass(frozen=True)
class MemorySettings:
    release_after_optimize: bool = True
    vae_block_pool: bool = False
    vae_state_on_disk: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise PyextError(f"pyext.memory: {f.name}={value!r} is not allowed; allowed: True, False")


_SETTINGS = MemorySettings()


def settings() -> MemorySettings:
    """The settings in force."""
    return _SETTINGS


def configure(**changes) -> MemorySettings:
    """Change some settings for the rest of the process (checked first); returns the new settings."""
    global _SETTINGS
    known = {f.name for f in dataclasses.fields(MemorySettings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise PyextError(f"pyext.memory: unknown setting {unknown[0]!r}; settings are: {', '.join(sorted(known))}")
    _SETTINGS = dataclasses.replace(_SETTINGS, **changes)
    return _SETTINGS


@contextlib.contextmanager
def using(**changes):
    """The settings changed inside the block only."""
    global _SETTINGS
    before = _SETTINGS
    configure(**changes)
    try:
        yield _SETTINGS
    finally:
        _SETTINGS = before
