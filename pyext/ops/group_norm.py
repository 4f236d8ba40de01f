"""GroupNorm with an optional fused SiLU and an optional per-(n, c) pre-add, in one op.

    y = act(group_norm(x + shift[:, :, None, ...], num_groups, weight, bias, eps)),  act = identity or SiLU

diffusers' ResnetBlock2D runs norm1 -> SiLU, and (h + temb[:, :, None, None]) -> norm2 -> SiLU:
each is one call here, reading x twice and writing y once (torch: an add, the norm, the SiLU,
each a pass over memory). x is (N, C, *spatial) in float32/float16/bfloat16, plain contiguous or
channels-last (4-D and 5-D); y has x's dtype and layout. weight/bias (C,) are x's dtype or
float32, shift (N, C) is x's dtype. The fast backends compute the statistics in float32 with an
accurate merge (never E[x^2] - E[x]^2), the shift add and the affine map in float32, and give
the same result on any number of threads.
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
from pyext.kernels import interpreter_advisory, triton_devices, triton_unavailable
from pyext.ops._library import define, like_strides
from pyext.ops._triton import triton_dtypes

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "silu")


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.group_norm: {msg}")


def channels_last_format(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def is_channels_last(x: torch.Tensor) -> bool:
    """x is channels-last and not also plain contiguous (C == 1 or one pixel is both: contiguous wins)."""
    return x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(memory_format=channels_last_format(x))


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    return channels_last_format(x) if is_channels_last(x) else torch.contiguous_format


def check_inputs(x, num_groups, weight, bias, eps, activation, shift) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        _fail(f"x must be a float32/float16/bfloat16 tensor (N, C, *spatial), got {dispatch.describe(x)}")
    if x.dim() < 2:
        _fail(f"x must have at least 2 dims (N, C, *spatial), got shape {tuple(x.shape)}")
    N, C = x.shape[:2]
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        _fail(f"num_groups must be a positive int, got {num_groups!r}")
    if C % num_groups:
        _fail(f"num_groups={num_groups} does not divide the {C} channels of x {tuple(x.shape)}; "
              "the channel count must be a multiple of num_groups")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not (isinstance(t, torch.Tensor) and tuple(t.shape) == (C,) and t.device == x.device
                                  and t.dtype in (x.dtype, torch.float32)):
            _fail(f"{name} must be a ({C},) tensor of x's dtype ({str(x.dtype)[6:]}) or float32 on {x.device}, "
                  f"got {dispatch.describe(t)}")
    if shift is not None and not (isinstance(shift, torch.Tensor) and tuple(shift.shape) == (N, C)
                                  and shift.dtype == x.dtype and shift.device == x.device):
        _fail(f"shift must be an (N, C) = ({N}, {C}) tensor of x's dtype ({str(x.dtype)[6:]}) on {x.device}, "
              f"got {dispatch.describe(shift)}")
    if activation not in ACTIVATIONS:
        _fail(f"activation {activation!r} is not supported; use None or 'silu'")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        _fail(f"eps must be a finite number > 0, got {eps!r}")


# ----------------------------------------------------------------------------- reference

def group_norm_reference(x, num_groups, weight, bias, shift, eps, silu):
    """PyTorch semantics of torch.ops.pyext.group_norm (the oracle for the kernels): float32 math on
    a contiguous copy (torch's channels-last CPU kernel computes E[x^2] - E[x]^2), x's dtype and layout."""
    h = x.float().contiguous()
    if shift is not None:
        h = h + shift.float().reshape(*shift.shape, *(1,) * (x.dim() - 2))
    h = F.group_norm(h, num_groups, None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    if silu:
        h = F.silu(h)
    return h.to(x.dtype).contiguous(memory_format=_memory_format(x))


# ----------------------------------------------------------------------------- backends
# Every backend gets x plain contiguous or channels-last and contiguous weight/bias/shift (the op).

def _cpp(x, num_groups, weight, bias, shift, eps, silu):
    return torch.ops.pyext_C.group_norm(x, num_groups, weight, bias, shift, eps, silu)


def _triton(x, num_groups, weight, bias, shift, eps, silu):
    from pyext.kernels.group_norm import group_norm_triton

    return group_norm_triton(x, num_groups, weight, bias, shift, eps, silu)


# The kernels have no tl.dot; what the interpreter gets wrong in bfloat16 is the rounding.
_TRITON_NOTES = {torch.bfloat16: "Triton's interpreter rounds float32 to bfloat16 toward zero (GPUs round to "
                                 "nearest even); use float16/float32 on CPU"}


def _triton_reasons(x, *args):
    if x.shape[0] and x.numel() // x.shape[0] >= 2 ** 31:
        return ["a sample of 2**31 elements or more: the Triton kernels index within a sample in 32 bits"]
    return []


# (shape, groups, channels-last, affine, float32 weight/bias, shift, silu) the op tests run every
# backend on: odd sizes, 1-D to 3-D spatial, one group and one channel per group, both layouts.
TEST_SHAPES = (((2, 6, 5, 7), 3, True, True, False, True, True),
               ((1, 32, 9, 11), 8, False, False, False, False, True),
               ((3, 4, 3, 5, 7), 2, True, True, True, False, False),
               ((2, 64, 17, 23), 32, False, True, True, True, True),
               ((1, 3, 1, 1), 1, False, True, False, True, False),
               ((2, 40, 13), 40, False, False, False, True, True))

dispatch.register("group_norm", Backend(
    "cpp", _cpp, unavailable=partial(kernel_missing, "group_norm"), devices=("cpu",), dtypes=DTYPES,
    test_shapes=TEST_SHAPES,
    doc="C++ two-pass kernel (AVX-512/AVX2/scalar, chosen at run time), at::parallel_for over fixed chunks"))
dispatch.register("group_norm", Backend(
    "triton", _triton, _triton_reasons, unavailable=triton_unavailable, advisory=interpreter_advisory,
    devices=triton_devices(), dtypes=triton_dtypes(DTYPES), test_shapes=TEST_SHAPES, notes=_TRITON_NOTES,
    doc="Triton partial moments, float64 merge, apply; cpu only under TRITON_INTERPRET=1"))
dispatch.register("group_norm", Backend(
    "reference", group_norm_reference, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="F.group_norm (+ F.silu) in float32; the semantics and test oracle"))


def _make(shape, groups, channels_last, weight_dtype, bias_dtype, with_shift, silu, eps, dtype, device):
    """Arguments of the op on random data (a mean and a spread away from 0 and 1); a None dtype: no such input."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(size, dt):
        return None if dt is None else (torch.randn(size, generator=g, device=device) * 2 + 0.5).to(dt)

    x = rand(shape, dtype)
    if channels_last:
        x = x.contiguous(memory_format=channels_last_format(x))
    N, C = shape[:2]
    return (x, groups, rand(C, weight_dtype), rand(C, bias_dtype), rand((N, C), dtype if with_shift else None),
            eps, silu)


def _example(spec, dtype, device):
    shape, groups, channels_last, affine, fp32_params, with_shift, silu = spec
    params = (torch.float32 if fp32_params else dtype) if affine else None
    return _make(shape, groups, channels_last, params, params, with_shift, silu, 1e-5, dtype, device)


def _sample(x, num_groups, weight, bias, shift, eps, silu):
    spatial = ((5, 7, 3) + (2,) * x.dim())[:x.dim() - 2]
    return _make((2, 8, *spatial), 4, is_channels_last(x), None if weight is None else weight.dtype,
                 None if bias is None else bias.dtype, shift is not None, silu, eps, x.dtype, x.device)


# Self-check tolerance: a few roundings of the output dtype at the output's magnitude.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _close(out, ref, args):
    diff = (out.float() - ref.float()).abs().masked_fill(out.isnan() & ref.isnan(), 0)
    err, allowed = diff.max().item(), _TOLERANCE[ref.dtype] * max(1.0, ref.float().abs().max().item())
    return None if err <= allowed else f"max error {err:.3g} (allowed {allowed:.3g})"


def _check_op(x, num_groups, weight, bias, shift, eps, silu) -> None:
    """check_inputs on the op's arguments (silu a bool where the public function takes an activation name)."""
    if not isinstance(silu, bool):
        _fail(f"silu must be a bool, got {silu!r}")
    check_inputs(x, num_groups, weight, bias, eps, "silu" if silu else None, shift)


dispatch.define("group_norm", check=_check_op, sample=lambda args: _sample(*args), close=_close, example=_example,
                variant=lambda args: (str(args[0].dtype), is_channels_last(args[0]), args[6]))


# ----------------------------------------------------------------------------- custom op

def _group_norm_kernel(x, num_groups, weight, bias, shift, eps, silu, backend=None):
    dense = x if x.is_contiguous() or is_channels_last(x) else x.contiguous()
    weight, bias, shift = (None if t is None else t.contiguous() for t in (weight, bias, shift))
    args = (dense, num_groups, weight, bias, shift, eps, silu)
    out = dispatch.select("group_norm", args, backend).run(*args)
    # empty_like(x)'s strides on every backend, as the fake kernel promises (x's own when x is dense).
    if out.stride() != like_strides(x):
        out = torch.empty_like(x).copy_(out)
    return out


def _group_norm_fake(x, num_groups, weight, bias, shift, eps, silu, backend=None):
    dispatch.check("group_norm", (x, num_groups, weight, bias, shift, eps, silu))
    return torch.empty_like(x)


define("group_norm(Tensor x, SymInt num_groups, Tensor? weight, Tensor? bias, Tensor? shift, float eps, bool silu, "
       "str? backend=None) -> Tensor", _group_norm_kernel, _group_norm_fake)


# ----------------------------------------------------------------------------- public API

def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, activation: Optional[str] = None,
               shift: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """act(group_norm(x + shift[:, :, None, ...], num_groups, weight, bias, eps)) with act None or "silu".

    Returns x's dtype and layout (plain contiguous or channels-last; x with other strides is made
    contiguous first). In diffusers' ResnetBlock2D (time_embedding_norm "default"), norm1 + SiLU is
    `group_norm(x, r.norm1.num_groups, r.norm1.weight, r.norm1.bias, r.norm1.eps, "silu")` and the
    time-embedding add + norm2 + SiLU is `group_norm(h, r.norm2.num_groups, r.norm2.weight,
    r.norm2.bias, r.norm2.eps, "silu", shift=r.time_emb_proj(r.nonlinearity(temb)))`: shift is the
    (N, C) projection, before diffusers' `[:, :, None, None]`.
    """
    check_inputs(x, num_groups, weight, bias, eps, activation, shift)
    if not (x.is_contiguous() or is_channels_last(x)):
        x = x.contiguous()
    return torch.ops.pyext.group_norm(x, num_groups, weight, bias, shift, float(eps), activation == "silu", backend)
