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


def print_support(archs) -> None:
    """The support matrix: each family's tiny offline pipeline through optimize(fp8="denoiser"),
    what applied where, and the attention calls pyext computed in one 2-step run. Run it in its
    own process: it lowers the fp8 size floor so that the tiny layers convert."""
    import pyext.nn.fp8
    from pyext import attention, offline, optimize, report
    from pyext.families import family_of, find_components, vae_kind

    pyext.nn.fp8.MIN_NUMEL = 0  # tiny models' layers are below the size floor; real models' are not

    print("| family | pipeline | denoisers (family) | channels-last | fp8 layers | attention: layers routed, "
          "calls by pyext / by torch (why) | VAE: kind, tiling |")
    print("|---|---|---|---|---|---|---|")
    for arch in archs:
        pipe = optimize(offline.build_pipeline(arch), fp8="denoiser")
        offline.run_example(pipe, arch)
        comps = find_components(pipe)
        entries = report(pipe).entries
        state = attention.status(pipe)["components"]

        def cell(technique, name):
            e = next((e for e in entries if e.technique == technique and e.component == name), None)
            if e is None:
                return "-"
            return e.detail.split(" layers")[0] if technique == "fp8" and e.status == "applied" else e.status

        dens = comps.denoisers
        routed = sum(state[n]["patched"] for n in dens)
        ours = sum(state[n]["pyext_calls"] for n in dens)
        torch_calls = {why: n for d in dens for why, n in state[d]["fallbacks"].items() if not why.startswith("no SDPA")}
        vaes = ", ".join(f"{type(v).__name__} ({vae_kind(v)}, {'pyext' if vae_kind(v) == 'kl2d' else 'diffusers'})"
                         for v in comps.vaes.values())
        fams = ", ".join(f"{type(m).__name__} ({family_of(m).name})" for m in dens.values())
        print(f"| {arch} | {type(pipe).__name__} | {fams} | {', '.join(cell('channels_last', n) for n in dens)} | "
              f"{', '.join(cell('fp8', n) for n in dens)} | {routed}, {ours} / {sum(torch_calls.values())}"
              f"{' (' + ', '.join(torch_calls) + ')' if torch_calls else ''} | {vaes} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyext")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="build, device and backends")
    info.add_argument("--json", action="store_true")
    plan = sub.add_parser("plan", help="what the memory planner picks per architecture and budget")
    plan.add_argument("--arch", nargs="+", default=["sd15", "sdxl", "sd3", "flux"])
    plan.add_argument("--budgets", nargs="+", default=["4GB", "8GB", "16GB", "24GB"])
    support = sub.add_parser("support", help="the support matrix, from the tiny offline pipelines (a few minutes)")
    support.add_argument("--arch", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "support":
        from pyext import offline

        print_support(args.arch or offline.ARCHS)
        return 0
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
