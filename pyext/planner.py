"""Memory planner: the fastest combination of techniques whose estimated peak fits a budget.

Estimates, per component: weight bytes (exact, from the parameters, at the compute
dtype or fp8) and peak activation bytes at the requested resolution (a documented
rule of thumb per model family, see `activation_bytes`). Candidate plans are tried
from fastest to slowest; the first whose device peak fits the budget wins.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

GB = 1 << 30


def parse_bytes(budget) -> int | None:
    """'8GB', '7.5 GiB', '512MB' or a number of bytes -> bytes (GB and GiB both mean 2**30 here)."""
    if budget is None or isinstance(budget, int):
        return budget
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?)?\s*", str(budget), re.IGNORECASE)
    if not m:
        raise ValueError(f"pyext.optimize: memory_budget {budget!r} is not a size like '8GB' or '512MB'")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GB, "T": 1 << 40}[unit])


@dataclass
class ComponentSize:
    name: str
    kind: str  # "denoiser" | "vae" | "text_encoder" | "other"
    weight_bytes: int  # at the compute dtype
    fp8_bytes: int  # weight bytes if its eligible layers were stored in fp8
    activation_bytes: int
    largest_block_bytes: int  # biggest offload group (block) for group offload
    largest_leaf_bytes: int  # biggest single layer for sequential offload


@dataclass
class Plan:
    name: str
    fp8: str  # "off" | "denoiser" | "all"
    offload: str  # "none" | "model" | "group" | "sequential"
    vae_tiling: bool
    peak_bytes: int
    fits: bool
    budget_bytes: int | None
    considered: list[tuple[str, int]] = field(default_factory=list)

    def describe(self) -> str:
        gb = self.peak_bytes / GB
        budget = f" of {self.budget_bytes / GB:.1f} GB" if self.budget_bytes else ""
        verdict = "fits" if self.fits else "DOES NOT FIT even the leanest plan"
        return (f"plan {self.name}: fp8={self.fp8}, offload={self.offload}, vae_tiling={self.vae_tiling}; "
                f"estimated device peak {gb:.2f} GB{budget} ({verdict})")


# Candidates from fastest to slowest. Model offload moves each component once per
# image; group offload (block level, overlapped with streams on GPU) moves the
# denoiser every step; sequential offload moves every layer every step.
CANDIDATES = [
    ("resident", "off", "none"),
    ("resident+fp8", "denoiser", "none"),
    ("resident+fp8_all", "all", "none"),
    ("model_offload", "off", "model"),
    ("model_offload+fp8", "all", "model"),
    ("group_offload+fp8", "all", "group"),
    ("group_offload", "off", "group"),
    ("sequential_offload+fp8", "all", "sequential"),
]


def _weight_bytes(module: nn.Module, elem: int) -> tuple[int, int, int]:
    """(bytes at the compute dtype, bytes with eligible layers stored in fp8, largest single layer).

    Floating tensors count at `elem` bytes (the compute dtype); integer ones (fp8
    codes and scale bits of layers already converted) at their own size.
    """
    from pyext.nn.fp8 import DEFAULT_SKIP, MIN_NUMEL

    total = fp8_total = largest_leaf = 0
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        size = sum(t.numel() * (elem if t.is_floating_point() else t.element_size()) for t in own)
        largest_leaf = max(largest_leaf, size)
        total += size
        eligible = (type(sub) in (nn.Linear, nn.Conv2d) and sub.weight.numel() >= MIN_NUMEL
                    and not any(re.search(p, name) for p in DEFAULT_SKIP))
        # fp8: one byte per weight element plus an fp32 scale per output channel
        fp8_total += size - sub.weight.numel() * (elem - 1) + 4 * sub.weight.shape[0] if eligible else size
    return total, fp8_total, largest_leaf


def _largest_block(module: nn.Module, elem: int) -> int:
    """Largest child of a ModuleList/Sequential: what block-level group offload moves at once."""
    best = 0
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            for block in sub:
                best = max(best, sum(p.numel() * elem for p in block.parameters()))
    return best


def activation_bytes(kind: str, config: dict, height: int, width: int, batch: int, elem: int,
                     efficient_attention: bool = True) -> int:
    """Rule-of-thumb peak activation bytes of one forward at this resolution.

    UNet: ~120 live feature maps of the first block's width at latent resolution
    (SD1.5 fp16 at 512x512, batch 2: ~0.6 GB), plus one head's full score matrix
    per head without memory-efficient attention. Transformers: ~12 tensors of
    tokens x hidden. VAE decode: ~8 maps of 128 channels at full image resolution.
    """
    if kind == "denoiser":
        if "block_out_channels" in config:  # UNet
            h, w = height // 8, width // 8
            maps = 120 * batch * config["block_out_channels"][0] * h * w * elem
            heads = config.get("attention_head_dim", 8)
            heads = heads[0] if isinstance(heads, (list, tuple)) else heads
            scores = 0 if efficient_attention else batch * heads * (h * w) ** 2 * elem
            return maps + scores
        patch = config.get("patch_size", 2) * 8
        tokens = (height // patch) * (width // patch) + config.get("text_tokens", 512)
        hidden = config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128)
        scores = 0 if efficient_attention else batch * config.get("num_attention_heads", 24) * tokens**2 * elem
        return 12 * batch * tokens * hidden * elem + scores
    if kind == "vae":
        return 8 * 128 * height * width * elem
    return 64 << 20  # text encoders at 77-512 tokens: tens of MB


def component_sizes(pipe, height: int, width: int, batch: int = 2, elem: int = 2) -> list[ComponentSize]:
    out = []
    for name, module in pipe.components.items():
        if not isinstance(module, nn.Module):
            continue
        kind = ("denoiser" if name in ("unet", "transformer") else "vae" if name == "vae"
                else "text_encoder" if name.startswith("text_encoder") else "other")
        total, fp8_total, leaf = _weight_bytes(module, elem)
        config = getattr(module, "config", None) or {}
        config = dict(config) if isinstance(config, dict) else config.to_dict()  # diffusers or transformers
        act = activation_bytes(kind, config, height, width, batch if kind == "denoiser" else 1, elem)
        out.append(ComponentSize(name, kind, total, fp8_total, act, _largest_block(module, elem) or total, leaf))
    return out


def _peak(sizes: list[ComponentSize], fp8: str, offload: str, vae_tiling: bool, tile_px: int = 512) -> int:
    def weights(c):
        quantized = fp8 == "all" or (fp8 == "denoiser" and c.kind == "denoiser")
        return c.fp8_bytes if quantized else c.weight_bytes

    def act(c):
        if c.kind == "vae" and vae_tiling:
            return 8 * 128 * tile_px * tile_px * 2
        return c.activation_bytes

    if offload == "none":
        return sum(weights(c) for c in sizes) + max(act(c) for c in sizes)
    if offload == "model":
        return max(weights(c) + act(c) for c in sizes)
    if offload == "group":  # two groups in flight (current + prefetched) plus activations
        return max(2 * min(c.largest_block_bytes, weights(c)) + act(c) for c in sizes)
    return max(c.largest_leaf_bytes + act(c) for c in sizes)


def plan(pipe, budget_bytes: int | None, height: int, width: int, batch: int = 2, elem: int = 2,
         allow_offload: bool = True) -> Plan:
    sizes = component_sizes(pipe, height, width, batch, elem)
    considered = []
    for name, fp8, offload in CANDIDATES:
        for tiling in (False, True):
            if offload != "none" and not allow_offload:
                continue
            peak = _peak(sizes, fp8, offload, tiling)
            label = name + ("+vae_tiling" if tiling else "")
            considered.append((label, peak))
            if budget_bytes is None or peak <= budget_bytes:
                return Plan(label, fp8, offload, tiling, peak, True, budget_bytes, considered)
    leanest = min(considered, key=lambda c: c[1])
    return Plan(leanest[0], "all", "sequential" if allow_offload else "none", True, leanest[1], False, budget_bytes,
                considered)
