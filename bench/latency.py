"""The SD1.5 latency table of diffusers' memory guide, end to end, one row per optimisation, and
the same rows at the anchors' workloads, SDXL and Flux (`--model-arch`).

    python -m bench.latency --preset {gpu,cpu,tiny} [--model-arch {sd15,sdxl,flux}] --out DIR
                            [--model PATH_OR_ID] [--rows a,b,c] [--repeats N] [--rounds N]

Each row runs in a fresh process (forked from a clean server): rows cannot leak state (patched
attention, compiled graphs, allocator caches) into each other, and the process's
peak memory is that row's. The parent builds the model once (random weights from
pyext.offline unless --model names real ones), saves it, and every row loads it.
Outputs in DIR: latency.json, latency.md, latency.png, images/<row>.pt, logs/<row>.log.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import multiprocessing
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

PROMPT = "a photo of an astronaut riding a horse on mars"
SEED = 0


@dataclass(frozen=True)
class Preset:
    size: str            # pyext.offline size of the arch when no --model is given
    device: str
    height: int
    width: int
    steps: int           # DDIM steps of a timed run
    warmup_steps: int    # steps of the untimed warm-up run (same shapes, so kernels/caches are ready)
    repeats: int         # timed runs; the row reports their median
    row_timeout_s: int   # a row still running after this is reported as timed out
    skip: tuple = ()     # ((row, reason), ...) rows this preset does not run
    # ((row, why), ...) rows this preset runs only when --rows names them: what keeps its default
    # run (`make bench`) within minutes.
    opt_in: tuple = ()
    threads: int = 0     # torch.set_num_threads in each row; 0 keeps torch's default
    emulated_bf16: bool = False  # half rows in bf16 on a CPU without native bf16 (tiny sizes only)
    # Steps of the image each row's check compares with the original row's (0: the timed image).
    # With random weights a long run amplifies rounding until an fp16 and an fp32 run give
    # unrelated images, plain diffusers' too; a short run keeps rounding apart from an unrelated
    # seed, the level a broken kernel falls to.
    check_steps: int = 0
    arch: str = "sd15"   # pyext.offline arch: the pipeline family
    guidance_scale: float = 7.5
    call: tuple = ()     # ((argument, value), ...) the pipeline call takes besides the shared ones
    half: str = ""       # the half rows' dtype (a torch name); "" is half_dtype's choice for the device
    load_half: bool = False  # every row loads the half dtype, the full-precision ones (original, pyext_*) too
    # Weights made on the device by each row (pyext.offline's on_device), not saved by the parent: a
    # model the host would take minutes to build and write. No text encoders: the rows pass seeded
    # prompt embeddings of the shapes they give (prompt_inputs).
    on_device: bool = False


# Rows that take SD1.5's UNet call (sample, timestep, text): the guide's traced UNet and OpenVINO.
_SD15_UNET_ONLY = (("traced_unet", "the guide's traced UNet takes SD1.5's UNet call (sample, timestep, text); "
                                   "this denoiser takes more (added conditioning, or a transformer's inputs)"),
                   ("openvino", "the OpenVINO row converts SD1.5's UNet call (sample, timestep, text) only"))
_NO_DENOISER_CONVS = (("pyext_fp8_linear_compile", "this denoiser has no convolutions: the row would be pyext_fp8_compile's"),)
_INT8_ON_CUDA = tuple((row, "an int8 row is the CPU presets' peer of fp8 weights; on CUDA the fp8 rows are")
                      for row in ("torchao_int8_weight_only", "torchao_int8_dynamic"))
PRESETS = {
    # The guide's setting: one 512x512 image, 50 DDIM steps, classifier-free guidance (UNet batch 2).
    # A 3-step warm-up: a UNet call per step, so pyext's captured UNet has run eagerly, captured and
    # replayed, and inductor's has compiled and recorded its CUDA graph before the timed run.
    "gpu": Preset("full", "cuda", 512, 512, 50, 3, 3, 900, check_steps=2, skip=_INT8_ON_CUDA),
    # The same full SD1.5 architecture, scaled to finish all rows in minutes on 2 cores:
    # 256x256 instead of 512x512 (latents 32x32 instead of 64x64), 2 steps instead of 50,
    # median of 3 timed runs after a 1-step warm-up. A long row timeout leaves torch.compile its chance.
    # The rows that compile with inductor (minutes each on 2 cores with a cold cache) run when named.
    "cpu": Preset("full", "cpu", 256, 256, 2, 1, 3, 600, opt_in=(
        *((row, "inductor compiles it: 2-7 minutes on 2 cores with a cold cache")
          for row in ("torchao_fp8_weight_only", "torchao_int8_weight_only", "torchao_int8_dynamic",
                      "torch_compile", "torch_compile_freezing", "pyext_fp8_compile", "pyext_fp8_linear_compile",
                      "pyext_fp8_all_compile")),
        ("pyext_eager", "on a CPU pyext.optimize does not compile, so this row is pyext_optimize's"))),
    # CI: the tiny sd15 of pyext.offline, seconds for all rows.
    # One thread: tiny ops gain nothing from two, and on a shared machine a stalled
    # second thread only adds noise.
    "tiny": Preset("tiny", "cpu", 64, 64, 2, 1, 1, 120, threads=1, emulated_bf16=True, skip=(
        ("torch_compile", "not run in preset tiny: inductor needs minutes on CPU; see presets cpu/gpu"),
        ("torch_compile_freezing", "not run in preset tiny: inductor needs minutes on CPU; see preset cpu"),
        *((row, "not run in preset tiny: inductor needs minutes on CPU; see preset cpu")
          for row in ("pyext_fp8_compile", "pyext_fp8_linear_compile", "pyext_fp8_all_compile")),
        # torchao_fp8_dynamic runs: torchao refuses the CPU before anything is compiled.
        *((row, "not run in preset tiny: its torch.compile needs minutes on CPU; see presets cpu/gpu")
          for row in ("torchao_fp8_weight_only", "torchao_int8_weight_only", "torchao_int8_dynamic")))),
}

# The anchors' workloads (--model-arch): SDXL at 1024x1024, 30 Euler steps, and Flux.1-dev's
# architecture at 1024x1024, 28 steps, on a GPU; on a CPU the pyext.offline "bench" sizes of both
# (the published denoiser widths with fewer layers; text encoders of the published widths cut to 2
# layers, T5 to 1) at 256x256, 2 steps, median of 2 timed runs after a 1-step warm-up.
ARCH_PRESETS = {
    "sdxl": {
        "gpu": Preset("full", "cuda", 1024, 1024, 30, 3, 3, 900, check_steps=2, arch="sdxl",
                      skip=_INT8_ON_CUDA + _SD15_UNET_ONLY),
        "cpu": Preset("bench", "cpu", 256, 256, 2, 1, 2, 900, arch="sdxl", skip=_SD15_UNET_ONLY),
    },
    # On a GPU, Flux.1-dev as it ships: every row loads bf16 (fp16 overflows in its activations),
    # so the original row is the bf16 eager one; weights made on the device, T5-XXL and CLIP replaced
    # by prompt embeddings.
    "flux": {
        "gpu": Preset("full", "cuda", 1024, 1024, 28, 3, 3, 900, check_steps=2, arch="flux", guidance_scale=3.5,
                      half="bfloat16", load_half=True, on_device=True, skip=_INT8_ON_CUDA + _SD15_UNET_ONLY + _NO_DENOISER_CONVS + (
                          ("fp16", "every row loads Flux.1-dev's bf16 here: the original row is this row"),)),
        "cpu": Preset("bench", "cpu", 256, 256, 2, 1, 2, 900, arch="flux", guidance_scale=3.5,
                      call=(("max_sequence_length", 128),), skip=_SD15_UNET_ONLY + _NO_DENOISER_CONVS),
    },
}


def preset_of(name: str, arch: str = "sd15") -> Preset:
    """The preset `name` for `arch`: PRESETS for sd15, ARCH_PRESETS for the others."""
    if arch == "sd15":
        return PRESETS[name]
    if name not in ARCH_PRESETS.get(arch, {}):
        raise SystemExit(f"bench.latency: no preset {name!r} for arch {arch!r}; "
                         f"it has {sorted(ARCH_PRESETS.get(arch, {}))}")
    return ARCH_PRESETS[arch][name]


def denoiser_name(pipe) -> str:
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def _denoiser(pipe):
    return getattr(pipe, denoiser_name(pipe))


def _set_denoiser(pipe, module) -> None:
    setattr(pipe, denoiser_name(pipe), module)


# row -> (half precision?, steps applied in order). Cumulative like the guide's table, with two
# restarts: the attention rows start again from channels_last (a traced graph freezes the
# attention it was traced with), and pyext_optimize gets the pipeline as `original` loads it
# (fp32): the one call decides dtype, attention, fp8, memory format itself.
ROWS = {
    "original": (False, ("classic_attention",)),
    "fp16": (True, ("classic_attention",)),
    "channels_last": (True, ("classic_attention", "channels_last")),
    "traced_unet": (True, ("classic_attention", "channels_last", "trace_unet")),
    "memory_efficient_attention": (True, ("channels_last", "sdpa_attention", "pyext_attention")),
    "sdpa_attention": (True, ("channels_last", "sdpa_attention")),
    "xformers": (True, ("channels_last", "xformers")),
    "pyext_fp8": (True, ("channels_last", "sdpa_attention", "pyext_fp8")),
    # The peers of pyext_fp8 that diffusers' quantization guide names, on pyext_fp8's base: torchao's
    # float8 configs, compiled as torchao documents (and its int8 configs, the CPU presets' peers of
    # fp8 weights), optimum-quanto's qfloat8 weights, diffusers' own layerwise casting.
    "torchao_fp8_weight_only": (True, ("channels_last", "sdpa_attention", "torchao_fp8_weight_only", "torchao_compile")),
    "torchao_fp8_dynamic": (True, ("channels_last", "sdpa_attention", "torchao_fp8_dynamic", "torchao_compile")),
    "torchao_int8_weight_only": (True, ("channels_last", "sdpa_attention", "torchao_int8_weight_only", "torchao_compile")),
    "torchao_int8_dynamic": (True, ("channels_last", "sdpa_attention", "torchao_int8_dynamic", "torchao_compile")),
    "quanto_fp8": (True, ("channels_last", "sdpa_attention", "quanto_fp8")),
    "diffusers_layerwise_fp8": (True, ("channels_last", "sdpa_attention", "diffusers_layerwise_fp8")),
    "pyext_optimize": (False, ("pyext_optimize",)),
    "pyext_fp8_dynamic": (False, ("pyext_fp8_dynamic",)),
    "pyext_fp8_compile": (False, ("pyext_fp8_compile",)),
    "pyext_fp8_linear_compile": (False, ("pyext_fp8_linear_compile",)),
    "pyext_fp8_all_compile": (False, ("pyext_fp8_all_compile",)),
    "pyext_eager": (False, ("pyext_eager",)),
    "pyext_cudagraphs": (False, ("pyext_cudagraphs",)),
    "torch_compile": (True, ("channels_last", "sdpa_attention", "torch_compile")),
    "torch_compile_cudagraphs": (True, ("channels_last", "sdpa_attention", "torch_compile_cudagraphs")),
    # CPU runtimes: inductor with weight freezing, and OpenVINO converted from the
    # same fp32 modules, computing in bf16 where the CPU has it natively (OpenVINO's own default).
    "torch_compile_freezing": (True, ("channels_last", "sdpa_attention", "torch_compile_freezing")),
    "openvino": (False, ("sdpa_attention", "openvino")),
}

# The pyext rows: optimize's options beyond the plan size. pyext_optimize takes the defaults (on CUDA
# the denoiser replays captured CUDA graphs), pyext_eager the same without them, pyext_cudagraphs
# inductor's CUDA graphs instead, pyext_fp8_dynamic the denoiser's linears in fp8 with activations
# quantized per row (fp8 x fp8 GEMMs: the setting of torchao_fp8_dynamic), pyext_fp8_compile the
# denoiser in fp8 and compiled by inductor (with freezing on a CPU), as the torchao rows compile theirs;
# pyext_fp8_linear_compile the same with the linears only in fp8, the layers torchao's rows quantize;
# pyext_fp8_all_compile with no layer kept by name (fp8_skip=()): the embedders, first and last layers
# that pyext keeps in full precision by default go to fp8 too, as in torchao's rows.
PYEXT_OPTIONS = {"pyext_optimize": {}, "pyext_eager": {"compile": "off"}, "pyext_cudagraphs": {"compile": "cudagraphs"},
                 "pyext_fp8_dynamic": {"fp8": "denoiser", "fp8_gemm": "dynamic"},
                 "pyext_fp8_compile": {"fp8": "denoiser", "compile": "compile"},
                 "pyext_fp8_linear_compile": {"fp8": "denoiser", "fp8_layers": "linear", "compile": "compile"},
                 "pyext_fp8_all_compile": {"fp8": "denoiser", "fp8_skip": (), "compile": "compile"}}

# The torchao rows' configs: classes of torchao.quantization.
TORCHAO_CONFIGS = {
    "torchao_fp8_weight_only": "Float8WeightOnlyConfig",
    "torchao_fp8_dynamic": "Float8DynamicActivationFloat8WeightConfig",
    "torchao_int8_weight_only": "Int8WeightOnlyConfig",
    "torchao_int8_dynamic": "Int8DynamicActivationInt8WeightConfig",
}

# Where the peers come from: `make bench` installs them from requirements-bench.txt; pyext needs none.
PEER_PACKAGES = {**{row: "torchao" for row in TORCHAO_CONFIGS}, "quanto_fp8": "optimum.quanto"}

# The guide's published Titan RTX figures (seconds), shown beside ours for reference.
GUIDE_TITAN_RTX = {"original": 9.50, "fp16": 3.61, "channels_last": 3.30, "traced_unet": 3.21,
                  "memory_efficient_attention": 2.63}

# A row whose image is this far from the original row's is flagged. fp16/bf16 through the
# whole pipeline stays well above it; a broken kernel (wrong head split, garbage) falls to
# the level of an unrelated image, which latency.json reports as "unrelated_psnr_db".
MIN_PSNR_DB = 20.0


class RowUnavailable(Exception):
    """This row cannot run here; the message is the reason shown in the table."""


def half_dtype(preset: Preset):
    # CPU has no fast fp16 GEMM; bf16 is the CPU's half precision (labelled so in the table) where
    # oneDNN computes it natively. Elsewhere bf16 is emulated, ~100x slower: the cpu preset's rows
    # stay fp32 there, while the tiny preset keeps bf16 so that CI runs the bf16 path everywhere.
    from pyext._compat import cpu_has_native_bf16

    if preset.half:
        return getattr(torch, preset.half)
    if preset.device == "cuda":
        return torch.float16
    return torch.bfloat16 if preset.emulated_bf16 or cpu_has_native_bf16() else torch.float32


def row_dtype(name: str, preset: Preset) -> torch.dtype:
    """The dtype a row loads its pipeline in."""
    return half_dtype(preset) if ROWS[name][0] or preset.load_half else torch.float32


def bench_dtype(name: str = "auto") -> torch.dtype:
    """The kernel benches' dtype: `name`, or for "auto" the one pyext.optimize computes in on the
    device they run on (pyext.decision.auto_dtype)."""
    from pyext.decision import auto_dtype

    if name != "auto":
        return getattr(torch, name)
    return auto_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def unavailable(name: str, preset: Preset, named: bool = False) -> str | None:
    """Why a row cannot run here, when that is known without loading a model; else None. `named`:
    --rows names the row, which runs it where the preset leaves it out by default."""

    skipped = dict(preset.skip).get(name)
    if skipped:
        return skipped
    steps = ROWS[name][1]
    if (preset.device == "cpu" and name != "original" and steps == ROWS["original"][1]
            and row_dtype(name, preset) == row_dtype("original", preset)):
        return (f"the half rows run {str(row_dtype(name, preset)).replace('torch.', '')} here (no native half "
                f"precision on this CPU): this row would run the original row's configuration again")
    if "xformers" in steps:
        if importlib.util.find_spec("xformers") is None:
            return "xformers not installed"
        if preset.device != "cuda":
            return "xformers memory-efficient attention needs CUDA"
    if any("cudagraphs" in step for step in steps) and preset.device != "cuda":
        return "CUDA graphs need a CUDA device"
    if "pyext_fp8_dynamic" in steps and preset.device != "cuda":
        return "fp8 x fp8 GEMMs need a GPU's fp8 tensor cores (sm_89+); on a CPU pyext_fp8 is the fp8 row"
    if name in PEER_PACKAGES and not _installed(PEER_PACKAGES[name]):
        return f"{PEER_PACKAGES[name]} not installed (pip install -r requirements-bench.txt)"
    if "openvino" in steps:
        from bench.cpu_runtimes import unavailable as runtime_unavailable
        if preset.device != "cpu":
            return "the openvino row is for CPU presets"
        if missing := runtime_unavailable("openvino"):
            return missing
    why = dict(preset.opt_in).get(name)  # (last: a row that cannot run here says so, named or not)
    if why and not named:
        return f"not in this preset's default run ({why}); `--rows {name}` (make bench ROWS={name}) runs it"
    return None


def _installed(module: str) -> bool:

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


# ---------------------------------------------------------------- row steps
class TracedUNet(torch.nn.Module):
    """The guide's wrapper: the pipeline keeps calling `pipe.unet(...)`, the traced graph runs."""

    def __init__(self, unet, traced):
        super().__init__()
        self.traced = traced  # a ScriptModule holding the UNet's weights
        self.config, self.dtype, self.device = unet.config, unet.dtype, unet.device
        self.in_channels = unet.config.in_channels

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True, **unused):
        extra = {k: v for k, v in unused.items() if v is not None}
        if extra:  # the graph was traced without them: refuse rather than ignore
            raise RuntimeError(f"TracedUNet: traced without {sorted(extra)}")
        out = self.traced(sample, timestep, encoder_hidden_states)[0]
        if return_dict:
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
            return UNet2DConditionOutput(sample=out)
        return (out,)


def _trace_unet(pipe, preset):
    from bench.cpu_runtimes import example_inputs

    unet = pipe.unet
    dev, dtype = unet.device, unet.dtype
    # As the pipeline calls it: CFG batch 2, a 0-d integer timestep, 77 text tokens.
    inputs = tuple(a.to(dev, dtype) if a.is_floating_point() else a.to(dev)
                   for a in example_inputs(pipe, preset.height, preset.width)[0])
    unet.forward = functools.partial(unet.forward, return_dict=False)  # as the guide: tuples trace
    with torch.no_grad():
        traced = torch.jit.trace(unet, inputs, check_trace=False)
    pipe.unet = TracedUNet(unet, traced)


def _apply_step(pipe, step, preset, notes: dict):
    """Applies one row step to `pipe` (returns the pipeline); what it did goes to `notes`."""
    from diffusers.models import attention_processor as ap

    if step in ("classic_attention", "sdpa_attention"):
        # classic: the pre-PyTorch-2 processor, explicit softmax(QK^T)V. Transformers' own processors
        # (Flux's) call SDPA and have no classic form: they keep theirs, and the VAE's is set.
        processor = ap.AttnProcessor() if step == "classic_attention" else ap.AttnProcessor2_0()
        if denoiser_name(pipe) == "unet":
            pipe.unet.set_attn_processor(processor)
        else:
            notes.setdefault("attention", f"{type(_denoiser(pipe)).__name__} keeps its own attention processors "
                                          "(SDPA); the steps classic_attention/sdpa_attention set the VAE's")
        pipe.vae.set_attn_processor(processor)
    elif step == "channels_last":
        _denoiser(pipe).to(memory_format=torch.channels_last)
    elif step == "trace_unet":
        _trace_unet(pipe, preset)
    elif step == "pyext_attention":
        try:
            import pyext.attention
        except ImportError as e:
            raise RowUnavailable(f"pyext.attention not available ({e})")
        report = pyext.attention.apply(pipe)
        if report.patched == 0:
            raise RuntimeError(f"pyext.attention patched no layer: {report}")
    elif step == "xformers":
        try:
            import xformers  # noqa: F401
        except ImportError as e:
            raise RowUnavailable(f"xformers not installed ({e})")
        if preset.device != "cuda":
            raise RowUnavailable("xformers memory-efficient attention needs CUDA")
        pipe.enable_xformers_memory_efficient_attention()
    elif step == "pyext_fp8":
        import pyext

        report = pyext.quantize_fp8(_denoiser(pipe))
        notes["pyext_fp8"] = (f"{len(report.converted)} {denoiser_name(pipe)} layers in fp8, their weights "
                              f"{report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f} MiB")
    elif step in TORCHAO_CONFIGS:
        from torchao import quantization

        cls = TORCHAO_CONFIGS[step]
        # fp8 dynamic with row-wise scales (torchao's default is one per tensor): the setting of
        # diffusers-torchao's published Flux figures
        config = (getattr(quantization, cls)(granularity=quantization.PerRow()) if step == "torchao_fp8_dynamic"
                  else getattr(quantization, cls)())
        with _weights_note(pipe, notes, step, f"torchao {cls}"):
            try:
                quantization.quantize_(_denoiser(pipe), config)
            except AssertionError as e:  # torchao states what a config needs of the hardware as assertions
                raise RowUnavailable(f"torchao refuses {cls} here: {e}")
    elif step == "torchao_compile":  # torchao's and diffusers' documented line for a quantized denoiser
        _set_denoiser(pipe, torch.compile(_denoiser(pipe), mode="max-autotune", fullgraph=True))
    elif step == "quanto_fp8":
        from optimum.quanto import freeze, qfloat8, quantize

        with _weights_note(pipe, notes, step, "optimum-quanto qfloat8"):
            quantize(_denoiser(pipe), weights=qfloat8)
            freeze(_denoiser(pipe))
    elif step == "diffusers_layerwise_fp8":  # stored in fp8, each layer cast up to the row's dtype to compute
        with _weights_note(pipe, notes, step, "diffusers layerwise casting"):
            _denoiser(pipe).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                     compute_dtype=_denoiser(pipe).dtype)
    elif step in PYEXT_OPTIONS:
        import pyext

        pipe = pyext.optimize(pipe, height=preset.height, width=preset.width, **PYEXT_OPTIONS[step]) or pipe
        notes[step] = " ".join(str(pyext.report(pipe)).split())
    elif step == "torch_compile":
        _set_denoiser(pipe, torch.compile(_denoiser(pipe)))
    elif step == "torch_compile_cudagraphs":
        _set_denoiser(pipe, torch.compile(_denoiser(pipe), mode="reduce-overhead"))
    elif step == "torch_compile_freezing":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # this row's process only
        _set_denoiser(pipe, torch.compile(_denoiser(pipe)))
    elif step == "openvino":
        from bench import cpu_runtimes

        unet, decode = cpu_runtimes.openvino_calls(pipe, *cpu_runtimes.example_inputs(pipe, preset.height, preset.width),
                                                   threads=preset.threads)
        pipe.unet = TracedUNet(pipe.unet, unet)
        pipe.vae.decode = lambda latents, return_dict=False, **unused: (decode(latents),)
        notes["openvino"] = f"OpenVINO {cpu_runtimes.openvino_version()}, inference precision {unet.precision}"
    else:
        raise ValueError(f"unknown step {step!r}")
    return pipe


@contextlib.contextmanager
def _weights_note(pipe, notes: dict, step: str, what: str):
    """Notes what the quantization inside the block did to the denoiser: its layers whose weight
    became another type or dtype, and its weight bytes before and after."""
    name = denoiser_name(pipe)

    def kinds():
        return {layer: (type(m.weight), m.weight.dtype) for layer, m in _denoiser(pipe).named_modules()
                if isinstance(getattr(m, "weight", None), torch.Tensor)}

    before, bytes_before = kinds(), component_weight_bytes(pipe, (name,))[name]
    yield
    after = kinds()
    changed = sum(after.get(layer) != kind for layer, kind in before.items())
    notes[step] = (f"{what}: weights of {changed} {name} layers converted, {name} weights "
                   f"{bytes_before / 2**20:.1f} -> {component_weight_bytes(pipe, (name,))[name] / 2**20:.1f} MiB")


# ---------------------------------------------------------------- measuring one row
class StageClock:
    """Time per pipeline stage, by wrapping the components' entry points on this instance. On CUDA
    a stage is timed by CUDA events on the current stream, and `totals` is read after the run's
    synchronize: the host never waits for the GPU between calls, as in a user's run (a sync per
    call would keep the host from queueing the next step while the GPU works)."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        self.marks = []  # (stage, start, end): perf_counter() values, or recorded CUDA events

    def wrap(self, owner, attr, stage):
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = self._now()
            out = inner(*args, **kwargs)
            self.marks.append((stage, start, self._now()))
            return out
        # A module compiled in place (pyext's compile="compile") traces its forward, this wrapper
        # included: the clock's own frame stays eager (no guards on its marks, no recompiles), the
        # forward it calls is compiled.
        setattr(owner, attr, torch.compiler.disable(timed, recursive=False, reason="bench.latency's stage clock"))

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per stage since reset (on CUDA, once the GPU has done the work timed)."""
        totals = {}
        for stage, start, end in self.marks:
            totals[stage] = totals.get(stage, 0.0) + (start.elapsed_time(end) / 1e3 if self.cuda else end - start)
        return totals

    def reset(self):
        self.marks = []


def _tensor_key(t: torch.Tensor):
    """What identifies a tensor's memory: its storage address, or the tensor itself for one that
    holds its data where torch gives no address (oneDNN's packed layout)."""
    return id(t) if t.is_mkldnn else t.data_ptr() or id(t)


def _storage_tensors(t: torch.Tensor):
    """The tensors holding `t`'s data: `t`, or for a wrapper subclass (torchao's and optimum-quanto's
    quantized weights, whose dtype is the dtype they compute in; pyext's fp8 weights) its inner
    tensors: codes, scales."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from pyext.nn.stored import StoredWeight

    if isinstance(t, StoredWeight):
        yield from t.stored_tensors()
        return
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    for attr in t.__tensor_flatten__()[0]:
        yield from _storage_tensors(getattr(t, attr))


def component_weight_bytes(pipe, names=None) -> dict[str, int]:
    """Bytes of parameters and buffers per module of the pipeline, each tensor counted once (in the
    first module holding it); fp8 codes are 1 byte, a quantized tensor subclass counts its inner tensors."""
    seen, sizes = set(), {}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and (names is None or name in names):
            sizes[name] = 0
            for t in list(module.parameters()) + list(module.buffers()):
                for stored in _storage_tensors(t):
                    if _tensor_key(stored) not in seen:
                        seen.add(_tensor_key(stored))
                        sizes[name] += stored.numel() * stored.element_size()
    return sizes


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM, so the peak covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def run_row(name: str, spec: dict) -> dict:
    """Runs one row in this process; returns its measurements (and writes its image)."""
    import pyext.offline

    preset = Preset(**spec["preset"])
    steps = ROWS[name][1]
    dtype = row_dtype(name, preset)
    if preset.threads:
        torch.set_num_threads(preset.threads)
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    if preset.on_device:
        pipe = pyext.offline.build_pipeline(preset.arch, preset.size, dtype=dtype, seed=SEED, device=preset.device,
                                            on_device=True, without=PROMPT_ENCODERS[preset.arch])
    else:
        pipe = pyext.offline.load_pipeline(spec["model_path"], dtype=dtype, device=preset.device)
    from diffusers import DDIMScheduler
    if preset.arch == "sd15" and not isinstance(pipe.scheduler, DDIMScheduler):
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)  # the guide's table is DDIM (real SD1.5 ships PNDM)
    notes = {}
    for step in steps:
        pipe = _apply_step(pipe, step, preset, notes)
    prompt = prompt_inputs(pipe, preset)  # after the steps: embeddings in the dtype the denoiser computes in
    clock = StageClock(preset.device)
    for encoder in TEXT_ENCODERS:
        if getattr(pipe, encoder, None) is not None:
            clock.wrap(getattr(pipe, encoder), "forward", "text_encoding")
    clock.wrap(_denoiser(pipe), "forward", "denoising")
    clock.wrap(pipe.vae, "decode", "vae_decode")

    def generate(n_steps, seed=SEED):
        with torch.inference_mode():
            return pipe(**prompt, height=preset.height, width=preset.width, num_inference_steps=n_steps,
                        guidance_scale=preset.guidance_scale, output_type="pt",
                        generator=torch.Generator("cpu").manual_seed(seed), **dict(preset.call)).images

    generate(preset.warmup_steps)
    setup_s = time.perf_counter() - t0
    if preset.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_reset = _reset_peak_rss() if preset.device == "cpu" else False
    runs = []
    for _ in range(spec["repeats"]):
        clock.reset()
        t = time.perf_counter()
        image = generate(preset.steps)
        if preset.device == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t, dict(clock.totals)))
    if preset.device == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated during timed runs"
    else:
        peak = _peak_rss_bytes()
        peak_kind = "process peak RSS (VmHWM) " + ("during timed runs" if rss_reset else "incl. loading")
    latency, stages = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    result = {
        "latency_s": latency, "latencies_s": [r[0] for r in runs], "setup_s": setup_s,
        "stages_s": {**stages, "other": latency - sum(stages.values())},
        "denoiser_it_per_s": preset.steps / stages["denoising"] if stages.get("denoising") else None,
        "peak_memory_bytes": peak, "peak_memory_kind": peak_kind,
        "weight_bytes": sum(component_weight_bytes(pipe, (denoiser_name(pipe), *TEXT_ENCODERS, "vae")).values()),
        "dtype": str(_denoiser(pipe).dtype).replace("torch.", ""), "steps": list(steps),
        "load_average_1m": os.getloadavg()[0],  # other processes' load: on a shared machine, the noise
    }
    if "pyext_attention" in steps:  # proof that pyext's kernel ran, and how often torch's did instead
        import pyext.attention
        st = pyext.attention.status(pipe)
        notes["pyext_attention"] = (f"backend {st['backend'] or 'auto'}: {st['patched']} layers patched, "
                                    f"{st['pyext_calls']} pyext calls, {st['fallbacks']} fallbacks to torch")
    result["notes"] = notes
    os.makedirs(os.path.join(spec["out"], "images"), exist_ok=True)
    checked = generate(preset.check_steps) if preset.check_steps else image
    torch.save(checked.float().cpu(), os.path.join(spec["out"], "images", f"{name}.pt"))
    if name == "original":  # what an unrelated image scores: the floor the threshold sits above
        torch.save(generate(preset.check_steps or preset.steps, seed=SEED + 1).float().cpu(),
                   os.path.join(spec["out"], "images", "unrelated_seed.pt"))
    return result


# What an on_device preset leaves out of the pipeline: the text encoders and their tokenizers.
PROMPT_ENCODERS = {"flux": ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")}


def prompt_inputs(pipe, preset: Preset) -> dict:
    """The call's prompt: PROMPT; for an on_device preset, which has no text encoders, seeded
    random embeddings of the shapes they give (Flux: T5's (1, max_sequence_length,
    joint_attention_dim), CLIP's pooled (1, pooled_projection_dim))."""
    if not preset.on_device:
        return {"prompt": PROMPT}
    if preset.arch not in PROMPT_ENCODERS:
        raise ValueError(f"bench.latency: no prompt embeddings for arch {preset.arch!r} (on_device presets: "
                         f"{sorted(PROMPT_ENCODERS)})")
    config, dtype = _denoiser(pipe).config, _denoiser(pipe).dtype
    g = torch.Generator().manual_seed(SEED)
    length = dict(preset.call).get("max_sequence_length", 512)  # FluxPipeline's default
    text = torch.randn(1, length, config.joint_attention_dim, generator=g)
    pooled = torch.randn(1, config.pooled_projection_dim, generator=g)
    return {"prompt_embeds": text.to(preset.device, dtype), "pooled_prompt_embeds": pooled.to(preset.device, dtype)}


def _worker(name: str, spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run_row(name, spec)
    except RowUnavailable as e:
        result = {"reason": str(e)}
    except Exception as e:  # any failure is this row's reason; the traceback goes to its log
        traceback.print_exc()
        result = {"reason": f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    with open(result_path, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- the parent
def compare_images(out: str, rows: dict) -> float | None:
    """Adds max_abs_diff / psnr_db / check to every measured row; returns the unrelated image's PSNR."""
    def load(name):
        path = os.path.join(out, "images", f"{name}.pt")
        return torch.load(path) if os.path.exists(path) else None

    def psnr(a, b):  # images in [0, 1]
        mse = torch.mean((a - b) ** 2).item()
        return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()

    ref, unrelated = load("original"), load("unrelated_seed")
    for name, row in rows.items():
        image = load(name) if "latency_s" in row else None
        if image is None:
            continue
        if not torch.isfinite(image).all():
            row["check"] = "FAIL: non-finite image"
        elif ref is None:
            row["check"] = "no reference (original row missing)"
        else:
            row["max_abs_diff"] = (image - ref).abs().max().item()
            row["psnr_db"] = psnr(image, ref)
            row["check"] = "ok" if row["psnr_db"] >= MIN_PSNR_DB else f"FAIL: PSNR < {MIN_PSNR_DB:g} dB"
    return psnr(unrelated, ref) if ref is not None and unrelated is not None else None


def machine_info(device: str) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        info["load_average"] = os.getloadavg()
    except (OSError, StopIteration):
        pass
    from pyext.dispatch import cpu_model

    info["cpu_flags"] = list(cpu_model()[1])  # the ISA the kernels and torch's oneDNN choose paths by
    info["kernel_paths"] = kernel_paths()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def kernel_paths() -> dict:
    """Which CPU path pyext's kernels take here: attention's fastest C++ path, whether fp8_linear's
    AMX backend (torch's brgemm) can run, and the SIMD level of the others."""
    from pyext._ext import has_kernel

    if not has_kernel("attention"):
        return {"extension": "missing"}
    return {"attention": torch.ops.pyext_C.attention_paths()[0],
            "fp8_linear_amx": bool(torch.ops.pyext_C.fp8_brgemm_available()),
            "simd": pyext_simd()}


def pyext_simd() -> str:
    from pyext._ext import cpu_capabilities

    return cpu_capabilities()[-1] if cpu_capabilities() else "none"


def describe_machine(device: str = "cpu") -> str:
    """One line naming the CPU, its ISA flags and the kernel paths pyext takes on it."""
    info = machine_info(device)
    return (f"{info.get('gpu') or info['cpu']} [{' '.join(info.get('cpu_flags', [])) or 'no simd flags'}], "
            f"{info['torch_threads']} threads; pyext paths: {info['kernel_paths']}")


def versions() -> dict:
    import diffusers
    import transformers

    import pyext
    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "pyext": pyext.__version__, "pyext_extension": "loaded" if pyext._ext.EXT is not None else "missing"}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def save_results(bench: str, device: str, out: str | None, **fields) -> dict:
    """A results file's content (the bench, the machine, the versions and the commit, then
    `fields`), written to `out` as JSON when given."""
    result = {"bench": bench, "machine": machine_info(device), "versions": versions(), "commit": commit(), **fields}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def prepare_model(model: str | None, preset: Preset, workdir: str) -> tuple[str, str]:
    """(path or id every row loads, what the weights are)."""
    if model:
        return model, f"real: {model}"
    if preset.on_device:
        return "", "random, made on the device by each row (pyext.offline on_device); prompt embeddings, no text encoders"
    import pyext.offline

    path = os.path.join(workdir, "model")
    pyext.offline.build_pipeline(preset.arch, preset.size, seed=SEED).save_pretrained(path)
    return path, "random"


def prepare_rows(bench: str, rows: list[str] | None, known: list[str], out: str) -> list[str]:
    """The rows to run (all by default; `original` first, since every row is checked against it),
    and an output folder with an empty images/ and a logs/."""
    rows = rows or known
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise SystemExit(f"{bench}: unknown rows {unknown}; rows are {known}")
    if "original" not in rows:
        rows = ["original"] + rows
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    shutil.rmtree(os.path.join(out, "images"), ignore_errors=True)
    return rows


def merge_rounds(runs: list[dict], base: list[dict] | None) -> dict:
    """One row's result over interleaved rounds: the first round's result, with the median of the
    rounds' latencies, and the per-round ratio to `base` (the original row's rounds, each run just
    before this row's in the same round): its median and range. On a noisy machine the ratio of
    runs close in time is steadier than either latency."""
    row = dict(runs[0])
    timed = [r["latency_s"] for r in runs if "latency_s" in r]
    if len(runs) == 1 or not timed:
        return row
    row["round_latencies_s"] = timed
    row["latency_s"] = statistics.median(timed)
    ratios = [r["latency_s"] / b["latency_s"] for r, b in zip(runs, base or []) if "latency_s" in r and "latency_s" in b]
    if ratios:
        row["vs_original"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                              "rounds": len(ratios)}
    return row


def run(preset_name: str, out: str, model: str | None = None, rows: list[str] | None = None,
        repeats: int | None = None, rounds: int = 1, arch: str = "sd15") -> dict:
    from tqdm import tqdm

    preset = preset_of(preset_name, arch)
    if model:  # real weights come with their text encoders
        preset = replace(preset, on_device=False)
    named = set(rows or ())
    rows = prepare_rows("bench.latency", rows, list(ROWS), out)
    workdir = tempfile.mkdtemp(prefix="bench_latency_")
    try:
        print(f"bench.latency: preparing {preset.arch} ({preset.size}) ...", flush=True)
        model_path, weights = prepare_model(model, preset, workdir)
        spec = {"preset": asdict(preset), "model_path": model_path, "out": os.path.abspath(out),
                "repeats": repeats or preset.repeats}
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        ctx = _row_context(preset.device)
        results = {}
        report = {
            "preset": preset_name, "preset_parameters": asdict(preset), "repeats": spec["repeats"],
            "model": f"{preset.arch} " + (preset.size if not model else model), "arch": preset.arch,
            "weights": weights, "prompt": PROMPT, "seed": SEED, "guidance_scale": preset.guidance_scale,
            "scheduler": "DDIMScheduler" if preset.arch == "sd15" else "the pipeline's own", "min_psnr_db": MIN_PSNR_DB,
            "versions": versions(), "commit": commit(), "rows": results, "rows_planned": rows,
            "guide_titan_rtx_s": GUIDE_TITAN_RTX if preset.arch == "sd15" else {}, "rounds": rounds,
        }
        runs: dict[str, list[dict]] = {name: [] for name in rows}
        # Rounds interleave the rows (A, B, ..., A, B, ...); a row that could not run once is not retried.
        bar = tqdm([(r, name) for r in range(rounds) for name in rows], desc="rows", unit="row")
        for round_index, name in bar:
            if round_index and "latency_s" not in runs[name][0]:
                continue
            bar.set_postfix_str(f"{name} (round {round_index + 1} of {rounds})")
            reason = unavailable(name, preset, name in named)
            t0 = time.perf_counter()
            result = ({"reason": reason} if reason else
                      _run_in_subprocess(ctx, name, spec_path, workdir, out, preset.row_timeout_s))
            result["row_wall_s"] = time.perf_counter() - t0  # the whole row: load, set-up, runs
            runs[name].append(result)
            results[name] = merge_rounds(runs[name], runs["original"])
            tqdm.write(f"  {name:28s} {_short(result)}  (row took {result['row_wall_s']:.1f} s)")
            _write_outputs(report, out, preset)  # after every row: a long run killed midway keeps its rows
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _write_outputs(report: dict, out: str, preset: Preset) -> None:
    from bench import plot

    report["machine"] = machine_info(preset.device)
    report["unrelated_psnr_db"] = compare_images(out, report["rows"])
    with open(os.path.join(out, "latency.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot.write_markdown(report, os.path.join(out, "latency.md"))
    plot.write_chart(report, os.path.join(out, "latency.png"))


def _short(row: dict) -> str:
    return f"{row['latency_s']:.3f} s" if "latency_s" in row else f"n/a: {row['reason']}"


def _row_process(name, spec_path, result_path, log_path):
    """Entry of a row's process: its output goes to the row's log."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _worker(name, spec_path, result_path)


def preloaded_forkserver(modules: list[str]):
    """A multiprocessing context whose processes are forked from a server that imported `modules`
    once and never computed (no thread pools): each starts clean without paying the imports again
    (seconds each on a busy machine). One server per process: what it preloads is set by the
    first use."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(modules)
    return ctx


def _row_context(device: str):
    """Where rows' processes come from: forked from a server that imported torch, transformers and
    pyext once and never computed (no thread pools), so each row starts clean without paying the
    imports again (seconds per row); diffusers and transformers import their classes lazily, so the
    pipeline's are named. For CUDA rows the server does not import diffusers: its import asks CUDA
    for the device count, which marks every later fork of that process as unable to use CUDA, and
    neither does transformers' CLIP model where torchao is installed (transformers then imports it,
    which asks too)."""
    modules = ["torch", "transformers", "pyext", "bench.latency", "transformers.models.clip.tokenization_clip"]
    if device != "cuda" or importlib.util.find_spec("torchao") is None:
        modules.append("transformers.models.clip.modeling_clip")
    if device != "cuda":
        modules += ["diffusers", "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion"]
    return preloaded_forkserver(modules)


def _run_in_subprocess(ctx, name, spec_path, workdir, out, timeout_s) -> dict:
    result_path = os.path.join(workdir, f"{name}.json")
    proc = ctx.Process(target=_row_process, args=(name, spec_path, result_path,
                                                  os.path.join(out, "logs", f"{name}.log")))
    proc.start()
    try:
        proc.join(timeout_s)
        timed_out = proc.is_alive()
    finally:  # also on Ctrl-C / SIGTERM of the parent: a row must not outlive the benchmark
        if proc.is_alive():
            proc.kill()
            proc.join()
    if timed_out:
        return {"reason": f"timed out after {timeout_s} s (log: logs/{name}.log)"}
    if not os.path.exists(result_path):
        return {"reason": f"worker died with exit code {proc.exitcode} (log: logs/{name}.log)"}
    with open(result_path) as f:
        return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--model-arch", choices=["sd15", *ARCH_PRESETS], default="sd15",
                   help="the pipeline family: SD1.5 (the guide's table), or the anchors' SDXL and Flux "
                        "(presets gpu and cpu)")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--model", help="local folder or hub id of real SD1.5-style weights (default: random weights)")
    p.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--repeats", type=int)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, interleaved; the table gives each row's median "
                        "per-round ratio to the original row and its range")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    # SIGTERM unwinds like Ctrl-C, so the running row's process is killed too (see _run_in_subprocess).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args.preset, args.out, args.model, args.rows.split(",") if args.rows else None, args.repeats,
                 args.rounds, args.model_arch)
    print(open(os.path.join(args.out, "latency.md")).read())
    return report


if __name__ == "__main__":
    main()
