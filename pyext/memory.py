"""What pyext may do to the process's memory beyond the pipeline it is given: nothing, unless asked.

pyext is a library inside someone else's process. By default `optimize` changes only the
pipeline, and a tiled decode only allocates the tensors it needs, through torch's allocator;
both leave the allocator, the heap's settings and the process's memory mappings as they were.
A process that is pyext's own (a bench, a batch job that decodes large images on a CPU) may
turn on what helps it, here and only here:

    pyext.memory.configure(release_after_optimize=True, vae_block_pool=True)
    with pyext.memory.using(vae_state_on_disk=True):
        ...

release_after_optimize: after `optimize`, hand the heap's free pages back to the OS
    (glibc's malloc_trim) and ask the kernel to reclaim the pages of memory-mapped weight files
    that no weight uses any more (madvise MADV_PAGEOUT): the fp32 weights a cast or a packing
    replaced stay resident otherwise (docs/optimize.md). The heap is trimmed again while the
    first calls repack packed convolutions for their input shapes (pyext.nn.packed).
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
    release_after_optimize: bool = False
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
