"""What a pipeline is made of, found by role, and what its denoiser family needs.

`find_components(pipe)` sorts a pipeline's modules into roles (denoisers in the order the
pipeline's loop calls them, conditioning encoders, VAEs, controlnets and adapters) from what
the modules are, never from a list of pipelines, so a pipeline pyext has never seen is
handled. `family_of(denoiser)` gives the denoiser's Family: everything pyext can read off
the model (conv-heavy or not, UNet or token activations) is derived; a descriptor in
FAMILIES only states what cannot be derived (trace support). Adding a
family is one descriptor there, or nothing.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch.nn as nn

ROLES = ("denoiser", "text_encoder", "vae", "controlnet", "other")


@dataclass(frozen=True)
class SequenceSplitPlan:
    """Where a denoiser's tokens are split across context-parallel ranks and gathered back, for a
    model class that declares no sharding of its own (diffusers' `_cp_plan`). Tensors are
    (batch, tokens, channels) and split or gathered along the tokens.

    split_inputs: (module path, forward argument) pairs split on the way in.
    gather_outputs: module paths whose output is gathered.
    whole_tail: the attention layers' forward argument whose tokens stay whole on every rank, and
        which their processors append after the split tokens (joint attention's text); pyext runs
        each of their attention calls across the ranks, attending to those tokens once.
    """

    split_inputs: tuple[tuple[str, str], ...]
    gather_outputs: tuple[str, ...]
    whole_tail: str | None = None


@dataclass(frozen=True)
class Family:
    """What one denoiser family needs from pyext.

    channels_last: conv-heavy, so channels-last convolutions pay (derived: conv weights are at
        least a third of the model's).
    trace: torch.jit.trace of the denoiser is supported (the memory guide's traced UNet).
    activation: the planner's rule for peak activations, "unet" (feature maps) or "tokens".
    sequence_split: pyext's sharding for context parallelism where diffusers' model class has none
        (`pyext.context_parallel_plan`).
    """

    name: str
    classes: tuple[str, ...] = ()
    channels_last: bool = False
    trace: bool = False
    activation: str = "tokens"
    sequence_split: SequenceSplitPlan | None = None


# Only what differs from what `_derived` reads off a model.
FAMILIES = (
    Family("stable-diffusion-unet", ("UNet2DConditionModel",), trace=True),
    # The image tokens split after their embedding (the first block's input); the text stays whole,
    # so any prompt length works: the joint attention appends it to the image tokens.
    Family("stable-diffusion-3", ("SD3Transformer2DModel",), sequence_split=SequenceSplitPlan(
        split_inputs=(("transformer_blocks.0", "hidden_states"),), gather_outputs=("proj_out",),
        whole_tail="encoder_hidden_states")),
)
_BY_CLASS = MappingProxyType({cls: fam for fam in FAMILIES for cls in fam.classes})


def conv_share(module: nn.Module) -> float:
    total = conv = 0
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            total += p.numel()
            conv += p.numel() if isinstance(sub, (nn.Conv2d, nn.Conv3d)) else 0
    return conv / total if total else 0.0


def _derived(module: nn.Module) -> Family:
    config = getattr(module, "config", {}) or {}
    return Family(
        name=type(module).__name__,
        channels_last=conv_share(module) >= 1 / 3,
        activation="unet" if "block_out_channels" in config else "tokens",
    )


def eager(module: nn.Module) -> nn.Module:
    """The model behind pyext's traced UNet, which stands in its slot; any other module itself."""
    from pyext.traced import TracedUNet

    return module.unet if isinstance(module, TracedUNet) else module


def sequence_split_of(model: nn.Module) -> SequenceSplitPlan | None:
    """pyext's sharding of the model's class (a descriptor's; nothing is derived from the model)."""
    known = _BY_CLASS.get(type(eager(model)).__name__)
    return None if known is None else known.sequence_split


def family_of(denoiser: nn.Module) -> Family:
    """The denoiser's family: derived from the model, with a descriptor's settings on top."""
    denoiser = eager(denoiser)
    derived = _derived(denoiser)
    known = _BY_CLASS.get(type(denoiser).__name__)
    if known is None:
        return derived
    return replace(known, channels_last=known.channels_last or derived.channels_last, activation=derived.activation)


# ----------------------------------------------------------------------------- roles

def role_of(name: str, module: nn.Module) -> str:
    """One of ROLES for a pipeline component, from its class and where the class lives."""
    cls = type(module)
    path = cls.__module__
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()
    if isinstance(module, PreTrainedModel):
        return "text_encoder"  # text and image encoders alike: they encode the conditioning
    if not path.startswith("diffusers."):
        return "other"
    if ".autoencoders." in path or "VQModel" in cls.__name__ or cls.__name__.startswith("Autoencoder"):
        return "vae"
    if ".controlnets." in path or "ControlNet" in cls.__name__ or "Adapter" in cls.__name__:
        return "controlnet"
    if ".unets." in path or ".transformers." in path:
        return "denoiser"
    # Denoisers defined inside a pipeline package (Wuerstchen's prior) go by their slot's name.
    return "denoiser" if name.rsplit("_", 1)[-1] in ("unet", "transformer", "prior", "decoder") else "other"


@dataclass(frozen=True)
class Components:
    """The pipeline's modules by role; denoisers in the order the pipeline's loop calls them."""

    roles: dict = field(default_factory=dict)  # name -> role
    modules: dict = field(default_factory=dict)  # name -> module (plain dicts: a deep copy of the pipeline copies them)

    def of(self, role: str) -> dict[str, nn.Module]:
        return {n: self.modules[n] for n, r in self.roles.items() if r == role}

    @property
    def denoisers(self) -> dict[str, nn.Module]:
        return self.of("denoiser")

    @property
    def vaes(self) -> dict[str, nn.Module]:
        return self.of("vae")


def modules_of(pipe) -> dict[str, nn.Module]:
    """The pipeline's nn.Module components by name (not its tokenizers, schedulers, processors)."""
    return {n: m for n, m in pipe.components.items() if isinstance(m, nn.Module)}


def find_components(pipe) -> Components:
    modules = modules_of(pipe)
    # model_cpu_offload_seq lists components in call order ("text_encoder->transformer->transformer_2->vae").
    seq = [n for n in (getattr(pipe, "model_cpu_offload_seq", None) or "").split("->") if n in modules]
    order = seq + [n for n in modules if n not in seq]
    roles = {n: role_of(n, eager(modules[n])) for n in order}
    return Components(roles, {n: modules[n] for n in order})


# ----------------------------------------------------------------------------- geometry

def call_default(pipe, name: str):
    """The default of a parameter of the pipeline's __call__ (e.g. num_frames), or None."""
    try:
        param = inspect.signature(type(pipe).__call__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default


def vae_compression(pipe) -> tuple[int, int]:
    """(spatial, temporal) compression of the pipeline's latents: 8 and 1 for SD, 32 for DC-AE,
    (8, 4) for CogVideoX and Wan. Read from the pipeline's own attributes."""
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
    temporal = getattr(pipe, "vae_scale_factor_temporal", None) or 1
    return int(spatial), int(temporal)


@dataclass(frozen=True)
class VaeFamily:
    """What the planner needs of a VAE's decode that cannot be read off the model, measured by
    `python -m bench.planner_peaks` in bf16 and fp32 (docs/benchmarks.md).

    maps: feature maps of the decoder's full-resolution width (the input width of its last
        convolution) alive at the decode's peak, per output frame held, in the compute dtype.
    fp32_maps: more such maps that the decoder computes in fp32 whatever its dtype.
    conv3d_columns, conv2d_columns: more maps, in the compute dtype, for the im2col buffers of a
        CPU's 3-D and 2-D convolutions, where torch lowers them so in that dtype rather than run
        them in oneDNN (`_compat.cpu_conv_im2col`): Conv3d in fp32 and fp16, and every convolution
        in bf16 and fp16 on a CPU without native bf16.
    frames: output frames the decoder holds at once; None: every frame (one batch).
    amx_bf16_maps: the maps in place of `maps` where a CPU with AMX computes the decode in bf16,
        for the 3-D VAEs whose peak is lower there (measured on one such CPU); None: `maps`.
    fused_norm_maps: the maps in place of `maps` on a CPU, where `fuse_norms` (on by default there)
        runs the decoder's GroupNorm + SiLU as one op, for the VAEs built of ResnetBlock2D; None:
        `maps`. (With fuse_norms="off" the estimate is low by that ratio.)
    """

    name: str
    classes: tuple[str, ...] = ()
    maps: float = 40.0
    fp32_maps: float = 0.0
    conv3d_columns: float = 27.0
    conv2d_columns: float = 30.0
    frames: int | None = None
    amx_bf16_maps: float | None = None
    fused_norm_maps: float | None = None


# Unknown VAEs take the default descriptor: as many maps as the most memory-hungry measured.
VAE_FAMILIES = (
    VaeFamily("kl", ("AutoencoderKL",), maps=6.0, conv3d_columns=0.0, conv2d_columns=7.0, fused_norm_maps=4.0),
    # its linear attention computes in fp32
    VaeFamily("deep-compression", ("AutoencoderDC",), maps=2.4, fp32_maps=2.4, conv3d_columns=0.0,
              conv2d_columns=14.4),
    # causal 3-D VAEs that decode one latent frame (four output frames) at a time with a cache
    VaeFamily("wan", ("AutoencoderKLWan",), maps=13.5, conv3d_columns=24.0, conv2d_columns=0.0, frames=4),
    VaeFamily("qwenimage", ("AutoencoderKLQwenImage",), maps=16.5, conv3d_columns=24.0, conv2d_columns=0.0,
              frames=4),
    # (their spatial up-samplers are 2-D convolutions)
    VaeFamily("cogvideox", ("AutoencoderKLCogVideoX",), maps=25.0, conv3d_columns=15.0, conv2d_columns=24.5,
              amx_bf16_maps=16.7),
    VaeFamily("hunyuanvideo", ("AutoencoderKLHunyuanVideo",), maps=15.0, conv3d_columns=18.0, conv2d_columns=30.0,
              amx_bf16_maps=13.1),
    VaeFamily("ltx-video", ("AutoencoderKLLTXVideo",), maps=7.0, conv3d_columns=25.0, conv2d_columns=0.0),
)
_VAE_BY_CLASS = MappingProxyType({cls: fam for fam in VAE_FAMILIES for cls in fam.classes})


def vae_family_of(vae: nn.Module) -> VaeFamily:
    return _VAE_BY_CLASS.get(type(vae).__name__) or VaeFamily(type(vae).__name__)


def full_resolution_width(vae: nn.Module) -> int:
    """Channels the decoder computes at full resolution: the input width of its last convolution."""
    decoder = getattr(vae, "decoder", None) or vae
    convs = [m for m in decoder.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    return convs[-1].in_channels if convs else 128


def vae_kind(vae: nn.Module) -> str:
    """'kl2d' (AutoencoderKL: pyext's tiling), 'video' (3-D, frames), 'dc' (deep compression) or 'other'."""
    from diffusers import AutoencoderKL

    if isinstance(vae, AutoencoderKL):
        return "kl2d"
    if any(isinstance(m, nn.Conv3d) for m in vae.modules()):
        return "video"
    if "DC" in type(vae).__name__:
        return "dc"
    return "other"
