"""Returning memory to the OS after one-time work (weight casts, tracing, packing): freed heap
blocks, and the pages of memory-mapped weight files that no weight uses any more. And keeping
freed blocks for the next tensors while repetitive work runs (reused_blocks)."""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import gc
import itertools
import os
import sys

from pyext.nn.stored import stored_tensors


_UNBOUNDED = sys.maxsize  # the pool's bound (size_t) when reused_blocks has none


@contextlib.contextmanager
def reused_blocks(cache_bytes: int | None = None):
    """While the block runs, torch's CPU tensors of 64 KiB or more come from a pool that keeps
    up to `cache_bytes` of the freed ones (the newest) for the next tensors of about their size,
    and frees them all at its end (csrc/common/block_pool.h). None: no bound of its own. A tensor
    that finds no block frees as many cached bytes first either way, so the pool and the tensors
    in use never hold more than those tensors held at their peak; a bound only gives back sooner
    what the work no longer uses.

    For loops over tiles: each fresh large tensor is new pages, a fault per page on first touch,
    where malloc returns large blocks to the OS at once. This is torch's CPU allocator, replaced
    for the whole process while a scope is open (scopes nest; other threads' tensors come from
    the pool too, which changes nothing for them). Without the compiled extension, or where
    another allocator has the place, nothing changes. Yields whether the pool is in place."""
    from pyext._ext import EXT
    if cache_bytes is None:
        cache_bytes = _UNBOUNDED
    elif isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or not 0 <= cache_bytes <= _UNBOUNDED:
        from pyext.dispatch import PyextError
        raise PyextError(f"pyext reused_blocks: cache_bytes must be None or an int in [0, 2**63), got {cache_bytes!r}")
    opened = EXT is not None and bool(EXT.pool_open(cache_bytes))
    try:
        yield opened
    finally:
        if opened:
            EXT.pool_close()


def release_freed_memory() -> None:
    """Hands heap pages that one-time work freed back to the OS (glibc only; a no-op elsewhere).

    glibc keeps freed medium-sized blocks in its heap: after a cast of SD1.5's weights to
    bf16, or a torch.jit.trace of its UNet, the process would otherwise keep 0.1-0.2 GB of
    dead memory resident for good.
    """
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere): a few
    milliseconds, no garbage collection."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Reclaim, not discard: clean file pages are dropped, a page someone wrote would be written back
# or swapped, never lost (Linux 5.4+; older kernels refuse it and nothing happens). Kernels since
# 6.x page out a file's pages only for a process that owns the file or may write it: weights on a
# read-only mount, or owned by another user, stay resident.
_MADV_PAGEOUT = 21


def storage_spans(modules) -> set[tuple[int, int]]:
    """(address, bytes) of the CPU storages behind these modules' parameters and buffers."""
    spans = set()
    for module in modules:
        for t in itertools.chain.from_iterable(map(stored_tensors, itertools.chain(module.parameters(),
                                                                                    module.buffers()))):
            if t.device.type != "cpu" or t.is_mkldnn:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):  # a subclass without storage of its own
                continue
            if storage.nbytes():
                spans.add((storage.data_ptr(), storage.nbytes()))
    return spans


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's file-backed mappings, sorted (safetensors' memory-mapped weights among them)."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                maps.append((start, end))
    return sorted(maps)


def release_mapped_pages(before: set[tuple[int, int]], live: set[tuple[int, int]]) -> int:
    """Asks the kernel to reclaim the resident pages of memory-mapped files under the storages in
    `before` that are not `live` any more; returns the bytes advised (0 off Linux).

    `from_pretrained` memory-maps safetensors files. A weight that optimize rewrites (packed,
    channels-last, cast) stops using its mapped pages, but the file's mapping stays open for the
    weights that remain, and the pages read while rewriting stay resident: 3.4 GiB for SD1.5 in
    fp32. Only whole pages inside a dropped storage that no live storage overlaps are touched.
    """
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6")
        maps = _file_mappings()
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    map_starts = [start for start, _ in maps]
    alive = sorted((ptr, ptr + n) for ptr, n in live)
    starts = [start for start, _ in alive]
    reach = list(itertools.accumulate((end for _, end in alive), max))  # furthest end among alive[:i + 1]
    advised = 0
    for ptr, n in before - live:
        lo, hi = -(-ptr // page) * page, (ptr + n) // page * page
        i = bisect.bisect_left(starts, hi)  # alive[:i] start below hi; one of them overlaps if it ends past lo
        if hi <= lo or (i and reach[i - 1] > lo):
            continue
        first = max(0, bisect.bisect_right(map_starts, lo) - 1)
        for start, end in itertools.takewhile(lambda m: m[0] < hi, itertools.islice(maps, first, None)):
            a, b = max(lo, start), min(hi, end)
            if b > a and libc.madvise(a, b - a, _MADV_PAGEOUT) == 0:
                advised += b - a
    return advised
