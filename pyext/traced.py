"""The UNet traced with torch.jit.trace, as diffusers' memory guide does ("traced UNet" row).

A trace bakes the example's shapes and shape-dependent control flow into the graph,
so running it on other shapes could be silently wrong. TracedUNet therefore traces
lazily, once per exact input signature (shapes, dtypes, devices) on the first call
that has it, keeps a few such graphs, and runs the eager UNet for anything else
(extra conditioning, more signatures than it keeps).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from pyext import _compat
from pyext._memory import release_freed_memory

MAX_GRAPHS = 4  # each graph holds references to the weights, not copies: cheap to keep a few


def trace_reason(unet: nn.Module, offload_mode: str) -> str | None:
    """Why this UNet (of a family with trace support) cannot be traced here, or None."""
    if unet.config.get("addition_embed_type") is not None or unet.config.get("class_embed_type") is not None:
        return "the UNet takes added conditioning (e.g. SDXL's text_time) that a traced graph cannot take"
    if offload_mode != "off":
        return "offload hooks move weights during the call; a trace would bake in their devices"
    from pyext.nn.fp8 import FP8Conv2d, FP8Linear

    if any(isinstance(m, (FP8Linear, FP8Conv2d)) for m in unet.modules()):
        return "fp8 weights are tensor subclasses (FP8Weight), which torch.jit.trace cannot record"
    return None


class _Plain(nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


def _signature(*tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class TracedUNet(nn.Module):
    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet
        self.config = unet.config
        self.graphs: dict[tuple, torch.jit.ScriptModule] = {}
        self.hits = self.misses = 0

    @property
    def dtype(self):
        return self.unet.dtype

    @property
    def device(self):
        return self.unet.device

    def describe(self) -> str:
        return (f"torch.jit.trace of the UNet, traced on the first call of each input shape "
                f"(up to {MAX_GRAPHS}); other calls run eagerly")

    def forward(self, sample, timestep, encoder_hidden_states=None, *args, return_dict: bool = True, **kwargs):
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        if not torch.is_tensor(timestep):
            timestep = torch.tensor(timestep, device=sample.device)
        graph = None
        # Offload hooks (accelerate's, or diffusers' group offload) may be added after
        # optimize; they move weights around each call, which a trace must not bake in.
        hooked = _compat.has_hooks(self) or _compat.has_hooks(self.unet)
        if not hooked and not args and torch.is_tensor(encoder_hidden_states) and \
                all(v is None or v == {} for v in kwargs.values()):
            key = _signature(sample, timestep, encoder_hidden_states)
            graph = self.graphs.get(key)
            if graph is None and len(self.graphs) < MAX_GRAPHS:
                with torch.no_grad():
                    graph = self.graphs[key] = torch.jit.trace(_Plain(self.unet).eval(),
                                                               (sample, timestep, encoder_hidden_states),
                                                               check_trace=False)
                release_freed_memory()  # the tracer's temporaries
        if graph is not None:
            self.hits += 1
            # On CPU TorchScript's optimizing executor has no fuser to offer (NNC's CPU fusion
            # is off by default); its profiled plans only hold ~0.1 GB more memory per run.
            with torch.jit.optimized_execution(sample.device.type != "cpu"):
                out = graph(sample, timestep, encoder_hidden_states)
        else:
            self.misses += 1
            out = self.unet(sample, timestep, encoder_hidden_states, *args, return_dict=False, **kwargs)[0]
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)
