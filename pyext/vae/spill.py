"""The exact run's whole-image state in a temporary file (TilingConfig.state_dir).

On a CPU the host is the device, so a state kept in memory (pyext.vae.state) costs as much
memory as the largest whole-image activation between two GroupNorms. FileBands keeps it on disk
instead: every tile a segment writes becomes one chunk of an unlinked file, written and read
with direct I/O (O_DIRECT), so the page cache holds none of it either. A chunk is stored rows
outermost, so the rows a later tile needs of it are one contiguous range of the file. Memory
then holds the tile that runs, a few pieces read recently (the neighbours that the next tiles
read again), and the output.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import weakref
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional

import torch

from pyext.vae.geometry import Span
from pyext.vae.state import COMPACT_DTYPE, empty, scale_of

ALIGN = 4096  # direct I/O moves whole blocks: buffer addresses, file offsets and lengths
# Pieces read are kept while their bytes are within this many of the largest chunk: a tile
# reads its own chunk and its neighbours', and the next tile in the row reads most of them again.
# (At least the pieces of the windows read ahead are kept: FileBands.plan.)
CACHED_CHUNKS = 4
WRITES_IN_FLIGHT = 2  # chunks written in the background, each holding its buffer until it is on disk
READ_AHEAD = 1  # windows whose pieces are read while the current tile runs
# A chunk's tensors (N, C, h, w) are stored (h, N, w, C): rows outermost, and in each row the
# pixels with their channels together, as the state's channels-last layout holds them.
ROWS_FIRST, FROM_ROWS_FIRST = (2, 0, 3, 1), (1, 3, 0, 2)


def _open(directory) -> int:
    """An unlinked file in `directory` (its blocks are freed when it is closed)."""
    return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)


def _file_system(directory) -> str:
    """The type of the file system that holds `directory` (the longest mount point above it)."""
    path, best, kind = os.path.realpath(directory), "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                mount, fs = line.split()[1:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fs
    except OSError:
        pass
    return kind


def unsupported(directory) -> Optional[str]:
    """Why `directory` cannot hold a state file, or None."""
    if not hasattr(os, "O_TMPFILE") or not hasattr(os, "O_DIRECT"):
        return "this platform has no unlinked files with direct I/O (O_TMPFILE, O_DIRECT: Linux has them)"
    if _file_system(directory) in ("tmpfs", "ramfs"):
        return f"it is on {_file_system(directory)}, in memory, where the state would save none"
    try:
        os.close(_open(directory))
    except OSError as e:
        return f"an unlinked direct-I/O file cannot be made there ({e.strerror})"
    return None


def default_dir(room: int) -> Optional[str]:
    """A directory for the state file when TilingConfig.state_dir is "auto": the system's
    temporary directory (TMPDIR), else /var/tmp, the first that allows direct I/O, is not in
    memory and has `room` bytes free; None if neither does."""
    for directory in dict.fromkeys((tempfile.gettempdir(), "/var/tmp")):
        if os.path.isdir(directory) and unsupported(directory) is None and _free_bytes(directory) >= room:
            return directory
    return None


def _free_bytes(directory) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _aligned(nbytes: int) -> torch.Tensor:
    """nbytes rounded up to whole blocks, as uint8 at a block-aligned address."""
    padded = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + padded]


def _typed(buf: torch.Tensor, start: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return buf[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


_POOL: ThreadPoolExecutor | None = None
_POOL_USERS = 0
_POOL_LOCK = threading.Lock()


def _io() -> ThreadPoolExecutor:
    # direct I/O waits for the disk: writes, reads ahead and closes run here while the tiles
    # compute. Threads that wait for the disk take no CPU; four keep more requests in flight
    # than two, which a disk serves faster (docs/vae.md).
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(4, thread_name_prefix="pyext-vae-spill")
        return _POOL


@contextlib.contextmanager
def io_threads():
    """The I/O threads live while a run that may use them does (runs may nest or overlap); at the
    end of the last one, every state file is closed and the threads end."""
    global _POOL, _POOL_USERS
    with _POOL_LOCK:
        _POOL_USERS += 1
    try:
        yield
    finally:
        wait_closed()
        with _POOL_LOCK:
            _POOL_USERS -= 1
            pool, _POOL = (_POOL, None) if _POOL_USERS == 0 else (None, _POOL)
        if pool is not None:
            pool.shutdown(wait=True)


_closing: list = []  # files closing in the background (_File.close)


def wait_closed() -> None:
    """Returns once every state file closed so far is closed, its blocks freed."""
    while _closing:
        _closing.pop().result()


def _close_after(tasks: list, file: "_File") -> None:
    wait(tasks)  # (returns the futures, results and all: not kept)
    tasks.clear()  # nor by this task's own arguments, which the pool drops only after it is done
    file._close()  # (the task holds the file: were it collected first, its finalizer would close it here)


class _File:
    def __init__(self, directory):
        self.fd, self.end, self.pending = _open(directory), 0, deque()
        self.tasks: list = []  # reads and writes submitted, not known to be done
        self._close = weakref.finalize(self, os.close, self.fd)

    def submit(self, fn, *args):
        """fn(*args) in an I/O thread; close() waits for it."""
        self.tasks = [t for t in self.tasks if not t.done()]
        self.tasks.append(_io().submit(fn, *args))
        return self.tasks[-1]

    def _pwrite(self, buf: torch.Tensor, at: int) -> None:
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):  # a write stops short only at a block boundary (2 GiB per call)
            done += os.pwrite(self.fd, view[done:], at + done)

    def append(self, buf: torch.Tensor) -> int:
        """Writes an _aligned buffer at the end, in the background (at most WRITES_IN_FLIGHT
        buffers wait); returns where it starts."""
        at = self.end
        self.end += buf.numel()
        self.pending.append(self.submit(self._pwrite, buf, at))
        while len(self.pending) > WRITES_IN_FLIGHT:
            self.pending.popleft().result()
        return at

    def flush(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        """Closes the file, which frees its blocks (once), in an I/O thread: freeing a large
        file's blocks takes tens of milliseconds. The close waits there for the file's reads
        still running (pieces read ahead and never used); they were submitted before it, so the
        pool has started them all before it starts the close (wait_closed: until it is done)."""
        _closing[:] = [c for c in _closing if not c.done() or c.exception()]  # a failed close raises in wait_closed
        _closing.append(_io().submit(_close_after, self.tasks, self))
        self.tasks = []

    def read_into(self, buf: torch.Tensor, at: int) -> torch.Tensor:
        """Fills an _aligned buffer with the file's bytes from `at`, a block boundary (after a
        flush); returns it."""
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], at + done)
            if n <= 0:
                raise OSError(f"pyext.vae state file: short read at byte {at + done} of {self.end}")
            done += n
        return buf


class Budget:
    """Bytes that the states of one run may keep in memory rather than in the file."""

    def __init__(self, nbytes: int):
        self.left = nbytes

    def take(self, n: int) -> bool:
        if n > self.left:
            return False
        self.left -= n
        return True

    def give(self, n: int) -> None:
        self.left += n


@dataclass(frozen=True)
class _Chunk:
    starts: tuple    # where each tensor starts: in the file, or in buf
    shapes: tuple    # each tensor's shape as stored, rows first: (rows, N, columns, C)
    dtype: torch.dtype
    scales: Optional[tuple]  # compact: one power-of-two scale per tensor (pyext.vae.state)
    buf: Optional[torch.Tensor] = None  # the chunk kept in memory (Budget), else None: in the file


class FileBands:
    """A whole-image state in a temporary file in `directory`, with Bands' interface: written
    tile by tile (a tile row at a time, top to bottom), read back over any window.

    Chunks are kept in memory instead while `budget` (shared by the states of one run) has
    room: the first ones written, which the next segment reads first and frees soonest, so
    neither writes nor reads them from the disk."""

    def __init__(self, rows: list[Span], width: int, directory, compact: bool = False, budget: Optional[Budget] = None):
        self.rows, self.width, self.compact = rows, width, compact
        self.budget = budget or Budget(0)
        self.file = _File(directory)
        self.chunks: list[dict] = [{} for _ in rows]  # per band of rows: {column span: _Chunk}
        self.dtype = None  # of the tensors written (compact: float32 stored as float16)
        self.cache: OrderedDict = OrderedDict()  # _overlaps' key -> (future of the pieces, bytes)
        self.cached_bytes = self.largest_chunk = 0
        self.windows, self.at = [], 0  # plan(): the windows to read, and the next one
        self.window_bytes = 0  # plan(): the most bytes of pieces of the windows read ahead at once

    @property
    def height(self) -> int:
        return self.rows[-1][1]

    def write(self, row: int, xs: Span, tiles: tuple) -> None:
        if tiles[0].numel() == 0:  # a downsampling's output of a one-pixel last span
            return
        self.dtype = self.dtype or tiles[0].dtype
        compact = self.compact and self.dtype == torch.float32
        dtype = COMPACT_DTYPE if compact else self.dtype
        scales = tuple(scale_of(t) for t in tiles) if compact else None
        shapes = tuple(tuple(t.shape[d] for d in ROWS_FIRST) for t in tiles)
        starts, end = [], 0
        for shape in shapes:
            starts.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        buf = _aligned(end)
        for k, (t, start, shape) in enumerate(zip(tiles, starts, shapes)):
            src, where = t.permute(ROWS_FIRST), _typed(buf, start, shape, dtype)
            if not compact:
                where.copy_(src)
            elif t.device == where.device:  # one pass into float16; exact scaling: a power of two
                torch.mul(src, (1 / scales[k]).permute(ROWS_FIRST), out=where)
            else:
                where.copy_((src * (1 / scales[k]).permute(ROWS_FIRST)).to(dtype))  # halve the copy's bytes
        if self.budget.take(end):
            self.chunks[row][xs] = _Chunk(tuple(starts), shapes, dtype, scales, buf)
        else:
            at = self.file.append(buf)
            self.chunks[row][xs] = _Chunk(tuple(at + s for s in starts), shapes, dtype, scales)
        self.largest_chunk = max(self.largest_chunk, end)

    def _overlaps(self, ys: Span, xs: Span):
        """(key, chunk, rows, columns) of each chunk under the window: key = (band, its column
        span, first and end row within the band) names the piece of it that the window reads."""
        for r, (a, b) in enumerate(self.rows):
            lo, hi = max(ys[0], a), min(ys[1], b)
            if lo < hi:
                for (p, q), chunk in self.chunks[r].items():
                    if max(xs[0], p) < min(xs[1], q):
                        yield (r, (p, q), lo - a, hi - a), chunk, (lo, hi), (max(xs[0], p), min(xs[1], q))

    @staticmethod
    def _parts(key, chunk: _Chunk) -> list[tuple[int, int]]:
        """(where it starts, bytes) of each tensor's part of the piece `key`: in the file, or in
        chunk.buf."""
        parts = []
        for start, shape in zip(chunk.starts, chunk.shapes):
            row_bytes = math.prod(shape[1:]) * chunk.dtype.itemsize
            parts.append((start + key[2] * row_bytes, (key[3] - key[2]) * row_bytes))
        return parts

    @staticmethod
    def _buffers(parts: list) -> list:
        """(buffer, block it starts at) for each of a piece's _parts in the file: the whole blocks
        around it. Made by the thread that runs the tiles, which frees them too: buffers made by
        the I/O threads would come from those threads' malloc arenas, which keep their freed
        blocks apart from the main heap (a higher peak: docs/vae.md)."""
        bufs = []
        for begin, nbytes in parts:
            at = begin // ALIGN * ALIGN
            bufs.append((_aligned(-(-(begin + nbytes) // ALIGN) * ALIGN - at), at))
        return bufs

    def _load(self, key, chunk: _Chunk, bufs=None) -> tuple:
        """The piece `key` names of `chunk`, each tensor (..., rows, columns): from chunk.buf, or
        read from the file into `bufs` (_buffers; in an I/O thread)."""
        pieces = []
        for k, ((begin, _), shape) in enumerate(zip(self._parts(key, chunk), chunk.shapes)):
            if chunk.buf is None:
                buf, at = bufs[k]
                buf, begin = self.file.read_into(buf, at), begin - at
            else:
                buf = chunk.buf
            pieces.append(_typed(buf, begin, (key[3] - key[2], *shape[1:]), chunk.dtype).permute(FROM_ROWS_FIRST))
        return tuple(pieces)

    def _fetch(self, key, chunk) -> None:
        """Starts reading a piece from the file unless it is cached; either way it becomes the
        newest entry."""
        if chunk.buf is not None:
            return
        if key in self.cache:
            self.cache.move_to_end(key)
            return
        parts = self._parts(key, chunk)
        size = sum(n for _, n in parts)
        self.cache[key] = (self.file.submit(self._load, key, chunk, self._buffers(parts)), size)
        self.cached_bytes += size
        while len(self.cache) > 1 and self.cached_bytes > max(CACHED_CHUNKS * self.largest_chunk, self.window_bytes):
            self.cached_bytes -= self.cache.popitem(last=False)[1][1]

    def plan(self, windows: list) -> None:
        """The windows that reads will ask for next, in order: each read starts reading the
        pieces of the next READ_AHEAD windows. The cache holds at least the pieces of the windows
        read ahead: where a window spans many small chunks (a segment that tiles more coarsely
        than the one that wrote the state), CACHED_CHUNKS chunks' bytes would evict pieces read
        ahead before they are used, and read them again."""
        self.file.flush()
        self.windows, self.at = list(windows), 0
        in_file = [{key: sum(n for _, n in self._parts(key, chunk)) for key, chunk, _, _ in self._overlaps(ys, xs)
                    if chunk.buf is None} for ys, xs in self.windows]  # per window: its pieces' bytes
        self.window_bytes = 0
        for i in range(len(in_file)):
            ahead = {}
            for pieces in in_file[i:i + READ_AHEAD]:
                ahead.update(pieces)
            self.window_bytes = max(self.window_bytes, sum(ahead.values()))
        self._read_ahead()

    def _read_ahead(self) -> None:
        for ys, xs in self.windows[self.at:self.at + READ_AHEAD]:
            for key, chunk, _, _ in self._overlaps(ys, xs):
                self._fetch(key, chunk)

    def read(self, ys: Span, xs: Span, device=None) -> tuple:
        """The state's tensors over rows ys and columns xs, on `device` (None: the host)."""
        self.file.flush()
        out = None
        for key, chunk, (lo, hi), (p2, q2) in self._overlaps(ys, xs):
            self._fetch(key, chunk)
            pieces = self._load(key, chunk) if chunk.buf is not None else self.cache[key][0].result()
            if out is None:
                out = tuple(empty((*t.shape[:-2], ys[1] - ys[0], xs[1] - xs[0]), dtype=self.dtype, device=device)
                            for t in pieces)
            p = key[1][0]
            for k, (t, dst) in enumerate(zip(pieces, out)):
                where = dst[..., lo - ys[0]:hi - ys[0], p2 - xs[0]:q2 - xs[0]]
                where.copy_(t[..., p2 - p:q2 - p])
                if chunk.scales is not None:
                    where.mul_(chunk.scales[k].to(where.device))
        if self.at < len(self.windows) and self.windows[self.at] == (ys, xs):
            self.at += 1
            self._read_ahead()
        return out

    def free_above(self, y: int) -> None:
        """Frees the bands that end at or above row y: their chunks kept in memory, and pieces
        read (the file keeps its blocks until release())."""
        for key in [k for k in self.cache if self.rows[k[0]][1] <= y]:
            self.cached_bytes -= self.cache.pop(key)[1]
        for r, (_, b) in enumerate(self.rows):
            if b <= y:
                self._drop(r)

    def _drop(self, row: int) -> None:
        for chunk in self.chunks[row].values():
            if chunk.buf is not None:
                self.budget.give(chunk.buf.numel())
        self.chunks[row] = {}

    def release(self) -> None:
        """Frees everything: the state is not read again."""
        for r in range(len(self.rows)):
            self._drop(r)
        self.cache.clear()
        self.cached_bytes = 0
        self.file.close()

    def whole(self, device=None) -> tuple:
        return self.read((0, self.height), (0, self.width), device)
