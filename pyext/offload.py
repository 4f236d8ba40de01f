"""Offload modes of a pipeline: detect, suspend while pyext changes modules, re-enable.

accelerate's hooks (model / sequential offload) and diffusers' group-offload hooks hold
references to the tensors they move; sequential offload even keeps weights on the meta
device. Changing layers under them breaks them, so `suspended(pipe)` removes them
(restoring real weights), lets the caller change the modules, then re-enables the same mode
with the same settings through diffusers' own APIs. This is what lets offload be enabled
before or after `pyext.optimize`, in either order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.nn as nn

from pyext import _compat
from pyext.families import modules_of


@dataclass
class OffloadState:
    mode: str  # "off" | "model" | "sequential" | "group" | "device_map"
    device: object = None
    group_configs: dict = field(default_factory=dict)  # component -> diffusers GroupOffloadingConfig


def detect(pipe) -> OffloadState:
    if getattr(pipe, "hf_device_map", None):
        return OffloadState("device_map")
    groups = {name: config for name, module in modules_of(pipe).items()
              if (config := _compat.group_offload_config(module)) is not None}
    if groups:
        return OffloadState("group", group_configs=groups)
    if any(_compat.has_accelerate_hook(m) for m in modules_of(pipe).values()):
        mode = "model" if _compat.pipeline_model_hooks(pipe) else "sequential"
        return OffloadState(mode, device=_compat.pipeline_offload_device(pipe))
    return OffloadState("off")


def enable(pipe, mode: str, device, modules: dict[str, nn.Module] | None = None) -> None:
    """Turn on one offload mode with diffusers' own APIs (group: block level, every module)."""
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif mode == "group":
        from diffusers.hooks import apply_group_offloading

        for module in (modules or modules_of(pipe)).values():
            apply_group_offloading(module, onload_device=device, offload_device="cpu", offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=device.type == "cuda")


def remove(pipe, state: OffloadState) -> None:
    if state.mode in ("model", "sequential"):
        pipe.remove_all_hooks()  # detaching accelerate's hooks puts offloaded weights back in place
    elif state.mode == "group":
        for name in state.group_configs:
            _compat.remove_group_offload(pipe.components[name])


def restore(pipe, state: OffloadState) -> None:
    """Re-enable what `detect` saw, with the same settings."""
    if state.mode in ("model", "sequential"):
        enable(pipe, state.mode, state.device)
    elif state.mode == "group":
        for name, config in state.group_configs.items():
            _compat.apply_group_offload(pipe.components[name], config)


@contextlib.contextmanager
def suspended(pipe):
    """Offload hooks removed inside the block, the same mode re-enabled after it."""
    state = detect(pipe)
    if state.mode in ("off", "device_map"):
        yield state
        return
    remove(pipe, state)
    try:
        yield state
    finally:
        restore(pipe, state)
