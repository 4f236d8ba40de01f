"""fp8 x fp8 linear: activations quantized per row on the fly, weights per output channel.

    y = round_to_x.dtype( (q(x) * sx) @ (w * sw)^T + bias )

where, for each row of x (a token), sx = max(amax(|x_row|) * fl32(1/448), fp32's smallest normal) and
q(x) = e4m3(x / sx), saturated at +-448; w are the layer's e4m3 codes with their fp32 scales sw
(per channel or per tensor). The products accumulate in fp32. This is the "dynamic" fp8 mode:
both operands of the GEMM are fp8, so it runs on fp8 tensor cores (sm_89 and newer) through
torch._scaled_mm (cuBLASLt), where the weight-only mode (pyext.ops.fp8) upcasts the weight and
runs a bf16 GEMM. The activations' rounding to e4m3 (3 mantissa bits, scaled per row) is the
price; docs/ops.md gives the error it costs per layer and per pipeline.

The fast backend takes bfloat16 (what cuBLASLt's row-wise scaled GEMM writes); the reference
takes every compute dtype. A row holding NaN or inf gives a NaN output row. Weight scales are
finite where they come from fp8_quantize; for a non-finite one the GPU's answer may differ
from the reference's (on CPU inputs the reference then runs). Quantizing the activations is a few elementwise
and reduction kernels, or one Triton kernel (pyext.kernels.fp8_quantize_rows) with the same codes; none reads
a value on the host.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from pyext import dispatch
from pyext.dispatch import Backend
from pyext.kernels import interpreter_advisory, triton_devices, triton_unavailable
from pyext.ops._library import define
from pyext.ops.fp8 import (LINEAR_TOLERANCE, _fail, call_linear, check_linear, check_public, example_linear,
                           relative_close, sample_codes, sample_scale)
from pyext.reference.fp8 import FP8, fp8_linear_dynamic_reference, quantize_rows

OP = "fp8_linear_dynamic"
ALIGN = 16  # cuBLASLt's fp8 GEMM takes in- and out-features in multiples of 16


def check_dynamic(x, w, scale, bias) -> None:
    """fp8_linear's validation, and at least one input feature (a row's scale needs a value)."""
    check_linear(x, w, scale, bias, OP)
    if x.shape[-1] == 0:
        _fail(OP, f"x has 0 input features (x {tuple(x.shape)}); each row needs at least one value to scale by")


def _scaled_mm(x, w, scale, bias, quantize=quantize_rows):
    n = w.shape[0]
    if x.numel() == 0:  # no rows: nothing for the GEMM to do
        return x.new_empty((*x.shape[:-1], n))
    xq, sx = quantize(x.reshape(-1, x.shape[-1]).contiguous())
    sw = scale.reshape(1, -1).expand(1, n).contiguous()  # row-wise scaling takes one scale per column
    y = torch._scaled_mm(xq, w.view(FP8).t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], n)


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` is a GPU with fp8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else
                                                 torch.cuda.current_device()) >= (8, 9)


def _triton_scaled_mm(x, w, scale, bias):
    from pyext.kernels.fp8_quantize_rows import quantize_rows_triton

    return _scaled_mm(x, w, scale, bias, quantize_rows_triton)


@lru_cache(maxsize=None)
def _cpu_rowwise_missing() -> str | None:
    """Why this torch's CPU torch._scaled_mm cannot take row-wise scales, or None. Older
    releases take per-tensor scales only; asked once, of a tiny GEMM."""
    codes = torch.zeros(ALIGN, ALIGN).to(FP8)
    try:
        torch._scaled_mm(codes[:1], codes.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, ALIGN),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only, not row-wise ones"
    return None


def _scaled_mm_reasons(x, w, scale, bias):
    reasons = []
    if x.shape[-1] % ALIGN or w.shape[0] % ALIGN:
        reasons.append(f"in- and out-features must be multiples of {ALIGN} for the fp8 GEMM, "
                       f"got {x.shape[-1]} and {w.shape[0]}")
    if x.device.type == "cuda" and not fp8_tensor_cores(x.device):
        reasons.append("this GPU has no fp8 tensor cores (compute capability 8.9 or newer)")
    missing = x.device.type == "cpu" and _cpu_rowwise_missing()
    if missing:
        reasons.append(missing)
    return reasons


def _scaled_mm_guard(x, w, scale, bias):
    # torch._scaled_mm applies an infinite scale differently per device (NaN on CPU, inf from an
    # fp32 epilogue on a GPU); fp8_quantize's scales are finite, so only a hand-made one can be.
    if not bool(torch.isfinite(scale).all()):
        return ["a weight scale is not finite: the fp8 GEMM's answer would depend on the device"]
    return []


# (rows of x, in features, out features, per-channel scale, bias): features in multiples of 16
# (the GEMM's), rows of any count.
TEST_SHAPES = ((5, 48, 32, True, True), (1, 16, 80, False, False), (70, 96, 48, True, False))

_BF16_ONLY = {dt: "cuBLASLt's row-wise scaled fp8 GEMM writes bfloat16 only" for dt in (torch.float16, torch.float32)}

dispatch.register(OP, Backend(
    "scaled_mm", _scaled_mm, reasons=_scaled_mm_reasons, guard=_scaled_mm_guard, dtypes=(torch.bfloat16,),
    test_shapes=TEST_SHAPES,
    notes=_BF16_ONLY, doc="torch._scaled_mm (cuBLASLt fp8 tensor cores on a GPU), row-wise activation scales"))
dispatch.register(OP, Backend(
    "triton_scaled_mm", _triton_scaled_mm, unavailable=triton_unavailable, advisory=interpreter_advisory,
    reasons=_scaled_mm_reasons, guard=_scaled_mm_guard, devices=triton_devices(), dtypes=(torch.bfloat16,),
    test_shapes=TEST_SHAPES,
    notes=_BF16_ONLY,
    doc="a Triton kernel quantizes the activations' rows in one launch (the same codes), then torch._scaled_mm"))
dispatch.register(OP, Backend(
    "reference", fp8_linear_dynamic_reference, dtypes=(torch.bfloat16, torch.float16, torch.float32),
    test_shapes=TEST_SHAPES + ((3, 7, 5, True, True),), doc="fp32 math on the decoded codes; the semantics"))


def _sample(x, w, scale, bias):
    g = torch.Generator(device=x.device).manual_seed(0)
    k = x.shape[-1]
    sample_x = torch.randn(5, k, generator=g, device=x.device).to(x.dtype)
    sample_bias = None if bias is None else torch.randn(ALIGN, generator=g, device=x.device).to(bias.dtype)
    return sample_x, sample_codes((ALIGN, k), x.device, g), sample_scale(scale, ALIGN, g), sample_bias


# Backends agree with the reference to the output's rounding (both quantize x the same way).
dispatch.define(OP, check=check_dynamic, sample=lambda args: _sample(*args), close=relative_close(LINEAR_TOLERANCE),
                variant=lambda args: (str(args[0].dtype), args[0].shape[-1], args[2].numel() == 1, args[3] is None),
                example=example_linear)


def _kernel(x, w, scale, bias=None, backend=None):
    return dispatch.select(OP, (x, w, scale, bias), backend).run(x, w, scale, bias)


def _fake(x, w, scale, bias=None, backend=None):
    dispatch.check(OP, (x, w, scale, bias))
    return x.new_empty((*x.shape[:-1], w.shape[0]))


define("fp8_linear_dynamic(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, str? backend=None) -> Tensor",
       _kernel, _fake)


def fp8_linear_dynamic(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       backend: Optional[str] = None) -> torch.Tensor:
    """x @ (w * scale)^T + bias with x quantized to e4m3 per row on the fly (module docstring).
    `w` is a float8_e4m3fn weight from fp8_quantize, `scale` its float32 scales."""
    check_public(OP, x, w, scale, bias)
    if backend is None:
        return call_linear(OP, x, w.view(torch.uint8), scale, bias)
    return torch.ops.pyext.fp8_linear_dynamic(x, w.view(torch.uint8), scale, bias, backend)
