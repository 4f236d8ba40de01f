"""pyext.optimize(pipe): one call that composes every technique on one pipeline instance.

Each technique is a step: it applies itself to the pipeline (or says why it does
not), and leaves an undo. Steps that change modules run with offload hooks
suspended (pyext.offload), so offload may be enabled before or after optimize.
The state lives on the pipeline (`pipe._pyext_state`): `report` reads it,
`restore` runs the undos in reverse, and a second `optimize` skips what is done.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from pyext import offload, planner
from pyext._memory import release_freed_memory
from pyext.nn.fp8 import DEFAULT_SKIP, quantize_fp8, restore_fp8


@dataclass
class OptimizeOptions:
    """What `pyext.optimize` may do; "auto" lets it decide for the machine and the memory budget.

    attention: "auto" (fastest pyext backend per call) | a backend name | "off" (keep diffusers').
        Speed and O(seq) memory; same images within kernel tolerance.
    dtype: "auto" (fp16 on CUDA, bf16 on CPU) | "keep" | a torch dtype. 2-3x speed, half the memory.
    fp8: "auto" (only when the budget needs it) | "off" | "denoiser" | "all" (denoiser + text encoders).
        Halves those weights; costs a little speed and ~30 dB SQNR per layer.
    fp8_skip: name regexes kept in full precision (norms, embeddings, first/last layers by default).
    keep_original_weights: keep a CPU copy of fp8-converted weights so `restore` is exact.
    channels_last: "auto" (UNet denoisers and the VAE) | True | False. Speed for conv-heavy models.
    compile: "auto" (trace UNets that can be traced, on GPUs) | "none" | "trace" (torch.jit.trace of the
        UNet per input shape, as the diffusers guide does) | "compile" (torch.compile, minutes up front).
    compile_backend: torch.compile backend for compile="compile".
    vae_tiling: "auto" (tile only images larger than a tile) | "on" | "off". Bounded VAE memory.
    vae_slicing: "auto" (when tiling or offload is planned) | True | False. Decode a batch one image at a time.
    offload: "auto" (planner) | "none" | "model" | "group" | "sequential". Memory for speed.
    device: where the pipeline runs; None = where it is. Components on several devices never move.
    memory_budget: e.g. "8GB"; None = the CUDA device's total memory, or no limit on CPU.
    height, width, batch: what the plan is made for (default: the model's default size, batch 1 with CFG).
    """

    attention: str = "auto"
    dtype: object = "auto"
    fp8: str = "auto"
    fp8_skip: tuple = DEFAULT_SKIP
    keep_original_weights: bool = False
    channels_last: object = "auto"
    compile: str = "auto"
    compile_backend: str = "inductor"
    vae_tiling: str = "auto"
    vae_slicing: object = "auto"
    offload: str = "auto"
    device: object = None
    memory_budget: object = None
    height: int | None = None
    width: int | None = None
    batch: int = 2


@dataclass
class Entry:
    component: str
    technique: str
    status: str  # "applied" | "skipped" | "already"
    detail: str = ""


@dataclass
class State:
    options: OptimizeOptions
    plan: planner.Plan | None = None
    entries: list[Entry] = field(default_factory=list)
    undo: list[tuple[str, Callable[[], str]]] = field(default_factory=list)
    traced: nn.Module | None = None


SUPPORTED_DENOISERS = {"UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel"}


def _denoiser(pipe) -> tuple[str, nn.Module] | tuple[None, None]:
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            return name, module
    return None, None


def _unsupported_reason(pipe) -> str | None:
    name, den = _denoiser(pipe)
    if den is None:
        return f"{type(pipe).__name__} has no unet/transformer denoiser"
    cls = type(getattr(den, "_orig_mod", den)).__name__
    if cls not in SUPPORTED_DENOISERS and cls != "TracedUNet":
        return f"denoiser {cls} is not one of {sorted(SUPPORTED_DENOISERS)} (SD1.5, SDXL, SD3, Flux)"
    return None


def _modules(pipe) -> dict[str, nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, nn.Module)}


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _compute_dtype(opts: OptimizeOptions, device: torch.device):
    if opts.dtype == "keep":
        return None
    if opts.dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return opts.dtype


# ---------------------------------------------------------------------------- steps
# Each step: (pipe, opts, state, ctx) -> None; appends Entries and undo closures.

def _step_dtype(pipe, opts, state, ctx):
    dtype = ctx["dtype"]
    if dtype is None:
        state.entries.append(Entry("*", "dtype", "skipped", "dtype='keep'"))
        return
    for name, module in _modules(pipe).items():
        before = getattr(module, "dtype", None)
        if before == dtype:
            state.entries.append(Entry(name, "dtype", "already", str(dtype)))
            continue
        saved = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()} \
            if opts.keep_original_weights else None
        module.to(dtype)
        state.entries.append(Entry(name, "dtype", "applied", f"{before} -> {dtype}"))
        state.undo.append((f"{name}: dtype", functools.partial(_cast_back, module, before, saved)))


def _cast_back(module, dtype, saved):
    module.to(dtype)
    if saved is None:
        return f"cast back to {dtype} (values keep the rounding of the compute dtype)"
    module.load_state_dict(saved)
    return f"cast back to {dtype}, original values reloaded (exact)"


def _step_fp8(pipe, opts, state, ctx):
    mode = ctx["fp8"]
    targets = {"off": [], "denoiser": ["denoiser"], "all": ["denoiser", "text_encoder"]}[mode]
    for name, module in _modules(pipe).items():
        kind = "denoiser" if module is ctx["denoiser"] else "text_encoder" if name.startswith("text_encoder") else name
        if kind not in targets:
            why = "fp8=off" if mode == "off" else f"fp8={mode} does not cover the {kind}"
            if kind == "vae":
                why = "VAE weights stay in the compute dtype (small and quality-sensitive)"
            state.entries.append(Entry(name, "fp8", "skipped", why))
            continue
        report = quantize_fp8(module, skip=opts.fp8_skip, keep_original=opts.keep_original_weights)
        if not report.converted:
            state.entries.append(Entry(name, "fp8", "already" if report.skipped else "skipped",
                                       "no eligible layers left" if report.skipped else "no Linear/Conv2d layers"))
            continue
        state.entries.append(Entry(name, "fp8", "applied", str(report)))
        state.undo.append((f"{name}: fp8", functools.partial(_undo_fp8, module, opts.keep_original_weights)))


def _undo_fp8(module, exact):
    n = len(restore_fp8(module))
    return f"{n} fp8 layers back to plain ones ({'exact originals' if exact else 'dequantised: fp8 rounding stays'})"


def _step_channels_last(pipe, opts, state, ctx):
    targets = {ctx["denoiser_name"]: ctx["denoiser"]}
    if isinstance(getattr(pipe, "vae", None), nn.Module):
        targets["vae"] = pipe.vae
    for name, module in targets.items():
        want = opts.channels_last
        reason = "channels_last=False"
        if want == "auto":
            want = name == "vae" or type(module).__name__ == "UNet2DConditionModel"
            reason = "transformer denoisers have no convolutions to speed up"
        if not want:
            state.entries.append(Entry(name, "channels_last", "skipped", reason))
            continue
        convs = [m.weight for m in module.modules() if isinstance(m, nn.Conv2d) and m.weight.is_floating_point()]
        if convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs):
            state.entries.append(Entry(name, "channels_last", "already", "weights in NHWC order"))
            continue
        module.to(memory_format=torch.channels_last)
        state.entries.append(Entry(name, "channels_last", "applied", "conv weights in NHWC order"))
        state.undo.append((f"{name}: channels_last",
                           lambda m=module: (m.to(memory_format=torch.contiguous_format), "contiguous format again")[1]))


def _step_attention(pipe, opts, state, ctx):
    if opts.attention == "off":
        state.entries.append(Entry("*", "attention", "skipped", "attention='off'"))
        return
    try:
        from pyext import attention
    except ImportError as err:
        state.entries.append(Entry("*", "attention", "skipped", f"pyext.attention unavailable: {err}"))
        return
    report = attention.apply(pipe, backend=None if opts.attention == "auto" else opts.attention)
    state.entries.append(Entry("*", "attention", "applied", str(report).splitlines()[0]))
    state.undo.append(("attention", lambda: f"{len(attention.remove(pipe))} attention processors restored"))


def _step_vae(pipe, opts, state, ctx):
    vae = getattr(pipe, "vae", None)
    if vae is None:
        state.entries.append(Entry("vae", "vae_tiling", "skipped", "pipeline has no VAE"))
        return
    tiling = ctx["vae_tiling"]
    if tiling == "off":
        state.entries.append(Entry("vae", "vae_tiling", "skipped", "vae_tiling='off'"))
    else:
        try:
            from pyext import vae as pvae
        except ImportError as err:
            state.entries.append(Entry("vae", "vae_tiling", "skipped", f"pyext.vae unavailable: {err}"))
        else:
            report = pvae.tile_vae(vae)  # diffusers still decides per image: tiles only when larger than a tile
            state.entries.append(Entry("vae", "vae_tiling", "applied", str(report)))
            state.undo.append(("vae: tiling", lambda: (pvae.untile_vae(vae), "diffusers' VAE decode again")[1]))
    slicing = opts.vae_slicing
    if slicing == "auto":
        slicing = tiling == "on" or ctx["offload"] != "none"
    if slicing and not getattr(vae, "use_slicing", False) and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
        state.entries.append(Entry("vae", "vae_slicing", "applied", "batches decode one image at a time"))
        state.undo.append(("vae: slicing", lambda: (vae.disable_slicing(), "slicing off")[1]))


def _step_compile(pipe, opts, state, ctx):
    name, den = ctx["denoiser_name"], ctx["denoiser"]
    if opts.compile == "none":
        state.entries.append(Entry(name, "compile", "skipped", "compile='none' (compilation costs minutes up front)"))
        return
    if opts.compile == "auto":
        from pyext.traced import trace_reason

        reason = trace_reason(den, ctx["offload"])
        if not reason and ctx["device"].type == "cpu":
            # Measured on SD1.5 (cpu bench preset): the trace saves ~4% of UNet time once
            # pyext attention runs, but its graph keeps ~0.2 GB more resident per run.
            reason = "on CPU a trace saves ~4% of UNet time for ~0.2 GB more memory; compile='trace' takes that trade"
        if reason:  # nothing cheap and safe to do: say so, stay eager
            state.entries.append(Entry(name, "compile", "skipped", f"auto: {reason}; compile='compile' is an option"))
            return
    if opts.compile == "compile":
        if getattr(den, "_compiled_call_impl", None) is not None:
            state.entries.append(Entry(name, "compile", "already", "torch.compile"))
            return
        den.compile(backend=opts.compile_backend)  # in place: hooks and attribute access keep working
        state.entries.append(Entry(name, "compile", "applied", f"torch.compile(backend={opts.compile_backend!r})"))
        state.undo.append((f"{name}: compile", lambda: (setattr(den, "_compiled_call_impl", None), "eager again")[1]))
        return
    from pyext.traced import TracedUNet, trace_reason

    if isinstance(den, TracedUNet) or isinstance(getattr(pipe, "unet", None), TracedUNet):
        state.entries.append(Entry(name, "compile", "already", "traced"))
        return
    reason = trace_reason(den, ctx["offload"])
    if reason:
        state.entries.append(Entry(name, "compile", "skipped", f"trace: {reason}"))
        return
    pipe.unet = TracedUNet(den)
    state.entries.append(Entry(name, "compile", "applied", pipe.unet.describe()))
    state.undo.append((f"{name}: trace", lambda: (setattr(pipe, "unet", den), "eager UNet again")[1]))


def _step_offload(pipe, opts, state, ctx):
    mode, device = ctx["offload"], ctx["device"]
    existing = offload.detect(pipe).mode
    if existing == "device_map":
        state.entries.append(Entry("*", "offload", "skipped", ctx["offload_reason"]))
        return
    if existing != "none":
        state.entries.append(Entry("*", "offload", "already", f"pipeline already uses {existing}; kept as it is"))
        return
    if mode == "none":
        state.entries.append(Entry("*", "offload", "skipped", ctx["offload_reason"]))
        return
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        for module in _modules(pipe).values():
            if hasattr(module, "enable_group_offload"):
                module.enable_group_offload(onload_device=device, offload_device="cpu", offload_type="block_level",
                                            num_blocks_per_group=1, use_stream=device.type == "cuda")
    state.entries.append(Entry("*", "offload", "applied", f"{mode} offload to {device}"))
    saved = offload.detect(pipe)
    state.undo.append(("offload", lambda: (offload.remove(pipe, saved), f"{mode} offload removed")[1]))


# ---------------------------------------------------------------------------- the call

def _decide(pipe, opts: OptimizeOptions, den_name: str, den: nn.Module) -> dict:
    """Device, dtype, resolution and the memory plan: what the steps will do."""
    devices = {_device_of(m) for m in _modules(pipe).values()}
    multi_device = bool(getattr(pipe, "hf_device_map", None)) or len(devices) > 1
    device = torch.device(opts.device) if opts.device is not None else _device_of(den)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = _compute_dtype(opts, device)
    scale = getattr(pipe, "vae_scale_factor", 8)
    default = (getattr(den.config, "sample_size", 64) or 64) * scale  # the pipelines' own default size
    height, width = opts.height or default, opts.width or default
    budget = planner.parse_bytes(opts.memory_budget)
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    elem = torch.tensor([], dtype=dtype or den.dtype).element_size()
    can_offload = device.type != "cpu" and not multi_device
    plan = planner.plan(pipe, budget, height, width, opts.batch, min(elem, 2), allow_offload=can_offload)
    fp8 = plan.fp8 if opts.fp8 == "auto" else opts.fp8
    if opts.offload == "auto":
        offload_mode = plan.offload if can_offload else "none"
        offload_reason = ("the plan fits without offload" if can_offload else
                          "components sit on several devices (device map): pyext never moves them" if multi_device
                          else "the pipeline runs on the CPU: there is nothing to offload to")
    else:
        offload_mode, offload_reason = opts.offload, f"offload={opts.offload!r}"
    tiling = opts.vae_tiling if opts.vae_tiling != "auto" else ("on" if plan.vae_tiling else "auto")
    return dict(denoiser=den, denoiser_name=den_name, device=device, dtype=dtype, height=height, width=width,
                plan=plan, fp8=fp8, offload=offload_mode, offload_reason=offload_reason, vae_tiling=tiling,
                multi_device=multi_device)


def optimize(pipe, options: OptimizeOptions | None = None, **kwargs):
    """Make this pipeline faster and leaner in place; returns it. See OptimizeOptions."""
    opts = options or OptimizeOptions()
    for key, value in kwargs.items():
        if not hasattr(opts, key):
            raise TypeError(f"pyext.optimize: unknown option {key!r}; options are {list(asdict(OptimizeOptions()))}")
        setattr(opts, key, value)
    state = getattr(pipe, "_pyext_state", None) or State(opts)
    state.options = opts
    reason = _unsupported_reason(pipe)
    if reason:
        state.entries.append(Entry("*", "optimize", "skipped", f"left untouched: {reason}"))
        pipe._pyext_state = state
        return pipe
    den_name, den = _denoiser(pipe)
    den = getattr(den, "unet", den)  # a traced UNet wraps the eager one
    ctx = _decide(pipe, opts, den_name, den)
    state.plan = ctx["plan"]
    with offload.suspended(pipe):
        for step in (_step_dtype, _step_fp8, _step_channels_last, _step_attention, _step_vae):
            step(pipe, opts, state, ctx)
    if opts.device is not None and ctx["offload"] == "none" and not ctx["multi_device"]:
        before = _device_of(den)
        if before != ctx["device"]:
            pipe.to(ctx["device"])
            state.undo.append(("device", lambda: (pipe.to(before), f"moved back to {before}")[1]))
    _step_offload(pipe, opts, state, ctx)
    _step_compile(pipe, opts, state, ctx)  # last: it captures the final modules
    pipe._pyext_state = state
    release_freed_memory()
    return pipe


@dataclass
class Report:
    pipeline: str
    plan: str
    entries: list[Entry]
    weight_bytes: dict[str, int]

    def to_dict(self) -> dict:
        return dict(pipeline=self.pipeline, plan=self.plan, entries=[asdict(e) for e in self.entries],
                    weight_bytes=self.weight_bytes)

    def __str__(self) -> str:
        lines = [f"pyext report for {self.pipeline}", f"  {self.plan}"]
        lines += [f"  {e.component:<15} {e.technique:<14} {e.status:<8} {e.detail}" for e in self.entries]
        total = sum(self.weight_bytes.values())
        lines.append("  weights: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in self.weight_bytes.items())
                     + f" (total {total / 2**20:.0f} MiB)")
        return "\n".join(lines)


def _weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def report(pipe) -> Report:
    state = getattr(pipe, "_pyext_state", None)
    weights = {name: _weight_bytes(m) for name, m in _modules(pipe).items()}
    if state is None:
        return Report(type(pipe).__name__, "not optimized by pyext", [], weights)
    plan = state.plan.describe() if state.plan else "no plan"
    return Report(type(pipe).__name__, plan, list(state.entries), weights)


def restore(pipe) -> list[str]:
    """Undo what optimize did, newest first; returns what each undo did (and what stays lossy)."""
    state = getattr(pipe, "_pyext_state", None)
    if state is None:
        return ["nothing to restore: pipeline was not optimized by pyext"]
    notes = []
    with offload.suspended(pipe):
        for name, undo in reversed(state.undo):
            if name == "offload":  # pyext's own offload: undone outside the suspension below
                continue
            notes.append(f"{name}: {undo()}")
    for name, undo in reversed(state.undo):
        if name == "offload":
            notes.append(f"{name}: {undo()}")
    del pipe._pyext_state
    return notes
