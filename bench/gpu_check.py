"""The GPU proof in one call (`make gpu-check`), sized to run on a bare machine in minutes.

    python -m bench.gpu_check [--stage sd15|flux] [--out DIR] [--only a,b] [--budget-s 450] [--resume DIR]

Two stages, each sized for a call of its own: sd15 (the default: build, the CUDA tests, dispatch
overhead, kernel benches, the SD1.5 rows) and flux (Flux.1-dev's architecture at 1024x1024, 28
steps, end to end: bf16 eager, pyext.optimize, pyext's dynamic fp8, diffusers + torch.compile,
torchao's fp8 dynamic + compile), so a short lease holds both and a rerun of one.
It prints its plan with each step's estimate first, then runs the steps in order. Everything lands
in two files under DIR: gpu_check.log (every step's output, one after another) and gpu_check.json
(each step's exit code, seconds and results), plus the built extension (pyext_C.tar.gz). Given
--resume with a former call's DIR (default .gpu_check/ when it exists), steps that passed on the
same sources are skipped, the build too when csrc/ is unchanged (its extension is unpacked
instead), so a rerun after a fix spends its time on what is left. Each step's time limit is cut
to what is left of the budget, so the JSON is always written before the caller's limit.

The machine is expected to have torch with CUDA, Triton, transformers, accelerate and pytest,
and no network: wheels in WHEELS (default .whl/, from `make gpu-wheels`) supply what it lacks.

Estimates come from the step times of the GPU run in docs/benchmarks.md. The SD1.5 step's adds a
guess for the torch.compile row (inductor compiles the UNet), which that run did not reach, less
what its rows no longer pay there (the imports in each row's process, a 50-step warm-up). The Flux
step has never run on a GPU: its estimate is arithmetic (FLUX_ROWS_S), to be replaced by its first
measured time.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SOURCES = ("csrc", "setup.py")
ALL_SOURCES = ("csrc", "setup.py", "pyext", "bench", "tests")
ARTEFACT = "pyext_C.tar.gz"
# One call with room for a rerun that skips what passed, where GPU time is lent in short slots.
BUDGET_S = 450
PLAN_S = 360  # what a stage's estimates may add up to: six minutes on a bare machine
STAGES = ("sd15", "flux")
# The Flux stage's rows and a guess of each one's seconds (process, weights made on the GPU, a
# 3-step warm-up, 28 steps timed once, 2 checked): 12B parameters at 4,608 tokens are about 1.1e14
# FLOPs a step, 0.2-0.3 s on an H100 in bf16; inductor's compile of the transformer about a
# minute, and torchao's max-autotune fullgraph compile (its documented line) about two.
FLUX_ROWS_S = {"original": 30, "pyext_optimize": 40, "pyext_fp8_dynamic": 45, "torch_compile": 80,
               "torchao_fp8_dynamic": 125}


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: int
    command: tuple[str, ...]
    what: str
    sources: tuple[str, ...] = ALL_SOURCES  # a step passed before is skipped while these are unchanged


def steps(out: str, stage: str = "sd15") -> list[Step]:
    py = sys.executable
    me = (py, "-m", "bench.gpu_check")
    shared = [
        Step("wheels", 5, (*me, "--install-wheels"),
             "install the local wheels of the packages this machine lacks (diffusers, torchao)", ()),
        Step("build", 35, (py, "setup.py", "build_ext", "--inplace"),
             "pyext._C with the CUDA kernels, every core (MAX_JOBS)", BUILD_SOURCES),
    ]
    if stage == "flux":
        return shared + [
            Step("flux_latency", sum(FLUX_ROWS_S.values()),
                 (py, "-m", "bench.latency", "--preset", "gpu", "--model-arch", "flux", "--repeats", "1",
                  "--rows", ",".join(FLUX_ROWS_S), "--out", os.path.join(out, "flux_latency")),
                 "Flux.1-dev's architecture, 1024x1024, 28 steps, bf16, weights made on the GPU, prompt embeddings: "
                 "eager, pyext.optimize, pyext's dynamic fp8, diffusers + torch.compile, torchao fp8 dynamic + compile"),
        ]
    return shared + [
        Step("info", 15, (py, "-m", "pyext", "info"), "the build, the GPU, every backend's availability"),
        Step("tests", 60, (py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-n", "8", "--dist", "load",
                           "--durations", "15", "tests"),
             "the tests marked cuda: every backend on its declared cases against the reference, and replayed "
             "from a CUDA graph; pipelines captured against eager; an optimized step with every host sync an error"),
        Step("dispatch_overhead", 30, (py, "-m", "bench.dispatch", "--overhead", "--device", "cuda", "--rounds", "3",
                                       "--calls", "500", "--out", os.path.join(out, "dispatch_overhead.json")),
             "each op's call against PyTorch's own call, a routed attention layer against the plain one (tiny inputs), "
             "a captured denoiser's host work per step"),
        Step("kernels", 45, (py, "-m", "bench.gpu_kernels", "--json", os.path.join(out, "kernels.json")),
             "attention against SDPA's flash, efficient and cuDNN backends, eager and replayed from CUDA graphs; "
             "fp8 linears against cuBLAS bf16; the fused GroupNorm + SiLU against PyTorch's"),
        Step("latency", 170, (py, "-m", "bench.latency", "--preset", "gpu", "--repeats", "1", "--rows",
                              "sdpa_attention,pyext_optimize,torch_compile_cudagraphs",
                              "--out", os.path.join(out, "latency")),
             "SD1.5 512x512, 50 steps: diffusers fp16 + SDPA eager, pyext_optimize (its CUDA graphs), "
             "diffusers + torch.compile with CUDA graphs"),
    ]


def sources_hash(paths) -> str:
    """A hash of the files under `paths` (what git tracks there, compiled outputs aside): the
    machine's copy of the tree may have no .git."""
    h = hashlib.sha1()
    for top in paths:
        files = [os.path.join(ROOT, top)] if os.path.isfile(os.path.join(ROOT, top)) else sorted(
            glob.glob(os.path.join(ROOT, top, "**", "*"), recursive=True))
        for f in files:
            if os.path.isfile(f) and not f.endswith((".so", ".pyc")) and not f.endswith("_build_info.py"):
                h.update(os.path.relpath(f, ROOT).encode())
                with open(f, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:12]


def install_wheels() -> int:
    """pip-installs WHEELS/*.whl whose distribution is missing here into SITE (never the network)."""
    import glob
    import importlib.metadata

    wheels = os.environ.get("WHEELS", os.path.join(ROOT, ".whl"))
    site = os.environ.get("SITE", "/tmp/pyext_site")
    missing = []
    for wheel in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
        try:
            importlib.metadata.version(os.path.basename(wheel).split("-")[0])
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    print(f"wheels to install into {site}: {missing or 'none'}")
    if not missing:
        return 0
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--upgrade", "--target", site, *missing])


def render(result: dict) -> str:
    """docs/benchmarks.md's GPU tables from a gpu_check.json: the steps, attention against SDPA's
    backends, fp8 linears against cuBLAS bf16, the fused GroupNorm + SiLU against PyTorch's, the
    SD1.5 rows and the dispatch overhead."""
    from bench.dispatch import render_results as render_dispatch

    steps = result["steps"]
    out = ["| step | exit code | seconds |", "|---|---:|---:|"]
    out += [f"| {name} | {r.get('rc')} | {r.get('seconds', r.get('reason', ''))} |" for name, r in steps.items()]
    rows = next(iter(steps.get("kernels", {}).get("results", {}).values()), [])
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} us"  # noqa: E731
    chosen = lambda r: f" ({r['auto_backend']})" if "auto_backend" in r else ""  # noqa: E731
    times = lambda v: "-" if v is None else f"{v}x"  # noqa: E731
    attention = [r for r in rows if r.get("bench") == "attention"]
    if attention:
        out += ["", "| attention (bf16) | B, H, Sq, Skv, D | pyext (Triton) | flash | efficient | cuDNN "
                "| best SDPA / Triton | pyext.attention (dispatch's choice) | best SDPA / pyext.attention "
                "| the same, replayed from CUDA graphs | error / SDPA's: Triton, dispatch's choice |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['shape']} | {r['b']}, {r['h']}, {r['sq']}, {r['skv']}, {r['d']} | {ms(r.get('pyext_ms'))} | "
                f"{ms(r.get('flash_ms'))} | {ms(r.get('efficient_ms'))} | {ms(r.get('cudnn_ms'))} | "
                f"{times(r.get('best_sdpa_over_pyext'))} | {ms(r.get('auto_ms'))}{chosen(r)} | "
                f"{times(r.get('best_sdpa_over_auto'))} | {times(r.get('best_sdpa_over_auto_graph'))} | "
                f"{times(r.get('err_vs_sdpa'))}, {times(r.get('auto_err_vs_sdpa'))} |" for r in attention]
    linears = [r for r in rows if r.get("bench") == "fp8_linear"]
    if linears:
        out += ["", "| fp8 linear (bf16 activations) | M, K, N | cuBLAS bf16 | weight-only, Triton GEMM "
                "| weight-only, upcast + cuBLAS | dynamic fp8 x fp8 (`_scaled_mm`) | SQNR weight-only / dynamic |",
                "|---|---|---:|---:|---:|---:|---:|"]
        out += [f"| {r['shape']} | {r['M']}, {r['K']}, {r['N']} | {ms(r.get('bf16_ms'))} | "
                f"{r.get('weight_only_triton_vs_bf16', '-')}x | {r.get('upcast_then_cublas_vs_bf16', '-')}x | "
                f"{r.get('dynamic_vs_bf16', '-')}x | {r.get('weight_only_sqnr_db', '-')} / {r.get('dynamic_sqnr_db', '-')} dB |"
                for r in linears]
    norms = [r for r in rows if r.get("bench") == "group_norm"]
    if norms:
        out += ["", "| GroupNorm + SiLU (fp16, channels-last) | N, C, H, W | diffusers (F.group_norm, F.silu) "
                "| fused layer (dispatch's choice) | Triton kernel (forced) | fused / diffusers "
                "| the same, replayed from CUDA graphs | error / diffusers' |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['shape']} | {r['b']}, {r['c']}, {r['h']}, {r['w']} | {ms(r.get('plain_ms'))} | "
                f"{ms(r.get('fused_ms'))} ({r.get('fused_backend', '-')}) | {ms(r.get('triton_ms'))} | "
                f"{times(r.get('fused_over_plain'))} | "
                f"{times(r.get('fused_over_plain_graph'))} | {times(r.get('err_vs_plain'))} |" for r in norms]
    for step in ("latency", "latency_graphs", "flux_latency"):
        report = next(iter(steps.get(step, {}).get("results", {}).values()), None)
        if report:
            shape = report["preset_parameters"]
            arch = {"sd15": "SD1.5", "sdxl": "SDXL", "flux": "Flux"}.get(report.get("arch", "sd15"), report.get("arch"))
            out += ["", f"| {arch} {shape['height']}x{shape['width']}, {shape['steps']} steps ({step}) | seconds | "
                    "PSNR against the first row |", "|---|---:|---:|"]
            out += [f"| {name} | {r['latency_s']:.3f} | {r.get('psnr_db', 0):.1f} dB |" if "latency_s" in r
                    else f"| {name} | {r['reason'][:80]} | |" for name, r in report["rows"].items()]
        elif step in steps:
            out += ["", f"{step}: {steps[step].get('reason') or 'not measured: it ran out of the budget'}."]
    overhead = next(iter(steps.get("dispatch_overhead", {}).get("results", {}).values()), None)
    if overhead:
        out += ["", render_dispatch(overhead)]
    return "\n".join(out)


def _failed_rows(results: dict) -> list[str]:
    """The rows of a step's results that say they failed: bench.latency's rows with a reason that
    is a failure, bench.gpu_kernels' rows with an error."""
    failed = []
    for content in results.values():
        rows = content.get("rows") if isinstance(content, dict) else None
        failed += [name for name, row in (rows.items() if isinstance(rows, dict) else ()) if isinstance(row, dict) and
                   (str(row.get("reason", "")).startswith(("failed", "worker died", "timed out"))
                    or str(row.get("check", "")).startswith("FAIL: non-finite"))]
        if isinstance(content, list):
            failed += [str(row.get("shape", row.get("bench"))) for row in content if isinstance(row, dict)
                       and any(k == "error" or k.endswith("_error") for k in row)]
    return failed


def _pack_build(out: str) -> None:
    with tarfile.open(os.path.join(out, ARTEFACT), "w:gz") as tar:
        for f in glob.glob(os.path.join(ROOT, "pyext", "_C*.so")) + [os.path.join(ROOT, "pyext", "_build_info.py")]:
            tar.add(f, arcname=os.path.relpath(f, ROOT))


def _run_step(command, env, log, timeout: float) -> int:
    """The step's exit code, or 124 when it ran past `timeout`: then its whole process group is
    stopped (SIGTERM, then SIGKILL), the processes it started too (a bench's rows, test workers)."""
    import signal

    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return 124


def _unpack_build(folder: str | None) -> bool:
    if folder is None:
        return False
    path = os.path.join(folder, ARTEFACT)
    if not os.path.exists(path):
        return False
    with tarfile.open(path) as tar:
        tar.extractall(ROOT, filter="data")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=STAGES, default="sd15", help="which stage's steps to run (module docstring)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out"))
    p.add_argument("--only", help="comma-separated steps to run (default: all)")
    p.add_argument("--budget-s", type=int, default=BUDGET_S, help="no step runs past this many seconds")
    p.add_argument("--resume", default=os.path.join(ROOT, ".gpu_check"),
                   help="a former call's output folder: skip what passed there on the same sources")
    p.add_argument("--install-wheels", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.install_wheels:
        return install_wheels()

    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    record_path, log_path = os.path.join(args.out, "gpu_check.json"), os.path.join(args.out, "gpu_check.log")
    former, came_from = {}, {}  # each former step's record, and the folder that holds it (and its build)
    for folder in dict.fromkeys([args.resume, args.out]):
        if os.path.exists(os.path.join(folder, "gpu_check.json")):
            with open(os.path.join(folder, "gpu_check.json")) as f:
                steps_there = json.load(f).get("steps", {})
            former.update(steps_there)
            came_from.update(dict.fromkeys(steps_there, folder))
    chosen = [s for s in steps(args.out, args.stage) if not args.only or s.name in args.only.split(",")]
    hashes = {s.name: sources_hash(s.sources) for s in chosen}
    done = {s.name for s in chosen if former.get(s.name, {}).get("rc") == 0
            and former[s.name].get("sources") == hashes[s.name] and s.sources}
    build_from = came_from.get("build")
    if "build" in done and not _unpack_build(build_from):
        done.discard("build")
    todo = [s for s in chosen if s.name not in done]
    print(f"gpu-check, stage {args.stage}: {len(todo)} steps, about {sum(s.estimate_s for s in todo)} s (budget {args.budget_s} s); "
          f"results in {record_path}, output in {log_path}")
    for s in chosen:
        print(f"  {s.name:<18} {'passed before on these sources, skipped' if s.name in done else f'~{s.estimate_s:>3} s'}"
              f"  {s.what}")
    sys.stdout.flush()

    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 8)), PYTHONUNBUFFERED="1")
    site = os.environ.get("SITE", "/tmp/pyext_site")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, ROOT, env.get("PYTHONPATH")]))
    record = {"steps": {name: former[name] for name in done}, "environment": {"MAX_JOBS": env["MAX_JOBS"]}}
    failed = False
    for s in todo:
        left = args.budget_s - (time.monotonic() - start)
        if left < max(min(s.estimate_s, 30), s.estimate_s // 2):  # a step that cannot finish is not begun
            record["steps"][s.name] = {"rc": None, "reason": "not started: budget spent"}
            print(f"== {s.name}: not started, budget spent")
            continue
        print(f"== {s.name}: {' '.join(s.command)}", flush=True)
        t = time.monotonic()
        # Each step measures afresh, a rerun too; its decisions, timings and marks stay with the results.
        cache = os.path.join(args.out, "dispatch", s.name)
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
        with open(log_path, "a") as log:
            log.write(f"\n==== {s.name}: {' '.join(s.command)}\n")
            log.flush()
            rc = _run_step(s.command, dict(env, PYEXT_CACHE_DIR=cache), log, timeout=min(3 * s.estimate_s, left))
        seconds = time.monotonic() - t
        entry = {"rc": rc, "seconds": round(seconds, 1), "estimate_s": s.estimate_s, "sources": hashes[s.name]}
        for results in glob.glob(os.path.join(args.out, s.name + "*.json")) + glob.glob(
                os.path.join(args.out, s.name, "*.json")):
            with open(results) as f:  # one JSON in the end: the step's results move into the record
                entry.setdefault("results", {})[os.path.basename(results)] = json.load(f)
            os.remove(results)
        with open(log_path, "a") as log:  # and its own logs into the one log
            for sub in sorted(glob.glob(os.path.join(args.out, s.name, "**", "*.log"), recursive=True)):
                with open(sub) as f:
                    log.write(f"\n---- {os.path.relpath(sub, args.out)}\n{f.read()}")
        shutil.rmtree(os.path.join(args.out, s.name), ignore_errors=True)
        if rc == 0 and _failed_rows(entry.get("results", {})):  # a bench that ran but could not measure a row
            entry["rc"], entry["failed_rows"] = 1, _failed_rows(entry["results"])
            rc = 1
        record["steps"][s.name] = entry
        print(f"   {s.name}: rc {rc} in {seconds:.0f} s (estimate {s.estimate_s} s)", flush=True)
        if s.name == "build" and rc == 0:
            _pack_build(args.out)
        failed |= rc != 0
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)
    import torch

    sys.path.insert(0, site)  # the wheels' packages, for the versions
    from bench.latency import commit, machine_info, versions

    record.update(bench="gpu_check", machine=machine_info("cuda" if torch.cuda.is_available() else "cpu"),
                  versions=versions(), commit=commit())
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    if "build" in done and os.path.abspath(build_from) != os.path.abspath(args.out):
        shutil.copy(os.path.join(build_from, ARTEFACT), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
