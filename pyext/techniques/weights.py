"""Weight techniques: the compute dtype, and fp8 storage."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import _compat, dispatch
from pyext.nn.fp8 import FP8Conv2d, FP8Linear, quantize_fp8, restore_fp8
from pyext.planner import FP8_ROLES
from pyext.techniques.base import Entry, Step, Technique


def _own_dtype(module: nn.Module) -> torch.dtype | None:
    return next((t.dtype for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                 if t.is_floating_point()), None)


def _kept_in_fp32(name: str, keep: list[str]) -> bool:
    return any(k in name.split(".") for k in keep)  # diffusers' loader rule: a whole name component


def _floating_tensors(module: nn.Module):
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if t.is_floating_point():
            yield name, t


class DType(Technique):
    """Cast every component to the compute dtype, keeping the modules the model's own loader
    keeps in fp32 (`_keep_in_fp32_modules`: Wan's time embedder and norms, T5's `wo` in fp16)."""

    name = "dtype"

    def plan(self, pipe, d) -> list[Step]:
        if d.dtype is None:
            return [self.wont("*", "dtype='keep'")]
        return [self.will(name) for name in d.components.modules]

    def change(self, pipe, name: str, d) -> Entry:
        return self._cast(name, d.components.modules[name], d.dtype, d.options.keep_original_weights)

    def _cast(self, name: str, module: nn.Module, dtype: torch.dtype, keep_original: bool) -> Entry:
        keep = _compat.keep_in_fp32_modules(module, dtype)
        before = {n: _own_dtype(m) for n, m in module.named_modules()}
        target = {n: torch.float32 if _kept_in_fp32(n, keep) else dtype for n, dt in before.items() if dt is not None}
        changes = {n: dt for n, dt in target.items() if before[n] != dt}
        if not changes:
            return self.already(name, str(dtype))
        # Every floating tensor, non-persistent buffers too (rotary frequencies, PixArt's pos_embed):
        # state_dict() would miss those, and their bf16 rounding would survive the restore.
        saved = {n: t.detach().to("cpu", copy=True) for n, t in _floating_tensors(module)} if keep_original else None
        for sub_name, dt in changes.items():
            _compat.cast_own_tensors(module.get_submodule(sub_name), dt)
        kept = sorted({n for n, dt in target.items() if dt != dtype})
        detail = f"{', '.join(sorted({str(before[n]) for n in changes}))} -> {dtype}"
        if kept:
            detail += f"; {len(kept)} modules kept in float32 as the model asks ({', '.join(keep)})"
        return self.applied(name, detail, functools.partial(self._undo, module, {n: before[n] for n in changes}, saved),
                            exact=keep_original)

    @staticmethod
    def _undo(module, before, saved) -> str:
        for sub_name, dt in before.items():
            _compat.cast_own_tensors(module.get_submodule(sub_name), dt)
        if saved is None:
            return "cast back (values keep the rounding of the compute dtype)"
        with torch.no_grad():
            for name, tensor in _floating_tensors(module):
                tensor.copy_(saved[name])
        return "cast back, original values reloaded (exact)"


COST_ROWS = 256  # rows of the sample input cpu_cost times: a denoiser's tokens are more, a batch's text fewer
COST_PIXELS = 32  # side of the sample image of its convolutions (SD's latent at 256x256)


def _largest(module: nn.Module, kind: type) -> nn.Module | None:
    layers = [m for m in module.modules() if isinstance(m, kind) and m.weight.device.type == "cpu"]
    return max(layers, key=lambda m: m.weight.numel(), default=None)


def _cost(layer: nn.Module, x: torch.Tensor, plain, key: str) -> float | None:
    """The time of `layer` on x over `plain`'s (the layer's op on its dequantized weight), timed once
    per CPU identity (dispatch keeps the decision with its others); None if either failed."""
    with torch.no_grad():
        # The layer's first call makes its op's own measured choice for this shape, which
        # measured_choice would take for the layer's time (its first calls screen out slow candidates).
        layer(x)
        decision = dispatch.measured_choice("fp8_cost", key, torch.device("cpu"),
                                            {"fp8": lambda: layer(x), "plain": plain})
    timings = decision["timings"]
    return timings["fp8"] / timings["plain"] if {"fp8", "plain"} <= timings.keys() else None


def cpu_cost(module: nn.Module) -> str:
    """What fp8 storage costs in time on this CPU, for the report: the module's largest fp8 linear
    and convolution against the plain op on the dequantized weight, on COST_ROWS random rows and a
    COST_PIXELS-square channels-last image."""
    g = torch.Generator().manual_seed(0)
    ratios = {}  # what -> (key, ratio)
    linear = _largest(module, FP8Linear)
    if linear is not None:
        dtype = linear.compute_dtype
        x = torch.randn(COST_ROWS, linear.in_features, generator=g).to(dtype)
        weight, bias = linear.dequantized_weight(), None if linear.bias is None else linear.bias.to(dtype)
        # (the GEMM mode too: weight-only and dynamic fp8 cost differently on one shape)
        key = f"{COST_ROWS}x{linear.in_features}x{linear.out_features} {str(dtype).removeprefix('torch.')} {linear.gemm}"
        ratios["linear"] = key, _cost(linear, x, lambda: F.linear(x, weight, bias), key)
    conv = _largest(module, FP8Conv2d)
    if conv is not None:
        dtype = conv.compute_dtype
        x = torch.randn(2, conv.in_channels, COST_PIXELS, COST_PIXELS, generator=g).to(dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = conv.dequantized_weight().contiguous(memory_format=torch.channels_last)
        bias = None if conv.bias is None else conv.bias.to(dtype)
        plain = functools.partial(F.conv2d, x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        key = (f"2x{conv.in_channels}x{COST_PIXELS}x{COST_PIXELS} -> {conv.out_channels}, "
               f"{'x'.join(map(str, conv.kernel_size))} {str(dtype).removeprefix('torch.')}")
        ratios["convolution"] = key, _cost(conv, x, plain, key)
    measured = {what: kr for what, kr in ratios.items() if kr[1] is not None}
    if not measured:
        return ""
    parts = [f"its largest fp8 {what} ({key}) takes {ratio:.2f}x" for what, (key, ratio) in measured.items()]
    slower = any(ratio > 1.05 for _, ratio in measured.values())
    return (f"; on this CPU {' and '.join(parts)} the time of the plain op on the same weight "
            f"({'slower: fp8 saves memory here, not time' if slower else 'no slower'})")


class FP8(Technique):
    """Store eligible Linear/Conv2d weights in fp8 (pyext.nn.fp8), by role: fp8="denoiser" or "all"."""

    name = "fp8"

    def plan(self, pipe, d) -> list[Step]:
        steps = []
        for name in d.components.modules:
            role = d.components.roles[name]
            if role in FP8_ROLES[d.fp8]:
                steps.append(self.will(name))
            elif role == "vae":
                steps.append(self.wont(name, "VAE weights stay in the compute dtype (small and quality-sensitive)"))
            elif d.fp8 != "off":
                steps.append(self.wont(name, f"fp8={d.fp8!r} does not cover the {role}"))
            else:
                steps.append(self.wont(name, "fp8='off'" if d.options.fp8 == "off"
                                       else f"fp8='auto': plan {d.plan.name} needs none"))
        return steps

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        report = quantize_fp8(module, skip=d.options.fp8_skip, keep_original=d.options.keep_original_weights,
                              gemm=d.fp8_gemm, layers=d.options.fp8_layers)
        if report.converted:
            cost = cpu_cost(module) if d.device.type == "cpu" else ""
            return self.applied(name, f"{report}; GEMM {d.fp8_gemm}: {d.fp8_gemm_reason}{cost}", functools.partial(
                self._undo, module, d.options.keep_original_weights), exact=d.options.keep_original_weights)
        if any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in module.modules()):
            return self.already(name, f"fp8 layers present, none left to convert; GEMM {d.fp8_gemm}")
        kept = "; ".join(f"{n} {why}" for why, n in report.kept_by_reason().items())
        return self.skipped(name, f"no eligible layers ({kept or 'no Linear/Conv2d layers'})")

    @staticmethod
    def _undo(module, exact: bool) -> str:
        # (layers written since (fuse_lora, load_state_dict) or stored anew (fuse_qkv_projections) have no originals)
        exact = exact and all(m.kept_original() is not None for m in module.modules()
                              if isinstance(m, (FP8Linear, FP8Conv2d)))
        n = len(restore_fp8(module))
        return f"{n} fp8 layers back to plain ones ({'exact originals' if exact else 'dequantised: fp8 rounding stays'})"
