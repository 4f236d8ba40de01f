"""What `pyext.optimize` will do to one pipeline, decided before anything changes.

`decide(pipe, options)` reads the pipeline (components by role, families, devices, the
call's default geometry), makes the memory plan and resolves every "auto" option into a
frozen Decision. It raises PyextError for anything the pipeline cannot take, so a bad
request never leaves a half-changed pipeline. The techniques act on the Decision only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from pyext import _compat, offload, planner
from pyext.dispatch import PyextError
from pyext.families import Components, call_default, family_of, find_components, vae_compression
from pyext.options import OptimizeOptions
from pyext.planner import Geometry, Plan, SequenceSplit


@dataclass(frozen=True)
class Decision:
    options: OptimizeOptions
    components: Components
    families: dict  # denoiser name -> Family
    device: torch.device
    dtype: torch.dtype | None  # None: keep each component's dtype
    geometry: Geometry
    sequence: SequenceSplit  # the denoiser's sequence over devices; the plan counts one device
    plan: Plan
    fp8: Literal["off", "denoiser", "all"]
    fp8_gemm: Literal["weight_only", "dynamic", "measured"]  # the fp8 linears' mode
    fp8_gemm_reason: str
    offload: Literal["off", "model", "group", "sequential"]
    offload_reason: str
    vae_tiling: bool
    vae_tiling_reason: str
    multi_device: bool

    def describe(self) -> str:
        g = self.geometry
        frames = f", {g.frames} frames" if g.frames > 1 else ""
        fams = ", ".join(f"{n}={f.name}" for n, f in self.families.items())
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype else "kept"
        gemm = f"; fp8 GEMM {self.fp8_gemm}" if self.fp8 != "off" else ""
        split = f"; {self.sequence.describe()}" if self.sequence.devices > 1 else ""
        return f"{dtype} on {self.device}, {g.width}x{g.height}{frames}, batch {g.batch}{gemm}; denoisers: {fams}{split}"


def check_pipeline(pipe, what: str = "pyext.optimize") -> None:
    if not isinstance(getattr(pipe, "components", None), dict):
        raise PyextError(f"{what}: expected a diffusers pipeline (an object with a .components dict), "
                         f"got {type(pipe).__name__}")


def auto_dtype(device: torch.device, capability: tuple[int, int] | None = None) -> torch.dtype:
    """What dtype="auto" computes in. CUDA: bf16 from sm_80 on (no activation overflow, as fp16
    risks for Flux and SD3), fp16 below; `capability` overrides the GPU's (dry runs). CPU: bf16
    only where oneDNN computes it natively, else fp32."""
    if device.type == "cuda":
        major, _ = capability or torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.bfloat16 if _compat.cpu_has_native_bf16() else torch.float32


def device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _geometry(pipe, opts: OptimizeOptions, denoiser: nn.Module) -> Geometry:
    spatial, temporal = vae_compression(pipe)
    config = getattr(denoiser, "config", None)
    sample = config.get("sample_size") if isinstance(config, dict) else None
    sample = sample[0] if isinstance(sample, (list, tuple)) else sample
    # The call's own defaults first (Wan: 480x832, 81 frames), then the denoiser's trained size.
    fallback = (sample if isinstance(sample, int) else 64) * spatial
    height = opts.height or call_default(pipe, "height") or fallback
    width = opts.width or call_default(pipe, "width") or fallback
    frames = opts.frames or call_default(pipe, "num_frames") or 1
    tokens = call_default(pipe, "max_sequence_length") or 77
    return Geometry(int(height), int(width), int(frames), spatial, temporal, int(tokens), opts.batch)


def _attention_check(opts: OptimizeOptions, device: torch.device) -> None:
    if opts.attention in ("auto", "off"):
        return
    from pyext import dispatch

    backend = next(b for b in dispatch.ops()["attention"].backends if b.name == opts.attention)
    missing = backend.unavailable() or (None if device.type in backend.devices else
                                         f"it runs on {'/'.join(backend.devices)}, the pipeline on {device.type}")
    if missing:
        raise PyextError(f"pyext.optimize: option attention={opts.attention!r} is unavailable here: {missing}")


def _device_check(device: torch.device) -> None:
    """A device this torch can use, else a PyextError naming the option (before anything changes)."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        why = f"this torch ({torch.__version__}) has no {device.type} device available"
        raise PyextError(f"pyext.optimize: option device={str(device)!r} is not usable here: {why}; "
                         "use device=None (where the pipeline is) or 'cpu'")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise PyextError(f"pyext.optimize: option device={str(device)!r} is not usable here: there are {count} "
                         f"{device.type} devices (indices 0..{count - 1})")


def decide(pipe, opts: OptimizeOptions, default_device: torch.device | None = None) -> Decision:
    """`default_device`: where the pipeline runs when options.device is None (a second optimize
    passes the first's: offload may have left the weights elsewhere)."""
    check_pipeline(pipe)
    comps = find_components(pipe)
    denoisers = comps.denoisers
    if not comps.modules:
        raise PyextError(f"pyext.optimize: {type(pipe).__name__} has no torch modules to optimize")
    first = next(iter(denoisers.values()), next(iter(comps.modules.values())))
    devices = {device_of(m) for m in comps.modules.values()}
    multi_device = bool(getattr(pipe, "hf_device_map", None)) or len(devices) > 1
    device = torch.device(opts.device) if opts.device is not None else default_device or device_of(first)
    _device_check(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _attention_check(opts, device)
    families = {name: family_of(m) for name, m in denoisers.items()}
    if opts.dtype == "keep":
        dtype = None
    elif opts.dtype == "auto":
        dtype = auto_dtype(device)
    else:
        dtype = opts.dtype
    geo = _geometry(pipe, opts, first)
    sequence = planner.sequence_split(first, geo, _devices(opts, first), planner.latent_channels(comps),
                                      pyext_attention=opts.attention != "off")
    budget = opts.budget_bytes
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    elem = min(torch.tensor([], dtype=dtype or first.dtype).element_size(), 4)
    host = (dtype or first.dtype) if device.type == "cpu" else None  # what the CPU computes in
    can_offload = device.type != "cpu" and not multi_device
    graphs = device.type == "cuda" and opts.compile in ("auto", "capture")  # (pyext.graphs; resident plans only)
    plan = planner.plan(comps, geo, budget, elem, allow_offload=can_offload, fp8_skip=opts.fp8_skip,
                        host=host, split_ways=sequence.ways, graphs=graphs, fp8_layers=opts.fp8_layers)

    if opts.offload != "auto":
        offload_mode, offload_reason = opts.offload, f"offload={opts.offload!r}"
    elif can_offload:
        offload_mode = plan.offload
        offload_reason = "the plan fits without offload" if plan.offload == "off" else f"the plan needs {plan.offload} offload"
    else:
        offload_mode = "off"
        offload_reason = ("components sit on several devices (device map): pyext never moves them" if multi_device
                          else "the pipeline runs on the CPU: there is nothing to offload to")
    if offload_mode != "off" and offload.detect(pipe).mode == "device_map":
        raise PyextError(f"pyext.optimize: option offload={opts.offload!r} cannot apply to a device-mapped pipeline")

    if opts.vae_tiling != "auto":
        tiling, tiling_reason = opts.vae_tiling == "on", f"vae_tiling={opts.vae_tiling!r}"
    elif budget is None:
        tiling, tiling_reason = False, "no memory budget (CPU): the full decode is exact and fits"
    elif plan.vae_tiling:
        tiling, tiling_reason = True, f"the full decode would not fit the budget ({plan.describe()})"
    else:
        tiling, tiling_reason = False, f"the full decode fits the budget ({plan.peak_bytes / planner.GB:.2f} GB " \
                                       f"of {budget / planner.GB:.1f} GB): untiled, exact"
    fp8 = plan.fp8 if opts.fp8 == "auto" else opts.fp8
    if (fp8, offload_mode, tiling) != (plan.fp8, plan.offload, plan.vae_tiling):  # the plan in force is the options'
        plan = planner.as_asked(comps, geo, budget, fp8, offload_mode, tiling, elem, opts.fp8_skip, host,
                                sequence.ways, graphs=graphs and (opts.compile == "capture" or plan.graphs),
                                fp8_layers=opts.fp8_layers)
    fp8_gemm, fp8_gemm_reason = _fp8_gemm(opts, device)
    return Decision(opts, comps, families, device, dtype, geo, sequence, plan, fp8, fp8_gemm, fp8_gemm_reason,
                    offload_mode, offload_reason, tiling, tiling_reason, multi_device)


def _devices(opts: OptimizeOptions, denoiser: nn.Module) -> int:
    """The devices the denoiser's sequence is split over: the option, else the context
    parallelism enabled on the denoiser, else 1. The two must agree."""
    degrees = _compat.context_parallel_degrees(denoiser)
    enabled = degrees[0] * degrees[1] if degrees else None
    if opts.devices is not None and enabled is not None and opts.devices != enabled:
        raise PyextError(f"pyext.optimize: option devices={opts.devices} disagrees with the context parallelism "
                         f"enabled on the denoiser, which spans {enabled} devices; use devices={enabled} or None")
    return opts.devices or enabled or 1


def _fp8_gemm(opts: OptimizeOptions, device: torch.device) -> tuple[str, str]:
    """The fp8 linears' mode and why: "auto" measures per layer shape where fp8 tensor cores exist."""
    from pyext.ops.fp8_dynamic import fp8_tensor_cores

    if opts.fp8_gemm != "auto":
        return opts.fp8_gemm, f"fp8_gemm={opts.fp8_gemm!r}"
    if device.type == "cuda" and fp8_tensor_cores(device):
        return "measured", "fp8 tensor cores: each layer shape keeps the faster of weight-only and dynamic"
    return "weight_only", "no fp8 tensor cores here: the weight is upcast in the GEMM"
