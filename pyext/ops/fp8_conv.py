"""fp8_conv2d: a convolution whose weight stays in fp8 (e4m3) storage.

The C++ backend runs the convolution as an implicit GEMM over channels-last
activations (an NCHW input is reordered first, as oneDNN does) and decodes the fp8 weight
inside the GEMM's packing step (the GEMM of fp8_linear), so no full-precision copy of the
weight is ever written. It takes bf16 on CPUs with AVX512_BF16. The `brgemm` backend is the
same implicit GEMM on torch's oneDNN micro-kernel (AMX tiles), each tap's inputs read in place.
The `upcast` backend decodes the weight with fp8_upcast's kernels into a reused buffer, then
runs torch's convolution (oneDNN, cuDNN); dispatch times them where more than one can take the input.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._compat import is_channels_last
from pyext._ext import cpu_capabilities, kernel_missing
from pyext.dispatch import Backend
from pyext.ops._library import define
from pyext.ops.fp8 import (BRGEMM_NOTES, COMPUTE_DTYPES, LINEAR_TOLERANCE, _check_dtype, _fail, brgemm_missing,
                           check_codes, check_public, example_weight, relative_close, sample_codes, sample_scale,
                           scales_fuse_exactly)
from pyext.reference.fp8 import fp8_conv2d_reference


def _pair(v) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(a) for a in v]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_pair(name: str, v, least: int) -> list[int]:
    """An int or two ints, each >= least, as [h, w]."""
    pair = [v, v] if _is_int(v) else list(v) if isinstance(v, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(_is_int(a) and a >= least for a in pair):
        _fail("fp8_conv2d", f"{name} must be an int or two ints (height, width), each >= {least}; got {v!r}")
    return pair


def _out_format(x: torch.Tensor, w: torch.Tensor):
    """The output's memory format: channels-last when x or the weight is (torch's conv rule, by
    strides: a 1x1 weight made channels-last counts)."""
    return torch.channels_last if is_channels_last(x) or is_channels_last(w) else torch.contiguous_format


def _cpp_unavailable() -> Optional[str]:
    missing = kernel_missing("fp8_conv2d")
    if missing:
        return missing
    if "avx512_bf16" not in cpu_capabilities():
        return "needs AVX-512 with AVX512_BF16 (this CPU lacks it, or PYEXT_CPU_SIMD caps it)"
    return None


def _cpp_argument_reasons(x, w, scale, bias, stride, padding, dilation, groups) -> list[str]:
    """What the C++ backend's declared data (cpu, bfloat16) does not say it refuses."""
    reasons = []
    if groups != 1:
        reasons.append(f"groups must be 1, got {groups}")
    if _pair(dilation) != [1, 1]:
        reasons.append(f"dilation must be 1, got {dilation}")
    if x.dim() == 4 and x.shape[1] % 2:
        reasons.append(f"input channels must be even (bf16 pairs), got {x.shape[1]}")
    return reasons


def _cpp_scale_guard(x, w, scale, *args) -> list[str]:
    if not scales_fuse_exactly(scale, torch.bfloat16):
        return ["scales must be finite with |scale| * 448 within bfloat16's range and no nonzero "
                "weight underflowing (the kernel applies them after the dot product)"]
    return []


def _conv_cpp(x, w, scale, bias, stride, padding, dilation, groups):
    return torch.ops.pyext_C.fp8_conv2d(x, w.permute(0, 2, 3, 1), scale, bias, _pair(stride), _pair(padding))


def _conv_brgemm(x, w, scale, bias, stride, padding, dilation, groups):
    return torch.ops.pyext_C.fp8_conv2d_brgemm(x, w.permute(0, 2, 3, 1), scale, bias, _pair(stride), _pair(padding))


# On CPU, one upcast buffer per thread and dtype, shared by every convolution and grown to the
# largest: reusing it avoids page faults for every fresh multi-MB weight. Per thread, so two
# pipelines running in two threads never share one.
_WORKSPACE = threading.local()


def workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer for an upcast weight. On a GPU a fresh tensor: torch's caching allocator
    reuses memory without page faults, and a CUDA graph must own what it writes (a shared
    buffer that later grew would leave a captured graph writing into freed memory)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    buf = buffers.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def upcast_weight(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in, kh, kw) codes decoded into workspace(), in their memory order: channels-last
    codes give a channels-last weight (and so, by torch's conv rule, a channels-last output)."""
    channels_last = w.is_contiguous(memory_format=torch.channels_last) and is_channels_last(w)
    rows = w.permute(0, 2, 3, 1) if channels_last else w.contiguous()
    out = workspace(rows.numel(), dtype, w.device).view(rows.shape)
    torch.ops.pyext.fp8_upcast_out(rows, scale, out, None)
    return out.permute(0, 3, 1, 2) if channels_last else out


def _conv_upcast(x, w, scale, bias, stride, padding, dilation, groups):
    return F.conv2d(x, upcast_weight(w, scale, x.dtype), bias, stride, padding, dilation, groups)


# (batch, in channels, height, width, out channels, kernel, stride, padding, groups, channels-last x)
# the op tests run every backend on; the reference also on what the C++ kernel refuses.
CPP_TEST_SHAPES = ((1, 2, 5, 7, 3, 3, 1, 1, 1, True), (2, 6, 9, 8, 70, 3, 2, 1, 1, False),
                   (1, 8, 6, 6, 64, 1, 1, 0, 1, True))
_CPP = Backend(
    "cpp", _conv_cpp, _cpp_argument_reasons, _cpp_unavailable, devices=("cpu",), dtypes=(torch.bfloat16,),
    guard=_cpp_scale_guard, test_shapes=CPP_TEST_SHAPES,
    doc="C++ implicit GEMM over channels-last bf16 activations, fp8 decoded in the GEMM's packing step")
# brgemm first: where it runs (AMX CPUs) it was faster than cpp at every shape measured (docs/benchmarks.md).
dispatch.register("fp8_conv2d", Backend(
    "brgemm", _conv_brgemm, _cpp_argument_reasons, lambda: brgemm_missing("fp8_conv2d_brgemm"), devices=("cpu",),
    dtypes=(torch.bfloat16,), guard=_cpp_scale_guard, test_shapes=CPP_TEST_SHAPES,
    notes=BRGEMM_NOTES, doc="C++ on AMX CPUs: the same implicit GEMM on torch's oneDNN brgemm, each tap's inputs read in place"))
dispatch.register("fp8_conv2d", _CPP)
dispatch.register("fp8_conv2d", Backend(
    "upcast", _conv_upcast, dtypes=COMPUTE_DTYPES,
    test_shapes=CPP_TEST_SHAPES + ((1, 3, 6, 5, 4, 3, 1, 1, 1, False), (1, 4, 7, 7, 6, 3, 2, 0, 2, True)),
    doc="fp8_upcast's kernel into a reused buffer (CPU; a fresh tensor on a GPU), then F.conv2d"))
dispatch.register("fp8_conv2d", Backend(
    "reference", fp8_conv2d_reference, dtypes=COMPUTE_DTYPES,
    test_shapes=CPP_TEST_SHAPES + ((1, 3, 6, 5, 4, 3, 1, 1, 1, False), (1, 4, 7, 7, 6, 3, 2, 0, 2, True)),
    doc="F.conv2d on the upcast weight"))


def _sample(x, w, scale, bias, stride, padding, dilation, groups):
    """A small input of the variant (dtype, memory format, geometry) for the dispatcher's self-check."""
    g = torch.Generator(device=x.device).manual_seed(0)
    out_channels = 2 * groups
    sample_x = torch.randn(1, x.shape[1], 7, 6, generator=g, device=x.device).to(x.dtype)
    sample_x = sample_x.contiguous(memory_format=torch.channels_last if is_channels_last(x) else torch.contiguous_format)
    codes = sample_codes((out_channels, *w.shape[1:]), x.device, g)
    sample_bias = None if bias is None else torch.randn(out_channels, generator=g, device=x.device).to(bias.dtype)
    return (sample_x, codes, sample_scale(scale, out_channels, g), sample_bias, stride, padding, dilation, groups)


def _example(spec, dtype, device):
    batch, channels, h, w, out_channels, kernel, stride, padding, groups, channels_last = spec
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, channels, h, w, generator=g, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    codes, scale = example_weight((out_channels, channels // groups, kernel, kernel), True, device, g)
    bias = torch.randn(out_channels, generator=g, device=device).to(dtype)
    return x, codes, scale, bias, [stride] * 2, [padding] * 2, [1, 1], groups


def check_conv(x, w, scale, bias, stride, padding, dilation, groups) -> None:
    """The validation of torch.ops.pyext.fp8_conv2d and fp8_conv2d (stride, padding and dilation
    as two ints each)."""
    op = "fp8_conv2d"
    check_codes(op, w, scale)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        _fail(op, f"x must be a 4-D (batch, channels, height, width) tensor, got {dispatch.describe(x)}")
    _check_dtype(op, x.dtype, "x.dtype")
    if x.shape[1] == 0:
        _fail(op, f"x has 0 input channels; a convolution needs at least one, got x {tuple(x.shape)}")
    if not _is_int(groups) or groups < 1 or w.shape[0] % groups:
        _fail(op, f"groups must be a positive int dividing the {w.shape[0]} output channels, got {groups!r}")
    if w.dim() != 4 or x.shape[1] != w.shape[1] * groups:
        _fail(op, f"weight must be (out, in/groups, kh, kw) with in = x.shape[1]; got x {tuple(x.shape)}, "
              f"weight {tuple(w.shape)}, groups {groups}")
    if x.device != w.device:
        _fail(op, f"x is on {x.device} but weight is on {w.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (w.shape[0],)
                             or bias.dtype != x.dtype or bias.device != x.device):
        _fail(op, f"bias must be {x.dtype}[{w.shape[0]}] on {x.device}, got {dispatch.describe(bias)}")
    stride, padding, dilation = (_check_pair("stride", stride, 1), _check_pair("padding", padding, 0),
                                 _check_pair("dilation", dilation, 1))
    for i in range(2):
        if x.shape[2 + i] + 2 * padding[i] < dilation[i] * (w.shape[2 + i] - 1) + 1:
            _fail(op, f"the kernel {tuple(w.shape[2:])} is larger than the padded input {tuple(x.shape[2:])}")


dispatch.define("fp8_conv2d", check=check_conv, sample=lambda args: _sample(*args),
                close=relative_close(LINEAR_TOLERANCE),
                variant=lambda args: (str(args[0].dtype), is_channels_last(args[0]), tuple(args[1].shape[1:]),
                                      args[2].numel() == 1, args[3] is None, *map(tuple, args[4:7]), args[7]),
                example=_example)


def _conv_kernel(x, w, scale, bias, stride, padding, dilation, groups, backend=None):
    args = (x, w, scale, bias, list(stride), list(padding), list(dilation), groups)
    out = dispatch.select("fp8_conv2d", args, backend).run(*args)
    return out.contiguous(memory_format=_out_format(x, w))


def _conv_fake(x, w, scale, bias, stride, padding, dilation, groups, backend=None):
    dispatch.check("fp8_conv2d", (x, w, scale, bias, list(stride), list(padding), list(dilation), groups))
    size = [x.shape[0], w.shape[0]]
    for i in range(2):
        size.append((x.shape[2 + i] + 2 * padding[i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1)
    return x.new_empty(size).contiguous(memory_format=_out_format(x, w))


define("fp8_conv2d(Tensor x, Tensor w, Tensor scale, Tensor? bias, SymInt[] stride, SymInt[] padding, "
       "SymInt[] dilation, SymInt groups, str? backend=None) -> Tensor", _conv_kernel, _conv_fake)


def fp8_conv2d(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
               stride=1, padding=0, dilation=1, groups: int = 1, backend: Optional[str] = None) -> torch.Tensor:
    """F.conv2d(x, fp8_upcast(w, scale, x.dtype), bias, ...) without materialising the upcast weight
    where the C++ backend can take the input (see the module docstring). Integer padding only.
    The op validates the input (check_conv); here only what its schema cannot take is refused first."""
    check_public("fp8_conv2d", x, w, scale, bias)
    if not _is_int(groups):
        _fail("fp8_conv2d", f"groups must be a positive int dividing the {w.shape[0]} output channels, got {groups!r}")
    stride, padding, dilation = (_check_pair("stride", stride, 1), _check_pair("padding", padding, 0),
                                 _check_pair("dilation", dilation, 1))
    return torch.ops.pyext.fp8_conv2d(x, w.view(torch.uint8), scale, bias, stride, padding, dilation, groups, backend)
