"""Save an fp8-stored model in safetensors shards and load it back without re-quantizing.

The fp8 codes (uint8) and scale bits (int32) are ordinary state-dict tensors, so
diffusers' `save_pretrained` shards them as it does any weight; a small
`pyext_fp8.json` beside the shards names the fp8 layers, so loading can rebuild
those layers before the saved tensors are assigned to them.
"""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.nn as nn

from pyext.nn.fp8 import FP8Conv2d, FP8Linear

MANIFEST = "pyext_fp8.json"


def save_pretrained(model: nn.Module, path: str, max_shard_size: str | int = "5GB", **kwargs) -> list[str]:
    """model.save_pretrained(path, max_shard_size=...) plus the list of fp8 layers; returns their names."""
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True, **kwargs)
    layers = {name: {"per_channel": m.per_channel, "compute_dtype": str(m.compute_dtype).removeprefix("torch.")}
              for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Conv2d))}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"format": 1, "layers": layers}, f, indent=1)
    return list(layers)


def _empty_fp8(module: nn.Module, per_channel: bool, dtype: torch.dtype) -> nn.Module:
    """An fp8 layer shaped like `module` with meta storage, filled by load_state_dict(assign=True)."""
    module = module.to(dtype)
    new = FP8Linear.from_linear(module, per_channel) if isinstance(module, nn.Linear) \
        else FP8Conv2d.from_conv(module, per_channel)
    return new


def from_pretrained(cls, path: str, device: str | torch.device = "cpu") -> nn.Module:
    """Load a model saved by `save_pretrained`: fp8 layers come back as saved (no re-quantization)."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    with open(os.path.join(path, MANIFEST)) as f:
        layers = json.load(f)["layers"]
    with init_empty_weights():
        model = cls.from_config(cls.load_config(path))
    for name, spec in layers.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, _empty_fp8(getattr(owner, child), spec["per_channel"],
                                         getattr(torch, spec["compute_dtype"])))
    state = {}
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(shard, device=str(device)))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"pyext.checkpoint.from_pretrained: {path} does not match {cls.__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for m in model.modules():
        if isinstance(m, FP8Conv2d):
            m.use_kernel_layout()  # safetensors stores contiguous tensors
    return model.eval()
