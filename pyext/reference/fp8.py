"""The fp8 (e4m3fn) family's semantics in PyTorch ops: decoding the codes, the upcast, the
weight-only linear and conv, and the dynamic linear with its per-row activation quantization.

Each is its op's reference backend (pyext.ops.fp8, fp8_conv, fp8_dynamic) and the oracle of its
tests; the Triton kernels check their launch configs against fp8_linear_reference and
quantize_rows. Weights come as e4m3 codes (fp8, or their uint8 view) with fp32 scales, one per
output channel or one per tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TINY = torch.finfo(torch.float32).tiny
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to fp32 where it multiplies an fp32 tensor, on every device


def _round_fp32_to(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """IEEE round-to-nearest-even narrowing that keeps NaN sign/payload bits on every device.

    PyTorch's own fp32 -> bf16 NaN bits differ between its scalar and vector paths
    (0x7fc0 vs 0xffff), so the reference spells the rounding out in integer ops.
    """
    if dtype == torch.float32:
        return f
    bits = f.view(torch.int32)
    nan = torch.isnan(f)
    if dtype == torch.bfloat16:
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return torch.where(nan, bits >> 16, rounded).to(torch.int16).view(torch.bfloat16)
    nan_bits = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
    return torch.where(nan, nan_bits.to(torch.int16), f.to(torch.float16).view(torch.int16)).view(torch.float16)


def _decode_table() -> torch.Tensor:
    """fp32 value of every e4m3 code, from PyTorch's own cast; NaN codes -> 0x7ff00000 with their sign."""
    table = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    table[0x7F] = torch.tensor(0x7FF00000, dtype=torch.int32).view(torch.float32)
    table[0xFF] = torch.tensor(-(2**31) | 0x7FF00000, dtype=torch.int32).view(torch.float32)
    return table


_DECODE = _decode_table()


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of a uint8 tensor of e4m3 codes (a table lookup: works on any device)."""
    return _DECODE.to(codes.device)[codes.long()]


def fp8_upcast_reference(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The semantics of fp8_upcast: round(fp32(w) * scale) to dtype. `w` is fp8 or its uint8 codes.
    A NaN code keeps its own NaN whatever the scale (NaN * NaN could return either operand)."""
    decoded = decode_codes(w.view(torch.uint8))
    f = torch.where(decoded.isnan(), decoded, decoded * scale.reshape(-1, *[1] * (w.dim() - 1)))
    return _round_fp32_to(f, dtype)


def fp8_linear_reference(x, w, scale, bias=None):
    return F.linear(x, fp8_upcast_reference(w, scale, x.dtype), bias)


def fp8_conv2d_reference(x, w, scale, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return F.conv2d(x, fp8_upcast_reference(w, scale, x.dtype), bias, stride, padding, dilation, groups)


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of x2d / sx, sx as an (M, 1) float32 column): each row scaled to its own amax."""
    # No fp32 copy of x before the division (type promotion makes the quotient fp32), and the
    # clamp in place: on a GPU, quantizing is memory traffic, so fewer passes over x matter.
    sx = torch.linalg.vector_norm(x2d, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    # Times the fp32 reciprocal, not divided by 448: PyTorch's GPU division by a number multiplies
    # by its reciprocal, its CPU division does not; a product is the same on every device.
    sx = sx.mul_(INV_FP8_MAX).clamp_min_(TINY)  # NaN stays NaN
    return torch.div(x2d, sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8), sx


def fp8_linear_dynamic_reference(x, w, scale, bias=None):
    """The semantics, in fp32 on any device: decoded codes, fp32 products and sums, then the scales."""
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    acc = xq.float() @ decode_codes(w).t()
    y = acc * sx * scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
