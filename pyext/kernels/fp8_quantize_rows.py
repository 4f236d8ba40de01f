"""Triton row quantization to e4m3 for the dynamic fp8 linear: one launch, one program per row.

Each program reads its row twice (its amax, then its codes) and writes one byte per value and
one fp32 scale, where PyTorch's ops (pyext.reference.fp8.quantize_rows) make four passes over
x and write an fp32 copy of it. The results are quantize_rows' bit for bit: the scale is the
amax times the fp32 reciprocal of 448, the quotients are divided with IEEE rounding (`div_rn`;
Triton's `/` is approximate on a GPU) and rounded to e4m3 in integer arithmetic, nearest even,
as PyTorch's cast does (Triton's own fp8 cast truncates in its interpreter). bfloat16 rows are
read as their bits and widened by a shift (the interpreter's own bf16 conversion mangles
subnormals). The one difference: in a row holding NaN every code is NaN, and the sign of those
NaNs follows the device's division, as in PyTorch.

Offsets within a row are 32-bit; rows are addressed in 64-bit. Launch configurations (`configs`):
the default first; every one is compiled for sm_80 and sm_90 by `python -m pyext kernels`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import Config, config, interpreting, tune

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where it multiplies, as in quantize_rows
TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: the least scale, as quantize_rows clamps it


@triton.jit
def _e4m3_codes(q):
    """e4m3 codes (uint8) of fp32 values, rounded to nearest even; |q| of 480 and more, and NaN, give NaN.
    PyTorch's float -> float8_e4m3fn conversion (c10's fp8e4m3fn_from_fp32_value), vectorised."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results: rebias the exponent (127 -> 7) and round the mantissa to 3 bits, half to even.
    normal = (mag + ((7 - 127) << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # Below e4m3's smallest normal (2^-6): adding 2^14 in fp32 rounds |q| to a multiple of 2^-9,
    # the subnormal step, half to even; the low bits are then the code.
    subnormal = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    code = tl.where(mag < (121 << 23), subnormal, normal)
    code = tl.where(mag >= (1087 << 20), 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _load_row(x_row, offsets, mask, BF16_BITS: tl.constexpr):
    """fp32 values of a row's elements; BF16_BITS: the row holds bfloat16 bits as int16."""
    v = tl.load(x_row + offsets, mask=mask, other=0)
    if BF16_BITS:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BF16_BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    lanes = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    nans = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        v = _load_row(x_row, k0 + lanes, k0 + lanes < K, BF16_BITS)
        amax = tl.maximum(amax, tl.abs(v))
        nans |= (v != v).to(tl.int32)  # a GPU's max drops NaN; the row's scale must be NaN
    scale = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX, TINY)
    scale = tl.where(tl.max(nans, 0) > 0, float("nan"), scale)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + lanes < K
        v = _load_row(x_row, k0 + lanes, mask, BF16_BITS)
        q = tl.math.div_rn(v, scale)
        q = tl.where(q > FP8_MAX, FP8_MAX, tl.where(q < -FP8_MAX, -FP8_MAX, q))  # NaN stays NaN
        tl.store(q_row + k0 + lanes, _e4m3_codes(q), mask=mask)


_CONFIGS = [config(4, 1, BLOCK_K=1024), config(8, 1, BLOCK_K=2048), config(4, 1, BLOCK_K=512)]
_INTERPRETER = [config(1, 1, BLOCK_K=64)]  # the interpreter runs each program in numpy


def configs() -> list[Config]:
    """Launch candidates (BLOCK_K values of a row per step), the default first."""
    return _INTERPRETER if interpreting() else _CONFIGS


def quantize_rows_triton(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x2d): (e4m3 codes of each row / its scale, the scales as an (M, 1) float32
    column), for a 2-D x2d whose rows are contiguous."""
    M, K = x2d.shape
    codes = torch.empty((M, K), dtype=torch.uint8, device=x2d.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=x2d.device)
    if M == 0:
        return codes.view(torch.float8_e4m3fn), scales

    bf16 = x2d.dtype == torch.bfloat16
    x_in = x2d.view(torch.int16) if bf16 else x2d

    def launch(cfg: Config):
        _quantize_rows_kernel[(M,)](x_in, codes, scales, K, x2d.stride(0), BF16_BITS=bf16, **cfg.launch_kwargs())
        return codes, scales

    key = f"{str(x2d.dtype).removeprefix('torch.')} k{K}"
    cfg = tune("fp8_quantize_rows:triton", key, x2d.device, configs(),
               lambda c: tuple(t.clone() for t in launch(c)), check=lambda out: _problem(out, x2d))
    launch(cfg)
    return codes.view(torch.float8_e4m3fn), scales


def same_quantization(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two (codes, scales) are the same bits, every NaN code and scale counting as one."""
    def canonical(codes):
        c = codes.view(torch.uint8)
        return torch.where((c & 0x7F) == 0x7F, 0x7F, c)

    return torch.equal(canonical(a[0]), canonical(b[0])) and torch.equal(a[1].isnan(), b[1].isnan()) and \
        torch.equal(a[1].nan_to_num(0.0), b[1].nan_to_num(0.0))


def _problem(out, x2d) -> str | None:
    """None when a config's codes and scales of the first rows are quantize_rows' own."""
    from pyext.reference.fp8 import quantize_rows

    rows = min(x2d.shape[0], 64)
    same = same_quantization((out[0][:rows], out[1][:rows]), quantize_rows(x2d[:rows]))
    return None if same else "codes or scales differ from quantize_rows"


def signature(dtype: torch.dtype, cfg: Config) -> tuple[dict, dict]:
    """(signature, constexprs) of _quantize_rows_kernel to compile it without a GPU."""
    ty = {torch.float16: "*fp16", torch.bfloat16: "*i16", torch.float32: "*fp32"}[dtype]
    sig = {"x_ptr": ty, "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32"}
    constexprs = dict(BF16_BITS=dtype == torch.bfloat16, **dict(cfg.blocks))
    return {**sig, **{name: "constexpr" for name in constexprs}}, constexprs
