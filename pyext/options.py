"""The options of `pyext.optimize`: one frozen, typed dataclass, checked when it is made.

A bad value raises PyextError naming the option, the value and what is allowed, before
anything touches a pipeline. Every switch spells "off" as "off"; "auto" decides for the
machine and the memory budget.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal, Union, get_args

import torch

from pyext.dispatch import PyextError
from pyext.nn.fp8 import DEFAULT_SKIP

Switch = Literal["auto", "on", "off"]
FP8Mode = Literal["auto", "off", "denoiser", "all"]
FP8Gemm = Literal["auto", "weight_only", "dynamic"]
FP8Layers = Literal["linear+conv", "linear"]  # pyext.nn.fp8.LAYER_KINDS
CompileMode = Literal["auto", "off", "capture", "trace", "compile", "cudagraphs"]
OffloadMode = Literal["auto", "off", "model", "group", "sequential"]
DTypeChoice = Union[Literal["auto", "keep"], torch.dtype]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_PIXELS = 1 << 16  # a side longer than this is a typo, not an image
GB = 1 << 30


def _fail(option: str, value, allowed: str) -> None:
    raise PyextError(f"pyext.optimize: option {option}={value!r} is not allowed; allowed: {allowed}")


def parse_bytes(value) -> int | None:
    """'8GB', '7.5 GiB', '512MB' or a number of bytes -> bytes (GB and GiB both mean 2**30 here)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", value, re.IGNORECASE) \
            if isinstance(value, str) else None
        if not m:
            _fail("memory_budget", value, "a size like '8GB', '512MB' or a positive number of bytes, or None")
        unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
        number = int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GB, "T": 1 << 40}[unit])
    if number <= 0:
        _fail("memory_budget", value, "a positive size")
    return number


@dataclass(frozen=True)
class OptimizeOptions:
    """What `pyext.optimize` may do. README's options table says what each one trades.

    attention: "auto" (fastest pyext backend per call) | a pyext attention backend name | "off".
    dtype: "auto" (the family's dtype on CUDA, bf16 on CPU) | "keep" | torch.float32/float16/bfloat16.
    fp8: "auto" (only when the budget needs it) | "off" | "denoiser" | "all" (denoisers,
        controlnets and conditioning encoders).
    fp8_gemm: how fp8 linears compute: "weight_only" (the weight upcast in the GEMM: exact to the
        stored weights), "dynamic" (bfloat16 linears: activations quantized per row to fp8 too, an
        fp8 x fp8 GEMM on fp8 tensor cores, with the activations' rounding) or "auto" (on a GPU
        with fp8 tensor cores, each layer shape measures both and keeps the faster; weight_only
        elsewhere).
    fp8_skip: regexes of layer names kept in full precision, on top of each model's own
        `_skip_layerwise_casting_patterns` and `_keep_in_fp32_modules`.
    fp8_layers: the layer kinds stored in fp8: "linear+conv" (Linear and Conv2d) or "linear"
        (Linear only, as torchao's and diffusers' guides quantize: convolutions keep the compute
        dtype, closer images for more weight bytes in conv-heavy UNets).
    keep_original_weights: keep a CPU copy of converted weights so `restore` is exact.
    channels_last: "auto" (conv-heavy denoisers and 2-D VAEs) | "on" | "off".
    prepack: "auto" (on a CPU: Conv2d/Linear weights of denoisers, VAEs and controlnets packed once
        for oneDNN) | "on" (every component) | "off".
    fuse_norms: "auto" (on a CPU: GroupNorm + SiLU in one pass in the ResnetBlock2D blocks of
        denoisers, VAEs and controlnets) | "on" (every component, any device) | "off".
    upsample_phases: "auto" (on a CPU: the VAEs' nearest 2x upsampling + 3x3 convolution as one 2x2
        convolution of the small input, pyext.nn.upsample, where dispatch measures it faster per
        shape) | "on" (every component) | "off".
    fuse_geglu: "auto" (on a CPU: the GEGLU activations of denoisers and controlnets, the
        feed-forward's chunk, GELU and product, in one pass of pyext.ops.geglu; not on a denoiser
        with compile="compile"/"cudagraphs", whose compiler fuses them) | "on" (every component,
        any device) | "off".
    compile: "auto" (capture on CUDA without offload; eager otherwise) | "off" | "capture" (pyext
        captures the denoiser's eager forward in CUDA graphs, one per input signature, and replays
        them; no compiler; CUDA only) | "trace" | "compile" (torch.compile; on a CPU with inductor,
        the denoiser's weights frozen and packed for oneDNN) | "cudagraphs" (torch.compile with
        CUDA graphs, one per input shape; CUDA only).
    compile_backend: the torch.compile backend for compile="compile".
    compile_autotune: with compile="compile" and inductor, each GEMM shape of the compiled graph is
        timed on this machine, inductor's generated GEMM against ATen's, and the faster kept
        (inductor's max_autotune; longer first compiles): "auto" (on a CPU) | "on" (on a GPU too,
        mode "max-autotune-no-cudagraphs") | "off".
    vae_tiling: "auto" (only when the full decode would not fit the budget) | "on" | "off".
    vae_slicing: "auto" (with tiling or offload) | "on" | "off".
    offload: "auto" (the planner's) | "off" | "model" | "group" | "sequential".
    device: where the pipeline runs; None = where it is. Components on several devices never move.
    memory_budget: "8GB", bytes, or None (the CUDA device's memory; no limit on a CPU).
    devices: the devices the denoiser's sequence is split over by diffusers' context parallelism
        (`enable_parallelism`); None = the degree enabled on the denoiser, else 1. The plan then
        says how the family splits and counts the memory of one device; the split itself is
        diffusers' `enable_parallelism`, before or after optimize.
    height, width, frames, batch: what the plan is made for (None: the pipeline's defaults;
        batch counts classifier-free guidance, so 2 is one prompt with guidance).
    """

    attention: str = "auto"
    dtype: DTypeChoice = "auto"
    fp8: FP8Mode = "auto"
    fp8_gemm: FP8Gemm = "auto"
    fp8_skip: tuple[str, ...] = DEFAULT_SKIP
    fp8_layers: FP8Layers = "linear+conv"
    keep_original_weights: bool = False
    channels_last: Switch = "auto"
    prepack: Switch = "auto"
    fuse_norms: Switch = "auto"
    upsample_phases: Switch = "auto"
    fuse_geglu: Switch = "auto"
    compile: CompileMode = "auto"
    compile_backend: str = "inductor"
    compile_autotune: Switch = "auto"
    vae_tiling: Switch = "auto"
    vae_slicing: Switch = "auto"
    offload: OffloadMode = "auto"
    device: str | torch.device | None = None
    memory_budget: int | str | None = None
    devices: int | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    batch: int = 2

    def __post_init__(self):
        for name, kind in (("fp8", FP8Mode), ("fp8_gemm", FP8Gemm), ("fp8_layers", FP8Layers), ("channels_last", Switch),
                           ("prepack", Switch), ("fuse_norms", Switch), ("upsample_phases", Switch), ("fuse_geglu", Switch),
                           ("compile", CompileMode), ("compile_autotune", Switch),
                           ("vae_tiling", Switch), ("vae_slicing", Switch), ("offload", OffloadMode)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in get_args(kind):
                _fail(name, value, ", ".join(map(repr, get_args(kind))))
        self._check_attention()
        if not (self.dtype in ("auto", "keep") or self.dtype in DTYPES):
            _fail("dtype", self.dtype, "'auto', 'keep', " + ", ".join(map(str, DTYPES)))
        if isinstance(self.fp8_skip, str) or not all(isinstance(p, str) for p in self.fp8_skip):
            _fail("fp8_skip", self.fp8_skip, "a tuple of regex strings")
        for pattern in self.fp8_skip:
            try:
                re.compile(pattern)
            except re.error as err:
                _fail("fp8_skip", self.fp8_skip, f"valid regexes ({pattern!r}: {err})")
        object.__setattr__(self, "fp8_skip", tuple(self.fp8_skip))
        if not isinstance(self.keep_original_weights, bool):
            _fail("keep_original_weights", self.keep_original_weights, "True, False")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            _fail("compile_backend", self.compile_backend, "a torch.compile backend name")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                _fail("device", self.device, "None, a torch.device or a device string such as 'cuda:0'")
        parse_bytes(self.memory_budget)
        for name, top in (("height", MAX_PIXELS), ("width", MAX_PIXELS), ("frames", 100_000), ("batch", 4096),
                          ("devices", 4096)):
            value = getattr(self, name)
            if value is None and name != "batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= top:
                _fail(name, value, f"an int from 1 to {top}" + ("" if name == "batch" else ", or None"))

    def _check_attention(self):
        from pyext import dispatch

        backends = [b.name for b in dispatch.ops()["attention"].backends]
        if not isinstance(self.attention, str) or self.attention not in ("auto", "off", *backends):
            _fail("attention", self.attention, ", ".join(map(repr, ("auto", "off", *backends))))

    @property
    def budget_bytes(self) -> int | None:
        return parse_bytes(self.memory_budget)

    def replace(self, **changes) -> "OptimizeOptions":
        """A checked copy with some options changed; unknown names are a PyextError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise PyextError(f"pyext.optimize: unknown option {unknown[0]!r}; options are: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **changes)
