"""Tile grids: spans along one axis, windows around them, and how they map through a network."""
from __future__ import annotations

from fractions import Fraction

Span = tuple[int, int]


def grid(n: int, tile: int, stride: int) -> list[Span]:
    """diffusers' tile grid along one axis: starts 0, stride, 2*stride, ... < n."""
    return [(i, min(i + tile, n)) for i in range(0, n, stride)]


def equal_cores(n: int, tile: int, unit: int = 1) -> list[Span]:
    """The fewest abutting spans covering [0, n), of equal length (a multiple of `unit`) at
    most `tile` (at least one unit), the last one cut at n."""
    size = max(unit, tile // unit * unit)
    count = -(-n // size)
    core = -(-n // (count * unit)) * unit
    return [(a, min(n, a + core)) for a in range(0, n, core)]


def overlapping_cores(n: int, tile: int, margin: int, overlap: float, unit: int = 1) -> list[Span]:
    """diffusers' grid of overlapping cores shrunk so that each core with `margin` on both
    sides fits in `tile`. Cores stop shrinking at a quarter tile: with margins wider than
    that the windows exceed the tile rather than the run splitting into many tiles that are
    mostly margin."""
    core = max(unit, tile // 4 // unit * unit, (tile - 2 * margin) // unit * unit)
    stride = max(unit, int(core * (1 - overlap)) // unit * unit)
    return grid(n, core, stride)


def window(span: Span, n: int, margin: int) -> Span:
    """The span with `margin` more on each side, inside [0, n)."""
    return max(0, span[0] - margin), min(n, span[1] + margin)


def rescale(spans: list[Span], scale: Fraction, n_out: int) -> list[Span]:
    """Abutting spans at a resolution `scale` times the input's; the last ends at n_out (a
    downsampling floors odd sizes). Span boundaries must land on whole pixels."""
    out = []
    for i, (a, b) in enumerate(spans):
        last = i == len(spans) - 1
        a2, b2 = a * scale, b * scale
        if a2.denominator != 1 or (b2.denominator != 1 and not last):
            raise ValueError(f"span {a, b} does not map onto whole pixels at scale {scale}")
        out.append((int(a2), n_out if last else int(b2)))
    return out


def overlaps(spans: list[Span], i: int) -> tuple[int, int]:
    """How far span i overlaps its neighbours before and after it."""
    before = max(0, spans[i - 1][1] - spans[i][0]) if i > 0 else 0
    after = max(0, spans[i][1] - spans[i + 1][0]) if i + 1 < len(spans) else 0
    size = spans[i][1] - spans[i][0]
    return min(before, size), min(after, size)
