"""Overlapping tiles into one preallocated output, each freed as soon as it is placed.

diffusers' tiled_decode keeps every tile (about 1.8x the image), blends the overlaps with one
Python-level op per overlap row, then concatenates (about 3.8x the output at the peak). Here
each tile goes into the output through one fused tile_blend call: with diffusers' blend and
crop ("diffusers": the strips the next tiles blend with are all that is kept) or with
symmetric ramps whose weight sums are divided out at the end ("normalized").
"""
from __future__ import annotations

from typing import Callable

import torch

from pyext.ops.tile_blend import edge_weights, tile_blend_diffusers, tile_blend_normalized
from pyext.vae.geometry import Span, overlaps

TileFn = Callable[[Span, Span], torch.Tensor]  # input spans (rows, cols) -> the tile's output


def diffusers_blend(tile_fn: TileFn, rows: list[Span], cols: list[Span], out_extent: Callable[[int], int],
                    tile_out: int, extent: int) -> torch.Tensor:
    """diffusers' blend_v / blend_h / crop to row_limit, tile by tile, into one output (same numbers)."""
    limit = tile_out - extent
    heights = [min(limit, out_extent(b - a)) for a, b in rows]
    widths = [min(limit, out_extent(b - a)) for a, b in cols]
    out = None
    bottoms: list = [None] * len(cols)  # blended bottom rows of each tile of the previous tile row
    for r, ys in enumerate(rows):
        right = None                     # blended right columns of the previous tile in this row
        for c, xs in enumerate(cols):
            tile = tile_fn(ys, xs)
            if out is None:
                out = tile.new_empty((*tile.shape[:-2], sum(heights), sum(widths)))
            th, tw = tile.shape[-2:]
            keep_b = min(extent, th) if r + 1 < len(rows) else 0
            keep_r = min(extent, tw) if c + 1 < len(cols) else 0
            bottoms[c], right = tile_blend_diffusers(tile, out, sum(heights[:r]), sum(widths[:c]),
                                                     (min(limit, th), min(limit, tw)), bottoms[c], right, keep_b, keep_r)
            del tile
    return out


def normalized_blend(tile_fn: TileFn, orows: list[Span], ocols: list[Span], rows: list[Span],
                     cols: list[Span]) -> torch.Tensor:
    """Weighted accumulation with symmetric ramps over the overlaps of the output spans
    (orows, ocols: where each tile of input spans rows x cols lands), normalised per axis."""
    H, W = orows[-1][1], ocols[-1][1]
    out = None
    for r, ys in enumerate(rows):
        for c, xs in enumerate(cols):
            tile = tile_fn(ys, xs)
            if out is None:
                out = tile.new_zeros((*tile.shape[:-2], H, W))
            tile_blend_normalized(tile, out, orows[r][0], ocols[c][0], (*overlaps(orows, r), *overlaps(ocols, c)))
            del tile
    for dim, spans in ((-2, orows), (-1, ocols)):
        w = torch.zeros(out.shape[dim], device=out.device)
        for i, (a, b) in enumerate(spans):
            w[a:b] += edge_weights(b - a, *overlaps(spans, i), device=out.device)
        out.div_(w[:, None] if dim == -2 else w)  # in place, per axis: no full-size weight image
    return out
