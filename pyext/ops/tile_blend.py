"""Fused tile blend: put one decoded (or encoded) tile into a preallocated output,
overlap ramps included, in one pass and one kernel launch per tile.

Two modes (both stream tiles in raster order; see pyext/vae/streaming.py):

* ``normalized``: ``out[y:y+h, x:x+w] += w * tile`` with symmetric ramps
  ``w = wy(row) * wx(col)``; inside an overlap of length ``ov`` the weight of index k
  from the tile's edge is ``(k + 0.5) / ov``, so two tiles over one overlap sum to 1.
  The weight sums are separable (``edge_weights`` per axis), so normalising at the end
  needs two 1-D vectors instead of a full weight image.
* ``diffusers``: exactly AutoencoderKL.tiled_decode's blend_v then blend_h against the
  already blended tile above and to the left, then the crop to the tile stride. Instead
  of keeping every tile, the caller keeps only the strips the next tiles need: the
  bottom rows of each tile of the previous tile row and the right columns of the
  previous tile, which the op returns. Rounding mirrors diffusers' tensor ops, so fp32
  (and fp16/bf16 on CPU) results are identical to diffusers'.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from pyext import dispatch
from pyext._ext import cuda_kernel_missing, kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.ops._alias import apart_from, check_disjoint
from pyext.ops._library import define

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODE_DIFFUSERS, MODE_NORMALIZED = 0, 1


# ----------------------------------------------------------------------------- validation

def _fail(op: str, msg: str) -> None:
    raise PyextError(f"pyext.{op}: {msg}")


def _check_tile_out(op: str, tile, out, y: int, x: int, h: int, w: int) -> None:
    """tile (..., C, th, tw) fits into out (..., C, H, W) at (y, x) over an (h, w) window."""
    if not isinstance(tile, torch.Tensor) or tile.dtype not in DTYPES or tile.dim() < 3:
        _fail(op, f"tile must be a float32/float16/bfloat16 tensor (..., C, h, w), got {dispatch.describe(tile)}")
    if not isinstance(out, torch.Tensor) or out.dtype != tile.dtype or out.device != tile.device:
        _fail(op, f"out must be a {tile.dtype} tensor on {tile.device}, got {dispatch.describe(out)}")
    if not out.is_contiguous():
        _fail(op, f"out must be contiguous, got {dispatch.describe(out)}")
    if out.dim() != tile.dim() or out.shape[:-2] != tile.shape[:-2]:
        _fail(op, f"tile and out must agree on every dim but the last two (batch, channels): tile "
              f"{tuple(tile.shape)}, out {tuple(out.shape)}")
    if not all(isinstance(v, int) and v >= 0 for v in (y, x)):
        _fail(op, f"position (y, x) must be non-negative ints, got ({y!r}, {x!r})")
    H, W = out.shape[-2:]
    if y + h > H or x + w > W:
        _fail(op, f"a {h}x{w} tile at (y={y}, x={x}) extends past the {H}x{W} output; "
              "the tile must lie inside the output at its position")


def _check_strip(op: str, name: str, strip, tile, rows: Optional[int], cols: Optional[int],
                 contiguous: bool = False) -> None:
    want = f"(..., {'r' if rows is None else rows}, {'c' if cols is None else cols})"
    if (not isinstance(strip, torch.Tensor) or strip.dtype != tile.dtype or strip.device != tile.device
            or (contiguous and not strip.is_contiguous()) or strip.dim() != tile.dim()
            or strip.shape[:-2] != tile.shape[:-2]
            or (rows is not None and strip.shape[-2] != rows) or (cols is not None and strip.shape[-1] != cols)):
        _fail(op, f"{name} must be a {'contiguous ' if contiguous else ''}{tile.dtype} tensor {want} with the "
              f"tile's leading dims "
              f"{tuple(tile.shape[:-2])} on {tile.device}, got {dispatch.describe(strip)}")


# ----------------------------------------------------------------------------- reference

def edge_weights(size: int, before: int, after: int, device=None) -> torch.Tensor:
    """The normalized-mode ramp along one axis of a tile of `size` with overlaps `before`/`after`."""
    k = torch.arange(size, dtype=torch.float32, device=device)
    w = torch.ones(size, dtype=torch.float32, device=device)
    if before:
        w = w * torch.where(k < before, (k + 0.5) / before, 1.0)
    if after:
        r = size - 1 - k
        w = w * torch.where(r < after, (r + 0.5) / after, 1.0)
    return w


def _diffusers_ramp(e: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # (1 - k/e, k/e) computed in double, used in fp32: what `tensor * python_float` does.
    t = torch.arange(e, dtype=torch.float64, device=device) / e
    return (1 - t).float(), t.float()


def tile_blend_reference(tile, out, oy, ox, mode, sizes, above, left, bottom, right) -> None:
    """PyTorch semantics of torch.ops.pyext.tile_blend (the oracle for the kernels)."""
    th, tw = tile.shape[-2:]
    dt = tile.dtype
    if mode == MODE_NORMALIZED:
        top, bot, lft, rgt = sizes
        w = edge_weights(th, top, bot, tile.device)[:, None] * edge_weights(tw, lft, rgt, tile.device)[None, :]
        region = out[..., oy:oy + th, ox:ox + tw]
        region.copy_((region.float() + tile.float() * w).to(dt))
        return
    crop_h, crop_w = sizes
    b = tile.clone()
    if above is not None and above.shape[-2]:
        ev = min(above.shape[-2], th)
        keep, new = _diffusers_ramp(ev, tile.device)
        b[..., :ev, :] = (above[..., -ev:, :] * keep[:, None]).to(dt) + (b[..., :ev, :] * new[:, None]).to(dt)
    if left is not None and left.shape[-1]:
        eh = min(left.shape[-1], tw)
        keep, new = _diffusers_ramp(eh, tile.device)
        b[..., :eh] = (left[..., -eh:] * keep).to(dt) + (b[..., :eh] * new).to(dt)
    out[..., oy:oy + crop_h, ox:ox + crop_w] = b[..., :crop_h, :crop_w]
    bottom.copy_(b[..., th - bottom.shape[-2]:, :])
    right.copy_(b[..., tw - right.shape[-1]:])


# ----------------------------------------------------------------------------- backends

def _run_ext(tile, out, oy, ox, mode, sizes, above, left, bottom, right) -> None:
    torch.ops.pyext_C.tile_blend(tile, out, oy, ox, mode, sizes, above, left, bottom, right)


# (mode, tile (h, w), out (H, W), position (y, x), sizes) the op tests run every backend on:
# normalized sizes are the (top, bottom, left, right) overlaps, diffusers sizes are
# (crop h, crop w, above rows, left columns, bottom rows kept, right columns kept).
TEST_SHAPES = ((MODE_NORMALIZED, (17, 23), (40, 50), (23, 27), (5, 0, 7, 0)),
               (MODE_NORMALIZED, (8, 8), (8, 8), (0, 0), (8, 8, 8, 8)),
               (MODE_DIFFUSERS, (24, 24), (40, 40), (18, 18), (18, 18, 6, 6, 6, 6)),
               (MODE_DIFFUSERS, (13, 7), (40, 40), (20, 33), (13, 7, 0, 9, 6, 0)))

dispatch.register("tile_blend", Backend(
    "cuda", _run_ext, unavailable=partial(cuda_kernel_missing, "tile_blend"), devices=("cuda",), dtypes=DTYPES,
    test_shapes=TEST_SHAPES, doc="CUDA C++ kernel, one thread per output element, one launch per tile"))
dispatch.register("tile_blend", Backend(
    "cpp", _run_ext, unavailable=partial(kernel_missing, "tile_blend"), devices=("cpu",), dtypes=DTYPES,
    test_shapes=TEST_SHAPES, doc="C++ AVX-512/scalar row kernel, at::parallel_for over (channel, row)"))
dispatch.register("tile_blend", Backend(
    "reference", tile_blend_reference, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="PyTorch ops; the semantics and test oracle"))


def _blend_close(out, ref, args):
    """Within the dtype's rounding of a weighted sum of two values. The self-check runs on the call's
    own arguments, which may hold NaN or inf (a diverged image, an output not yet written): the same
    non-finite value in both agrees, any other NaN is a mismatch."""
    tolerance = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[args[0].dtype]
    for a, b in zip(out, ref):
        if a.numel():
            a, b = a.float(), b.float()
            err = (a - b).abs().masked_fill((a == b) | (a.isnan() & b.isnan()), 0).max().item()
            if not err <= tolerance * 4:  # (NaN too)
                return f"max error {err:.3g}"
    return None


def _example(spec, dtype, device):
    mode, (th, tw), (out_h, out_w), (y, x), sizes = spec
    g = torch.Generator(device=device).manual_seed(0)

    def planes(h, w):
        return torch.randn(1, 3, h, w, generator=g, device=device).to(dtype)

    tile, out = planes(th, tw), planes(out_h, out_w)
    if mode == MODE_NORMALIZED:
        empty = planes(0, 0)
        return tile, out, y, x, mode, list(sizes), None, None, empty, empty.clone()
    crop_h, crop_w, above_rows, left_cols, keep_bottom, keep_right = sizes
    return (tile, out, y, x, mode, [crop_h, crop_w], planes(above_rows, tw), planes(th, left_cols),
            planes(keep_bottom, tw), planes(th, keep_right))


def check_blend(tile, out, oy, ox, blend_mode, sizes, above, left, bottom, right) -> None:
    """The validation of torch.ops.pyext.tile_blend: every tensor contiguous, of the tile's dtype and
    device and leading dims, and every write inside its buffer."""
    op = "tile_blend"
    if not isinstance(tile, torch.Tensor) or tile.dtype not in DTYPES or tile.dim() < 3 or not tile.is_contiguous():
        _fail(op, f"tile must be a contiguous float32/float16/bfloat16 tensor (..., C, h, w), "
              f"got {dispatch.describe(tile)}")
    th, tw = tile.shape[-2:]
    if blend_mode == MODE_NORMALIZED:
        if len(sizes) != 4 or min(sizes) < 0:
            _fail(op, f"normalized mode takes sizes = [top, bottom, left, right] overlaps >= 0, got {sizes!r}")
        if max(sizes[:2]) > th or max(sizes[2:]) > tw:
            _fail(op, f"overlaps {tuple(sizes)} are larger than the {th}x{tw} tile; each overlap must be at "
                  "most the tile's extent along its axis")
        _check_tile_out(op, tile, out, oy, ox, th, tw)
        strips = (("bottom", bottom, None, None), ("right", right, None, None))
    elif blend_mode == MODE_DIFFUSERS:
        if len(sizes) != 2 or not (0 <= sizes[0] <= th and 0 <= sizes[1] <= tw):
            _fail(op, f"diffusers mode takes sizes = [crop_h, crop_w] inside the {th}x{tw} tile, got {sizes!r}")
        _check_tile_out(op, tile, out, oy, ox, *sizes)
        strips = (("above", above, None, tw), ("left", left, th, None), ("bottom", bottom, None, tw),
                  ("right", right, th, None))
    else:
        _fail(op, f"mode must be {MODE_DIFFUSERS} (diffusers) or {MODE_NORMALIZED} (normalized), got {blend_mode!r}")
    for name, strip, rows, cols in strips:
        if strip is not None:
            _check_strip(op, name, strip, tile, rows, cols, contiguous=True)
    if blend_mode == MODE_DIFFUSERS and (bottom.shape[-2] > th or right.shape[-1] > tw):
        _fail(op, f"keep_bottom={bottom.shape[-2]}, keep_right={right.shape[-1]} must be within the {th}x{tw} tile")


def _sample(args):
    """A tile of the call's mode and dtype from the op tests' shapes: a small valid input."""
    tile, mode = args[0], args[4]
    spec = next(s for s in TEST_SHAPES if s[0] == mode)
    return _example(spec, tile.dtype, tile.device)


dispatch.define("tile_blend", check=check_blend, sample=_sample, close=_blend_close, pure=False,
                signature=lambda args: (args[0].dtype, args[0].device, args[4]),  # not every tile's position
                output=lambda args, returned: (args[1], args[8], args[9]),
                variant=lambda args: (str(args[0].dtype), args[4]), example=_example)


# ----------------------------------------------------------------------------- custom op

def _blend_kernel(tile, out, oy, ox, blend_mode, sizes, above, left, bottom, right, backend=None):
    # (not named `mode`: that name clashes with torch's mode-redirect wrappers in opcheck)
    check_disjoint("tile_blend", out=out, bottom=bottom, right=right)  # on real tensors: reads their addresses
    tile, above, left = apart_from([out, bottom, right], tile, above, left)
    args = (tile, out, oy, ox, blend_mode, sizes, above, left, bottom, right)
    dispatch.select("tile_blend", args, backend).run(*args)


def _blend_fake(tile, out, oy, ox, blend_mode, sizes, above, left, bottom, right, backend=None):
    dispatch.check("tile_blend", (tile, out, oy, ox, blend_mode, sizes, above, left, bottom, right))


define("tile_blend(Tensor tile, Tensor(a1!) out, SymInt oy, SymInt ox, SymInt blend_mode, SymInt[] sizes, Tensor? above, "
       "Tensor? left, Tensor(a8!) bottom, Tensor(a9!) right, str? backend=None) -> ()", _blend_kernel, _blend_fake)


# ----------------------------------------------------------------------------- public API

def tile_blend_normalized(tile: torch.Tensor, out: torch.Tensor, y: int, x: int,
                          overlaps: tuple[int, int, int, int] = (0, 0, 0, 0),
                          backend: Optional[str] = None) -> torch.Tensor:
    """out[..., y:y+th, x:x+tw] += wy * wx * tile with ramps over (top, bottom, left, right) overlaps.

    After every tile, divide by the weight sums: for a grid of tiles they are the outer
    product of the per-axis sums of `edge_weights` (1 wherever two ramps meet).
    """
    op = "tile_blend"
    th, tw = (tile.shape[-2:] if isinstance(tile, torch.Tensor) and tile.dim() >= 2 else (0, 0))
    _check_tile_out(op, tile, out, y, x, th, tw)
    if len(overlaps) != 4 or not all(isinstance(v, int) and v >= 0 for v in overlaps):
        _fail(op, f"overlaps must be 4 non-negative ints (top, bottom, left, right), got {overlaps!r}")
    top, bot, lft, rgt = overlaps
    if max(top, bot) > th or max(lft, rgt) > tw:
        _fail(op, f"overlaps {tuple(overlaps)} are larger than the {th}x{tw} tile; each overlap must be at "
              "most the tile's extent along its axis")
    empty = tile.new_empty((*tile.shape[:-2], 0, 0))
    torch.ops.pyext.tile_blend(tile.contiguous(), out, y, x, MODE_NORMALIZED, list(overlaps), None, None,
                               empty, empty.clone(), backend)
    return out


def tile_blend_diffusers(tile: torch.Tensor, out: torch.Tensor, y: int, x: int,
                         crop: Optional[tuple[int, int]] = None,
                         above: Optional[torch.Tensor] = None, left: Optional[torch.Tensor] = None,
                         keep_bottom: int = 0, keep_right: int = 0,
                         backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoencoderKL's blend_v(above) + blend_h(left) + crop, written to out at (y, x).

    `above`: the last rows of the blended tile above (..., r, tw); `left`: the last
    columns of the blended tile to the left (..., th, c); the blend extents are
    min(r, th) and min(c, tw), as diffusers clamps them. Returns the blended tile's
    last `keep_bottom` rows and `keep_right` columns, for the next tiles.
    """
    op = "tile_blend"
    th, tw = (tile.shape[-2:] if isinstance(tile, torch.Tensor) and tile.dim() >= 2 else (0, 0))
    crop_h, crop_w = crop if crop is not None else (th, tw)
    if not (0 <= crop_h <= th and 0 <= crop_w <= tw):
        _fail(op, f"crop {crop!r} must lie inside the {th}x{tw} tile")
    _check_tile_out(op, tile, out, y, x, crop_h, crop_w)
    if above is not None:
        _check_strip(op, "above", above, tile, None, tw)
    if left is not None:
        _check_strip(op, "left", left, tile, th, None)
    if not (0 <= keep_bottom <= th and 0 <= keep_right <= tw):
        _fail(op, f"keep_bottom={keep_bottom}, keep_right={keep_right} must be within the {th}x{tw} tile")
    lead = tile.shape[:-2]
    bottom = tile.new_empty((*lead, keep_bottom, tw))
    right = tile.new_empty((*lead, th, keep_right))
    torch.ops.pyext.tile_blend(tile.contiguous(), out, y, x, MODE_DIFFUSERS, [crop_h, crop_w],
                               None if above is None else above.contiguous(),
                               None if left is None else left.contiguous(), bottom, right, backend)
    return bottom, right
