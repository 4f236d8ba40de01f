"""Kernel-level benchmarks of every pyext suite, in one table.

    python -m bench.kernels [--json PATH] [--suites attention,vae,fp8]

Each suite is a module bench/<suite>.py exposing run() -> list[dict] (one dict per
measurement, any keys). A suite that is missing or fails shows as a row with the
reason, so the table always says what was and was not measured.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

SUITES = ("attention", "vae", "fp8", "winograd")


def run_suite(name: str) -> dict:
    """{"rows": [...], "seconds": s} or {"reason": why nothing was measured}."""
    try:
        module = importlib.import_module(f"bench.{name}")
    except ImportError as e:
        return {"reason": f"not available: bench.{name} cannot be imported ({e})"}
    if not hasattr(module, "run"):
        return {"reason": f"not available: bench.{name} has no run()"}
    t0 = time.perf_counter()
    try:
        rows = module.run()
    except Exception as e:  # one suite's failure must not hide the others' results
        traceback.print_exc()
        return {"reason": f"failed: {type(e).__name__}: {e}"[:300]}
    return {"rows": list(rows), "seconds": time.perf_counter() - t0}


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(results: dict) -> str:
    """Markdown: one table per (suite, kind of row), since suites' rows have different keys."""
    out = ["| suite | status |", "|---|---|"]
    for name, res in results.items():
        status = res["reason"] if "reason" in res else f"{len(res['rows'])} rows in {res['seconds']:.1f} s"
        out.append(f"| {name} | {status} |")
    for name, res in results.items():
        groups: dict[str, list[dict]] = {}
        for row in res.get("rows", []):
            groups.setdefault(str(row.get("bench", row.get("kind", ""))), []).append(row)
        for kind, rows in groups.items():
            keys = list(dict.fromkeys(k for r in rows for k in r))  # union, first-seen order
            out += ["", f"### {name}" + (f": {kind}" if kind else ""), "",
                    "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            out += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write every suite's rows (or reason) here")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    args = p.parse_args(argv)
    import torch

    import pyext
    results = {name: run_suite(name) for name in args.suites.split(",")}
    header = (f"pyext {pyext.__version__}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, "
              f"{torch.get_num_threads()} threads; weights (where models are involved) random")
    print(header + "\n\n" + format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "suites": results}, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
