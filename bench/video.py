"""The fp8 video example of diffusers' memory guide (CogVideoX, bf16, fp8 weight storage) as a table, one row per setting.

    python -m bench.video --preset {bench,tiny} --out DIR [--rows a,b,c] [--repeats N]

Rows run like bench.latency's (whose process runner, memory and image-check helpers this
reuses): each in a fresh process forked from a clean server, peak memory = that process's peak
RSS during the timed runs, frames compared with the `original` row's by PSNR. Every row builds
the same seeded random-weight CogVideoX of pyext.offline itself (no weights are downloaded).
Outputs in DIR: video.json, video.md, images/<row>.pt, logs/<row>.log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from bench import latency
from bench.plot import _bytes, _fmt
from pyext.nn.fp8 import FP8Weight

ARCH = "cogvideox"
SEED = 0


@dataclass(frozen=True)
class Preset:
    size: str            # pyext.offline size of cogvideox; its example call sets frames, height, width
    steps: int           # denoising steps of a timed run
    warmup_steps: int    # steps of the untimed warm-up run (same shapes)
    repeats: int         # timed runs; the row reports their median
    row_timeout_s: int
    unrelated_seed: bool  # also generate another seed in `original`: the PSNR an unrelated video scores
    threads: int = 0     # torch.set_num_threads in each row; 0 keeps torch's default
    bf16_needs_native: bool = True  # compute in fp32 where the CPU lacks native bf16 (hours otherwise)


PRESETS = {
    # CogVideoX-2b's transformer and VAE on 2 CPU cores: a step of the 1.7B transformer (CFG batch 2)
    # takes minutes in fp32, a decode a minute: one timed run per row, no warm-up (a CPU compiles and
    # tunes nothing; the first call's oneDNN set-up is under 1% of a step), no unrelated-seed run.
    "bench": Preset("bench", 2, 0, 1, 2400, unrelated_seed=False),
    # CI: seconds for all rows. One thread: tiny ops gain nothing from two.
    "tiny": Preset("tiny", 2, 1, 1, 120, unrelated_seed=True, threads=1, bf16_needs_native=False),
}

# row -> steps applied in order to the fp32 pipeline as built. The fp8 rows first go to the compute
# dtype (`compute`: bf16, as the guide's example, where the CPU computes bf16 natively, else fp32), with
# the VAE decoding in fp32 (see _fp32_decode); the pyext_optimize rows get the fp32 pipeline and
# decide dtypes themselves.
ROWS = {
    "original": (),
    "bf16": ("bf16",),
    "diffusers_layerwise_fp8": ("compute", "layerwise_fp8"),
    "pyext_fp8": ("compute", "pyext_fp8"),
    "pyext_optimize": ("pyext_optimize",),
    "pyext_optimize_fp8": ("pyext_optimize_fp8",),
}


def compute_dtype(preset: Preset) -> torch.dtype:
    """bf16 as the guide's example, unless the preset is too big for a CPU that emulates bf16 (see
    skip_reason): fp32 there."""
    from pyext import _compat

    native = _compat.cpu_has_native_bf16() or not preset.bf16_needs_native
    return torch.bfloat16 if native else torch.float32


def skip_reason(row: str, preset: Preset) -> str | None:
    """Why a row cannot run on this CPU in useful time, with the figure that says so, or None."""
    if "bf16" not in ROWS[row] or compute_dtype(preset) == torch.bfloat16:
        return None
    times = {}
    for dtype in (torch.float32, torch.bfloat16):  # one GEMM at the transformer's width
        a, b = torch.randn(256, 1920, dtype=dtype), torch.randn(1920, 1920, dtype=dtype)
        t = time.perf_counter()
        a @ b
        times[dtype] = time.perf_counter() - t
    ratio = times[torch.bfloat16] / times[torch.float32]
    return (f"this CPU has no native bf16 (no AVX512-BF16/AMX): a bf16 GEMM 256x1920x1920 took "
            f"{ratio:.0f}x the fp32 one, so a bf16 step would take hours; the fp8 rows compute in fp32")


def _apply_step(pipe, step: str, call: dict, notes: dict, compute: torch.dtype):
    import pyext

    if step == "bf16" or (step == "compute" and compute == torch.bfloat16):
        pipe.to(torch.bfloat16)
        _fp32_decode(pipe)
    elif step == "compute":
        notes[step] = "computes in fp32: this CPU has no native bf16"
    elif step == "layerwise_fp8":  # the guide's line, with this CPU's compute dtype
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute)
    elif step == "pyext_fp8":
        report = pyext.quantize_fp8(pipe.transformer)
        notes[step] = (f"{len(report.converted)} transformer layers in fp8, their weights "
                       f"{report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f} MiB")
    elif step in ("pyext_optimize", "pyext_optimize_fp8"):
        fp8 = {"fp8": "denoiser"} if step == "pyext_optimize_fp8" else {}
        pipe = pyext.optimize(pipe, height=call["height"], width=call["width"], frames=call["num_frames"], **fp8)
        notes[step] = str(pyext.report(pipe))
    else:
        raise ValueError(f"unknown step {step!r}")
    return pipe


def _fp32_decode(pipe) -> None:
    """The VAE back in fp32, decoding the bf16 latents. On CPUs without native bf16 (no AVX512-BF16
    or AMX) torch's bf16 3-D convolutions are over 100x slower than fp32 ones: a bf16 CogVideoX-2b VAE
    decodes 9 frames of 40x64 in over 15 minutes (fp32: 4 s). diffusers upcasts other VAEs for decoding
    (force_upcast); CogVideoXPipeline does not, so this row does it."""
    pipe.vae.to(torch.float32)
    decode = pipe.vae.decode
    pipe.vae.decode = lambda latents, *args, **kwargs: decode(latents.float(), *args, **kwargs)


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}


def _weight_dtypes(module) -> str:
    return "+".join(sorted({"fp8" if isinstance(p, FP8Weight) else _SHORT.get(p.dtype, str(p.dtype))
                            for p in module.parameters()}))


def run_row(name: str, spec: dict) -> dict:
    """Runs one row in this process; returns its measurements (and writes its frames)."""
    import pyext.offline
    from pyext._memory import release_freed_memory

    preset = Preset(**spec["preset"])
    if preset.threads:
        torch.set_num_threads(preset.threads)
    call = pyext.offline.example_call(ARCH, preset.size)
    t0 = time.perf_counter()
    pipe = pyext.offline.build_pipeline(ARCH, preset.size, seed=SEED)
    notes = {}
    for step in ROWS[name]:
        pipe = _apply_step(pipe, step, call, notes, compute_dtype(preset))
    for note in notes.values():  # also in the row's log: a row that times out still shows what was set up
        print(note, flush=True)
    clock = latency.StageClock("cpu")
    clock.wrap(pipe.text_encoder, "forward", "text_encoding")
    clock.wrap(pipe.transformer, "forward", "denoising")
    clock.wrap(pipe.vae, "decode", "vae_decode")

    def generate(steps, seed=SEED, **call):
        return pyext.offline.run_example(pipe, ARCH, preset.size, steps=steps, seed=seed, **call)

    # The warm-up stops at the latents: a CPU has nothing to warm in the VAE (no autotuning, no
    # compilation), and at size "bench" its decode takes a minute.
    if preset.warmup_steps:
        generate(preset.warmup_steps, output_type="latent")
    setup_s = time.perf_counter() - t0
    release_freed_memory()  # the fp32 weights a cast freed must not stay resident and count as this row's peak
    rss_reset = latency._reset_peak_rss()
    runs = []
    for _ in range(spec["repeats"]):
        clock.reset()
        t = time.perf_counter()
        video = generate(preset.steps)
        runs.append((time.perf_counter() - t, dict(clock.totals)))
    latency_s, stages = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    weights = latency.component_weight_bytes(pipe)
    result = {
        "latency_s": latency_s, "latencies_s": [r[0] for r in runs], "setup_s": setup_s,
        "stages_s": {**stages, "other": latency_s - sum(stages.values())},
        "peak_memory_bytes": latency._peak_rss_bytes(),
        "peak_memory_kind": "process peak RSS (VmHWM) " + ("during timed runs" if rss_reset else "incl. loading"),
        "weight_bytes": sum(weights.values()), "component_weight_bytes": weights,
        "dtype": _weight_dtypes(pipe.transformer), "steps": list(ROWS[name]),
        "load_average_1m": os.getloadavg()[0], "notes": notes,
    }
    images = os.path.join(spec["out"], "images")
    os.makedirs(images, exist_ok=True)
    torch.save(video, os.path.join(images, f"{name}.pt"))
    if name == "original" and preset.unrelated_seed:  # the PSNR floor the threshold sits above
        torch.save(generate(preset.steps, seed=SEED + 1), os.path.join(images, "unrelated_seed.pt"))
    return result


# bench.latency's runner starts bench.latency's run_row; these two shims start ours instead.
def _row_process(*args):
    latency.run_row = run_row  # this process is a fresh fork that runs this one row and exits
    latency._row_process(*args)


class _RowContext:
    def __init__(self, ctx):
        self.ctx = ctx

    def Process(self, target, args):
        return self.ctx.Process(target=_row_process, args=args)


# ---------------------------------------------------------------- the parent
def run(preset_name: str, out: str, rows: list[str] | None = None, repeats: int | None = None) -> dict:
    import pyext.offline

    preset = PRESETS[preset_name]
    rows = latency.prepare_rows("bench.video", rows, list(ROWS), out)
    spec = {"preset": asdict(preset), "out": os.path.abspath(out), "repeats": repeats or preset.repeats}
    results = {}
    report = {
        "preset": preset_name, "preset_parameters": asdict(preset), "repeats": spec["repeats"],
        "model": f"{ARCH} {preset.size}", "weights": "random", "prompt": pyext.offline.PROMPT, "seed": SEED,
        "call": pyext.offline.example_call(ARCH, preset.size),
        "compute_dtype": str(compute_dtype(preset)).removeprefix("torch."), "min_psnr_db": latency.MIN_PSNR_DB,
        "versions": latency.versions(), "rows": results, "rows_planned": rows,
    }
    # diffusers imports the pipeline's module lazily, and with it torch._dynamo and T5: seconds
    # per row unless the server that rows are forked from imports it once.
    ctx = latency.preloaded_forkserver(["torch", "diffusers", "transformers", "pyext", "bench.latency",
                                        "diffusers.pipelines.cogvideo.pipeline_cogvideox"])
    workdir = tempfile.mkdtemp(prefix="bench_video_")
    try:
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for name in rows:
            print(f"bench.video: {name} ...", flush=True)
            t0 = time.perf_counter()
            reason = skip_reason(name, preset)
            if reason:
                results[name] = {"reason": reason}
            else:
                results[name] = latency._run_in_subprocess(_RowContext(ctx), name, spec_path, workdir, out,
                                                           preset.row_timeout_s)
            results[name]["row_wall_s"] = time.perf_counter() - t0  # the whole row: build, set-up, runs
            print(f"  {name:26s} {latency._short(results[name])}  (row took {results[name]['row_wall_s']:.1f} s)",
                  flush=True)
            _write_outputs(report, out)  # after every row: a long run killed midway keeps its rows
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _write_outputs(report: dict, out: str) -> None:
    report["machine"] = latency.machine_info("cpu")
    report["unrelated_psnr_db"] = latency.compare_images(out, report["rows"])
    with open(os.path.join(out, "video.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_markdown(report, os.path.join(out, "video.md"))


def write_markdown(report: dict, path: str) -> None:
    rows, p, m, call = report["rows"], report["preset_parameters"], report["machine"], report["call"]
    base = rows.get("original", {}).get("latency_s")
    lines = [
        f"# CogVideoX fp8 video table, preset `{report['preset']}`",
        "",
        f"{report['model']} of pyext.offline, weights: **random** (seeded, seed {report['seed']}), so frames are "
        f"noise-like and the check compares numerics, not quality. {call['num_frames']} frames of "
        f"{call['width']}x{call['height']}, {p['steps']} steps, default guidance (transformer batch 2), median of "
        f"{report['repeats']} run(s) "
        + (f"after a {p['warmup_steps']}-step warm-up (up to the latents)" if p["warmup_steps"] else "without warm-up")
        + f", on the CPU; each row in its own process. Prompt: \"{report['prompt']}\". The fp8 rows compute in "
        f"{report['compute_dtype']} (bf16 as the guide's example where the CPU has native bf16, else fp32). In the "
        "bf16 rows the VAE decodes in fp32, as diffusers' force_upcast does for other VAEs: a CPU without native "
        "bf16 runs bf16 3-D convolutions over 100x slower than fp32 ones. pyext_optimize rows keep the dtypes "
        "pyext chooses.",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch threads {p['threads'] or m['torch_threads']}"
        + (f", load average at the end {', '.join(f'{x:.1f}' for x in m['load_average'])}" if "load_average" in m else "")
        + ". " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        "",
        "| row | dtype | latency | speed-up | text | denoise | VAE decode | peak mem | weights | max abs diff "
        "| PSNR vs original | check | row wall |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, row in rows.items():
        wall = _fmt(row.get("row_wall_s"), ".0f", " s")
        if "latency_s" not in row:
            lines.append(f"| {name} | | n/a: {row['reason']} | | | | | | | | | | {wall} |")
            continue
        st, psnr = row["stages_s"], row.get("psnr_db")
        lines.append(" | ".join([
            f"| {name}", row["dtype"], _fmt(row["latency_s"], ".2f", " s"),
            _fmt(base / row["latency_s"] if base else None, ".2f", "x"), _fmt(st.get("text_encoding"), ".2f", " s"),
            _fmt(st.get("denoising"), ".2f", " s"), _fmt(st.get("vae_decode"), ".2f", " s"),
            _bytes(row["peak_memory_bytes"]), _bytes(row["weight_bytes"]), _fmt(row.get("max_abs_diff"), ".2e"),
            "identical" if psnr == float("inf") else _fmt(psnr, ".1f", " dB"), row.get("check", ""), wall + " |",
        ]))
    unrelated = report.get("unrelated_psnr_db")
    lines += [
        "",
        "dtype: the transformer's weight storage. Peak memory: "
        f"{next((r['peak_memory_kind'] for r in rows.values() if 'peak_memory_kind' in r), '-')}. "
        "Weights: bytes of parameters and buffers of all modules, each tensor once, fp8 codes 1 byte. "
        "Row wall: the whole row (building the random weights, set-up, warm-up, timed runs).",
        f"Check: all frames vs the `original` row's (same seed and latents, pixel values in [0, 1]); a row fails when "
        f"its frames are non-finite or its PSNR is below {report['min_psnr_db']:g} dB."
        + (f" For scale, a video from another seed scores {_fmt(unrelated, '.1f', ' dB')}." if unrelated else ""),
    ]
    for name, row in rows.items():
        for step, note in row.get("notes", {}).items():
            lines += ["", f"`{name}` ({step}):", "", "```", note, "```"]
    missing = [r for r in report["rows_planned"] if r not in rows]
    if missing:
        lines += ["", f"**Incomplete: rows not run (yet): {', '.join(missing)}.**"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.video", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--out", default=os.path.join("bench_out", "video"))
    p.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--repeats", type=int)
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running row's process is killed too (bench.latency's runner).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args.preset, args.out, args.rows.split(",") if args.rows else None, args.repeats)
    print(open(os.path.join(args.out, "video.md")).read())
    return report


if __name__ == "__main__":
    main()
