"""Offload modes of a pipeline: detect, suspend while pyext changes modules, re-enable.

accelerate's hooks (model / sequential offload) and diffusers' group-offload hooks
hold references to the tensors they move; sequential offload even keeps weights on
the meta device. Changing layers under them breaks them, so `suspended(pipe)`
removes them (restoring real weights), lets the caller change the modules, then
re-enables the same mode with the same settings. This is what lets offload be
enabled before or after `pyext.optimize`, in either order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.nn as nn


@dataclass
class OffloadState:
    mode: str  # "none" | "model" | "sequential" | "group" | "device_map"
    device: object = None
    group_configs: dict = field(default_factory=dict)  # component -> diffusers GroupOffloadingConfig


def _modules(pipe) -> dict[str, nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, nn.Module)}


def detect(pipe) -> OffloadState:
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    if getattr(pipe, "hf_device_map", None):
        return OffloadState("device_map")
    groups = {}
    for name, module in _modules(pipe).items():
        # block level hooks the top module's blocks, leaf level every leaf: look at all of them
        for sub in module.modules():
            hook = sub._diffusers_hook.get_hook(_GROUP_OFFLOADING) if hasattr(sub, "_diffusers_hook") else None
            if hook is not None:
                groups[name] = hook.config
                break
    if groups:
        return OffloadState("group", group_configs=groups)
    if any(hasattr(m, "_hf_hook") for m in _modules(pipe).values()):
        mode = "model" if getattr(pipe, "_all_hooks", None) else "sequential"
        return OffloadState(mode, device=getattr(pipe, "_offload_device", None))
    return OffloadState("none")


def remove(pipe, state: OffloadState) -> None:
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING,
    )

    if state.mode in ("model", "sequential"):
        pipe.remove_all_hooks()  # detaching accelerate's hooks puts offloaded weights back in place
    elif state.mode == "group":
        for name in state.group_configs:
            module = pipe.components[name]
            # Bring every group's weights back to where they are stored, then drop the hooks.
            for hook_name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                HookRegistry.check_if_exists_or_initialize(module).remove_hook(hook_name, recurse=True)


def enable(pipe, state: OffloadState) -> None:
    from diffusers.hooks.group_offloading import _apply_group_offloading

    if state.mode == "model":
        pipe.enable_model_cpu_offload(device=state.device)
    elif state.mode == "sequential":
        pipe.enable_sequential_cpu_offload(device=state.device)
    elif state.mode == "group":
        for name, config in state.group_configs.items():
            _apply_group_offloading(pipe.components[name], config)


@contextlib.contextmanager
def suspended(pipe):
    """Offload hooks removed inside the block, the same mode re-enabled after it."""
    state = detect(pipe)
    if state.mode in ("none", "device_map"):
        yield state
        return
    remove(pipe, state)
    try:
        yield state
    finally:
        enable(pipe, state)
