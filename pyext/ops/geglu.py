"""GEGLU, the gated GELU of diffusers' feed-forward blocks, in one pass:

    y = a * gelu(g),  a, g = x.chunk(2, dim=-1),  gelu(g) = g / 2 * (1 + erf(g / sqrt(2)))

x is (..., 2 * D) in float32/float16/bfloat16; y is (..., D) in x's dtype, contiguous. torch runs
the chunk's gelu and the product as two passes, the first writing gelu(g) rounded to x's dtype;
here each output is computed in float32 from x and rounded once.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from pyext import dispatch
from pyext._ext import kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.kernels import interpreter_advisory, relative_close, triton_devices, triton_unavailable
from pyext.ops._library import define
from pyext.ops._triton import triton_dtypes

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.geglu: {msg}")


def check_inputs(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        _fail(f"x must be a float32/float16/bfloat16 tensor (..., 2 * D), got {dispatch.describe(x)}")
    if x.dim() == 0 or x.shape[-1] % 2:
        _fail(f"x's last dim must be even (values and gates, 2 * D), got shape {tuple(x.shape)}")


# ----------------------------------------------------------------------------- reference

def geglu_reference(x2d: torch.Tensor) -> torch.Tensor:
    """PyTorch semantics of torch.ops.pyext.geglu (the oracle for the kernels): float32 math, one
    rounding to x's dtype."""
    a, g = x2d.float().chunk(2, dim=-1)
    return (a * F.gelu(g)).to(x2d.dtype)


# ----------------------------------------------------------------------------- backends
# Every backend gets x as (rows, 2 * D) with each row contiguous (the op) and returns (rows, D).

def _cpp(x2d):
    return torch.ops.pyext_C.geglu(x2d)


def _triton(x2d):
    from pyext.kernels.geglu import geglu_triton

    return geglu_triton(x2d)


_TRITON_NOTES = {torch.bfloat16: "Triton's interpreter rounds float32 to bfloat16 toward zero (GPUs round to "
                                 "nearest even); use float16/float32 on CPU"}


def _triton_reasons(x2d):
    if x2d.shape[1] >= 2 ** 31:
        return ["a row of 2**31 elements or more: the Triton kernel indexes within a row in 32 bits"]
    return []


# (rows, 2 * D) the op tests run every backend on: one element, odd widths, rows wider than a
# SIMD register and than a kernel's block, no rows.
TEST_SHAPES = ((1, 2), (3, 14), (5, 34), (7, 202), (2, 4098), (0, 8))

dispatch.register("geglu", Backend(
    "cpp", _cpp, unavailable=partial(kernel_missing, "geglu"), devices=("cpu",), dtypes=DTYPES,
    test_shapes=TEST_SHAPES,
    doc="C++ kernel (AVX-512/AVX2/scalar, chosen at run time): erf as a per-segment polynomial, no exp"))
dispatch.register("geglu", Backend(
    "triton", _triton, _triton_reasons, unavailable=triton_unavailable, advisory=interpreter_advisory,
    devices=triton_devices(), dtypes=triton_dtypes(DTYPES), test_shapes=TEST_SHAPES, notes=_TRITON_NOTES,
    doc="Triton, one program per block of a row; cpu only under TRITON_INTERPRET=1"))
dispatch.register("geglu", Backend(
    "reference", geglu_reference, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="chunk, F.gelu and the product in float32; the semantics and test oracle"))


def _example(spec, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    return ((torch.randn(spec, generator=g, device=device) * 3).to(dtype),)


def _sample(x2d):
    return _example((3, 2 * 37), x2d.dtype, x2d.device)


# Self-check tolerance: a few roundings of the output dtype at the output's magnitude.
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

dispatch.define("geglu", check=check_inputs, sample=lambda args: _sample(*args), example=_example,
                close=lambda out, ref, args: relative_close(out, ref, _TOLERANCE[ref.dtype]),
                variant=lambda args: (str(args[0].dtype),))


# ----------------------------------------------------------------------------- custom op

def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, 2 * D) with each row contiguous: a view where x allows one."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return x2d if x2d.stride(-1) == 1 or x2d.shape[-1] <= 1 else x2d.contiguous()


def _geglu_kernel(x, backend=None):
    if x.dim() == 0:  # no last dim to reshape by: the validation says so (dispatch.select validates the rest)
        check_inputs(x)
    x2d = _rows(x)
    out = dispatch.select("geglu", (x2d,), backend).run(x2d)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 2)


def _geglu_fake(x, backend=None):
    dispatch.check("geglu", (x,))
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


define("geglu(Tensor x, str? backend=None) -> Tensor", _geglu_kernel, _geglu_fake)


# ----------------------------------------------------------------------------- public API

def geglu(x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """a * gelu(g) for a, g = x.chunk(2, dim=-1), gelu exact (erf): diffusers' GEGLU after its
    projection, `geglu(ff.net[0].proj(h))`. Returns (..., D) in x's dtype, contiguous."""
    check_inputs(x)
    return torch.ops.pyext.geglu(x, backend)
