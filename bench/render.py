"""Puts the benches' results files into docs/benchmarks.md.

    python -m bench.render [--check]

Each results file in RENDERED has a block in docs/benchmarks.md between

    <!-- rendered from bench/results/NAME.json -->
    <!-- end of rendered table -->

which is replaced by the file's table and a line naming the machine, the commit and the
versions it was measured with. --check changes nothing and exits 1 when the page is not what
the files give (a results file was updated without rendering).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
END = "<!-- end of rendered table -->"


def _renderers() -> dict[str, Callable[[dict], str]]:
    from bench.attention import render as render_attention
    from bench.compiled_precision import render as render_compiled_precision
    from bench.cpu_runtimes import render as render_cpu_runtimes
    from bench.dispatch import render_results as render_dispatch
    from bench.fp8 import render as render_fp8
    from bench.fp8_accuracy import render as render_fp8_accuracy
    from bench.geglu import render as render_geglu
    from bench.gpu_check import render as render_gpu_check
    from bench.group_norm import render as render_group_norm
    from bench.parallel import render as render_parallel
    from bench.plot import results_block as render_latency
    from bench.planner_peaks import render_result as render_planner_peaks
    from bench.vae import render_runs

    return {"attention_cpu_avx2": render_attention,
            "fp8_cpu_avx2": render_fp8,
            "attention_cpu_avx512bf16": render_attention,
            "fp8_cpu_avx512bf16": render_fp8,
            "attention_cpu_amx": render_attention,
            "fp8_cpu_amx": render_fp8,
            "cpu_runtimes_avx2": render_cpu_runtimes,
            "cpu_runtimes_avx512bf16": render_cpu_runtimes,
            "cpu_runtimes_amx": render_cpu_runtimes,
            "cpu_runtimes_unet_amx": render_cpu_runtimes,
            "dispatch_overhead_cpu": render_dispatch,
            "fp8_accuracy_cpu": lambda r: render_fp8_accuracy(r["rows"]),
            "latency_peers_cpu": render_latency,
            "latency_peers_cpu_avx2": render_latency,
            "latency_peers_cpu_amx": render_latency,
            "latency_cpu_avx2": render_latency,
            "latency_rounds_cpu_avx2": render_latency,
            "latency_cpu_avx512bf16": render_latency,
            "latency_cpu_amx": render_latency,
            "latency_rounds_cpu_amx": render_latency,
            "latency_flux_cpu_avx2": render_latency,
            "latency_flux_fp8_cpu_avx2": render_latency,
            "latency_flux_cpu_amx": render_latency,
            "latency_flux_fp8_skip_cpu_amx": render_latency,
            "latency_sdxl_cpu_avx2": render_latency,
            "latency_sdxl_cpu_amx": render_latency,
            "compiled_precision_cpu_amx": render_compiled_precision,
            "group_norm_cpu_amx": render_group_norm,
            "geglu_cpu_amx": render_geglu,
            "vae_memory_settings_cpu": lambda r: render_runs(r["rows"]),
            "planner_peaks_cpu": render_planner_peaks,
            "planner_peaks_cpu_avx2": render_planner_peaks,
            "planner_peaks_cpu_amx": render_planner_peaks,
            "parallel_cpu_1": render_parallel,
            "parallel_cpu_2": render_parallel,
            "parallel_sd3_cpu_2": render_parallel,
            "parallel_sd3_cpu_4": render_parallel,
            "parallel_vae_cpu_1": render_parallel,
            "parallel_vae_cpu_1_thread": render_parallel,
            "parallel_vae_cpu_2": render_parallel,
            "gpu_check_h200": render_gpu_check}


def _provenance(result: dict) -> str:
    m, v = result["machine"], result["versions"]
    flags = f" ({' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    where = m.get("gpu") or f"{m.get('cpu', 'unknown CPU')}{flags}, {m.get('cpu_count')} cores"
    return (f"Measured on {where}, torch {v.get('torch')}, diffusers {v.get('diffusers')}, "
            f"at commit {result.get('commit', 'unknown')}.")


def block(name: str) -> str:
    with open(os.path.join(ROOT, "bench", "results", f"{name}.json")) as f:
        result = json.load(f)
    table = _renderers()[name](result)
    return f"<!-- rendered from bench/results/{name}.json -->\n{_provenance(result)}\n\n{table}\n{END}"


def rendered(page: str) -> str:
    for name in _renderers():
        pattern = re.compile(rf"<!-- rendered from bench/results/{re.escape(name)}\.json -->.*?{re.escape(END)}",
                             re.DOTALL)
        if not pattern.search(page):
            raise SystemExit(f"docs/benchmarks.md has no block for bench/results/{name}.json")
        page = pattern.sub(lambda _: block(name), page)
    return page


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = p.parse_args(argv)
    with open(PAGE) as f:
        page = f.read()
    new = rendered(page)
    if args.check:
        if new != page:
            print("docs/benchmarks.md differs from the results files: run python -m bench.render")
            return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
