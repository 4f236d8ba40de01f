"""The UNet traced with torch.jit.trace, as diffusers' memory guide does ("traced UNet" row).

A trace bakes the example's shapes and control flow into the graph, so running it
on other shapes could be silently wrong. TracedUNet therefore keeps the eager UNet
and uses the trace only for calls that match the traced signature exactly.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def trace_reason(unet: nn.Module, offload_mode: str) -> str | None:
    """Why this UNet cannot be traced here, or None."""
    if type(unet).__name__ != "UNet2DConditionModel":
        return f"{type(unet).__name__} is not a UNet2DConditionModel"
    if unet.config.get("addition_embed_type") is not None or unet.config.get("class_embed_type") is not None:
        return "the UNet takes added conditioning (e.g. SDXL's text_time) that a traced graph cannot take"
    if offload_mode != "none":
        return "offload hooks move weights during the call; a trace would bake in their devices"
    return None


class _Plain(nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class TracedUNet(nn.Module):
    def __init__(self, unet: nn.Module, height: int, width: int, batch: int):
        super().__init__()
        self.unet = unet
        self.config = unet.config
        p = next(unet.parameters())
        dtype = next((q.dtype for q in unet.parameters() if q.is_floating_point()), torch.float32)
        h, w = height // 8, width // 8
        g = torch.Generator().manual_seed(0)
        example = (torch.randn(batch, unet.config.in_channels, h, w, generator=g).to(p.device, dtype),
                   torch.tensor(999, device=p.device),
                   torch.randn(batch, 77, unet.config.cross_attention_dim, generator=g).to(p.device, dtype))
        self.signature = self._signature(*example)
        with torch.no_grad():
            self.traced = torch.jit.trace(_Plain(unet).eval(), example, check_trace=False)
        self.hits = self.misses = 0

    @staticmethod
    def _signature(sample, timestep, encoder_hidden_states):
        return tuple((tuple(t.shape), t.dtype, t.device) for t in (sample, timestep, encoder_hidden_states))

    @property
    def dtype(self):
        return self.unet.dtype

    @property
    def device(self):
        return self.unet.device

    def describe(self) -> str:
        (s, _, _), _, (e, _, _) = self.signature
        return f"torch.jit.trace for sample {list(s)} and text {list(e)}; other shapes run eagerly"

    def forward(self, sample, timestep, encoder_hidden_states=None, *args, return_dict: bool = True, **kwargs):
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        if not torch.is_tensor(timestep):
            timestep = torch.tensor(timestep, device=sample.device)
        plain_call = not args and all(v is None or v == {} for v in kwargs.values())
        if plain_call and torch.is_tensor(encoder_hidden_states) and \
                self._signature(sample, timestep, encoder_hidden_states) == self.signature:
            self.hits += 1
            out = self.traced(sample, timestep, encoder_hidden_states)
        else:
            self.misses += 1
            out = self.unet(sample, timestep, encoder_hidden_states, *args, return_dict=False, **kwargs)[0]
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)
