"""`python -m pyext`: info (build, device, backends, dispatch decisions), plan, support, kernels."""
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
        "dispatch_mode": {dev: _mode(dev) for dev in devices},
        "dispatch_cache": dispatch.cache_dir(),
        "decisions": dispatch.decisions(),
        "unusable": dispatch.unusable(),
    }


def _mode(device: str) -> str:
    from pyext import dispatch

    try:
        return dispatch.mode(torch_device(device))
    except dispatch.PyextError as err:
        return str(err)


def torch_device(name: str):
    import torch

    return torch.device(name)


def print_text(info: dict) -> None:
    print(f"pyext {info['pyext']}  torch {info['torch']}  threads {info['torch_threads']}")
    print(f"extension: {info['extension']} {info['extension_error']}")
    print(f"build: {info['build']}")
    print(f"cpu simd (run time): {', '.join(info['cpu_simd']) or 'n/a'}")
    print(f"cuda: {info['cuda_device'] or 'not available'}")
    for dev, ops in info["ops"].items():
        print(f"\nbackends on {dev} (in order of preference):")
        op_width = max(map(len, ops), default=0)
        backend_width = max((len(row["backend"]) for rows in ops.values() for row in rows), default=0)
        for op, rows in ops.items():
            for row in rows:
                mark = "yes" if row["available"] else "no "
                why = f"  ({row['reason']})" if row["reason"] else ""
                print(f"  {op:<{op_width}} {row['backend']:<{backend_width}} {mark}{why}")
    print(f"\ndispatch: {', '.join(f'{d} {m}' for d, m in info['dispatch_mode'].items())} "
          f"(PYEXT_DISPATCH); cache {info['dispatch_cache']}")
    for d in info["decisions"]:
        timings = ", ".join(f"{b} {t * 1e3:.3g} ms" for b, t in sorted(d["timings"].items(), key=lambda x: x[1]))
        print(f"  {d['device']}, {d['time']}: {d['op']} {d['key']} -> {d['backend']} ({timings})")
    for u in info["unusable"]:
        print(f"  unusable on {u['device']} since {u['time']}: {u['op']} {u['backend']} for {u['variant']}: "
              f"{u['reason']}")
    if info["unusable"]:
        print("  (checked again by the next process that would choose them; "
              "`python -m pyext info --clear-marks` forgets them now)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int of at least 1, got {text!r}")
    return int(text)


def plans(archs, budgets, device: str, capability, devices: int = 1) -> list[dict]:
    """Plans for the full architectures (built on the meta device: shapes only, nothing allocated),
    with the dtype dtype="auto" picks on `device` (a GPU of `capability` for cuda: a dry run),
    per device when the denoiser's sequence is split over `devices`."""
    import torch

    from pyext import offline, planner
    from pyext.decision import auto_dtype
    from pyext.families import call_default, find_components
    from pyext.options import parse_bytes

    dtype = auto_dtype(torch.device(device), capability)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for arch in archs:
        pipe = offline.build_pipeline(arch, "full", dtype=dtype, device="meta")
        components = find_components(pipe)
        res = 512 if arch == "sd15" else 1024
        geo = planner.Geometry(res, res, text_tokens=call_default(pipe, "max_sequence_length") or 77)
        weights = sum(c.weight_bytes for c in planner.component_sizes(components, geo, elem))
        split = planner.sequence_split(next(iter(components.denoisers.values())), geo, devices,
                                       planner.latent_channels(components))
        row = {"arch": arch, "device": device, "capability": capability, "dtype": str(dtype).removeprefix("torch."),
               "resolution": f"{res}x{res}", "weight_bytes": weights, "devices": devices, "split": split.split,
               "split_reason": split.reason, "plans": {}}
        for budget in budgets:
            p = planner.plan(components, geo, parse_bytes(budget), elem, allow_offload=device != "cpu",
                             host=dtype if device == "cpu" else None, split_ways=split.ways, graphs=device == "cuda")
            row["plans"][budget] = {"plan": p.name, "peak_bytes": p.peak_bytes, "fits": p.fits}
        rows.append(row)
    return rows


def print_plans(rows, budgets) -> None:
    from pyext.planner import GB

    several = any(row["devices"] > 1 for row in rows)
    split_head, split_rule = ("split | ", "---|") if several else ("", "")
    print(f"| arch | dtype | resolution | weights | {split_head}" + " | ".join(budgets) + " |")
    print(f"|---|---|---|---|{split_rule}" + "---|" * len(budgets))
    for row in rows:
        cells = [f"{p['plan']} ({p['peak_bytes'] / GB:.1f} GB{'' if p['fits'] else ', over'})"
                 for p in row["plans"].values()]
        split = f"{row['split']} ({row['split_reason']}) | " if several else ""
        print(f"| {row['arch']} | {row['dtype']} | {row['resolution']} | {row['weight_bytes'] / GB:.1f} GB | {split}"
              + " | ".join(cells) + " |")
    if several:
        print("\n(Estimated peak per device: every device holds all the weights and its share of the denoiser's "
              "tokens.)")


def print_kernels(entries: list[dict]) -> None:
    print("| kernel | variant | config | arch | default | registers | spills | shared | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        print(f"| {e['kernel']} | {e['variant']} | {e['config']} | {e['arch']} | {'yes' if e['default'] else ''} | "
              f"{e['registers']} | {e['spill_bytes']} | {e['shared_bytes']} | {e['error'][:80]} |")


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
    info.add_argument("--clear-marks", action="store_true",
                      help="forget every backend marked unusable (pyext.dispatch.clear_marks())")
    plan = sub.add_parser("plan", help="what the memory planner picks per architecture and budget")
    plan.add_argument("--arch", nargs="+", default=["sd15", "sdxl", "sd3", "flux"])
    plan.add_argument("--budgets", nargs="+", default=["4GB", "8GB", "16GB", "24GB"])
    plan.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    plan.add_argument("--capability", default="9.0", help="the GPU's compute capability (cuda only), e.g. 8.0")
    plan.add_argument("--devices", type=_positive_int, default=1,
                      help="devices the denoiser's sequence is split over (diffusers' context parallelism)")
    plan.add_argument("--json", action="store_true")
    kernels = sub.add_parser("kernels", help="compile every GPU kernel config for sm_80/sm_90 (no GPU needed)")
    kernels.add_argument("--json", action="store_true")
    kernels.add_argument("--everything", action="store_true",
                         help="every config of every head dim and dtype (default: the CI test's subset)")
    kernels.add_argument("--jobs", type=int)
    support = sub.add_parser("support", help="the support matrix, from the tiny offline pipelines (a few minutes)")
    support.add_argument("--arch", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "support":
        from pyext import offline

        print_support(args.arch or offline.ARCHS)
        return 0
    if args.command == "plan":
        capability = tuple(int(x) for x in args.capability.split(".")) if args.device == "cuda" else None
        rows = plans(args.arch, args.budgets, args.device, capability, args.devices)
        json.dump(rows, sys.stdout, indent=1) if args.json else print_plans(rows, args.budgets)
        return 0
    if args.command == "kernels":
        from pyext.kernels import compile_check

        entries = compile_check.check_all(everything=args.everything, jobs=args.jobs)
        json.dump(entries, sys.stdout, indent=1) if args.json else print_kernels(entries)
        problems = compile_check.problems(entries)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if args.clear_marks:
        from pyext import dispatch

        print(f"cleared {dispatch.clear_marks()} unusable marks", file=sys.stderr)
    data = collect()
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        print()
    else:
        print_text(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
