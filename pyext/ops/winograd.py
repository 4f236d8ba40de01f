"""winograd_conv3x3: a 3x3 convolution (stride 1, padding 1) by Winograd's F(4x4, 3x3) on the CPU.

Each 4x4 block of output pixels takes 36 multiplies per (input, output) channel pair instead
of 144: the input's 6x6 windows and the weight go to the Winograd domain, the 36 points are 36
independent GEMMs (torch's BLAS), and the output transform brings each tile back
(csrc/winograd/). The weight is transformed on every call, into the workspace of the caller
(`using_workspace`: the packed layers of one model share one, at most 256 MiB with the tile
chunks, which the rule enforces) or into a buffer of the call's own, so the layers hold no
second copy of their weights and nothing outlives its owner. In fp32 the result differs from a
direct convolution by a few times its rounding error (the transforms' constants are up to 8;
tests bound it).

It pays where the GEMMs dominate: many output pixels per weight element. Where they do not
(the UNet's 8x8 levels, 3- or 4-channel layers) oneDNN's direct convolution is faster;
`winograd_reason` is that rule, from measurements (docs/benchmarks.md, "CPU runtimes"), and the
prepacked layers of pyext.nn.packed follow it per input shape.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.ops._library import define

DTYPES = (torch.float32,)
# The rule, measured on SD1.5 UNet and VAE layer shapes (`python -m bench.winograd`, figures in
# docs/benchmarks.md, "Winograd per layer"): Winograd is faster than oneDNN with at least this
# many output pixels per call, at least MIN_CHANNELS in and out, and pixels >= PIXELS_PER_CHANNEL
# x the larger channel count (the per-call weight transform is then small); below, slower.
MIN_PIXELS, MIN_CHANNELS, PIXELS_PER_CHANNEL = 512, 32, 0.25
# The transformed weight (36 floats per input/output channel pair) and the tile chunks live in a
# workspace (csrc/winograd/winograd_ops.cpp: kChunkBytes, kMinChunkTiles), which the rule keeps
# within KEPT_WORKSPACE_BYTES: enough for 1280x1280 channels, the largest of the SD UNets. Without
# a kept workspace each call maps fresh pages, whose faults cost about what the transforms do.
KEPT_WORKSPACE_BYTES, CHUNK_BYTES, MIN_CHUNK_TILES = 256 << 20, 2 << 20, 64
PANEL = 32  # csrc/winograd/winograd_cpu.h: kPanel


def workspace_bytes(batch: int, in_channels: int, out_channels: int, height: int, width: int) -> int:
    """Bytes of the workspace the C++ op needs for this shape: transformed weight plus one tile chunk
    (the weight's output channels padded to whole panels, as the AVX-512 unit stores them)."""
    tiles = batch * -(-height // 4) * -(-width // 4)
    per_tile = 36 * 4 * (in_channels + out_channels)
    chunk = min(tiles, max(MIN_CHUNK_TILES, CHUNK_BYTES // per_tile))
    return 36 * 4 * in_channels * -(-out_channels // PANEL) * PANEL + chunk * per_tile


def winograd_reason(batch: int, in_channels: int, out_channels: int, height: int, width: int) -> Optional[str]:
    """Why Winograd would be slower than oneDNN's direct convolution for this shape; None when faster."""
    pixels = batch * height * width
    workspace = workspace_bytes(batch, in_channels, out_channels, height, width)
    if workspace > KEPT_WORKSPACE_BYTES:
        return (f"{in_channels}->{out_channels} channels: the transformed weight and tiles would take "
                f"{workspace >> 20} MiB, over the {KEPT_WORKSPACE_BYTES >> 20} MiB kept workspace")
    if min(in_channels, out_channels) < MIN_CHANNELS:
        return f"{in_channels}->{out_channels} channels: under {MIN_CHANNELS}, the transforms outweigh the GEMM"
    if pixels < max(MIN_PIXELS, PIXELS_PER_CHANNEL * max(in_channels, out_channels)):
        return (f"{pixels} output pixels for {in_channels}->{out_channels} channels: too few to amortise "
                "the weight's transform")
    return None


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.winograd_conv3x3: {msg}")


def winograd_conv3x3_reference(x, weight, bias):
    return F.conv2d(x, weight, bias, padding=1)


class Workspace:
    """A float32 buffer for winograd_conv3x3's C++ backend, grown to its owner's largest call and
    freed with the owner (pyext.nn.packed gives the packed layers of one model one). One buffer
    per thread, so that two threads never share one."""

    def __init__(self):
        self._local = threading.local()

    def __deepcopy__(self, memo):
        return self  # a copied model shares its source's buffer (they run one layer at a time per thread)

    def get(self, floats: int) -> torch.Tensor:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < floats:
            self._local.buffer = None  # free the old one first
            buffer = self._local.buffer = torch.empty(floats)
        return buffer


_WORKSPACE: contextvars.ContextVar[Workspace | None] = contextvars.ContextVar("pyext_winograd_workspace",
                                                                             default=None)


@contextlib.contextmanager
def using_workspace(workspace: Workspace | None):
    """winograd_conv3x3 calls inside the block work in `workspace` (None: a buffer per call)."""
    token = _WORKSPACE.set(workspace)
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


def _cpp(x, weight, bias):
    workspace = _WORKSPACE.get()
    if workspace is not None:
        floats = workspace_bytes(x.shape[0], x.shape[1], weight.shape[0], x.shape[2], x.shape[3]) // 4
        workspace = workspace.get(floats)
    return torch.ops.pyext_C.winograd_conv3x3(x, weight, bias, workspace)


def _cpp_slower(x, weight, bias):
    reason = winograd_reason(x.shape[0], x.shape[1], weight.shape[0], x.shape[2], x.shape[3])
    return [reason] if reason else []


# (batch, in channels, out channels, height, width, channels-last x, bias): odd sizes, tiles cut
# at the edges, channel counts off the 64-channel blocks.
TEST_SHAPES = ((1, 3, 5, 7, 9, True, True), (2, 64, 70, 13, 6, True, False), (1, 130, 33, 5, 17, False, True),
               (1, 1, 1, 1, 1, True, True), (2, 16, 16, 8, 8, False, False))
dispatch.register("winograd_conv3x3", Backend(
    "cpp", _cpp, unavailable=partial(kernel_missing, "winograd_conv3x3"), slower=_cpp_slower, devices=("cpu",),
    dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="C++ F(4x4, 3x3) transforms (scalar/AVX2/AVX-512) around torch's batched GEMM, channels-last"))
dispatch.register("winograd_conv3x3", Backend(
    "reference", winograd_conv3x3_reference, dtypes=(torch.float32, torch.float16, torch.bfloat16),
    test_shapes=TEST_SHAPES, doc="F.conv2d(x, weight, bias, padding=1)"))

# The transforms' constants (up to 8, and 1/24) amplify fp32 rounding a few times over a direct
# convolution's: within this fraction of the output's largest magnitude (at least 1).
TOLERANCE = 1e-4


def _close(out, ref, args):
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    bound = TOLERANCE * max(1.0, ref.float().abs().max().item() if ref.numel() else 0.0)
    return None if err <= bound else f"max error {err:.3g} (tolerance {bound:.3g})"


def _example(spec, dtype, device):
    batch, cin, cout, h, w, channels_last, with_bias = spec
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, cin, h, w, generator=g, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    weight = (torch.randn(cout, cin, 3, 3, generator=g, device=device) / (3 * cin ** 0.5)).to(dtype)
    bias = torch.randn(cout, generator=g, device=device).to(dtype) if with_bias else None
    return x, weight, bias


def _sample(x, weight, bias):
    return _example((1, x.shape[1], weight.shape[0], 9, 7, True, bias is not None), x.dtype, x.device)


def check_inputs(x, weight, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        _fail(f"x must be a floating (batch, channels, height, width) tensor, got {dispatch.describe(x)}")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 4 or tuple(weight.shape[1:]) != (x.shape[1], 3, 3)
            or weight.dtype != x.dtype or weight.device != x.device):
        _fail(f"weight must be a {x.dtype} tensor (out, {x.shape[1]}, 3, 3) on {x.device}, "
              f"got {dispatch.describe(weight)}; only 3x3 kernels, stride 1, padding 1, groups 1")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)
                             or bias.dtype != x.dtype or bias.device != x.device):
        _fail(f"bias must be a {x.dtype} tensor ({weight.shape[0]},) on {x.device}, got {dispatch.describe(bias)}")


dispatch.define("winograd_conv3x3", check=check_inputs, sample=lambda args: _sample(*args), close=_close,
                example=_example, variant=lambda args: (str(args[0].dtype), args[2] is None))


def _winograd_kernel(x, weight, bias, backend=None):
    out = dispatch.select("winograd_conv3x3", (x, weight, bias), backend).run(x, weight, bias)
    return out.contiguous(memory_format=torch.channels_last)


def _winograd_fake(x, weight, bias, backend=None):
    dispatch.check("winograd_conv3x3", (x, weight, bias))
    return x.new_empty((x.shape[0], weight.shape[0], *x.shape[2:])).contiguous(memory_format=torch.channels_last)


define("winograd_conv3x3(Tensor x, Tensor weight, Tensor? bias, str? backend=None) -> Tensor", _winograd_kernel,
       _winograd_fake)


def winograd_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride=1, padding=1) for a 3x3 weight; the output is channels-last.

    The C++ backend reads the weight fastest stored as (3, 3, in, out), i.e. a (out, in, 3, 3) view of
    `w.permute(2, 3, 1, 0).contiguous()`; any other layout is copied into it on each call."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        _fail(f"bias must be a tensor or None, got {type(bias).__name__}")
    return torch.ops.pyext.winograd_conv3x3(x, weight, bias, backend)
