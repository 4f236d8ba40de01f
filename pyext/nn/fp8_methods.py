"""Methods of diffusers and transformers models that an fp8 weight (pyext.nn.fp8.FP8Weight) cannot
serve by reading as its values, replaced on each converted model's instance (undone by restore):
- save_pretrained writes each fp8 layer's weight as a plain tensor of its values in the compute
  dtype (safetensors takes plain tensors only), so plain diffusers or transformers loads the
  directory into the same model; `pyext.checkpoint.save_pretrained` keeps the fp8 codes instead.
- fuse_qkv_projections builds the fused layers from the values of q, k and v; after the call the
  model's eligible layers, the fused ones included, are stored in fp8 by the rule it was converted by.
- requires_grad_(True) raises a PyextError before any parameter changes: an optimizer's step on an
  fp8 weight is rounded back to fp8, so small updates would be lost without a word.
"""
from __future__ import annotations

import functools

import torch.nn as nn

from pyext import _state
from pyext.dispatch import PyextError

STATE = "fp8_methods"  # pyext._state key: the methods install replaced (_state.replace_attributes)


def _save_pretrained(method, model, *args, **kwargs):
    from pyext.nn.fp8 import dense_state_dict

    with dense_state_dict():
        return method(*args, **kwargs)


def _quantize_new_layers(method, model, *args, **kwargs):
    from pyext.nn.fp8 import STATE as CONVERTED, quantize_fp8

    out = method(*args, **kwargs)
    rule = _state.get(model, CONVERTED)
    quantize_fp8(model, skip=rule["skip"], per_channel=rule["per_channel"], keep_original=False,
                 gemm=rule.get("gemm", "weight_only"), layers=rule.get("layers", "linear+conv"))
    return out


def _requires_grad_(method, model, requires_grad: bool = True):
    from pyext.nn.fp8 import FP8Conv2d, FP8Linear

    layers = [name for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Conv2d))] \
        if requires_grad else []
    if layers:
        raise PyextError(
            f"pyext: {type(model).__name__}.requires_grad_(True): {len(layers)} layers ({layers[0]}, ...) store "
            "their weights in fp8 (pyext.optimize's fp8 option, or pyext.quantize_fp8), which does not train: each "
            "optimizer step would be rounded back to fp8. To train, optimize with fp8=\"off\", or call "
            "pyext.restore(pipe) (or pyext.restore_fp8(model)) first: the exact weights back with "
            "keep_original_weights=True, else the dequantized ones")
    return method(requires_grad)


WRAPPERS = {
    "requires_grad_": _requires_grad_,
    "save_pretrained": _save_pretrained,
    "fuse_qkv_projections": _quantize_new_layers,
}


def install(model: nn.Module) -> None:
    """Replace the model's methods named in WRAPPERS (those it has) on the instance; idempotent."""
    if _state.get(model, STATE) is not None:
        return
    _state.replace_attributes(model, STATE, {name: functools.partial(wrapper, getattr(model, name), model)
                                             for name, wrapper in WRAPPERS.items()
                                             if callable(getattr(model, name, None))})


def remove(model: nn.Module) -> None:
    """Give the model back the methods install replaced (unless something replaced them since)."""
    _state.restore_attributes(model, STATE)
