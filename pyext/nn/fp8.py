"""FP8Linear / FP8Conv2d: nn.Linear / nn.Conv2d whose weight is stored in fp8 (e4m3).

The layers stay instances of nn.Linear / nn.Conv2d, so diffusers, accelerate and PEFT still
recognise them. Their weight is an FP8Weight: one byte per weight plus its scales, read as its
values by everything but pyext's kernels (reads, arithmetic, state_dict, copies, `to()`, deepcopy,
pickling), and quantized again when written (copy_, load_state_dict, PEFT's merges). A dtype cast
of the module changes the compute dtype and keeps the codes; device moves (offload hooks) move the
fp8 bytes: half of what bf16 weights would move.
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
from pyext.nn.stored import StoredWeight, probe_like
from pyext.ops.fp8 import COMPUTE_DTYPES, FP8, call_linear, fp8_quantize, fp8_upcast
from pyext.ops.fp8_conv import upcast_weight

# Names with "norm", but for a norm's modulation linear (adaptive norms' `norm*.linear`: the shift,
# scale and gate computed from the timestep). Norms hold no Linear/Conv2d of their own; diffusers'
# layerwise casting skips every "norm" name because its cast has no scale, while per-channel scales
# keep the modulation linears' precision, and they hold about a quarter of Flux's and SD3's weights.
NORM_BUT_MODULATION = r"norm(?![^.]*\.linear$)"

# Names (regexes, searched in the module's qualified name) kept in full precision by
# default: embeddings and the first and last layers, where fp8 error shows in images (the
# families diffusers' layerwise casting skips); and the small layers that condition every token
# on an image or a timestep: IP-Adapter image projections and attention layers, timestep embedders.
DEFAULT_SKIP = (
    NORM_BUT_MODULATION, r"time_embed", r"add_embed", r"pos_embed", r"patch_embed", r"x_embedder",
    r"context_embedder", r"time_text_embed", r"class_embed",
    r"^conv_in$", r"^conv_out$", r"^proj_in$", r"^proj_out$",
    r"encoder_hid_proj", r"to_[kv]_ip", r"t_embedder",
)
# The layer kinds fp8 may store (optimize's fp8_layers): convolutions too, or linears only, as
# torchao's and diffusers' quantization guides do. A UNet's convolutions hold a third to a half
# of its weights, and their rounding shows more in images than its linears' (docs/benchmarks.md).
LAYER_KINDS = {"linear+conv": (nn.Linear, nn.Conv2d), "linear": (nn.Linear,)}
MIN_NUMEL = 4096  # smaller weights save nothing worth the upcast
STATE = "fp8"  # pyext._state key on a converted model: the rule it was converted by (quantize_fp8's arguments)

# The form fp8 layers give state_dict() their weight in: "values" (the FP8Weight, which reads as its
# values and keeps its fp8 storage: what offload and model copies take), "dense" (a plain tensor of
# the values in the compute dtype: what savers of plain models need) or "codes" (uint8 codes plus
# `weight_scale`, the scales' int32 bits: what pyext.checkpoint saves).
_STATE_DICT_FORM = contextvars.ContextVar("pyext_fp8_state_dict_form", default="values")


@contextlib.contextmanager
def state_dict_form(form: str):
    """fp8 layers' state_dict() entries take `form` ("dense" or "codes", see _STATE_DICT_FORM) inside the block."""
    token = _STATE_DICT_FORM.set(form)
    try:
        yield
    finally:
        _STATE_DICT_FORM.reset(token)


def dense_state_dict():
    """fp8 layers' state_dict() entries are plain weights (`weight` in the compute dtype) inside the
    block: a model saved so loads as a plain model."""
    return state_dict_form("dense")


class FP8Weight(StoredWeight):
    """A weight stored as e4m3 codes (uint8, the weight's shape and strides) and fp32 scales (one per
    output channel, or one), which reads as `codes * scale` in its dtype (the layer's compute dtype):
    one byte per weight, and no dense copy kept (pyext.nn.stored). A dtype cast among the compute
    dtypes or a device move keeps the fp8 storage; writes quantize the new values by the same rule."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, writes: list | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, strides=codes.stride(), dtype=dtype,
                                                   device=codes.device, requires_grad=False)

    def __init__(self, codes, scale, dtype, writes=None):
        self.codes, self.scale = codes, scale
        self.writes = writes if writes is not None else [0]  # stores so far; shared by aliases and moves

    @classmethod
    def quantize(cls, weight: torch.Tensor, per_channel: bool) -> "FP8Weight":
        weight = weight.detach()
        if weight.device.type == "meta":  # a skeleton with the right shapes, filled later by load_state_dict
            codes = torch.empty_strided(weight.shape, weight.stride(), dtype=torch.uint8, device="meta")
            return cls(codes, torch.empty(weight.shape[0] if per_channel else 1, device="meta"), weight.dtype)
        q, scale = fp8_quantize(weight, per_channel)
        codes = torch.empty_strided(weight.shape, weight.stride(), dtype=torch.uint8, device=weight.device)
        return cls(codes.copy_(q.view(torch.uint8)), scale, weight.dtype)

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1 or self.shape[0] == 1

    def values(self) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
        return fp8_upcast(self.codes.view(FP8), self.scale, self.dtype)

    def store(self, values: torch.Tensor) -> None:
        if values.shape != self.shape:
            raise PyextError(f"pyext: storing a {tuple(values.shape)} tensor in a {tuple(self.shape)} fp8 weight")
        q, scale = fp8_quantize(values.detach().to(self.device), self.per_channel)
        self.codes.copy_(q.view(torch.uint8))
        self.scale.copy_(scale.reshape(self.scale.shape))
        self.writes[0] += 1

    def alias(self) -> "FP8Weight":
        return FP8Weight(self.codes, self.scale, self.dtype, self.writes)

    def adopt(self, other: "FP8Weight") -> None:
        self.codes, self.scale, self.writes = other.codes, other.scale, other.writes

    def own_op(self, func, args, kwargs):
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", self.dtype) == self.dtype:
            # A move (what offload and accelerate ask of a weight): the same codes, where they are asked
            # to be. A cast gives the values in the new dtype, as a plain weight's would; the layers'
            # own casts (module.to(dtype)) change their compute dtype instead (_FP8Storage._apply).
            return self.moved(kwargs.get("device"), kwargs.get("memory_format"), kwargs.get("non_blocking", False))
        if func is torch.ops.aten.copy_.default and isinstance(args[1], FP8Weight) \
                and args[1].shape == self.shape and args[1].scale.shape == self.scale.shape:
            self.codes.copy_(args[1].codes)  # another fp8 weight of the same layout: exact
            self.scale.copy_(args[1].scale)
            self.writes[0] += 1
            return self
        return NotImplemented

    def moved(self, device=None, memory_format=None, non_blocking: bool = False, dtype=None) -> "FP8Weight":
        """The same weight on `device` (codes in `memory_format`), read as `dtype`."""
        codes = self.codes.to(device=device, non_blocking=non_blocking,
                              memory_format=memory_format or torch.preserve_format)
        scale = self.scale.to(device=codes.device, non_blocking=non_blocking)
        return FP8Weight(codes, scale, dtype or self.dtype, self.writes)

    def stored_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale

    def __deepcopy__(self, memo):
        copy = FP8Weight(self.codes.clone(), self.scale.clone(), self.dtype)
        copy.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):  # a Parameter: stays one in the copied module
            copy._is_param = True
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        return (_rebuild_fp8_weight, (self.codes, self.scale, self.dtype, self.requires_grad,
                                      getattr(self, "_is_param", False)))

    def __repr__(self) -> str:
        kind = "per-channel" if self.per_channel else "per-tensor"
        return f"FP8Weight({tuple(self.shape)}, e4m3 codes, {kind} scale, reads as {self.dtype}, {self.device})"


def _rebuild_fp8_weight(codes, scale, dtype, requires_grad, is_param):
    weight = FP8Weight(codes, scale, dtype)
    return nn.Parameter(weight, requires_grad) if is_param else weight.requires_grad_(requires_grad)


# torch.load's default (weights_only) unpickles only what is allowed: a state dict saved with
# torch.save holds fp8 weights, which this function rebuilds from plain tensors.
torch.serialization.add_safe_globals([_rebuild_fp8_weight])


class _FP8Storage:
    """Shared by both layers: the weight is an FP8Weight Parameter. A weight assigned since that is
    not (a plain tensor) is used as it is, by torch's own layer."""

    def _store(self, weight: torch.Tensor, per_channel: bool, keep_original: bool) -> None:
        # fp8 weights take no gradient; the plain layer that restore gives back takes the original's flag.
        self.original_requires_grad = weight.requires_grad
        self.per_channel = per_channel
        self.weight = nn.Parameter(FP8Weight.quantize(weight, per_channel), requires_grad=False)
        self._keep(weight.detach().clone().cpu() if keep_original else None)

    def _keep(self, original: torch.Tensor | None) -> None:
        """Keep `original` as what the stored weight stands for, until the next write into it."""
        self.original_weight = original
        self._original_of = (self.weight.writes, self.weight.writes[0]) if isinstance(self.weight, FP8Weight) else None

    def kept_original(self) -> torch.Tensor | None:
        """The original weight, if kept and nothing has been written into the fp8 weight since."""
        of = self._original_of
        stored = isinstance(self.weight, FP8Weight) and of is not None and self.weight.writes is of[0] \
            and self.weight.writes[0] == of[1]
        return self.original_weight if stored else None

    def _stored(self, x: torch.Tensor) -> FP8Weight | None:
        """The fp8 weight for pyext's kernels; None where torch's own op runs on the weight's values:
        a plain weight assigned since, or a call autograd records (adapters trained over frozen fp8
        layers, a trained fp8 weight), since pyext's fp8 ops have no backward."""
        w = self.weight
        if not isinstance(w, FP8Weight):
            return None
        recorded = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        return None if recorded else w

    def _apply(self, fn, recurse=True):
        # A cast (module.to(dtype), .half()) sets the compute dtype and keeps the codes; a move moves
        # them. What fn does to the weight is learnt from a probe shaped and laid out like it.
        w = self.weight
        if not isinstance(w, FP8Weight):
            return super()._apply(fn, recurse)
        probe = probe_like(w)
        out = fn(probe)
        del self._parameters["weight"]
        try:
            result = super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = w
        if out is not probe:
            layout = torch.channels_last if _compat.is_channels_last(out) else torch.contiguous_format
            dtype = out.dtype if out.dtype in COMPUTE_DTYPES else w.dtype
            w.data = w.moved(out.device, layout if w.dim() == 4 else None, dtype=dtype)
        return result

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def fp8_weight(self) -> torch.Tensor:
        return self.weight.codes.view(FP8)

    @property
    def scale(self) -> torch.Tensor:
        return self.weight.scale

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        return fp8_upcast(self.fp8_weight, self.scale, dtype or self.compute_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w, form = self.weight, _STATE_DICT_FORM.get()
        if not isinstance(w, FP8Weight) or w.device.type == "meta" or form == "values":
            return
        if form == "dense":
            destination[prefix + "weight"] = w.values().contiguous()
        else:  # safetensors takes contiguous tensors only
            destination[prefix + "weight"] = w.codes.contiguous()
            destination[prefix + "weight_scale"] = w.scale.view(torch.int32)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Codes and scale bits (pyext.checkpoint's form) load as they are; a plain float weight is
        # quantized by the weight's copy_, and becomes the kept original.
        weight, bits = state_dict.get(prefix + "weight"), state_dict.pop(prefix + "weight_scale", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8 and isinstance(bits, torch.Tensor):
            state_dict[prefix + "weight"] = FP8Weight(weight, bits.view(torch.float32), self.compute_dtype)
        original = isinstance(weight, torch.Tensor) and not isinstance(weight, FP8Weight) \
            and weight.is_floating_point() and weight.shape == self.weight.shape and self.original_weight is not None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if original:
            self._keep(weight.detach().to("cpu", self.original_weight.dtype, copy=True))

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
            args = (x, self.weight.codes, self.weight.scale, bias, None)
            decision = dispatch.measured_choice(
                "fp8_gemm", str(key[1:]), x.device,
                {"weight_only": lambda: torch.ops.pyext.fp8_linear(*args),
                 "dynamic": lambda: torch.ops.pyext.fp8_linear_dynamic(*args)})
            choice = _GEMM_CHOICE[key] = decision["backend"]
        return choice == "dynamic"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: callers pass input=
        w = self._stored(input)
        if w is None:
            return nn.Linear.forward(self, input)
        x = input
        bias = self.bias
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        # The layer's own tensors are valid by construction: skip the public function's
        # checks and the fp8 <-> uint8 view round trip on this hot path.
        op = "fp8_linear_dynamic" if self.gemm != "weight_only" and self._dynamic(x, bias) else "fp8_linear"
        return _with_bias_grad(call_linear(op, x, w.codes, w.scale, _detached(bias)), bias, -1)

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
        """Store the codes as (out, kh, kw, in) rows (channels-last strides, shape unchanged, a 1x1's
        too), the layout the fp8 conv GEMM reads in place, whatever the module's memory format. As
        with any channels-last conv weight, the output is then channels-last even for an NCHW input
        (torch's conv rule), so the layers after it run channels-last too, without a reorder per
        layer. `module.to(memory_format=torch.contiguous_format)` still gives (out, in, kh, kw) codes."""
        w = self.weight
        if isinstance(w, FP8Weight):
            w.data = FP8Weight(w.codes.to(memory_format=torch.channels_last), w.scale, w.dtype, w.writes)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Conv2d's name: callers pass input=
        w = self._stored(input)
        if w is None:
            return nn.Conv2d.forward(self, input)
        x = input
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if isinstance(self.padding, str) or self.padding_mode != "zeros":
            # Padding the op's schema cannot express: torch's conv pads, on the upcast weight.
            return self._conv_forward(x, upcast_weight(w.codes, w.scale, x.dtype), bias)
        # Dispatch chooses: the C++ GEMM that reads the codes in place, or the upcast into a reused
        # buffer and torch's conv (timed on this machine where both can take the input).
        y = torch.ops.pyext.fp8_conv2d(x, w.codes, w.scale, _detached(bias), self.stride, self.padding,
                                       self.dilation, self.groups, None)
        return _with_bias_grad(y, bias, 1)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + self._fp8_extra_repr()


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias for a kernel: detached only where autograd records (no alias made per call otherwise)."""
    return bias.detach() if bias is not None and bias.requires_grad and torch.is_grad_enabled() else bias


def _with_bias_grad(y: torch.Tensor, bias: torch.Tensor | None, channel_dim: int) -> torch.Tensor:
    """y, which a kernel computed with the bias detached (pyext's fp8 ops record no autograd graph),
    plus a zero made of the bias where autograd records: the bias gets a plain layer's gradient,
    and y's values stay those of the fused epilogue."""
    if bias is None or not (bias.requires_grad and torch.is_grad_enabled()):
        return y
    zero = bias - bias.detach()
    return y + (zero if channel_dim == -1 else zero.view(-1, *[1] * (y.dim() - 2)))


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
    """`skip` plus the model's own: diffusers' `_skip_layerwise_casting_patterns` (regexes; their
    "norm" as NORM_BUT_MODULATION) and the modules its loader keeps in fp32 (whole name components)."""
    kept = [rf"(^|\.){re.escape(m)}(\.|$)" for m in _compat.keep_in_fp32_modules(model, torch.float16)]
    own = [NORM_BUT_MODULATION if p == "norm" else p for p in _compat.skip_layerwise_casting_patterns(model)]
    return tuple(dict.fromkeys((*skip, *own, *kept)))


def check_layers(layers: str) -> None:
    if layers not in LAYER_KINDS:
        raise PyextError(f"fp8: layers={layers!r} is not a layer choice; choices: {', '.join(map(repr, LAYER_KINDS))}")


def layer_rules(model: nn.Module, patterns: tuple[str, ...], layers: str = "linear+conv"):
    """(name, layer, why it stays in full precision or None) for every Linear/Conv2d of the model;
    `layers` names the kinds converted (LAYER_KINDS). The one rule shared by the converter and the
    memory planner (which sees meta models)."""
    # Pipelines read a model's dtype from its first parameter (next(prior.parameters()).dtype
    # in Stable Cascade): the layer holding it keeps a floating weight.
    first = next((n for n, _ in model.named_parameters()), "").rpartition(".")[0]
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            why = "holds the model's first parameter (its dtype is the model's)" if name == first else None
            yield name, module, why or _skip_reason(name, module, patterns, layers)


def _skip_reason(name: str, module: nn.Module, patterns: tuple[str, ...], layers: str) -> str | None:
    if type(module) not in (nn.Linear, nn.Conv2d):
        return "already fp8" if isinstance(module, (FP8Linear, FP8Conv2d)) else "not a Linear/Conv2d"
    if type(module) not in LAYER_KINDS[layers]:
        return f"a {type(module).__name__} (layers {layers!r})"
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
                 keep_original: bool = False, gemm: str = "weight_only", layers: str = "linear+conv") -> FP8Report:
    """Replace the model's nn.Linear / nn.Conv2d layers by fp8-stored ones, in place.

    `skip` holds regexes searched in each layer's qualified name; the model's own skip
    patterns (skip_patterns) are added. `layers`: the kinds converted, "linear+conv" or
    "linear" (LAYER_KINDS). `gemm` is the linears' mode (FP8Linear); the model's
    fp8 linears converted before take it too. Returns what was converted, what was kept and
    why, and the weight bytes before and after.
    """
    from pyext.nn import fp8_methods

    check_gemm(gemm)
    check_layers(layers)
    report = FP8Report()
    patterns = skip_patterns(model, skip)
    for name, module, reason in list(layer_rules(model, patterns, layers)):
        if reason is None and module.weight.device.type == "meta":
            reason = "weight is on the meta device (not loaded)"
        if reason:
            report.skipped[name] = reason
            continue
        report.bytes_before += module.weight.numel() * module.weight.element_size()
        new = (FP8Linear.from_linear(module, per_channel, keep_original, gemm) if isinstance(module, nn.Linear)
               else FP8Conv2d.from_conv(module, per_channel, keep_original))
        report.bytes_after += new.weight.stored_bytes()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        report.converted.append(name)
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.gemm = gemm
    if report.converted or any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in model.modules()):
        _state.put(model, STATE, dict(skip=tuple(skip), per_channel=per_channel, keep_original=keep_original,
                                      gemm=gemm, layers=layers))
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
    kept = module.kept_original() if original else None
    weight = kept if kept is not None else module.dequantized_weight()
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
