"""Random differential tests of every pyext op: each backend (the C++ one at every SIMD level
this CPU has) against a float64 oracle and against the op's reference backend, plus bad
inputs that must raise a PyextError naming the op.

A case is a small JSON-able dict of parameters (shapes, dtype, layout, scale kind, special
values, the data seed), so a failure is replayed, and shrunk, from its parameters alone.

    python -m tests.fuzz_cases [--cases N] [--seed S] [--ops a,b]   # runs, counts, prints repros
    python -m tests.fuzz_cases --op NAME --params JSON               # replays one case

tests/test_fuzz.py runs a fixed-seed slice of the same cases in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pyext._ext import cpu_capabilities, has_kernel
from pyext.dispatch import PyextError
from pyext.ops import (FP8, attention, fp8_conv2d, fp8_linear, fp8_linear_dynamic, fp8_quantize, fp8_upcast,
                       tile_blend_diffusers, tile_blend_normalized)
from pyext.reference.fp8 import decode_codes, quantize_rows

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Output tolerance relative to the magnitudes that feed an element (rounding of the output and
# of bf16 probabilities/weights, fp32 accumulation); a wrong answer is off by O(1) of them.
EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -14}
FP32_MAX = torch.finfo(torch.float32).max
FP32_SUBNORMAL = 2.0 ** -149  # each fp32 product or sum that lands there is rounded to a multiple of it


def gemm_tol(dtype: torch.dtype, k: int, mag: torch.Tensor) -> torch.Tensor:
    """Tolerance of a k-term dot product accumulated in fp32 and rounded to dtype: relative to
    the sum of the terms' magnitudes, plus one subnormal step per term."""
    return (EPS[dtype] + k * 2.0 ** -23) * mag + k * FP32_SUBNORMAL


class Mismatch(AssertionError):
    """A silent wrong answer: a backend's result disagrees with the oracle or the reference."""


@dataclass
class Fuzzer:
    op: str                                   # the name in PyextError messages ("pyext.<op>: ...")
    draw: Callable[[random.Random], dict]     # random valid parameters (JSON-able)
    run: Callable[[dict], None]               # runs every backend on the case; raises Mismatch
    bad: dict[str, Callable[[dict], None]]    # bad-input calls, each must raise PyextError


# ----------------------------------------------------------------------------- shared helpers

def simd_levels() -> list[str]:
    return [lvl for lvl in ("scalar", "avx2", "avx512") if lvl in cpu_capabilities()]


@contextlib.contextmanager
def simd(level: Optional[str]):
    """Caps the C++ kernels' SIMD level (read per call) for the duration."""
    old = os.environ.get("PYEXT_CPU_SIMD")
    if level is not None:
        os.environ["PYEXT_CPU_SIMD"] = level
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYEXT_CPU_SIMD", None)
        else:
            os.environ["PYEXT_CPU_SIMD"] = old


def variants(kernel: str, extra=("reference",)) -> list[tuple[Optional[str], Optional[str]]]:
    """(backend, SIMD level) pairs to run: the C++ backend at each level, the others, and automatic choice."""
    cpp = [("cpp", lvl) for lvl in simd_levels()] if has_kernel(kernel) else []
    return cpp + [(b, None) for b in extra] + [(None, None)]


def gen(p: dict) -> torch.Generator:
    return torch.Generator().manual_seed(p["seed"])


def randn(p, g, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def poke(t: torch.Tensor, g: torch.Generator, value: float) -> None:
    """Sets one random element of t (in place) to value."""
    if t.numel():
        flat = torch.randint(t.numel(), (), generator=g)
        t[tuple(int(i) for i in torch.unravel_index(flat, t.shape))] = value


def same_bits(a: torch.Tensor, b: torch.Tensor, nan_bits: bool = True) -> bool:
    """Bitwise equality; with nan_bits=False any NaN equals any NaN (payloads are not the op's meaning)."""
    ints = {torch.float32: torch.int32}.get(a.dtype, torch.int16)
    if nan_bits:
        return torch.equal(a.view(ints), b.view(ints))
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


def check_close(name: str, out: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor,
                skip: Optional[torch.Tensor] = None) -> None:
    """out (any dtype) against a float64 oracle: NaN exactly where the oracle has NaN, infinities
    equal, finite values within tol; an overflow to inf is fine where the oracle reaches the
    dtype's range. `skip` masks elements whose answer depends on fp32 overflow order."""
    o = out.double()
    info = torch.finfo(out.dtype)
    fmax = info.max
    tol = tol + info.tiny * info.eps  # rounding to a subnormal is absolute: one subnormal step of dtype
    ok = torch.isnan(o) == torch.isnan(exact)
    both = ~torch.isnan(o) & ~torch.isnan(exact)
    close = (o - exact).abs() <= tol
    overflow = torch.isinf(o) & (exact.abs() + tol >= fmax) & (torch.sign(o) == torch.sign(exact))
    ok &= ~both | close | (o == exact) | overflow
    if skip is not None:
        ok |= skip
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise Mismatch(f"{name}: at {bad} got {o[tuple(bad)].item()!r}, float64 oracle "
                       f"{exact[tuple(bad)].item()!r} (tolerance {tol.expand_as(o)[tuple(bad)].item():.3g}); "
                       f"{int((~ok).sum())} of {o.numel()} elements wrong")


def run_variants(kernel: str, call: Callable, check: Callable, extra=("reference",)) -> None:
    """Runs call(backend) for every variant and checks each result. A forced backend may
    decline an input it does not take (its documented reasons); that is not a finding."""
    for backend, level in variants(kernel, extra):
        name = f"backend={backend!r}" + (f", PYEXT_CPU_SIMD={level}" if level else "")
        with simd(level):
            try:
                out = call(backend)
            except PyextError as e:
                if backend is not None and f"backend {backend!r} cannot run this input" in str(e):
                    continue
                raise
        check(name, out)


# ----------------------------------------------------------------------------- scales (fp8 ops)

SCALE_KINDS = ["normal", "normal", "normal", "tiny", "subnormal", "negative", "huge", "overflow", "nan", "inf", "zero"]


def make_scale(p: dict, g, n: int, dtype: torch.dtype) -> torch.Tensor:
    count = n if p["per_channel"] else 1
    s = torch.rand(count, generator=g) * 0.01 + 1e-4
    kind = p["scale"]
    if kind == "tiny":
        s = s * 1e-34
    elif kind == "subnormal":
        s = torch.full((count,), 3e-42)
    elif kind == "negative":
        s = -s
    elif kind == "huge":  # large but every decoded weight stays finite in dtype
        s = s * (1e30 if dtype != torch.float16 else 1.0)
    elif kind == "overflow":  # some decoded weights exceed dtype's range
        s = torch.full((count,), 3e36 if dtype != torch.float16 else 400.0)
    elif kind in ("nan", "inf", "zero"):
        poke(s, g, {"nan": math.nan, "inf": -math.inf, "zero": 0.0}[kind])
    return s


def random_codes(g, shape) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(FP8)


def upcast_oracle(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_upcast's meaning in float64: round(fp32(decode(w) * scale)) to dtype (the float64
    product is exact, so its fp32 rounding is the correctly rounded fp32 product)."""
    f = decode_codes(w.contiguous().view(torch.uint8)).double() * s.double().reshape(-1, *[1] * (w.dim() - 1))
    return f.float().to(dtype).double()


def lay_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout: transposed storage or a broadcast first dim."""
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded" and t.dim() >= 2 and t.shape[0] > 1:
        return t[:1].expand_as(t)
    return t


# ----------------------------------------------------------------------------- fp8_quantize

def draw_quantize(r: random.Random) -> dict:
    return {"seed": r.randrange(2 ** 31), "rows": r.choice([1, 2, 3, 8, 17]), "cols": r.choice([1, 2, 5, 16, 33]),
            "dtype": r.choice(list(DTYPES)), "per_channel": r.random() < 0.7,
            "magnitude": r.choice(["mixed", "mixed", "tiny", "subnormal", "huge", "zeros"])}


def quantize_input(p: dict) -> torch.Tensor:
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    rows, cols = p["rows"], p["cols"]
    exps = {"mixed": (-40, 30), "tiny": (-44, -36), "subnormal": (-45, -39), "huge": (30, 38), "zeros": (0, 0)}
    lo, hi = exps[p["magnitude"]]
    rng = torch.finfo(dtype)  # from the dtype's smallest subnormal to a tenth of its largest value
    hi = min(hi, math.log10(rng.max) - 1)
    lo = min(max(lo, math.log10(rng.tiny * rng.eps)), hi)
    mag = 10 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    w = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * mag).to(dtype)
    return torch.zeros_like(w) if p["magnitude"] == "zeros" else w


def run_quantize(p: dict) -> None:
    w = quantize_input(p)
    q, s = fp8_quantize(w, p["per_channel"])
    if not (bool(torch.isfinite(s).all()) and bool((s > 0).all())):
        raise Mismatch(f"scales must be finite and positive, got {s.tolist()}")
    codes = q.view(torch.uint8) & 0x7F
    if bool((codes == 0x7F).any()):
        raise Mismatch("a finite weight got a NaN code")
    back = decode_codes(q.view(torch.uint8)).double() * s.double().reshape(-1, 1)
    w64 = w.double()
    # e4m3: 2^-4 relative for normal codes, half the smallest code step (2^-10 * scale) below.
    tol = w64.abs() * 2.0 ** -4 + s.double().reshape(-1, 1) * 2.0 ** -10 + FP32_SUBNORMAL
    check_close("fp8_quantize round trip", back, w64, tol)


def _quantize_bad(p: dict, what: str) -> None:
    w = quantize_input(p)
    arg = {"int": lambda: w.to(torch.int32), "nan": lambda: w.index_fill(1, torch.tensor([0]), math.nan),
           "empty": lambda: w[:0], "scalar": lambda: w[0, 0], "meta": lambda: w.to("meta"),
           "fp8": lambda: w.float().clamp(-448, 448).to(FP8), "list": lambda: w.tolist()}[what]()
    fp8_quantize(arg, p["per_channel"])


# ----------------------------------------------------------------------------- fp8_upcast

def draw_upcast(r: random.Random) -> dict:
    shape = [r.choice([1, 2, 3, 7, 16, 17, 33]) for _ in range(r.choice([1, 2, 2, 3]))]
    return {"seed": r.randrange(2 ** 31), "shape": shape, "dtype": r.choice(list(DTYPES)),
            "per_channel": r.random() < 0.7, "scale": r.choice(SCALE_KINDS),
            "layout": r.choice(["contiguous", "contiguous", "transposed", "expanded"]),
            "out": r.choice(["none", "fresh", "alias"])}


def upcast_inputs(p: dict):
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    shape = tuple(p["shape"])
    w = lay_out(random_codes(g, shape), p["layout"])
    return w, make_scale(p, g, shape[0], dtype), dtype


def run_upcast(p: dict) -> None:
    w, s, dtype = upcast_inputs(p)
    exact = upcast_oracle(w, s, dtype)
    ref = fp8_upcast(w, s, dtype, backend="reference")

    def call(backend):
        if p["out"] == "none":
            return fp8_upcast(w, s, dtype, backend=backend)
        if p["out"] == "fresh":
            return fp8_upcast(w, s, out=torch.empty(w.shape, dtype=dtype), backend=backend)
        # out's storage starts with a copy of the weight's bytes, and the weight is that view
        storage = torch.empty(w.shape, dtype=dtype)
        alias = storage.view(-1).view(torch.uint8)[:w.numel()].view(FP8).view(w.shape)
        alias.copy_(w)
        return fp8_upcast(alias, s, out=storage, backend=backend)

    def check(name, out):
        check_close(f"fp8_upcast {name}", out, exact, torch.zeros(()))
        if not same_bits(out, ref):  # the reference's NaN bits included
            raise Mismatch(f"fp8_upcast {name}: bits differ from the reference")

    run_variants("fp8_upcast_out", call, check)


def _upcast_bad(p: dict, what: str) -> None:
    w, s, dtype = upcast_inputs(p)
    calls = {
        "float_weight": lambda: fp8_upcast(w.float(), s, dtype),
        "scale_float64": lambda: fp8_upcast(w, s.double(), dtype),
        "scale_size": lambda: fp8_upcast(w, torch.ones(w.shape[0] + 2), dtype),
        "int_dtype": lambda: fp8_upcast(w, s, torch.int32),
        "out_shape": lambda: fp8_upcast(w, s, out=torch.empty(w.numel() + 1, dtype=dtype)),
        # (one element is contiguous whatever its strides: then a wrong shape instead)
        "out_strided": lambda: fp8_upcast(w, s, out=torch.empty((*w.shape, 2), dtype=dtype)[..., 0] if w.numel() > 1
                                          else torch.empty(2, dtype=dtype)),
        "out_dtype": lambda: fp8_upcast(w, s, out=torch.empty(w.shape, dtype=torch.float64)),
        "out_meta": lambda: fp8_upcast(w, s, out=torch.empty(w.shape, dtype=dtype, device="meta")),
        "scalar_weight": lambda: fp8_upcast(w.reshape(-1)[0], torch.ones(1), dtype),
    }
    calls[what]()


# ----------------------------------------------------------------------------- fp8_linear

def draw_linear(r: random.Random) -> dict:
    return {"seed": r.randrange(2 ** 31), "lead": r.choice([[1], [3], [2, 3], [0], [5, 1], [2, 0]]),
            "k": r.choice([0, 1, 2, 3, 16, 17, 64, 100]), "n": r.choice([1, 2, 7, 16, 33, 65]),
            "dtype": r.choice(list(DTYPES)), "bias": r.random() < 0.5, "per_channel": r.random() < 0.7,
            "scale": r.choice(SCALE_KINDS), "layout": r.choice(["contiguous", "contiguous", "transposed", "expanded"]),
            "special": r.choice(["none", "none", "none", "nan_x", "inf_x"])}


def linear_inputs(p: dict):
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    k, n = p["k"], p["n"]
    x = randn(p, g, *p["lead"], k, dtype=dtype)
    if p["special"] != "none":
        poke(x, g, math.nan if p["special"] == "nan_x" else math.inf)
    x = lay_out(x, p["layout"])
    w = random_codes(g, (n, k))
    return x, w, make_scale(p, g, n, dtype), randn(p, g, n, dtype=dtype) if p["bias"] else None, dtype


def linear_oracle(x, w, s, b, dtype):
    """F.linear in float64 on the upcast weight; also a mask of elements whose fp32 accumulation
    may overflow (their NaN/inf/finite outcome depends on the summation order), and the tolerance."""
    wd = upcast_oracle(w, s, dtype)
    x64, b64 = x.double(), (b.double() if b is not None else torch.zeros(w.shape[0], dtype=torch.float64))
    exact = x64 @ wd.T + b64
    finite = lambda t: torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype))
    mag = finite(x64) @ finite(wd).T + b64.abs()
    return exact, gemm_tol(dtype, w.shape[1], mag), mag > FP32_MAX / 16


def run_linear(p: dict) -> None:
    x, w, s, b, dtype = linear_inputs(p)
    exact, tol, skip = linear_oracle(x, w, s, b, dtype)
    run_variants("fp8_linear", lambda backend: fp8_linear(x, w, s, b, backend=backend),
                 lambda name, out: check_close(f"fp8_linear {name}", out, exact, tol, skip))


def _linear_bad(p: dict, what: str) -> None:
    x, w, s, b, dtype = linear_inputs(p)
    n, k = w.shape
    calls = {
        "int_x": lambda: fp8_linear(x.to(torch.int32), w, s, b),
        "k_mismatch": lambda: fp8_linear(torch.ones(2, k + 1, dtype=dtype), w, s, b),
        "weight_3d": lambda: fp8_linear(x, w.unsqueeze(0), s, b),
        "scale_size": lambda: fp8_linear(x, w, torch.ones(n + 1), b),
        "bias_shape": lambda: fp8_linear(x, w, s, torch.ones(n + 1, dtype=dtype)),
        "bias_dtype": lambda: fp8_linear(x, w, s, torch.ones(n, dtype=torch.float64)),
        "float_weight": lambda: fp8_linear(x, w.float(), s, b),
        "x_not_tensor": lambda: fp8_linear(x.tolist(), w, s, b),
        "scalar_x": lambda: fp8_linear(torch.ones((), dtype=dtype), w, s, b),
    }
    calls[what]()


# ----------------------------------------------------------------------------- fp8_linear_dynamic

def draw_dynamic(r: random.Random) -> dict:
    p = draw_linear(r)
    p.update(k=r.choice([1, 3, 16, 17, 32, 64, 100]), n=r.choice([1, 16, 33, 48, 64]))
    return p


def dynamic_oracle(x, w, s, b, dtype):
    """The dynamic linear's meaning in float64 on the op's own row quantization: the e4m3 products
    summed (exact in float64 here), then the row and channel scales, then the bias."""
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    xd, wd = xq.double(), decode_codes(w.contiguous().view(torch.uint8)).double()
    sw = s.double().reshape(1, -1)
    b64 = b.double() if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    exact = (xd @ wd.T) * sx.double() * sw + b64
    finite = lambda t: torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype))
    mag = (finite(xd) @ finite(wd).T) * finite(sx.double()) * finite(sw) + b64.abs()
    shape = (*x.shape[:-1], w.shape[0])
    return exact.reshape(shape), gemm_tol(dtype, w.shape[1], mag).reshape(shape), (mag > FP32_MAX / 16).reshape(shape)


def run_dynamic(p: dict) -> None:
    x, w, s, b, dtype = linear_inputs(p)
    exact, tol, skip = dynamic_oracle(x, w, s, b, dtype)
    run_variants("fp8_linear_dynamic", lambda backend: fp8_linear_dynamic(x, w, s, b, backend=backend),
                 lambda name, out: check_close(f"fp8_linear_dynamic {name}", out, exact, tol, skip),
                 extra=("reference", "scaled_mm"))


def _dynamic_bad(p: dict, what: str) -> None:
    x, w, s, b, dtype = linear_inputs(p)
    n, k = w.shape
    calls = {
        "int_x": lambda: fp8_linear_dynamic(x.to(torch.int32), w, s, b),
        "k_mismatch": lambda: fp8_linear_dynamic(torch.ones(2, k + 1, dtype=dtype), w, s, b),
        "no_features": lambda: fp8_linear_dynamic(torch.ones(2, 0, dtype=dtype), w[:, :0], s, b),
        "scale_size": lambda: fp8_linear_dynamic(x, w, torch.ones(n + 1), b),
        "bias_dtype": lambda: fp8_linear_dynamic(x, w, s, torch.ones(n, dtype=torch.float64)),
        "float_weight": lambda: fp8_linear_dynamic(x, w.float(), s, b),
    }
    calls[what]()


# ----------------------------------------------------------------------------- fp8_conv2d

def draw_conv(r: random.Random) -> dict:
    groups = r.choice([1, 1, 1, 2])
    p = {"seed": r.randrange(2 ** 31), "b": r.choice([1, 2]), "c": groups * r.choice([1, 2, 3, 4]),
         "h": r.choice([1, 2, 5, 8, 9]), "w": r.choice([1, 3, 6, 7]), "n": groups * r.choice([1, 2, 5, 8]),
         "k": r.choice([1, 2, 3]), "stride": r.choice([1, 1, 2, [1, 2]]), "padding": r.choice([0, 1, 2, [0, 1]]),
         "dilation": r.choice([1, 1, 2]), "groups": groups, "dtype": r.choice(list(DTYPES)),
         "bias": r.random() < 0.5, "per_channel": r.random() < 0.7,
         "scale": r.choice(SCALE_KINDS), "x_layout": r.choice(["contiguous", "channels_last", "transposed"]),
         "w_layout": r.choice(["contiguous", "channels_last"])}
    pad = p["padding"] if isinstance(p["padding"], list) else [p["padding"]] * 2
    dil = p["dilation"]
    p["h"] = max(p["h"], dil * (p["k"] - 1) + 1 - 2 * pad[0])  # a kernel that fits the padded input
    p["w"] = max(p["w"], dil * (p["k"] - 1) + 1 - 2 * pad[1])
    return p


def conv_inputs(p: dict):
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    x = randn(p, g, p["b"], p["c"], p["h"], p["w"], dtype=dtype)
    if p["x_layout"] == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif p["x_layout"] == "transposed":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    w = random_codes(g, (p["n"], p["c"] // p["groups"], p["k"], p["k"]))
    if p["w_layout"] == "channels_last":
        w = w.view(torch.uint8).contiguous(memory_format=torch.channels_last).view(FP8)
    b = randn(p, g, p["n"], dtype=dtype) if p["bias"] else None
    return x, w, make_scale(p, g, p["n"], dtype), b, dtype


def run_conv(p: dict) -> None:
    x, w, s, b, dtype = conv_inputs(p)
    geo = dict(stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    wd = upcast_oracle(w, s, dtype)
    b64 = b.double() if b is not None else None
    exact = F.conv2d(x.double(), wd, b64, **geo)
    finite = lambda t: torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype))
    mag = F.conv2d(finite(x.double()), finite(wd), None if b64 is None else b64.abs(), **geo)
    tol = gemm_tol(dtype, wd[0].numel(), mag)
    # Zero padding times a NaN/inf weight: NaN if the padding is multiplied (float64's conv),
    # nothing if it is skipped (fp32/bf16 convs): torch itself differs, so those are skipped.
    ph, pw = p["padding"] if isinstance(p["padding"], list) else [p["padding"]] * 2
    padded = F.pad(torch.zeros_like(x, dtype=torch.float64), (pw, pw, ph, ph), value=1.0)
    at_padding = F.conv2d(padded, (~torch.isfinite(wd)).double(), None, **{**geo, "padding": 0}) > 0
    skip = at_padding | (mag > FP32_MAX / 16)
    run_variants("fp8_conv2d", lambda backend: fp8_conv2d(x, w, s, b, backend=backend, **geo),
                 lambda name, out: check_close(f"fp8_conv2d {name}", out, exact, tol, skip))


def _conv_bad(p: dict, what: str) -> None:
    x, w, s, b, dtype = conv_inputs(p)
    geo = dict(stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    calls = {
        "groups_0": lambda: fp8_conv2d(x, w, s, b, **{**geo, "groups": 0}),
        "groups_not_dividing": lambda: fp8_conv2d(x, w, s, b, **{**geo, "groups": p["n"] + 1}),
        "groups_float": lambda: fp8_conv2d(x, w, s, b, **{**geo, "groups": 1.5}),
        "stride_0": lambda: fp8_conv2d(x, w, s, b, **{**geo, "stride": 0}),
        "stride_3_values": lambda: fp8_conv2d(x, w, s, b, **{**geo, "stride": (1, 1, 1)}),
        "padding_negative": lambda: fp8_conv2d(x, w, s, b, **{**geo, "padding": -1}),
        "padding_same": lambda: fp8_conv2d(x, w, s, b, **{**geo, "padding": "same"}),
        "dilation_0": lambda: fp8_conv2d(x, w, s, b, **{**geo, "dilation": 0}),
        "x_3d": lambda: fp8_conv2d(x[0], w, s, b, **geo),
        "no_channels": lambda: fp8_conv2d(x[:, :0], w[:, :0], s, b, **{**geo, "groups": 1}),
        "kernel_too_big": lambda: fp8_conv2d(x[..., :1, :1], torch.zeros(p["n"], p["c"] // p["groups"], 3, 3).to(FP8),
                                             s, b, **{**geo, "padding": 0}),
        "bias_shape": lambda: fp8_conv2d(x, w, s, torch.ones(p["n"] + 1, dtype=dtype), **geo),
    }
    calls[what]()


# ----------------------------------------------------------------------------- attention

def draw_attention(r: random.Random) -> dict:
    return {"seed": r.randrange(2 ** 31), "b": r.choice([1, 2]), "h": r.choice([1, 2, 3]),
            "sq": r.choice([0, 1, 2, 7, 33, 64, 65]), "skv": r.choice([1, 2, 15, 33, 256, 257, 300]),
            "d": r.choice([1, 2, 3, 8, 17, 40, 64, 80, 128]), "dtype": r.choice(list(DTYPES)),
            "layout": r.choice(["contiguous", "bshd", "bshd", "expanded"]),
            "scale": r.choice([None, None, None, 0.05, 1.0, -0.7, 1e-30, 30.0]),
            "special": r.choice(["none", "none", "none", "nan_q", "nan_k", "nan_v", "neg_first_block"]),
            "mask": r.choice([None, None, "keys", "bias"])}


def attention_mask(p: dict, g: torch.Generator):
    """Key padding per sample (the last sample may keep no key), or a float32 bias per head and
    position with masked (-inf) entries."""
    b, h, sq, skv = p["b"], p["h"], p["sq"], p["skv"]
    if p.get("mask") == "keys":
        return (torch.arange(skv) < torch.randint(0, skv + 1, (b, 1), generator=g))[:, None, None, :]
    if p.get("mask") == "bias":
        bias = torch.randn(1, h, sq, skv, generator=g) * 3
        return bias.masked_fill(torch.rand(1, h, sq, skv, generator=g) < 0.3, -math.inf)
    return None


def attention_inputs(p: dict):
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    b, h, sq, skv, d = p["b"], p["h"], p["sq"], p["skv"], p["d"]
    nb = 1 if p["layout"] == "expanded" else b
    q, k, v = (torch.randn(nb, s, h, d, generator=g) for s in (sq, skv, skv))
    if p["special"] == "neg_first_block" and dtype != torch.float16:
        # the first 256 keys score about -1e40 (overflow to -inf in fp32), the rest ~ +1e20
        q, k = (torch.rand(nb, sq, h, d, generator=g) + 0.1) * 1e20, torch.rand(nb, skv, h, d, generator=g) + 0.1
        k[:, :min(256, skv - 1)] *= -1e20
    special = {"nan_q": q, "nan_k": k, "nan_v": v}.get(p["special"])
    if special is not None:
        poke(special, g, math.nan)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if p["layout"] == "contiguous":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    else:  # (B, S, H, D) memory seen as (B, H, S, D), as diffusers' processors pass it
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if p["layout"] == "expanded":
        q, k, v = (t.expand(b, -1, -1, -1) for t in (q, k, v))
    return q, k, v, dtype


def attention_oracle(q, k, v, scale, mask=None):
    """softmax(q k^T * scale + mask) v in float64, with fp32's overflow of the scores to +-inf
    (far from the threshold in these cases), 0 for rows whose keys are all masked; the
    tolerance per output row, and the rows whose answer depends on fp32 evaluation order."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    qk = q64 @ k64.transpose(-1, -2)
    s = qk * scale
    # Where q.k overflows fp32 but its scaled score does not, whether a kernel sees -inf depends on
    # where it applies the scale (to q first, as SDPA does, or to the scores): such rows are skipped.
    order = ((qk.abs() > FP32_MAX / 2) & (s.abs() <= FP32_MAX / 2)).any(-1, keepdim=True)
    s = torch.where((qk.abs() > FP32_MAX / 2) | (s.abs() > FP32_MAX / 2), torch.sign(s) * math.inf, s)
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf) \
            if mask.dtype == torch.bool else mask.double()
        s = s + bias
    exact = torch.softmax(s, -1) @ v64
    if mask is not None:
        exact = exact.masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
    # fp32 scores are off by ~2^-22 of |q||k| |scale|; that moves the output by about that
    # many e-folds of every key that can carry weight.
    delta = 2.0 ** -21 * abs(scale) * (q64.abs() @ k64.abs().transpose(-1, -2))
    m = s.amax(-1, keepdim=True)
    weighty = (s - m + delta >= -30) & torch.isfinite(s)
    row_delta = torch.where(weighty, delta, torch.zeros((), dtype=torch.float64)).amax(-1, keepdim=True)
    vmax = v64.abs().nan_to_num(0).amax((-1, -2), keepdim=True)
    tol = (EPS[q.dtype] + 4 * row_delta) * vmax
    return exact, tol, order.expand_as(exact)


def run_attention(p: dict) -> None:
    q, k, v, dtype = attention_inputs(p)
    mask = attention_mask(p, gen(p))
    exact, tol, skip = attention_oracle(q, k, v, p["scale"], mask)

    def check(name, out):
        if out.stride() != torch.empty_like(q).stride():
            raise Mismatch(f"attention {name}: strides {out.stride()}, the op promises empty_like(q)'s")
        check_close(f"attention {name}", out, exact, tol, skip)

    run_variants("attention", lambda backend: attention(q, k, v, p["scale"], backend=backend, attn_mask=mask), check,
                 extra=("sdpa", "reference"))


def _attention_bad(p: dict, what: str) -> None:
    q, k, v, dtype = attention_inputs(p)
    calls = {
        "q_3d": lambda: attention(q[0], k, v),
        "int_dtype": lambda: attention(q.to(torch.int32), k, v),
        "mixed_dtype": lambda: attention(q, k.double(), v),
        "kv_shape": lambda: attention(q, k, v[..., :1, :]) if v.shape[2] > 1 else attention(q, k, v[..., :0]),
        "head_dim_0": lambda: attention(q[..., :0], k[..., :0], v[..., :0]),
        "heads": lambda: attention(q, torch.cat([k, k], 1), torch.cat([v, v], 1)),
        "no_keys": lambda: attention(torch.ones(1, 1, 2, 4, dtype=dtype), torch.ones(1, 1, 0, 4, dtype=dtype),
                                     torch.ones(1, 1, 0, 4, dtype=dtype)),
        "scale_nan": lambda: attention(q, k, v, math.nan),
        "scale_str": lambda: attention(q, k, v, "0.1"),
        "q_list": lambda: attention(q.tolist(), k, v),
    }
    calls[what]()


# ----------------------------------------------------------------------------- tile_blend

def draw_tiles(r: random.Random) -> dict:
    th, tw = r.choice([1, 2, 5, 8, 17]), r.choice([1, 3, 8, 16, 33])
    H, W = th + r.choice([0, 1, 4, 9]), tw + r.choice([0, 2, 7])
    return {"seed": r.randrange(2 ** 31), "lead": r.choice([[1], [3], [2, 2]]), "th": th, "tw": tw, "H": H, "W": W,
            "y": r.randint(0, H - th), "x": r.randint(0, W - tw), "dtype": r.choice(list(DTYPES)),
            "overlaps": [r.randint(0, th), r.randint(0, th), r.randint(0, tw), r.randint(0, tw)],
            "above": r.choice([0, 1, th, th + 2]), "left": r.choice([0, 1, tw, tw + 1]),
            "crop": [r.randint(0, th), r.randint(0, tw)], "keep": [r.randint(0, th), r.randint(0, tw)],
            "layout": r.choice(["contiguous", "transposed"]), "alias": r.choice(["none", "none", "view_of_out"]),
            "special": r.choice(["none", "none", "nan"])}


def tile_inputs(p: dict):
    g = gen(p)
    dtype = DTYPES[p["dtype"]]
    lead = tuple(p["lead"])
    out = randn(p, g, *lead, p["H"], p["W"], dtype=dtype)
    tile = randn(p, g, *lead, p["th"], p["tw"], dtype=dtype)
    if p["special"] == "nan":
        poke(tile, g, math.nan)
    tile = lay_out(tile, p["layout"])
    above = randn(p, g, *lead, p["above"], p["tw"], dtype=dtype)
    left = randn(p, g, *lead, p["th"], p["left"], dtype=dtype)
    return out, tile, above, left, dtype


def _aliased(p: dict, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A view of out holding t's values, one row and column before the tile's position, so
    the op writes elements of it before it reads them (t itself where the view does not fit)."""
    y, x = max(p["y"] - 1, 0), max(p["x"] - 1, 0)
    rows, cols = t.shape[-2:]
    if y + rows > out.shape[-2] or x + cols > out.shape[-1]:
        return t
    view = out[..., y:y + rows, x:x + cols]
    view.copy_(t)
    return view


def normalized_oracle(p, out, tile):
    th, tw = tile.shape[-2:]
    top, bot, lft, rgt = p["overlaps"]
    k = lambda n: torch.arange(n, dtype=torch.float64)
    ramp = lambda n, a, b: (torch.where(k(n) < a, (k(n) + 0.5) / max(a, 1), 1.0)
                            * torch.where(n - 1 - k(n) < b, (n - 1 - k(n) + 0.5) / max(b, 1), 1.0))
    wgt = ramp(th, top, bot)[:, None] * ramp(tw, lft, rgt)[None, :]
    exact, mag = out.double(), out.double().abs()
    y, x = p["y"], p["x"]
    exact[..., y:y + th, x:x + tw] += tile.double() * wgt
    mag[..., y:y + th, x:x + tw] += (tile.double() * wgt).abs()
    return exact, EPS[out.dtype] * mag.nan_to_num(0)


def run_normalized(p: dict) -> None:
    out0, tile, _, _, _ = tile_inputs(p)

    def call(backend):
        out = out0.clone()
        t = _aliased(p, out, tile) if p["alias"] == "view_of_out" else tile
        before_out, before_tile = out.clone(), t.clone()
        tile_blend_normalized(t, out, p["y"], p["x"], tuple(p["overlaps"]), backend=backend)
        return out, before_out, before_tile

    ref = {}

    def check(name, result):
        out, before_out, before_tile = result
        exact, tol = normalized_oracle(p, before_out, before_tile)
        check_close(f"tile_blend_normalized {name}", out, exact, tol)
        ref.setdefault("out", out)
        if not same_bits(out, ref["out"], nan_bits=False):
            raise Mismatch(f"tile_blend_normalized {name}: bits differ from the first backend's")

    run_variants("tile_blend", call, check)


def diffusers_oracle(p, out, tile, above, left):
    th, tw = tile.shape[-2:]
    b = tile.double().clone()
    ev, eh = min(above.shape[-2], th), min(left.shape[-1], tw)
    for i in range(ev):
        b[..., i, :] = above.double()[..., above.shape[-2] - ev + i, :] * (1 - i / ev) + b[..., i, :] * (i / ev)
    for j in range(eh):
        b[..., :, j] = left.double()[..., left.shape[-1] - eh + j] * (1 - j / eh) + b[..., :, j] * (j / eh)
    exact = out.double()
    (ch, cw), (kb, kr), y, x = p["crop"], p["keep"], p["y"], p["x"]
    exact[..., y:y + ch, x:x + cw] = b[..., :ch, :cw]
    scale = max(t.double().abs().nan_to_num(0).max().item() if t.numel() else 0.0 for t in (out, tile, above, left))
    return exact, b[..., th - kb:, :], b[..., tw - kr:], torch.tensor(4 * EPS[out.dtype] * scale)


def run_diffusers(p: dict) -> None:
    out0, tile, above0, left0, _ = tile_inputs(p)

    def call(backend):
        out = out0.clone()
        above = _aliased(p, out, above0) if p["alias"] == "view_of_out" else above0
        before = (out.clone(), tile.clone(), above.clone(), left0.clone())
        bottom, right = tile_blend_diffusers(tile, out, p["y"], p["x"], tuple(p["crop"]), above, left0,
                                             p["keep"][0], p["keep"][1], backend=backend)
        return out, bottom, right, before

    ref = {}

    def check(name, result):
        out, bottom, right, before = result
        exact, e_bottom, e_right, tol = diffusers_oracle(p, *before)
        for what, got, want in (("out", out, exact), ("bottom", bottom, e_bottom), ("right", right, e_right)):
            check_close(f"tile_blend_diffusers {name} {what}", got, want, tol)
        ref.setdefault("out", result)
        if not all(same_bits(a, b, nan_bits=False) for a, b in zip(result[:3], ref["out"][:3])):
            raise Mismatch(f"tile_blend_diffusers {name}: bits differ from the first backend's")

    run_variants("tile_blend", call, check)


def _tile_bad(p: dict, what: str) -> None:
    out, tile, above, left, dtype = tile_inputs(p)
    y, x = p["y"], p["x"]
    calls = {
        "int_tile": lambda: tile_blend_normalized(tile.to(torch.int32), out, y, x),
        "out_dtype": lambda: tile_blend_normalized(tile, out.double(), y, x),
        "out_strided": lambda: tile_blend_normalized(tile, out.transpose(-1, -2), 0, 0),
        "negative_position": lambda: tile_blend_normalized(tile, out, -1, x),
        "past_output": lambda: tile_blend_normalized(tile, out, p["H"], x),
        "overlap_too_big": lambda: tile_blend_normalized(tile, out, y, x, (p["th"] + 1, 0, 0, 0)),
        "overlap_negative": lambda: tile_blend_normalized(tile, out, y, x, (0, -1, 0, 0)),
        "channels": lambda: tile_blend_normalized(torch.cat([tile, tile], -3), out, y, x),
        "above_width": lambda: tile_blend_diffusers(tile, out, y, x, above=torch.ones(*tile.shape[:-1], p["tw"] + 1,
                                                                                       dtype=dtype)),
        "crop_too_big": lambda: tile_blend_diffusers(tile, out, y, x, crop=(p["th"] + 1, 1)),
        "keep_too_big": lambda: tile_blend_diffusers(tile, out, y, x, keep_bottom=p["th"] + 1),
    }
    calls[what]()


# ----------------------------------------------------------------------------- registry and runner

def _bad(fn, names):
    return {name: (lambda p, name=name: fn(p, name)) for name in names}


FUZZERS = {
    "fp8_quantize": Fuzzer("fp8_quantize", draw_quantize, run_quantize,
                           _bad(_quantize_bad, ["int", "nan", "empty", "scalar", "meta", "fp8", "list"])),
    "fp8_upcast": Fuzzer("fp8_upcast", draw_upcast, run_upcast,
                         _bad(_upcast_bad, ["float_weight", "scale_float64", "scale_size", "int_dtype", "out_shape",
                                            "out_strided", "out_dtype", "out_meta", "scalar_weight"])),
    "fp8_linear": Fuzzer("fp8_linear", draw_linear, run_linear,
                         _bad(_linear_bad, ["int_x", "k_mismatch", "weight_3d", "scale_size", "bias_shape",
                                            "bias_dtype", "float_weight", "x_not_tensor", "scalar_x"])),
    "fp8_linear_dynamic": Fuzzer("fp8_linear_dynamic", draw_dynamic, run_dynamic,
                                 _bad(_dynamic_bad, ["int_x", "k_mismatch", "no_features", "scale_size", "bias_dtype",
                                                     "float_weight"])),
    "fp8_conv2d": Fuzzer("fp8_conv2d", draw_conv, run_conv,
                         _bad(_conv_bad, ["groups_0", "groups_not_dividing", "groups_float", "stride_0",
                                          "stride_3_values", "padding_negative", "padding_same", "dilation_0", "x_3d",
                                          "no_channels", "kernel_too_big", "bias_shape"])),
    "attention": Fuzzer("attention", draw_attention, run_attention,
                        _bad(_attention_bad, ["q_3d", "int_dtype", "mixed_dtype", "kv_shape", "head_dim_0", "heads",
                                              "no_keys", "scale_nan", "scale_str", "q_list"])),
    "tile_blend_normalized": Fuzzer("tile_blend", draw_tiles, run_normalized,
                                    _bad(_tile_bad, ["int_tile", "out_dtype", "out_strided", "negative_position",
                                                     "past_output", "overlap_too_big", "overlap_negative",
                                                     "channels"])),
    "tile_blend_diffusers": Fuzzer("tile_blend", draw_tiles, run_diffusers,
                                   _bad(_tile_bad, ["above_width", "crop_too_big", "keep_too_big"])),
}
BAD_RATE = 0.2  # share of cases that are bad inputs


def draw_case(op: str, seed: int, index: int) -> dict:
    """Case `index` of `op` under `seed`: deterministic, so any case is replayed by its numbers."""
    r = random.Random(f"{seed}/{op}/{index}")
    fuzzer = FUZZERS[op]
    params = fuzzer.draw(r)
    params["bad"] = r.choice(sorted(fuzzer.bad)) if r.random() < BAD_RATE else None
    return params


def run_case(op: str, params: dict) -> tuple[str, str]:
    """Outcome of one case: ok | clear_error | other_exception | wrong, and a detail line."""
    fuzzer = FUZZERS[op]
    try:
        if params["bad"] is not None:
            fuzzer.bad[params["bad"]](params)
            return "wrong", f"bad input {params['bad']!r} was accepted without an error"
        fuzzer.run(params)
        return "ok", ""
    except Mismatch as e:
        return "wrong", str(e)
    except PyextError as e:
        expected = params["bad"] is not None and str(e).startswith(f"pyext.{fuzzer.op}")
        return ("clear_error" if expected else "other_exception"), f"PyextError: {e}"
    except Exception as e:  # noqa: BLE001 - anything else is the finding
        return "other_exception", f"{type(e).__name__}: {e} ({traceback.extract_tb(e.__traceback__)[-1].name})"


FAILURES = ("other_exception", "wrong")


def _kind(result: tuple[str, str]) -> tuple[str, str]:
    """The outcome and the exception's type (or the mismatch's op and variant)."""
    return result[0], result[1].split(":")[0]


def shrink(op: str, params: dict, outcome: str, detail: str, budget: int = 60) -> dict:
    """A smaller case failing the same way: greedy halving of sizes, plain layouts and values."""
    best = dict(params)
    plain = {"layout": "contiguous", "x_layout": "contiguous", "w_layout": "contiguous", "special": "none",
             "alias": "none", "bias": False, "per_channel": False, "scale": "normal"}
    changed = True
    while changed and budget > 0:
        changed = False
        for key, value in list(best.items()):
            if key in ("seed", "bad"):
                continue
            if isinstance(value, (bool, str)) or value is None:
                same_kind = key in plain and type(plain[key]) is type(value)
                options = [plain[key]] if same_kind and plain[key] != value else []
            elif isinstance(value, int):
                options = [o for o in (0, 1, value // 2, value - 1) if 0 <= o < value]
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                options = [[v // 2 for v in value], value[:-1]] if value else []
            else:
                options = []
            for option in options:
                if budget <= 0:
                    break
                budget -= 1
                trial = {**best, key: option}
                if _kind(run_case(op, trial)) == _kind((outcome, detail)):
                    best, changed = trial, True
                    break
    return best


def repro(op: str, params: dict) -> str:
    return f"python -m tests.fuzz_cases --op {op} --params '{json.dumps(params)}'"


def run_op(op: str, seed: int, start: int, stop: int, log: str) -> None:
    """Runs cases [start, stop) of op, appending one JSON line per case to `log`: a line
    {"index", "params"} before the case (so a crash names it), one with the outcome after."""
    with open(log, "a") as f:
        for i in range(start, stop):
            params = draw_case(op, seed, i)
            f.write(json.dumps({"index": i, "params": params}) + "\n")
            f.flush()
            outcome, detail = run_case(op, params)
            line = {"index": i, "outcome": outcome}
            if outcome in FAILURES:
                small = shrink(op, params, outcome, detail)
                line.update(detail=run_case(op, small)[1], repro=repro(op, small))
            f.write(json.dumps(line) + "\n")
            f.flush()


def run_isolated(op: str, seed: int, cases: int) -> tuple[dict, list[dict]]:
    """Runs op's cases in child processes, so an interpreter crash is counted (and its case
    reported) instead of ending the run; the next child resumes after the crashing case."""
    counts = dict.fromkeys(("cases", "ok", "clear_error", "other_exception", "wrong", "crash"), 0)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        start = 0
        while start < cases:
            cmd = [sys.executable, "-m", "tests.fuzz_cases", "--child", op, "--seed", str(seed),
                   "--start", str(start), "--cases", str(cases), "--log", log]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            with open(log) as f:
                lines = [json.loads(line) for line in f]
            open(log, "w").close()
            for line in lines:
                if "outcome" in line:
                    counts["cases"] += 1
                    counts[line["outcome"]] += 1
                    if line["outcome"] in FAILURES:
                        failures.append(line)
            if proc.returncode == 0:
                break
            last = lines[-1] if lines else None
            if last is None or "outcome" in last:  # the child failed outside any case
                raise RuntimeError(f"fuzz child for {op} failed: {proc.stderr[-2000:]}")
            counts["cases"] += 1
            counts["crash"] += 1
            failures.append({"outcome": f"crash (exit {proc.returncode})", "detail": proc.stderr[-300:],
                             "repro": repro(op, last["params"])})
            start = last["index"] + 1
    return counts, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="cases per op")
    ap.add_argument("--seed", type=int, default=None, help="default: a new random seed")
    ap.add_argument("--ops", default=",".join(FUZZERS))
    ap.add_argument("--op", help="with --params: replay one case")
    ap.add_argument("--params")
    ap.add_argument("--child")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--log")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if args.params:
        params = json.loads(args.params)
        outcome, detail = run_case(args.op, params)
        print(f"{args.op}: {outcome} {detail}")
        return 0 if outcome not in FAILURES else 1
    if args.child:
        run_op(args.child, args.seed, args.start, args.cases, args.log)
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    print(f"pyext fuzz: seed {seed}, {args.cases} cases per op, SIMD levels {simd_levels()}")
    grand, failed = {}, False
    for op in args.ops.split(","):
        counts, failures = run_isolated(op, seed, args.cases)
        for key, n in counts.items():
            grand[key] = grand.get(key, 0) + n
        print(_summary(op, counts), flush=True)
        for fail in failures[:5]:
            print(f"    {fail['outcome']}: {fail['detail']}\n      repro: {fail['repro']}")
        failed |= bool(failures)
    print(_summary("total", grand))
    return 1 if failed else 0


def _summary(name: str, c: dict) -> str:
    return (f"  {name:22s} cases {c['cases']:5d}  ok {c['ok']:5d}  clear errors {c['clear_error']:4d}  "
            f"other exceptions {c['other_exception']}  crashes {c['crash']}  silent wrong answers {c['wrong']}")


if __name__ == "__main__":
    sys.exit(main())
