"""Methods of diffusers, transformers and PEFT that read or write weights as numbers, on models
(and pipelines) whose layers store fp8 codes.

An fp8 layer's `weight` holds uint8 codes (pyext.nn.fp8): a method that reads it as a number or
adds to it would misread or corrupt it. On each converted model, and on a pipeline holding one,
pyext replaces these methods on the instance only (undone by restore):
- save_pretrained writes each fp8 layer's dequantized weight in the compute dtype (the values
  the layer computes with), so plain diffusers or transformers loads the directory into the
  same model; `pyext.checkpoint.save_pretrained` keeps the fp8 codes instead.
- fuse_lora / unfuse_lora (PEFT adds or subtracts each adapter's delta to its base layer's
  weight) and fuse_qkv_projections (concatenates the q, k, v weights) run with the layers they
  touch dequantized; after the call the model's eligible layers are stored in fp8 again, by the
  rule it was converted by, the fused ones included. The layers they touch are briefly held in
  the compute dtype.
- requires_grad_(True) raises a PyextError before any parameter changes: fp8 codes do not train,
  and torch's own error (uint8 cannot require grad) names neither pyext nor the way out.
"""
from __future__ import annotations

import contextlib
import functools

import torch.nn as nn

from pyext import _state
from pyext.dispatch import PyextError

STATE = "fp8_methods"  # pyext._state key: the methods install replaced (_state.replace_attributes)
_QKV = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}


def _models(obj) -> list[nn.Module]:
    """The converted models of a pipeline (its components), or the model itself."""
    from pyext.nn.fp8 import STATE as CONVERTED

    if isinstance(obj, nn.Module):
        return [obj]
    components = getattr(obj, "components", None) or {}
    return [m for m in components.values() if isinstance(m, nn.Module) and _state.get(m, CONVERTED) is not None]


@contextlib.contextmanager
def _plain(obj, select):
    """The fp8 layers of obj's models for which select(name) holds are plain (dequantized) inside the
    block; after it, each model's eligible layers are converted again by its own rule."""
    from pyext.nn.fp8 import STATE as CONVERTED, quantize_fp8, restore_layers

    touched = [m for m in _models(obj) if restore_layers(m, lambda name, layer: select(name), original=False)]
    try:
        yield
    finally:
        for model in touched:  # (no originals: they no longer describe the layers the call changed)
            rule = _state.get(model, CONVERTED)
            quantize_fp8(model, skip=rule["skip"], per_channel=rule["per_channel"], keep_original=False,
                         gemm=rule.get("gemm", "weight_only"))
            _state.put(model, CONVERTED, rule)


def _save_pretrained(method, obj, *args, **kwargs):
    from pyext.nn.fp8 import dense_state_dict

    with dense_state_dict():
        return method(*args, **kwargs)


def _lora_base(name: str) -> bool:
    return name.rpartition(".")[2] == "base_layer"  # PEFT's tuner layers keep the wrapped layer there


def _qkv(name: str) -> bool:
    return name.rpartition(".")[2] in _QKV


def _run_on_plain(select, method, obj, *args, **kwargs):
    with _plain(obj, select):
        return method(*args, **kwargs)


def _requires_grad_(method, obj, requires_grad: bool = True):
    from pyext.nn.fp8 import FP8Conv2d, FP8Linear

    layers = [name for name, m in obj.named_modules() if isinstance(m, (FP8Linear, FP8Conv2d))] if requires_grad else []
    if layers:
        raise PyextError(
            f"pyext: {type(obj).__name__}.requires_grad_(True): {len(layers)} layers ({layers[0]}, ...) store "
            "their weights as fp8 codes (pyext.optimize's fp8 option, or pyext.quantize_fp8), which do not train. "
            "To train, optimize with fp8=\"off\", or call pyext.restore(pipe) (or pyext.restore_fp8(model)) first: "
            "the exact weights back with keep_original_weights=True, else the dequantized ones")
    return method(requires_grad)


WRAPPERS = {
    "requires_grad_": _requires_grad_,
    "save_pretrained": _save_pretrained,
    "fuse_lora": functools.partial(_run_on_plain, _lora_base),
    "unfuse_lora": functools.partial(_run_on_plain, _lora_base),
    "fuse_qkv_projections": functools.partial(_run_on_plain, _qkv),
}


def install(obj) -> None:
    """Replace obj's methods named in WRAPPERS (those it has) on the instance; idempotent."""
    if _state.get(obj, STATE) is not None:
        return
    _state.replace_attributes(obj, STATE, {name: functools.partial(wrapper, getattr(obj, name), obj)
                                           for name, wrapper in WRAPPERS.items() if callable(getattr(obj, name, None))})


def remove(obj) -> None:
    """Give obj back the methods install replaced (unless something replaced them since)."""
    _state.restore_attributes(obj, STATE)
