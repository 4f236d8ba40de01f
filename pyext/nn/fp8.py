"""FP8Linear / FP8Conv2d: nn.Linear / nn.Conv2d whose weight is stored in fp8 (e4m3).

The layers stay instances of nn.Linear / nn.Conv2d, so diffusers, accelerate and
PEFT still recognise them. The fp8 weight is held as a uint8 view and the fp32
scales as int32 bits: `module.to(torch.bfloat16)` casts floating tensors only, so
neither the codes nor the scales can be destroyed by a dtype cast, while device
moves (offload hooks) move the fp8 bytes: half of what bf16 weights would move.
`compute_dtype` follows the module's dtype casts.
"""
from __future__ import annotations

import contextlib
import contextvars
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pyext import _compat, _state, dispatch
from pyext.dispatch import PyextError
from pyext.ops.fp8 import FP8, call_linear, fp8_quantize, fp8_upcast
from pyext.ops.fp8_conv import upcast_weight

# Names (regexes, searched in the module's qualified name) kept in full precision by
# default: norms, embeddings/modulation and the first and last layers, where fp8
# error shows in images (the same families diffusers' layerwise casting skips); and layers
# whose weight dtype diffusers reads to cast their input or to build new layers (an fp8
# layer's weight holds uint8 codes): IP-Adapter image projections and attention layers,
# and the timestep embedders that read `mlp[0].weight.dtype`.
DEFAULT_SKIP = (
    r"norm", r"time_embed", r"add_embed", r"pos_embed", r"patch_embed", r"x_embedder",
    r"context_embedder", r"time_text_embed", r"class_embed",
    r"^conv_in$", r"^conv_out$", r"^proj_in$", r"^proj_out$",
    r"encoder_hid_proj", r"to_[kv]_ip", r"t_embedder",
)
MIN_NUMEL = 4096  # smaller weights save nothing worth the upcast
STATE = "fp8"  # pyext._state key on a converted model: the rule it was converted by (quantize_fp8's arguments)

# While set, fp8 layers give state_dict() their dequantized weight in the compute dtype (what a
# plain layer holds) instead of their codes and scale bits: what savers for plain models need.
_DENSE_STATE_DICT = contextvars.ContextVar("pyext_fp8_dense_state_dict", default=False)


@contextlib.contextmanager
def dense_state_dict():
    """fp8 layers' state_dict() entries are plain weights (`weight` in the compute dtype, no
    `weight_scale`) inside the block: a model saved so loads as a plain model."""
    token = _DENSE_STATE_DICT.set(True)
    try:
        yield
    finally:
        _DENSE_STATE_DICT.reset(token)


class _FP8Storage:
    """Shared by both layers: fp8 codes + fp32 scales in cast-proof integer buffers."""

    def _store(self, weight: torch.Tensor, per_channel: bool, keep_original: bool) -> None:
        # Codes take no gradient; the plain layer that restore gives back takes the original's flag.
        self.original_requires_grad = weight.requires_grad
        if weight.device.type == "meta":  # a skeleton with the right shapes, filled later by load_state_dict
            codes = torch.empty(weight.shape, dtype=torch.uint8, device="meta")
            scale = torch.empty(weight.shape[0] if per_channel else 1, device="meta")
        else:
            q, scale = fp8_quantize(weight, per_channel)
            codes = q.view(torch.uint8)
        self.compute_dtype = weight.dtype
        self.per_channel = per_channel
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.register_buffer("weight_scale", scale.view(torch.int32))
        self.original_weight = weight.detach().clone().cpu() if keep_original else None

    @property
    def fp8_weight(self) -> torch.Tensor:
        return self.weight.view(FP8)

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale.view(torch.float32)

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        return fp8_upcast(self.fp8_weight, self.scale, dtype or self.compute_dtype)

    def _apply(self, fn, recurse=True):
        # Learn the dtype the cast asks for from a probe tensor, then let the module move.
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        out = super()._apply(fn, recurse)
        # The kernels read dense rows: (out, in) for a linear; for a conv, (out, kh, kw, in)
        # (FP8Conv2d.use_kernel_layout), which the fp8 conv GEMM reads in place, or
        # (out, in, kh, kw) after module.to(memory_format=torch.contiguous_format).
        w = self.weight
        if not (w.is_contiguous() or (w.dim() == 4 and w.is_contiguous(memory_format=torch.channels_last))):
            self.weight.data = w.data.contiguous()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if _DENSE_STATE_DICT.get() and self.weight.device.type != "meta":
            destination[prefix + "weight"] = self.dequantized_weight().contiguous()
            destination.pop(prefix + "weight_scale", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A plain weight (a float `weight`, no `weight_scale`: load_state_dict of a plain model's
        # state) is quantized as the layer's own was; codes and scale bits load as they are.
        weight = state_dict.get(prefix + "weight")
        if (isinstance(weight, torch.Tensor) and weight.is_floating_point() and prefix + "weight_scale" not in state_dict
                and weight.shape == self.weight.shape):
            q, scale = fp8_quantize(weight, self.per_channel)
            codes = q.view(torch.uint8)
            if self.original_weight is not None:  # the kept original is now this weight
                self.original_weight = weight.detach().to("cpu", self.original_weight.dtype, copy=True)
            state_dict[prefix + "weight"] = codes.contiguous(memory_format=torch.channels_last) \
                if self.weight.dim() == 4 and self.weight.is_contiguous(memory_format=torch.channels_last) else codes
            state_dict[prefix + "weight_scale"] = scale.view(torch.int32)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _fp8_extra_repr(self) -> str:
        return f"fp8=e4m3, {'per-channel' if self.per_channel else 'per-tensor'} scale, compute={self.compute_dtype}"


GEMMS = ("weight_only", "dynamic", "measured")


def check_gemm(gemm, what: str = "pyext.quantize_fp8: gemm") -> None:
    if gemm not in GEMMS:
        raise PyextError(f"{what}={gemm!r} is not an fp8 GEMM mode; modes are: {', '.join(map(repr, GEMMS))}")


# (device, dtype, rows bucket, in, out) -> "weight_only" | "dynamic": measured_choice's answer, kept
# here so that a repeated call costs one dict lookup; dropped with dispatch's own choices.
_GEMM_CHOICE: dict[tuple, str] = {}
dispatch.on_forget(_GEMM_CHOICE.clear)


class FP8Linear(_FP8Storage, nn.Linear):
    """gemm: "weight_only" (pyext.ops.fp8_linear: the weight upcast in the GEMM), "dynamic"
    (pyext.ops.fp8_linear_dynamic: activations quantized per row, an fp8 x fp8 GEMM), or
    "measured" (per input shape, the faster of the two, timed on its first call). Layers the
    dynamic GEMM cannot take (not bfloat16, features not multiples of 16) stay weight-only."""

    gemm = "weight_only"

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_channel: bool = True, keep_original: bool = False,
                    gemm: str = "weight_only") -> "FP8Linear":
        check_gemm(gemm)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new._store(linear.weight, per_channel, keep_original)
        new.bias = linear.bias
        new.gemm = gemm
        return new

    def _dynamic(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this call takes the dynamic GEMM (the layer's gemm is not weight_only)."""
        if x.dtype != torch.bfloat16 or self.in_features % 16 or self.out_features % 16:
            return False
        if self.gemm == "dynamic":
            return True
        rows = x.numel() // self.in_features
        key = (x.device, x.dtype, dispatch.bucket_dim(rows), self.in_features, self.out_features)
        choice = _GEMM_CHOICE.get(key)
        if choice is None:
            if not dispatch.can_measure(x.device):  # tracing or capturing: fp8 tensor cores, unmeasured
                return True
            args = (x, self.weight, self.scale, bias, None)
            decision = dispatch.measured_choice(
                "fp8_gemm", str(key[1:]), x.device,
                {"weight_only": lambda: torch.ops.pyext.fp8_linear(*args),
                 "dynamic": lambda: torch.ops.pyext.fp8_linear_dynamic(*args)})
            choice = _GEMM_CHOICE[key] = decision["backend"]
        return choice == "dynamic"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers pass input=
        x = input
        bias = self.bias
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        # The layer's own tensors are valid by construction: skip the public function's
        # checks and the fp8 <-> uint8 view round trip on this hot path.
        op = "fp8_linear_dynamic" if self.gemm != "weight_only" and self._dynamic(x, bias) else "fp8_linear"
        return call_linear(op, x, self.weight, self.scale, bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + self._fp8_extra_repr() + f", gemm={self.gemm}"


class FP8Conv2d(_FP8Storage, nn.Conv2d):
    @classmethod
    def from_conv(cls, conv: nn.Conv2d, per_channel: bool = True, keep_original: bool = False) -> "FP8Conv2d":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
                     "transposed", "output_padding", "groups", "padding_mode"):
            setattr(new, attr, getattr(conv, attr))
        new._reversed_padding_repeated_twice = conv._reversed_padding_repeated_twice
        new._store(conv.weight, per_channel, keep_original)
        new.use_kernel_layout()
        new.bias = conv.bias
        return new

    def use_kernel_layout(self) -> None:
        """Store the codes as (out, kh, kw, in) rows (channels-last strides, shape unchanged), the
        layout the fp8 conv GEMM reads in place, whatever the module's memory format. As with
        any channels-last conv weight, the output is then channels-last even for an NCHW input
        (torch's conv rule), so the layers after it run channels-last too: measured on the SD1.5
        UNet in NCHW, 0.92x the bf16 step with these codes, 1.09x with (out, in, kh, kw) codes,
        which then took the upcast path (the kernel now reorders them on every call). `module.to(memory_format=torch.contiguous_format)` still
        gives (out, in, kh, kw) codes."""
        self.weight.data = self.weight.data.contiguous(memory_format=torch.channels_last)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Conv2d's name: callers pass input=
        x = input
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if isinstance(self.padding, str) or self.padding_mode != "zeros":
            # Padding the op's schema cannot express: torch's conv pads, on the upcast weight.
            return self._conv_forward(x, upcast_weight(self.weight, self.scale, x.dtype), bias)
        # Dispatch chooses: the C++ GEMM that reads the codes in place, or the upcast into a reused
        # buffer and torch's conv (timed on this machine where both can take the input).
        return torch.ops.pyext.fp8_conv2d(x, self.weight, self.scale, bias, self.stride, self.padding,
                                          self.dilation, self.groups, None)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + self._fp8_extra_repr()


@dataclass
class FP8Report:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def kept_by_reason(self) -> dict[str, int]:
        return dict(Counter(self.skipped.values()).most_common())

    def __str__(self) -> str:
        kept = "; ".join(f"{n} {why}" for why, n in self.kept_by_reason().items()) or "none"
        return (f"{len(self.converted)} layers converted, weights {self.bytes_before / 2**20:.1f} MiB -> "
                f"{self.bytes_after / 2**20:.1f} MiB; kept: {kept}")


def skip_patterns(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP) -> tuple[str, ...]:
    """`skip` plus the model's own: diffusers' `_skip_layerwise_casting_patterns` (regexes) and
    the modules its loader keeps in fp32 (whole name components)."""
    kept = [rf"(^|\.){re.escape(m)}(\.|$)" for m in _compat.keep_in_fp32_modules(model, torch.float16)]
    return tuple(dict.fromkeys((*skip, *_compat.skip_layerwise_casting_patterns(model), *kept)))


def layer_rules(model: nn.Module, patterns: tuple[str, ...]):
    """(name, layer, why it stays in full precision or None) for every Linear/Conv2d of the model.
    The one rule shared by the converter and the memory planner (which sees meta models)."""
    # Pipelines read a model's dtype from its first parameter (next(prior.parameters()).dtype
    # in Stable Cascade): the layer holding it keeps a floating weight.
    first = next((n for n, _ in model.named_parameters()), "").rpartition(".")[0]
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            why = "holds the model's first parameter (its dtype is the model's)" if name == first else None
            yield name, module, why or _skip_reason(name, module, patterns)


def _skip_reason(name: str, module: nn.Module, patterns: tuple[str, ...]) -> str | None:
    if type(module) not in (nn.Linear, nn.Conv2d):
        return "already fp8" if isinstance(module, (FP8Linear, FP8Conv2d)) else "not a Linear/Conv2d"
    if _compat.is_peft_adapter_layer(name):
        return "a LoRA adapter layer (PEFT loads, scales and swaps it in place)"
    for pattern in patterns:
        if re.search(pattern, name):
            return f"name matches skip pattern {pattern!r}"
    if module.weight.numel() < MIN_NUMEL:
        return f"weight below {MIN_NUMEL} elements"
    if not module.weight.is_floating_point():
        return f"weight dtype {module.weight.dtype} is not a float to quantize"
    if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
        return f"padding_mode {module.padding_mode!r}"
    return None


def quantize_fp8(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, per_channel: bool = True,
                 keep_original: bool = False, gemm: str = "weight_only") -> FP8Report:
    """Replace the model's nn.Linear / nn.Conv2d layers by fp8-stored ones, in place.

    `skip` holds regexes searched in each layer's qualified name; the model's own skip
    patterns (skip_patterns) are added. `gemm` is the linears' mode (FP8Linear); the model's
    fp8 linears converted before take it too. Returns what was converted, what was kept and
    why, and the weight bytes before and after.
    """
    from pyext.nn import fp8_methods

    check_gemm(gemm)
    report = FP8Report()
    patterns = skip_patterns(model, skip)
    for name, module, reason in list(layer_rules(model, patterns)):
        if reason is None and module.weight.device.type == "meta":
            reason = "weight is on the meta device (not loaded)"
        if reason:
            report.skipped[name] = reason
            continue
        report.bytes_before += module.weight.numel() * module.weight.element_size()
        new = (FP8Linear.from_linear(module, per_channel, keep_original, gemm) if isinstance(module, nn.Linear)
               else FP8Conv2d.from_conv(module, per_channel, keep_original))
        report.bytes_after += new.weight.numel() + new.weight_scale.numel() * 4
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        report.converted.append(name)
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.gemm = gemm
    if report.converted or any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in model.modules()):
        _state.put(model, STATE, dict(skip=tuple(skip), per_channel=per_channel, keep_original=keep_original,
                                      gemm=gemm))
        fp8_methods.install(model)
    return report


def restore_fp8(model: nn.Module) -> list[str]:
    """Turn fp8 layers back into plain ones: exact where the originals were kept, else dequantised."""
    from pyext.nn import fp8_methods

    restored = restore_layers(model, lambda name, module: True)
    _state.pop(model, STATE)
    fp8_methods.remove(model)
    return restored


def plain_layer(module: nn.Module, original: bool = True) -> nn.Module:
    """The plain nn.Linear / nn.Conv2d an fp8 layer stands for: its kept original weight (if
    `original` and kept), else the dequantized one, in the compute dtype, where the codes are."""
    weight = module.original_weight if original and module.original_weight is not None \
        else module.dequantized_weight()
    weight = weight.to(device=module.weight.device, dtype=module.compute_dtype)
    if isinstance(module, FP8Linear):
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    else:
        plain = nn.Conv2d(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                          module.padding, module.dilation, module.groups, module.bias is not None,
                          module.padding_mode, device="meta")
    plain.weight = nn.Parameter(weight.detach(), requires_grad=getattr(module, "original_requires_grad", True))
    plain.bias = module.bias
    return plain


def restore_layers(model: nn.Module, select, original: bool = True) -> list[str]:
    """Replace the fp8 layers for which select(name, layer) holds by plain_layer(layer, original)."""
    restored = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (FP8Linear, FP8Conv2d)) and select(name, module):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain_layer(module, original))
            restored.append(name)
    return restored
