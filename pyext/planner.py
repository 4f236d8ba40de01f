"""Memory planner: the fastest combination of techniques whose estimated peak fits a budget.

Estimates, per component: weight bytes (exact, from the parameters, at the compute dtype or
with fp8 storage by the converter's own eligibility rule) and peak activation bytes for the
requested geometry (a documented rule of thumb per role, see `activation_bytes`). Candidate
plans are tried from fastest to slowest; the first whose device peak fits the budget wins.
Works on pipelines built on the meta device (shapes only).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn as nn

from pyext import _compat, parallel
from pyext.dispatch import PyextError
from pyext.families import Components, family_of, full_resolution_width, vae_family_of, vae_kind
from pyext.nn.fp8 import DEFAULT_SKIP, FP8Weight, layer_rules, skip_patterns
from pyext.nn.stored import stored_bytes
from pyext.options import GB


@dataclass(frozen=True)
class Geometry:
    """What one generation looks like: output size and frames, latent compression, text length."""

    height: int
    width: int
    frames: int = 1  # output frames; 1 for images
    spatial: int = 8  # VAE compression per side
    temporal: int = 1  # VAE compression of frames (4 for CogVideoX and Wan)
    text_tokens: int = 77
    batch: int = 2  # denoiser batch (2: one prompt with classifier-free guidance)

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // self.temporal + 1  # causal video VAEs keep the first frame alone


@dataclass
class ComponentSize:
    name: str
    role: str  # one of families.ROLES
    weight_bytes: int  # at the compute dtype
    fp8_bytes: int  # with its eligible layers stored in fp8
    activation_bytes: int
    tiled_activation_bytes: int  # a VAE's, when tiled (else activation_bytes)
    largest_block_bytes: int  # biggest offload group (block) for group offload
    largest_leaf_bytes: int  # biggest single layer for sequential offload


@dataclass
class Plan:
    name: str
    fp8: str  # "off" | "denoiser" | "all"
    offload: str  # "off" | "model" | "group" | "sequential"
    vae_tiling: bool
    peak_bytes: int
    fits: bool
    budget_bytes: int | None
    considered: list[tuple[str, int]] = field(default_factory=list)
    graphs: bool = False  # the denoisers' captured CUDA graphs keep their activations between calls

    def describe(self) -> str:
        budget = f" of {self.budget_bytes / GB:.1f} GB" if self.budget_bytes else " (no budget)"
        verdict = "fits" if self.fits else "DOES NOT FIT even the leanest plan"
        graphs = ", CUDA graphs' memory kept" if self.graphs else ""
        return (f"plan {self.name}: fp8={self.fp8}, offload={self.offload}, vae_tiling={self.vae_tiling}{graphs}; "
                f"estimated device peak {self.peak_bytes / GB:.2f} GB{budget} ({verdict})")


# Candidates from fastest to slowest. Model offload moves each component once per image;
# group offload (block level, overlapped with streams on GPU) moves the denoiser every
# step; sequential offload moves every layer every step.
CANDIDATES = [
    ("resident", "off", "off"),
    ("resident+fp8", "denoiser", "off"),
    ("resident+fp8_all", "all", "off"),
    ("model_offload", "off", "model"),
    ("model_offload+fp8", "all", "model"),
    ("group_offload+fp8", "all", "group"),
    ("group_offload", "off", "group"),
    ("sequential_offload+fp8", "all", "sequential"),
]


def _weight_bytes(module: nn.Module, elem: int, patterns: tuple[str, ...], layers: str) -> tuple[int, int, int]:
    """(bytes at the compute dtype, bytes with eligible layers in fp8, largest single layer).

    Floating tensors count at `elem` bytes (the compute dtype); the fp8 weights of layers already
    converted, and integer tensors, at what they hold."""
    total = fp8_total = largest_leaf = 0
    eligible_layers = {name for name, _, why in layer_rules(module, patterns, layers) if why is None}
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        size = sum(stored_bytes(t) if isinstance(t, FP8Weight) else t.numel() * (elem if t.is_floating_point()
                   else t.element_size()) for t in own)
        largest_leaf = max(largest_leaf, size)
        total += size
        eligible = name in eligible_layers
        # fp8: one byte per weight element plus an fp32 scale per output channel
        fp8_total += size - sub.weight.numel() * (elem - 1) + 4 * sub.weight.shape[0] if eligible else size
    return total, fp8_total, largest_leaf


def _largest_block(module: nn.Module, elem: int) -> int:
    """Largest child of a ModuleList/Sequential: what block-level group offload moves at once.
    Lists may hold None (diffusers' mid blocks without attention) or nothing at all."""
    best = 0
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            for block in sub.children():
                best = max(best, sum(p.numel() * elem for p in block.parameters()))
    return best


def model_width(module: nn.Module) -> int:
    """The model's hidden size: the most common input width of its linear layers."""
    widths = Counter(m.in_features for m in module.modules() if isinstance(m, nn.Linear))
    return widths.most_common(1)[0][0] if widths else 1024


def _patch(config: dict) -> tuple[int, int]:
    """(temporal, spatial) patch size of a transformer denoiser's config."""
    p = config.get("patch_size") or 1
    if isinstance(p, (list, tuple)):  # Wan: (t, h, w)
        return (p[0] if len(p) == 3 else 1), p[-1]
    return config.get("patch_size_t") or 1, p


# Peak activations per rule, in units a model's config gives (measured: bench.planner_peaks).
UNET_MAPS = 45  # latent feature maps of the first block's width alive at a UNet's peak
TOKEN_TENSORS = 12  # tokens x width tensors alive at a transformer's peak
TEXT_TENSORS = 12  # tokens x width tensors, plus SCORE_TENSORS of the eager attention's scores
SCORE_TENSORS = 3


def _image_tokens(config: dict, geo: Geometry) -> int:
    """The tokens a transformer denoiser makes of the latent: frames / temporal patch x pixels / patch^2."""
    pt, p = _patch(config)
    h, w = geo.height // geo.spatial, geo.width // geo.spatial
    return -(-geo.latent_frames // pt) * (h // p) * (w // p)


def _config(module: nn.Module) -> dict:
    config = getattr(module, "config", None) or {}
    return config if isinstance(config, dict) else config.to_dict()  # diffusers or transformers


def _heads(config: dict, width: int) -> int:
    return config.get("num_attention_heads") or config.get("num_heads") or max(1, width // 64)


def activation_bytes(module: nn.Module, role: str, geo: Geometry, elem: int,
                     host: torch.dtype | None = None) -> int:
    """Peak activation bytes of one forward, with memory-efficient attention; `host`: the dtype a
    CPU computes it in (None: a GPU).

    UNet-like denoisers and controlnets: UNET_MAPS feature maps of the first block's width at
    latent resolution, per latent frame. Transformer denoisers: TOKEN_TENSORS tensors of tokens x
    width, tokens = latent frames / temporal patch x latent pixels / patch^2 + text tokens. VAE
    decode: its VaeFamily's maps of its full-resolution width at image resolution, per frame it
    holds (on a CPU, with its 3-D convolutions' im2col columns where torch lowers them so).
    Conditioning encoders: TEXT_TENSORS tensors of text tokens x width, plus the scores of their
    eager attention.
    """
    config = _config(module)
    h, w = geo.height // geo.spatial, geo.width // geo.spatial
    if role in ("denoiser", "controlnet"):
        rule = family_of(module).activation if role == "denoiser" else \
            "unet" if "block_out_channels" in config else "tokens"
        if rule == "unet":
            return UNET_MAPS * geo.batch * geo.latent_frames * config["block_out_channels"][0] * h * w * elem
        return TOKEN_TENSORS * geo.batch * (_image_tokens(config, geo) + geo.text_tokens) * model_width(module) * elem
    if role == "vae":
        return vae_decode_bytes(module, geo, elem, host)
    if role == "text_encoder":
        width, tokens = model_width(module), geo.text_tokens
        return (TEXT_TENSORS * tokens * width + SCORE_TENSORS * _heads(config, width) * tokens**2) * elem
    return 0


def vae_decode_bytes(module: nn.Module, geo: Geometry, elem: int, host: torch.dtype | None,
                     columns: bool = True) -> int:
    """A VAE decode's peak activation (activation_bytes); `columns=False` leaves out the im2col
    buffers of a CPU's convolutions."""
    family = vae_family_of(module)
    frames = geo.frames if family.frames is None else min(family.frames, geo.frames)
    maps = family.fused_norm_maps if host is not None and family.fused_norm_maps is not None else family.maps
    if host == torch.bfloat16 and family.amx_bf16_maps is not None and _compat.cpu_has_amx():
        maps = family.amx_bf16_maps
    if columns and host is not None:
        maps += family.conv3d_columns * _compat.cpu_conv_im2col(host, 3) + \
            family.conv2d_columns * _compat.cpu_conv_im2col(host, 2)
    per_map = full_resolution_width(module) * geo.height * geo.width * frames
    return int((maps * elem + family.fp32_maps * 4) * per_map)


def tiled_activation_bytes(module: nn.Module, role: str, geo: Geometry, act: int, host: torch.dtype | None,
                           elem: int) -> int:
    """A tiled VAE's peak: one tile's share of the full decode's, except pyext's exact tiling of a
    2-D KL VAE on a CPU (`host`), which keeps each stage's whole-image activation in the same RAM:
    there it is EXACT_ON_HOST of the untiled peak's maps (its convolutions' columns are a tile's,
    small beside them; docs/vae.md)."""
    if role != "vae":
        return act
    if host is not None and vae_kind(module) == "kl2d":
        return int(vae_decode_bytes(module, geo, elem, host, columns=False) * EXACT_ON_HOST)
    return act * min(TILE_PX**2, geo.height * geo.width) // (geo.height * geo.width)


def component_sizes(components: Components, geo: Geometry, elem: int = 2,
                    fp8_skip: tuple[str, ...] = DEFAULT_SKIP, host: torch.dtype | None = None,
                    split_ways: int = 1, fp8_layers: str = "linear+conv") -> list[ComponentSize]:
    """Each component's sizes on one device; `host`: the dtype the pipeline computes in on the CPU, in the
    memory it is planned for; `split_ways`: the denoisers' sequence is split over that many
    devices (each holds every weight and its share of the tokens)."""
    out = []
    for name, module in components.modules.items():
        role = components.roles[name]
        total, fp8_total, leaf = _weight_bytes(module, elem, skip_patterns(module, fp8_skip), fp8_layers)
        act = activation_bytes(module, role, geo, elem, host) // (split_ways if role == "denoiser" else 1)
        out.append(ComponentSize(name, role, total, fp8_total, act, tiled_activation_bytes(module, role, geo, act, host, elem),
                                 _largest_block(module, elem) or total, leaf))
    return out


FP8_ROLES = {"off": (), "denoiser": ("denoiser",), "all": ("denoiser", "controlnet", "text_encoder")}
TILE_PX = 512
EXACT_ON_HOST = 0.55  # measured: bench.planner_peaks


def peak_bytes(sizes: list[ComponentSize], geo: Geometry, fp8: str, offload: str, vae_tiling: bool,
               graphs: bool = False) -> int:
    """The device peak of a plan. graphs: the denoisers replay captured CUDA graphs, whose memory
    (their activations) stays reserved while the other components run (resident plans only)."""
    def weights(c):
        return c.fp8_bytes if c.role in FP8_ROLES[fp8] else c.weight_bytes

    def act(c):
        return c.tiled_activation_bytes if vae_tiling else c.activation_bytes

    if offload == "off" and graphs:
        kept = sum(act(c) for c in sizes if c.role == "denoiser")
        return sum(weights(c) for c in sizes) + kept + max((act(c) for c in sizes if c.role != "denoiser"), default=0)
    if offload == "off":
        return sum(weights(c) for c in sizes) + max((act(c) for c in sizes), default=0)
    if offload == "model":
        return max((weights(c) + act(c) for c in sizes), default=0)
    if offload == "group":  # two groups in flight (current + prefetched) plus activations
        return max((2 * min(c.largest_block_bytes, weights(c)) + act(c) for c in sizes), default=0)
    return max((c.largest_leaf_bytes + act(c) for c in sizes), default=0)


def as_asked(components: Components, geo: Geometry, budget_bytes: int | None, fp8: str, offload: str,
             vae_tiling: bool, elem: int = 2, fp8_skip: tuple[str, ...] = DEFAULT_SKIP,
             host: torch.dtype | None = None,
             split_ways: int = 1, graphs: bool = False, fp8_layers: str = "linear+conv") -> Plan:
    """The plan that options fixing fp8, offload and tiling make, with its estimated peak."""
    graphs = graphs and offload == "off"
    peak = peak_bytes(component_sizes(components, geo, elem, fp8_skip, host, split_ways, fp8_layers), geo, fp8,
                      offload, vae_tiling, graphs)
    return Plan("as asked", fp8, offload, vae_tiling, peak, budget_bytes is None or peak <= budget_bytes,
                budget_bytes, graphs=graphs)


def plan(components: Components, geo: Geometry, budget_bytes: int | None, elem: int = 2,
         allow_offload: bool = True, fp8_skip: tuple[str, ...] = DEFAULT_SKIP, host: torch.dtype | None = None,
         split_ways: int = 1, graphs: bool = False, fp8_layers: str = "linear+conv") -> Plan:
    """The fastest candidate that fits. graphs: the denoisers would replay captured CUDA graphs; a
    resident plan whose graphs' memory does not fit is taken without them before anything slower."""
    sizes = component_sizes(components, geo, elem, fp8_skip, host, split_ways, fp8_layers)
    considered = []
    for name, fp8, offload in CANDIDATES:
        for tiling in (False, True):
            if offload != "off" and not allow_offload:
                continue
            for kept in ((True, False) if graphs and offload == "off" else (False,)):
                peak = peak_bytes(sizes, geo, fp8, offload, tiling, kept)
                label = name + ("+vae_tiling" if tiling else "") + ("+cuda_graphs" if kept else "")
                considered.append((label, peak))
                if budget_bytes is None or peak <= budget_bytes:
                    return Plan(label, fp8, offload, tiling, peak, True, budget_bytes, considered, kept)
    leanest = min(considered, key=lambda c: c[1])
    return Plan(leanest[0], "all", "sequential" if allow_offload else "off", True, leanest[1], False, budget_bytes,
                considered)


# ----------------------------------------------------------------------------- several devices
Split = Literal["none", "ulysses", "ring", "ulysses+ring"]


@dataclass(frozen=True)
class SequenceSplit:
    """How a denoiser's sequence is split over devices by diffusers' context parallelism
    (`enable_parallelism`): when it splits, each device holds every weight and 1/devices of the
    tokens; "none" runs the whole model on every device."""

    devices: int
    split: Split
    reason: str

    @property
    def ways(self) -> int:
        return 1 if self.split == "none" else self.devices

    def describe(self) -> str:
        how = "not split" if self.split == "none" else f"{self.split} over {self.devices} devices"
        return f"sequence {how} ({self.reason})"


def latent_channels(components: Components) -> int | None:
    """The latent channels of the pipeline's VAE, where its config says."""
    for name, module in components.modules.items():
        channels = _config(module).get("latent_channels") if components.roles[name] == "vae" else None
        if channels:
            return int(channels)
    return None


def _packing(config: dict, latents: int | None) -> int:
    """Latent pixels per token beyond the patch: 4 where the pipeline packs 2x2 latents into one
    token (Flux, Qwen-Image: the denoiser takes 4x the VAE's channels), else 1."""
    channels = config.get("in_channels")
    if not latents or not channels or channels % latents:
        return 1
    return channels // latents


def sequence_split(denoiser: nn.Module, geo: Geometry, devices: int, latents: int | None = None,
                   pyext_attention: bool = True) -> SequenceSplit:
    """The split for `devices` devices: what diffusers' context parallelism can do with this
    denoiser at this geometry (`latents`: the VAE's latent channels), Ulysses where the heads
    divide, else pyext's ring (which needs pyext's attention: `pyext_attention`)."""
    split = _sequence_split(denoiser, geo, devices, latents)
    if split.split == "none" or pyext_attention:
        return split
    if parallel.own_plan(denoiser) is not None:
        return SequenceSplit(devices, "none", f"{type(denoiser).__name__}'s processors split no attention themselves; "
                                              "with attention='off' pyext does not either")
    if "ring" in split.split:
        return replace(split, reason=f"{split.reason}; with attention='off' pyext does not compute the ring, and "
                                     "diffusers' native backend refuses it")
    return split


def _sequence_split(denoiser: nn.Module, geo: Geometry, devices: int, latents: int | None) -> SequenceSplit:
    if devices == 1:
        return SequenceSplit(1, "none", "one device")
    enabled = _compat.context_parallel_degrees(denoiser)
    if enabled is not None:
        ring, ulysses = enabled
        split = "ulysses+ring" if ring > 1 and ulysses > 1 else "ring" if ring > 1 else "ulysses"
        return SequenceSplit(devices, split, "as enable_parallelism set it on the denoiser")
    try:
        cp_plan = parallel.context_parallel_plan(denoiser)
    except PyextError:
        return SequenceSplit(devices, "none", f"{type(denoiser).__name__} declares no sequence split (diffusers' "
                                              "_cp_plan) and pyext has none: each device would run the whole model")
    config = _config(denoiser)
    inputs = {name for split in cp_plan.values() if isinstance(split, dict) for name in split}
    tokens = _image_tokens(config, geo) // _packing(config, latents)
    if tokens % devices:
        return SequenceSplit(devices, "none", f"its {tokens} image tokens do not divide by {devices}")
    if "encoder_hidden_states" in inputs and geo.text_tokens % devices:
        return SequenceSplit(devices, "none", f"its {geo.text_tokens} text tokens do not divide by {devices}")
    if any("mask" in str(name) for name in inputs):
        return SequenceSplit(devices, "ring", "its text mask: diffusers' Ulysses fails with it, pyext's ring takes "
                                              f"it; a prompt of tokens not a multiple of {devices} fails diffusers' split")
    heads = _heads(config, model_width(denoiser))
    if heads % devices:
        return SequenceSplit(devices, "ring", f"its {heads} heads do not divide by {devices}")
    return SequenceSplit(devices, "ulysses", f"its {heads} heads divide by {devices}: two all-to-alls per attention")
