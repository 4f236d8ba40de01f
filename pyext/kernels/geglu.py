"""Triton GEGLU: y[r, j] = a * gelu(g), a = x[r, j], g = x[r, D + j], one launch.

One program per block of one row's D outputs: it reads the block's values and gates, computes in
fp32 with the exact gelu (libdevice's erf) and writes y once in x's dtype. Rows are addressed in
64-bit, offsets within a row in 32-bit. Launch configurations (`configs`): the default first; every
one is compiled for sm_80 and sm_90 by `python -m pyext kernels`. No GPU has timed them yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyext.kernels import Config, config, interpreting, tune

INV_SQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _geglu_kernel(x_ptr, y_ptr, D, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < D
    x_row = x_ptr + row * stride_xm
    a = tl.load(x_row + j, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_row + D + j, mask=mask, other=0.0).to(tl.float32)
    h = 0.5 * g
    y = a * (h + h * tl.math.erf(g * INV_SQRT2))
    tl.store(y_ptr + row * D + j, y.to(y_ptr.dtype.element_ty), mask=mask)


_CONFIGS = [config(4, 1, BLOCK=1024), config(8, 1, BLOCK=2048), config(4, 1, BLOCK=512)]
_INTERPRETER = [config(1, 1, BLOCK=128)]  # the interpreter runs each program in numpy


def configs() -> list[Config]:
    """Launch candidates (BLOCK outputs of a row per program), the default first."""
    return _INTERPRETER if interpreting() else _CONFIGS


def geglu_triton(x2d: torch.Tensor) -> torch.Tensor:
    """(rows, 2 * D) whose rows are contiguous -> (rows, D) contiguous."""
    rows, D = x2d.shape[0], x2d.shape[1] // 2
    y = torch.empty((rows, D), dtype=x2d.dtype, device=x2d.device)
    if y.numel() == 0:
        return y

    def launch(cfg: Config) -> torch.Tensor:
        block = dict(cfg.blocks)["BLOCK"]
        _geglu_kernel[(rows, triton.cdiv(D, block))](x2d, y, D, x2d.stride(0), **cfg.launch_kwargs())
        return y

    key = f"{str(x2d.dtype).removeprefix('torch.')} d{triton.next_power_of_2(D)}"
    return launch(tune("geglu:triton", key, x2d.device, configs(), lambda c: launch(c).clone()))


_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def signature(dtype: torch.dtype, cfg: Config) -> tuple[dict, dict]:
    """(signature, constexprs) of _geglu_kernel to compile it without a GPU."""
    constexprs = dict(cfg.blocks)
    sig = {"x_ptr": _PTR[dtype], "y_ptr": _PTR[dtype], "D": "i32", "stride_xm": "i32"}
    return {**sig, **{name: "constexpr" for name in constexprs}}, constexprs
