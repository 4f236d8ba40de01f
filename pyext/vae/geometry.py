"""Tile grids: spans along one axis, windows around them, and how they map through a network."""
from __future__ import annotations

from fractions import Fraction
from typing import Optional

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


def _diffusers_kept_and_stride(tile: int, latent: int, factor: float) -> tuple:
    """Output pixels diffusers' tiling keeps of each tile, and output pixels between tiles, when
    decoding (sample pixels) and encoding (latent pixels): it rounds the stride and the blend
    from the tile size and the overlap factor each on its own."""
    ratio = max(1, tile // latent)
    decode = (tile - int(tile * factor), int(latent * (1 - factor)) * ratio)
    encode = (latent - int(latent * factor), int(tile * (1 - factor)) / ratio)
    return decode, encode


def _diffusers_fits(tile: int, latent: int, factor: float) -> bool:
    return tile % latent == 0 and tile >= latent and all(
        kept == stride > 0 for kept, stride in _diffusers_kept_and_stride(tile, latent, factor))


def diffusers_tiling_mismatch(name: str, tile: int, latent: int, factor: float) -> Optional[str]:
    """Why diffusers' tiling with tiles of `tile` sample (`latent` latent) pixels and this overlap
    factor gives an output of the wrong size, or None: where the kept parts of the tiles and the
    stride between them disagree, tiles overlap or leave gaps. `name` is the option that sets
    `tile`; the message names the nearest sizes that fit."""
    if _diffusers_fits(tile, latent, factor):
        return None
    ratio = max(1, tile // latent)
    fits = [n * ratio for n in range(1, 4 * latent + 8) if _diffusers_fits(n * ratio, n, factor)]
    near = sorted(sorted(fits, key=lambda t: (abs(t - tile), t))[:2])
    (kept, stride), (kept_e, stride_e) = _diffusers_kept_and_stride(tile, latent, factor)
    what = (f"its decode would keep {kept} pixels of each tile where tiles start every {stride:g}" if kept != stride
            else f"its encode would keep {kept_e} latent pixels of each tile where tiles start every {stride_e:g}")
    works = f"{name} {' or '.join(map(str, near))} works" if near else "no tile size works"
    return (f"{name}={tile} with overlap factor {factor:g} ({latent} latent pixels per tile): with diffusers' "
            f"tiling {what}, so the tiled output would be the wrong size; with this factor, {works}")
