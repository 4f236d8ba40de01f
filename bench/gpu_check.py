"""The GPU proof in one call (`make gpu-check`), sized for a short lease on a bare machine.

    python -m bench.gpu_check [--out DIR] [--only a,b] [--budget-s 360]

It prints its plan with each step's estimate first, then runs the steps in order: each one's
output goes to DIR/<step>.log, and DIR/gpu_check.json records every step's exit code, seconds
and (for the benches) its results file. A second call with the same DIR skips the steps that
passed at the same commit, so a rerun after a fix spends its time on what is left. Steps stop
being started once the budget is spent (the JSON says which were left).

The machine is expected to have torch with CUDA, Triton, transformers, accelerate and pytest,
and no network: wheels in WHEELS (default .whl/, from `make gpu-wheels`) supply what it lacks.

Estimates for a 16-core H100 machine; the build's CUDA part was timed here (nvcc, the two .cu
files for sm_80 and sm_90: 8 s on 2 cores), the rest are budgets each step is sized to.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: int
    command: tuple[str, ...]
    what: str


def steps(out: str) -> list[Step]:
    py = sys.executable
    return [
        Step("wheels", 10, (py, "-m", "bench.gpu_check", "--install-wheels"),
             "install the local wheels of the packages this machine lacks (diffusers)"),
        Step("build", 90, (py, "setup.py", "build_ext", "--inplace"),
             "pyext._C with the CUDA kernels, every core (MAX_JOBS)"),
        Step("info", 5, (py, "-m", "pyext", "info"), "the build, the GPU, every backend's availability"),
        Step("tests", 60, (py, "-m", "pytest", "-q", "-m", "cuda", "tests"),
             "the tests marked cuda: every backend on its declared cases on the GPU, against the reference"),
        Step("sync_debug", 25, (py, "-m", "bench.gpu_check", "--sync-debug"),
             "one step of optimized tiny SD1.5 and Flux under torch.cuda.set_sync_debug_mode('error')"),
        Step("dispatch_overhead", 10, (py, "-m", "bench.dispatch", "--overhead", "--device", "cuda",
                                       "--out", os.path.join(out, "dispatch_overhead.json")),
             "each op's call against PyTorch's own call, tiny inputs"),
        Step("kernels", 40, (py, "-m", "bench.kernels", "--json", os.path.join(out, "kernels.json")),
             "kernel benches (attention against SDPA's backends, fp8 linears against cuBLAS bf16)"),
        Step("latency", 120, (py, "-m", "bench.latency", "--preset", "gpu", "--repeats", "1", "--rows",
                              "sdpa_attention,pyext_optimize,pyext_cudagraphs,torch_compile_cudagraphs",
                              "--out", os.path.join(out, "latency")),
             "SD1.5 512x512, 50 steps: fp16 + SDPA, pyext_optimize eager and with CUDA graphs, "
             "torch.compile with CUDA graphs"),
    ]


def _commit() -> str:
    """The commit, and a hash of the uncommitted changes to tracked files if any: a step that passed
    is skipped again only on the same code."""
    import hashlib

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    diff = subprocess.run(["git", "diff", "HEAD"], capture_output=True, cwd=ROOT)
    commit = head.stdout.strip() or f"unknown-{int(time.time())}"
    return f"{commit}+{hashlib.sha1(diff.stdout).hexdigest()[:10]}" if diff.stdout else commit


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


def sync_debug() -> int:
    """One denoiser step of optimized tiny pipelines with every host sync an error."""
    import torch

    import pyext
    from pyext.offline import build_pipeline, run_example

    for arch in ("sd15", "flux"):
        pipe = pyext.optimize(build_pipeline(arch, "tiny", dtype=torch.bfloat16, device="cuda"))
        run_example(pipe, arch, steps=1)  # warm: dispatch chooses (it may time backends) once per signature
        denoiser = pipe.unet if arch == "sd15" else pipe.transformer
        calls = []
        handle = denoiser.register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
        run_example(pipe, arch, steps=1)
        handle.remove()
        args, kwargs = calls[0]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                denoiser(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print(f"{arch}: one denoiser step, no host sync")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out"))
    p.add_argument("--only", help="comma-separated steps to run (default: all)")
    p.add_argument("--budget-s", type=int, default=360, help="start no step once this many seconds have passed")
    p.add_argument("--install-wheels", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-debug", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.install_wheels:
        return install_wheels()
    if args.sync_debug:
        return sync_debug()

    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.out, "gpu_check.json")
    record = {}
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
    commit = _commit()
    done = {name for name, r in record.get("steps", {}).items() if r.get("rc") == 0 and r.get("commit") == commit}
    chosen = [s for s in steps(args.out) if not args.only or s.name in args.only.split(",")]
    todo = [s for s in chosen if s.name not in done]
    print(f"gpu-check at {commit}: {len(todo)} steps, about {sum(s.estimate_s for s in todo)} s "
          f"(budget {args.budget_s} s); results in {record_path}")
    for s in chosen:
        print(f"  {s.name:<18} {'done, skipped' if s.name in done else f'~{s.estimate_s:>3} s'}  {s.what}")
    sys.stdout.flush()

    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 8)))
    site = os.environ.get("SITE", "/tmp/pyext_site")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, ROOT, env.get("PYTHONPATH")]))
    record.setdefault("steps", {})
    start, failed = time.monotonic(), False
    for s in todo:
        if time.monotonic() - start > args.budget_s:
            record["steps"][s.name] = {"rc": None, "commit": commit, "reason": "not started: budget spent"}
            print(f"== {s.name}: not started, budget spent")
            continue
        print(f"== {s.name}: {' '.join(s.command)}", flush=True)
        t = time.monotonic()
        with open(os.path.join(args.out, f"{s.name}.log"), "w") as log:
            try:  # three times its estimate at most: a hung step must not eat the lease
                rc = subprocess.call(s.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=3 * s.estimate_s)
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = time.monotonic() - t
        record["steps"][s.name] = {"rc": rc, "seconds": round(seconds, 1), "estimate_s": s.estimate_s,
                                   "commit": commit, "log": f"{s.name}.log"}
        print(f"   {s.name}: rc {rc} in {seconds:.0f} s (estimate {s.estimate_s} s)", flush=True)
        failed |= rc != 0
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
