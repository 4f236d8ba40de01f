"""`python -m pyext info [--json]`: the build, the device, and every op's backends with reasons."""
from __future__ import annotations

import argparse
import json
import sys


def collect() -> dict:
    import torch

    import pyext
    from pyext import _ext, dispatch

    cuda = torch.cuda.is_available()  # only here, on request: importing pyext never queries the GPU
    devices = ["cpu"] + (["cuda"] if cuda else [])
    return {
        "pyext": pyext.__version__,
        "torch": torch.__version__,
        "extension": "loaded" if _ext.EXT is not None else "missing",
        "extension_error": _ext.EXT_ERROR or "",
        "build": _ext.BUILD_INFO,
        "cpu_simd": _ext.cpu_capabilities(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_device": torch.cuda.get_device_name(0) if cuda else "",
        "ops": {dev: dispatch.status(dev) for dev in devices},
    }


def print_text(info: dict) -> None:
    print(f"pyext {info['pyext']}  torch {info['torch']}  threads {info['torch_threads']}")
    print(f"extension: {info['extension']} {info['extension_error']}")
    print(f"build: {info['build']}")
    print(f"cpu simd (run time): {', '.join(info['cpu_simd']) or 'n/a'}")
    print(f"cuda: {info['cuda_device'] or 'not available'}")
    for dev, ops in info["ops"].items():
        print(f"\nbackends on {dev} (in order of preference):")
        for op, rows in ops.items():
            for row in rows:
                mark = "yes" if row["available"] else "no "
                why = f"  ({row['reason']})" if row["reason"] else ""
                print(f"  {op:<14} {row['backend']:<10} {mark}{why}")


def print_plans(archs, budgets) -> None:
    """Plans for the full architectures (built on the meta device: shapes only, nothing allocated)."""
    import torch

    from pyext import offline, planner
    from pyext.families import find_components
    from pyext.options import parse_bytes

    print("| arch | resolution | weights bf16 | " + " | ".join(budgets) + " |")
    print("|---|---|---|" + "---|" * len(budgets))
    for arch in archs:
        components = find_components(offline.build_pipeline(arch, "full", dtype=torch.bfloat16, device="meta"))
        res = 512 if arch == "sd15" else 1024
        geo = planner.Geometry(res, res)
        weights = sum(c.weight_bytes for c in planner.component_sizes(components, geo)) / planner.GB
        cells = []
        for budget in budgets:
            p = planner.plan(components, geo, parse_bytes(budget))
            cells.append(f"{p.name} ({p.peak_bytes / planner.GB:.1f} GB{'' if p.fits else ', over'})")
        print(f"| {arch} | {res}x{res} | {weights:.1f} GB | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyext")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="build, device and backends")
    info.add_argument("--json", action="store_true")
    plan = sub.add_parser("plan", help="what the memory planner picks per architecture and budget")
    plan.add_argument("--arch", nargs="+", default=["sd15", "sdxl", "sd3", "flux"])
    plan.add_argument("--budgets", nargs="+", default=["4GB", "8GB", "16GB", "24GB"])
    args = parser.parse_args(argv)
    if args.command == "plan":
        print_plans(args.arch, args.budgets)
        return 0
    data = collect()
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        print()
    else:
        print_text(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
