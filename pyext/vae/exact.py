"""The exact tiled run: the network, segment by segment, over abutting tiles, with every
GroupNorm normalised by the whole image's statistics.

The tiled part of the network is cut before every GroupNorm: each resnet into two steps, the
second starting at its second GroupNorm (stages.split_resnets), and a segment starts at each
step with a GroupNorm, taking along the steps without one that follow it (a resampler, the
output activation and conv). A segment runs over all tiles twice: the first pass stops at its
GroupNorm, which is its first call, and only adds the moments of that input over each tile's
own pixels (statistics.SyncedGroupNorms); the second normalises with the merged whole-image
statistics and runs every tile to the end. So each layer runs once, as in the untiled
network; the first passes only read. Where a segment starts with a GroupNorm of its input
(Step.input_norm), the previous segment gathers those moments per channel while it writes that
input, and the reading pass is skipped. (A segment with more GroupNorm calls, from a block
that is not split, runs once more per call, each pass stopping at the next one. The first
segment is one: a cheap head, the convs before the first GroupNorm, runs again in each of its
passes with the first resnet whole, rather than being kept as two whole-image states; and with
the state on disk, so is each resnet whose conv1 reads few channels: plan.)

Each tile runs with `margin` more pixels of the segment's input on each side (its receptive
field, a few pixels) and keeps only its own pixels of the output, which are then those of the
untiled network. So the result is the untiled network's to rounding, and no tile overlaps
another.

The mid block's self-attention, where every output pixel reads every input pixel, is the one
step not run by tiles (_attend): its input is normed band by band with the whole image's
statistics into one tensor of normed tokens, which serve as both keys and values (the key and
value projections fold into the queries and the output, stages.fold_query), and each band of
queries attends over all of them. So the latent-resolution part (the mid block's resnets, the
convs around it) is tiled like the rest, and the largest tensor of the whole image held at once
is that of the normed tokens, not the keys and values (twice that) and the activations of an
untiled mid block.

Between segments the whole-image state (the activation; inside a resnet conv1's output, read
along with the block's input, which is kept for the second half rather than copied) lives on
the host (pyext.vae.state: pinned when the network runs on a GPU, so only one tile's working
set is on the device; banded, each band freed as soon as no later tile reads it). Each segment
tiles on its own grid, its tiles bounded by element_budget (TILE_ELEMENTS, and a share of the
VAE's own tile), so the working set does not grow with the resolution. The host holds about
the largest state of the whole image between two GroupNorms (for the SD VAE: 256 channels at
full resolution, 1 KiB per output pixel in float32; half that with the compact state). That is
the price of exact statistics in one pass: holding less memory means recomputing the network
up to each GroupNorm, or keeping the state on disk (pyext.vae.spill: memory then holds one tile
and a few pieces of the state read back).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch

from pyext import memory, ops
from pyext._memory import reused_blocks, trim_heap
from pyext.dispatch import PyextError
from pyext.vae import spill, stages
from pyext.vae.config import AUTO, TilingConfig, fail
from pyext.vae.distributed import Ranks
from pyext.vae.geometry import Span, equal_cores, rescale, window
from pyext.vae.spill import Budget, FileBands
from pyext.vae.state import LAYOUT, Bands, Joined
from pyext.vae.statistics import Moments, Stop, SyncedGroupNorms, normalize


# Elements in the widest tensor of one tile, all samples (16 MiB in fp32). Exact tiles need no size for
# their numbers, so each segment sizes its own tiles by this: the working set stays that of a
# small tile at every resolution, and a band of the whole-image state is freed soon after the
# last tile that reads it.
TILE_ELEMENTS = 2 ** 22
# Exact tiles are also smaller than the VAE's own (diffusers') tiles: their widest tensor holds at
# most this share of the widest one that a tile of the VAE's size makes (element_budget). Besides
# its tile the run holds a few tile-sized chunks of the state (with state_dir: the pieces read back
# and the writes in flight, spill.CACHED_CHUNKS and WRITES_IN_FLIGHT), where diffusers' tiling
# holds only its tile's activations. For the SD and Flux VAEs TILE_ELEMENTS is the smaller bound.
TILE_SHARE = Fraction(1, 4)
# A head (the steps before the first GroupNorm) whose convs read at most this many channels is
# run again in each pass of the first segment rather than kept as a state (plan).
HEAD_CHANNELS = 16
# With the state on disk (state_dir), a resnet whose conv1 reads at most this many channels stays
# whole: conv1 runs twice rather than its output being written and read back. Recomputing costs
# 2.25 * C_in FLOPs per byte of fp32 output it saves writing and reading; at this many channels
# that is about what the convs compute in the time the disk moves a byte (docs/vae.md; SD's
# resnets read more).
RECOMPUTE_CHANNELS = 64
# With state_dir "auto" on a CPU and pyext.memory.vae_state_on_disk, the run keeps its states in
# memory while the largest fits in the bytes of this many widest tiles (about what it holds for
# its tiles anyway), else in a file with state_memory_mib of them in memory (0 by default: 8
# tiles' bytes there put the small VAE's peak over diffusers', docs/vae.md). So memory stays that
# of a few tiles plus the output. Without the setting the states are in memory.
AUTO_MEMORY_TILES = 8


@dataclass(frozen=True)
class Segment:
    steps: list
    scale: Fraction  # output pixels per input pixel
    margin: int      # input pixels of receptive field per side, aligned to the downsampling
    align: int       # input pixels a tile starts on (stages.alignment)
    width: Fraction  # elements per input pixel of the widest tensor a tile makes (stages.width)

    def grid(self, n: int, tile: int, batch: int, elements: int) -> list[Span]:
        """Abutting tiles along an axis of n input pixels: at most `tile`, and small enough that
        a square tile's widest tensor (over `batch` samples) stays within `elements`."""
        side = min(tile, math.isqrt(int(elements / max(self.width * batch, 1))))
        return equal_cores(n, max(side, self.align), self.align)


def element_budget(segs: list[Segment], tile: int, batch: int) -> int:
    """The elements a tile's widest tensor may hold: TILE_SHARE of the widest tensor that a tile of
    `tile` pixels of the input makes in any segment, and at most TILE_ELEMENTS."""
    res, widest = Fraction(1), Fraction(0)
    for seg in segs:
        at = max(1, math.floor(tile * res))
        widest = max(widest, at * at * seg.width * batch)
        res *= seg.scale
    return max(1, min(TILE_ELEMENTS, int(widest * TILE_SHARE)))


def segments(steps, fold_head: bool = False) -> list[Segment]:
    """A new segment at each step with a GroupNorm (and one for the steps before the first,
    the head, unless fold_head: then the first step with a GroupNorm joins it); a whole-image
    attention (Step.attends_whole) is a segment of its own."""
    groups: list[list] = []
    for step in steps:
        joins_head = fold_head and len(groups) == 1 and not any(stages.has_group_norm(s) for s in groups[0])
        if (not groups or (stages.has_group_norm(step) and not joins_head) or groups[-1][-1].attends_whole
                or step.attends_whole):
            groups.append([])
        groups[-1].append(step)
    return [Segment(g, math.prod((s.scale for s in g), start=Fraction(1)), stages.margin(g), stages.alignment(g),
                    stages.width(g)) for g in groups]


def plan(steps, whole_channels: int = 0) -> list[Segment]:
    """The segments of the tiled steps, resnets split (stages.split_resnets), except those whose
    conv1 reads at most `whole_channels`. A head whose convs read at most HEAD_CHANNELS channels
    (the encoder's conv_in from the image, the decoder's from the latent) joins the first
    segment, and the resnet there is not split: the head's output and that resnet's conv1 output
    would each be a whole-image state, written once and read twice, where running the head again
    in each pass and conv1 once more costs less."""
    k = next((i for i, s in enumerate(steps) if stages.has_group_norm(s)), len(steps))
    fold = 0 < k < len(steps) and not steps[k].attends_whole and stages.reads_at_most(steps[:k], HEAD_CHANNELS)
    if not fold:
        return segments(stages.split_resnets(steps, whole_channels))
    return segments([*steps[:k], stages.whole_resnet(steps[k]), *stages.split_resnets(steps[k + 1:], whole_channels)],
                    fold_head=True)


def _run_segment(seg: Segment, state, rows: list[Span], cols: list[Span], device, new_state,
                 first: Optional[Moments] = None, gather: bool = False, keep: bool = False,
                 ranks: Ranks = Ranks()) -> tuple:
    """The segment over the tiles rows x cols of the state (which may be banded otherwise):
    the whole-image state at its end, banded by the tile rows, made by new_state(rows, width)
    (state.Bands in memory, or spill.FileBands). ranks: who runs which tiles (this process
    alone, or pyext.vae.distributed's ranks).

    first: per-channel moments of the state's first tensor, gathered as it was written, when
    this segment starts with a GroupNorm of it (Step.input_norm): its pass that would only
    gather them is skipped. gather: gather those of the output's first tensor for the next.
    keep: the state is read again later (Step.passes_input), so none of it is freed here."""
    H, W = state.height, state.width
    out_rows = rescale(rows, seg.scale, math.floor(H * seg.scale))
    out_cols = rescale(cols, seg.scale, math.floor(W * seg.scale))
    known: list = [] if first is None else [first.grouped(seg.steps[0].input_norm.num_groups).result()]
    out = new_state(out_rows, out_cols[-1][1])  # only the last pass writes it
    while True:
        written: dict[int, Moments] = {}  # per tile, merged in tile order
        moments: dict[int, Moments] = {}
        finished = 0
        state.plan([(window(ys, H, seg.margin), window(xs, W, seg.margin)) for r, ys in enumerate(rows)
                    for c, xs in enumerate(cols) if ranks.owns(r * len(cols) + c)])
        for r, ys in enumerate(rows):
            outputs, failed = {}, None
            for c, xs in enumerate(cols):
                index = r * len(cols) + c
                if not ranks.owns(index):
                    continue
                moments[index] = Moments()
                try:
                    own = _run_tile(seg, state, ys, xs, out_rows[r], out_cols[c], device, known, moments[index])
                except Exception as err:  # with ranks, raised on every rank once the row is shared
                    if ranks.size == 1:
                        raise
                    failed = err
                    break
                if own is None:  # stopped at a GroupNorm
                    continue
                finished += 1
                if gather and own[0].numel():
                    written[index] = Moments()
                    written[index].add(own[0], own[0].shape[1])  # per channel: the next GroupNorm's groups merge them
                if ranks.size == 1:
                    out.write(r, out_cols[c], own)  # at once: a GPU holds one tile's output
                else:
                    # the row's tiles wait for the exchange: keep their own pixels only
                    outputs[c] = tuple(t.contiguous() for t in own)
            row_done = finished > 0 if ranks.size == 1 else _share_row(ranks, r, out_rows[r], out_cols, outputs,
                                                                       failed, out)
            if row_done and not keep and r + 1 < len(rows):  # the last pass: free what no later tile reads
                state.free_above(window(rows[r + 1], H, seg.margin)[0])
        finished = sum(ranks.gather({ranks.rank: finished}).values())
        if finished not in (0, len(rows) * len(cols)):
            raise RuntimeError("tiles of one segment stopped at different GroupNorm calls")
        if finished:
            return out, (_in_order(ranks.gather_moments(written)) if gather else None)
        known.append(_in_order(ranks.gather_moments(moments)).result())


def _run_tile(seg: Segment, state, ys: Span, xs: Span, out_ys: Span, out_xs: Span, device, known: list,
              moments: Moments) -> Optional[tuple]:
    """One tile of a segment: its own pixels of the output (out_ys x out_xs of the output), or None
    where it stopped at a GroupNorm whose statistics are not known yet (its moments added)."""
    H, W = state.height, state.width
    (y0, y1), (x0, x1) = window(ys, H, seg.margin), window(xs, W, seg.margin)
    tile = tuple(t.contiguous(memory_format=LAYOUT) for t in state.read((y0, y1), (x0, x1), device))
    try:
        with SyncedGroupNorms(known, moments, (ys[0] - y0, y1 - ys[1], xs[0] - x0, x1 - xs[1]), (y1 - y0, x1 - x0)):
            y = stages.run(seg.steps, *tile)
    except Stop:
        return None
    y = y if isinstance(y, tuple) else (y,)
    oy, ox = int((ys[0] - y0) * seg.scale), int((xs[0] - x0) * seg.scale)
    (a, b), (p, q) = out_ys, out_xs
    if y[0].shape[-2] < oy + b - a or y[0].shape[-1] < ox + q - p:
        fail(f"a {y1 - y0}x{x1 - x0} window gave a {tuple(y[0].shape[-2:])} output; at scale {seg.scale} "
             f"it should cover {oy + b - a}x{ox + q - p}: this network does not scale like AutoencoderKL's")
    return tuple(t[..., oy:oy + b - a, ox:ox + q - p] for t in y)


# The dtypes a tile's outputs may have, as _share_row codes them; and at most how many outputs.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_OUTPUTS = 4


def _share_row(ranks: Ranks, r: int, out_ys: Span, out_cols: list[Span], outputs: dict,
               failed: Optional[Exception], out) -> bool:
    """Every tile of row r written to `out` on every rank, from the owners' `outputs` {column:
    tensors}; whether the row's tiles ran to the end (False in a pass that stops at a GroupNorm).
    A tile that raised on one rank (`failed`) raises on every rank."""
    some = next(iter(outputs.values()), ())
    if failed is None and some and (len(some) > _MAX_OUTPUTS or some[0].dtype not in _DTYPES):
        try:  # raised below, on every rank
            fail(f"a tile gave {len(some)} outputs of {some[0].dtype}; the ranks exchange at most "
                 f"{_MAX_OUTPUTS}, of {', '.join(map(str, _DTYPES))}")
        except PyextError as err:
            failed = err
    if failed is not None:
        some = ()
    header = [int(bool(some)), 0 if failed is None else ranks.rank + 1,
              some[0].shape[0] if some else 0, _DTYPES.index(some[0].dtype) if some else 0,
              *[t.shape[1] for t in some], *[0] * (_MAX_OUTPUTS - len(some))]
    done, failed_rank, batch, dtype, *channels = ranks.most(header)
    if failed_rank:
        messages = ranks.gather({} if failed is None else {ranks.rank: f"{type(failed).__name__}: {failed}"})
        if failed is not None:
            raise failed
        raise RuntimeError(f"pyext exact VAE run: a tile raised on rank {failed_rank - 1}: "
                           f"{messages[failed_rank - 1]}")
    if not done:
        return False
    for c, (p, q) in enumerate(out_cols):
        like = [((batch, n, out_ys[1] - out_ys[0], q - p), _DTYPES[dtype]) for n in channels if n]
        out.write(r, (p, q), ranks.share(r * len(out_cols) + c, outputs.get(c), like))
    return True


def _in_order(parts: dict[int, Moments]) -> Moments:
    """The tiles' moments merged in tile order: the same float64 sums on every rank and in one process."""
    merged = Moments()
    for index in sorted(parts):
        merged.merge(parts[index])
    return merged


def _attend(attn, state, batch: int, device, new_state, first: Moments, gather: bool, elements: int,
            ranks: Ranks = Ranks()) -> tuple:
    """A whole-image self-attention (Step.attends_whole) over the state: each output pixel
    reads every input pixel, so it is not tiled. Its GroupNorm is applied with the whole
    image's statistics, band by band of rows, into the normed tokens of the whole image (the
    one tensor of this size held: the keys and values fold into it, stages.fold_query); then
    each band's queries attend over all of them and its output is written as the next state,
    as a segment's tiles are. first: the per-channel moments of the state, which the previous
    segment gathered (the step's input_norm is its GroupNorm). elements bounds the bands of rows
    read. The attention op's own copy of the keys stays small however many there are (the C++
    kernel packs long keys a chunk at a time). ranks: the query bands are dealt out as tiles are
    (every rank norms all the tokens, which is cheap), and each band's output goes to every rank."""
    H, W = state.height, state.width
    norm, c = attn.group_norm, attn.group_norm.num_channels
    # bands of at most stages.QUERY_CHUNK queries, as the untiled lean attention runs them (an
    # attention backend without a memory-efficient kernel for this head size holds their scores)
    rows = equal_cores(H, max(1, min(elements // (W * c * batch), stages.QUERY_CHUNK // W)), 1)
    bands = [(ys, (0, W)) for ys in rows]
    mean, var = first.grouped(norm.num_groups).result()
    state.plan(bands * 2)  # each band is read twice: normed, then added back as the residual
    normed = torch.empty(batch, H * W, c, device=device, dtype=state.dtype)
    for (a, b), xs in bands:
        x, = state.read((a, b), xs, device)
        normed[:, a * W:b * W] = normalize(x, norm.num_groups, norm.weight, norm.bias, norm.eps, mean, var).flatten(2).mT
    keys = normed[:, None]  # (batch, one head, tokens, channels): the keys and the values
    out, written = new_state(rows, W), {}
    for r, ((a, b), xs) in enumerate(bands):
        x, = state.read((a, b), xs, device)
        outputs, failed = {}, None
        if ranks.owns(r):
            try:
                mixed = ops.attention(stages.fold_query(attn, normed[:, a * W:b * W])[:, None], keys, keys,
                                      scale=attn.scale)
                y = stages.unfold_output(attn, mixed[:, 0], x)
            except Exception as err:  # with ranks, raised on every rank once the band is shared
                if ranks.size == 1:
                    raise
                failed = err
            else:
                if gather:
                    written[r] = Moments()
                    written[r].add(y, c)
                if ranks.size == 1:
                    out.write(r, xs, (y,))
                else:
                    outputs[0] = (y.contiguous(),)
        if ranks.size > 1:
            _share_row(ranks, r, (a, b), [xs], outputs, failed, out)
        state.free_above(b)
    return out, (_in_order(ranks.gather_moments(written)) if gather else None)


def largest_state(segs: list[Segment], x: torch.Tensor) -> int:
    """Bytes of the largest whole-image state between the segments, at most: a segment's output
    holds at most as many elements per input pixel as its widest tensor (Segment.width)."""
    res, most = Fraction(1), 0
    for seg in segs:
        pixels = math.floor(x.shape[-2] * res) * math.floor(x.shape[-1] * res)
        most = max(most, math.ceil(pixels * seg.width * x.shape[0]))
        res *= seg.scale
    return most * x.element_size()


def placement(config: TilingConfig, segs: list[Segment], x: torch.Tensor, elements: int) -> tuple:
    """Where a run keeps its states: (a directory for the file, or None: in memory; bytes kept in
    memory with a file). state_dir "auto" resolves here (TilingConfig)."""
    keep = config.state_memory_mib << 20
    if config.state_dir != AUTO:
        return config.state_dir, keep
    if x.is_cuda or config.distributed or not memory.settings().vae_state_on_disk:
        return None, 0  # (ranks must place it alike: each host's free disk differs)
    largest = largest_state(segs, x)
    if largest <= AUTO_MEMORY_TILES * elements * x.element_size():
        return None, 0
    directory = spill.default_dir(2 * largest)  # two states live at once: the one read, the one written
    return directory, keep if directory else 0


def run(tiled_steps, x: torch.Tensor, tile: int, config: TilingConfig = TilingConfig()) -> torch.Tensor:
    """The tiled steps on x, exactly, over abutting tiles of at most `tile` pixels of x (fewer
    where the resolution grows: Segment.grid), each segment on its own grid. The states between
    segments as the config says: float16 (compact_state, pyext.vae.state) and in a file
    (state_dir, pyext.vae.spill; placement); x itself, small, is kept as it is."""
    segs = plan(tiled_steps)
    directory, keep = placement(config, segs, x, element_budget(segs, tile, x.shape[0]))
    if directory is not None:
        segs = plan(tiled_steps, RECOMPUTE_CHANNELS)
    elements = element_budget(segs, tile, x.shape[0])
    budget = Budget(keep)

    def new_state(rows, width):
        if directory is not None:
            return FileBands(rows, width, directory, config.compact_state, budget)
        return Bands(rows, width, x.is_cuda, config.compact_state)

    # With pyext.memory.vae_block_pool, freed tensors serve the next tiles, and a state's freed
    # bands the next state's (on a GPU the device's allocator keeps its blocks already). No bound:
    # the pool frees cached blocks before it takes new memory, so the peak is that of the tensors
    # in use (docs/vae.md: a bound of 8 tiles kept too few bands, and cost time).
    pooled = memory.settings().vae_block_pool and not x.is_cuda
    ranks = Ranks.of_world(x.device) if config.distributed else Ranks()
    with spill.io_threads(), reused_blocks() if pooled else contextlib.nullcontext():
        return _run(segs, x, tile, elements, new_state, ranks, trim=pooled)  # no state file or I/O thread stays


def _run(segs: list[Segment], x: torch.Tensor, tile: int, elements: int, new_state, ranks: Ranks,
         trim: bool) -> torch.Tensor:
    state, res, moments, batch = None, Fraction(1), None, x.shape[0]  # res: pixels of the state per pixel of x
    for i, seg in enumerate(segs):
        at = max(1, math.floor(tile * res))
        gather = i + 1 < len(segs) and segs[i + 1].steps[0].input_norm is not None
        rows = seg.grid(x.shape[-2] if state is None else state.height, at, batch, elements)
        if state is None:
            state = Bands.of(x, rows)
        keep = seg.steps[-1].passes_input  # a resnet's first half: its second half adds this state
        if seg.steps[0].attends_whole:
            done, moments = _attend(seg.steps[0].module, state, batch, x.device, new_state, moments, gather, elements,
                                    ranks)
        else:
            cols = seg.grid(state.width, at, batch, elements)
            done, moments = _run_segment(seg, state, rows, cols, x.device, new_state, moments, gather, keep, ranks)
        if keep:  # the next segment reads both, and frees both as it goes
            done = Joined(done, state)
        else:
            state.release()
        if trim:  # (pyext.memory.vae_block_pool; on a GPU the tiles are the device's)
            # glibc keeps the blocks freed in its heap, where the next segment's tiles, of other
            # sizes, may not fit: under its default settings that raised the peak (docs/vae.md)
            trim_heap()
        state, res = done, res * seg.scale
    if state is None:  # nothing to tile (a VAE without resampling blocks)
        return x
    out, = state.whole(x.device)
    state.release()
    return out
