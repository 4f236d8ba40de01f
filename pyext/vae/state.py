"""The whole-image state between two segments of an exact tiled run, on the host.

One or more activations (N, C, H, W) of the same height and width, channels-last, kept in
horizontal bands (one per tile row of the segment that wrote them), each freed as soon as no
later tile reads it. On a GPU the bands are pinned host memory, so the device holds only the
tile it runs.

Compact bands keep a float32 state in float16, with a power-of-two scale per (sample, channel)
of each written tile: half the memory, no overflow (a tile's largest magnitude is stored as at
most 2^14; only a value within 2^-11 of float32's largest can read back as inf), and about
2^-12 relative rounding per value instead of float32's. A state that is already in a 16-bit
dtype is kept as it is.
"""
from __future__ import annotations

import torch

from pyext.vae.geometry import Span

COMPACT_DTYPE = torch.float16
_COMPACT_TOP = 14  # a tile's largest magnitude is stored in [2^13, 2^14]: far from float16's 65504
# The state is channels-last: a tile's convolutions run in that layout (on CPU, oneDNN reorders
# a contiguous NCHW input and output around every conv: slower, and two more tile-sized
# allocations), and a window of it is then rows of whole pixels, copied a row at a time.
LAYOUT = torch.channels_last


def empty(shape: tuple, **kwargs) -> torch.Tensor:
    """A (N, C, H, W) tensor in the state's layout."""
    return torch.empty(shape, memory_format=LAYOUT, **kwargs)


def scale_of(t: torch.Tensor) -> torch.Tensor:
    """A power of two per (sample, channel) that brings t's largest finite magnitude to
    [2^13, 2^14]; inf and nan are kept as they are."""
    t = t.detach()
    # max(amax, -amin): no full-size abs() temporary, and 2-15x faster than abs().amax() or
    # vector_norm(inf) on CPU (measured on a 16 MiB tile)
    amax = torch.maximum(t.amax(dim=(-2, -1), keepdim=True), -t.amin(dim=(-2, -1), keepdim=True)).float()
    if not bool(torch.isfinite(amax).all()):
        amax = torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=(-2, -1), keepdim=True)
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(2.0 ** -100))) - _COMPACT_TOP)


class Bands:
    """A whole-image state: per band of rows, one tensor per activation (full width), filled
    tile by tile with write() and read back over any window with read()."""

    def __init__(self, rows: list[Span], width: int, pin: bool, compact: bool = False):
        self.rows, self.width, self.pin, self.compact = rows, width, pin, compact
        self.parts: list = [None] * len(rows)
        self.dtype = None  # of the tensors written (a compact band stores float32 as float16)
        # compact: per row, {column span: one scale per tensor} of each tile written there
        self.scales: list[dict] = [{} for _ in rows]

    @classmethod
    def of(cls, t: torch.Tensor, rows: list[Span]) -> "Bands":
        bands = cls(rows, t.shape[-1], t.is_cuda)
        for i, (a, b) in enumerate(rows):
            bands.write(i, (0, t.shape[-1]), (t[..., a:b, :],))
        return bands

    @property
    def height(self) -> int:
        return self.rows[-1][1]

    def read(self, ys: Span, xs: Span, device=None) -> tuple:
        """The state's tensors over rows ys and columns xs, on `device` (None: where they are)."""
        pieces = []  # (row, rows of the band, rows of the result)
        for i, (a, b) in enumerate(self.rows):
            if a < ys[1] and b > ys[0]:
                lo, hi = max(ys[0], a), min(ys[1], b)
                pieces.append((i, slice(lo - a, hi - a), slice(lo - ys[0], hi - ys[0])))
        if len(pieces) == 1 and not self.scales[pieces[0][0]]:  # a view, no copy
            i, band_rows, _ = pieces[0]
            return tuple(t[..., band_rows, xs[0]:xs[1]].to(device) for t in self.parts[i])
        i = pieces[0][0]
        out = tuple(empty((*t.shape[:-2], ys[1] - ys[0], xs[1] - xs[0]), device=device or t.device, dtype=self.dtype)
                    for t in self.parts[i])
        for i, band_rows, out_rows in pieces:
            self._fill(i, band_rows, xs, tuple(t[..., out_rows, :] for t in out))
        return out

    def _fill(self, row: int, band_rows: slice, xs: Span, dst: tuple) -> None:
        """Copies rows of one band over columns xs into dst, undoing each tile's scale."""
        # the full width at once, or each tile's column span with its scales
        spans = self.scales[row].items() if self.scales[row] else [((0, self.width), None)]
        for (p, q), scales in spans:
            p, q = max(p, xs[0]), min(q, xs[1])
            if p >= q:
                continue
            for k, (band, where) in enumerate(zip(self.parts[row], dst)):
                src, where = band[..., band_rows, p:q], where[..., p - xs[0]:q - xs[0]]
                where.copy_(src)
                if scales is not None:
                    where.mul_(scales[k].to(where.device))  # faster than a mixed-dtype mul into `where`

    def write(self, row: int, xs: Span, tiles: tuple) -> None:
        if tiles[0].numel() == 0:  # a downsampling's output of a one-pixel last span
            return
        self.dtype = self.dtype or tiles[0].dtype
        compact = self.compact and self.dtype == torch.float32
        if self.parts[row] is None:
            a, b = self.rows[row]
            self.parts[row] = tuple(empty((*t.shape[:-2], b - a, self.width), pin_memory=self.pin,
                                          dtype=COMPACT_DTYPE if compact else t.dtype) for t in tiles)
        scales = tuple(scale_of(t) for t in tiles) if compact else (None,) * len(tiles)
        if compact:
            self.scales[row][xs] = scales
        for band, t, s in zip(self.parts[row], tiles, scales):
            where = band[..., xs[0]:xs[1]]
            if s is None:
                where.copy_(t)  # blocking: a strided host destination
            elif t.device == where.device:
                torch.mul(t, 1 / s, out=where)  # one pass into float16; exact scaling: a power of two
            else:
                where.copy_((t * (1 / s)).to(COMPACT_DTYPE))  # halve the copy's bytes on the device

    def plan(self, windows: list) -> None:
        """The windows reads will ask for (FileBands reads ahead; here everything is at hand)."""

    def free_above(self, y: int) -> None:
        """Frees the bands that end at or above row y."""
        for i, (_, b) in enumerate(self.rows):
            if b <= y:
                self.parts[i], self.scales[i] = None, {}

    def release(self) -> None:
        """Frees everything: the state is not read again."""
        self.free_above(self.height)

    def whole(self, device=None) -> tuple:
        return self.read((0, self.height), (0, self.width), device)


class Joined:
    """States of the same height and width read as one: the tensors of each, in order. A
    resnet's second half reads conv1's output and the block's input, which the exact run keeps
    from the first half instead of writing a copy of it next to conv1's output."""

    def __init__(self, *states):
        self.states = states
        self.height, self.width = states[0].height, states[0].width

    def read(self, ys: Span, xs: Span, device=None) -> tuple:
        return sum((s.read(ys, xs, device) for s in self.states), ())

    def plan(self, windows: list) -> None:
        for s in self.states:
            s.plan(windows)

    def free_above(self, y: int) -> None:
        for s in self.states:
            s.free_above(y)

    def release(self) -> None:
        for s in self.states:
            s.release()
