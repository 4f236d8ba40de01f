"""Channels-last convolution weights for conv-heavy components."""
from __future__ import annotations

import torch
import torch.nn as nn

from pyext.families import conv_share
from pyext.techniques.base import Entry, PerComponent, undo_by


def _contiguous(module: nn.Module) -> None:
    module.to(memory_format=torch.contiguous_format)


class ChannelsLast(PerComponent):
    """NHWC conv weights where 2-D convolutions carry the model: denoisers whose family says
    so, and conv-heavy VAEs and controlnets. Models with 5-D weights (3-D video VAEs) are left
    alone: channels-last is a 4-D format."""

    name = "channels_last"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        convs = [m.weight for m in module.modules() if isinstance(m, nn.Conv2d) and m.weight.dim() == 4]
        if all(w.is_contiguous(memory_format=torch.channels_last) for w in convs):
            return self.already(name, "conv weights in NHWC order")
        module.to(memory_format=torch.channels_last)
        return self.applied(name, f"{len(convs)} conv weights in NHWC order", undo_by(
            _contiguous, module, says="contiguous format again"))

    def why_not(self, name: str, module: nn.Module, d) -> str | None:
        setting = d.options.channels_last
        if setting == "off":
            return "channels_last='off'"
        if not any(isinstance(m, nn.Conv2d) for m in module.modules()):
            return "no 2-D convolutions"
        if any(p.dim() == 5 for p in module.parameters()):
            return "has 5-D (3-D conv) weights; channels-last is a 4-D format"
        if setting == "on":
            return None
        role = d.components.roles[name]
        if role == "denoiser":
            family = d.families[name]
            return None if family.channels_last else f"{family.name}: convolutions carry too little of the model"
        if role in ("vae", "controlnet") and conv_share(module) >= 1 / 3:
            return None
        return f"auto: not a conv-heavy {role}"
