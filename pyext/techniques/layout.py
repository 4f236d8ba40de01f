"""Channels-last convolution weights for conv-heavy components."""
from __future__ import annotations

import torch
import torch.nn as nn

from pyext.families import conv_share
from pyext.techniques.base import Entry, PerComponent, undo_by
from pyext.techniques.packing import convs_it_packs


def _contiguous(convs: tuple[nn.Module, ...]) -> None:
    for conv in convs:
        conv.to(memory_format=torch.contiguous_format)


class ChannelsLast(PerComponent):
    """NHWC conv weights where 2-D convolutions carry the model: denoisers whose family says
    so, and conv-heavy VAEs and controlnets. Models with 5-D weights (3-D video VAEs) are left
    alone: channels-last is a 4-D format. The convolutions prepack will pack are left as they
    are: their weights go into oneDNN's layout either way, and oneDNN's convolutions on a packed
    weight give channels-last outputs; copying them to NHWC first would only cost time and memory."""

    name = "channels_last"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        packed = {id(m) for m in convs_it_packs(name, d)}
        convs = [m for m in module.modules() if isinstance(m, nn.Conv2d) and m.weight.dim() == 4]
        plain = tuple(m for m in convs if id(m) not in packed)
        if not plain:
            return self.skipped(name, f"prepack packs all {len(convs)} conv weights into oneDNN's layout, "
                                "whose convolutions give channels-last outputs")
        if all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in plain):
            return self.already(name, "conv weights in NHWC order")
        for conv in plain:
            conv.to(memory_format=torch.channels_last)
        left = f" (the other {len(packed)} are packed by prepack)" if packed else ""
        return self.applied(name, f"{len(plain)} conv weights in NHWC order{left}", undo_by(
            _contiguous, plain, says="contiguous format again"))

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
