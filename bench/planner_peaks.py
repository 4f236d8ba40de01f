"""The memory planner's peak estimate against the measured peak, per pipeline family.

    python -m bench.planner_peaks [--archs sd15,flux,...] [--scale 4] [--out FILE]

Each tiny pipeline (pyext.offline) is optimized on the CPU for a geometry `--scale` times its
example's size, generates once (2 steps), then again under torch's profiler with memory
profiling: the planner estimates the steady peak, and a first call's one-time work would read as
activations there (measured dispatch timing every candidate on the real input, the convolutions
packed for it, whose plain copies, allocated before profiling, are never seen freed). The
measured peak is the weights plus the highest total of live allocations the call made; each
component's own peak (its forward's allocations above what was live when it began) is shown
beside the planner's activation estimate for it. Then one VAE decode alone, untiled and with
pyext's exact tiling on the CPU. The planner's constants (pyext.planner,
pyext.families.VAE_FAMILIES) are set from these figures.
"""
from __future__ import annotations

import argparse
import warnings

import torch

ARCHS = ("sd15", "sdxl", "sd3", "flux", "sana", "pixart_sigma", "auraflow", "lumina2", "qwenimage", "chroma",
         "wan21", "wan22", "cogvideox", "hunyuanvideo", "ltx", "animatediff")
# The generated Gemma tokenizer spells SANA's built-in instruction prompt a character at a time,
# several times as many tokens as the real tokenizer: left out, the text is the planned length.
CALL = {"sana": {"complex_human_instruction": None}}


def _forward_ranges(modules: dict) -> list:
    """Hooks that mark each module's forward as a profiler range named after it."""
    open_ranges: dict[str, list] = {}
    handles = []
    for name, module in modules.items():
        def pre(mod, args, name=name):
            r = torch.profiler.record_function(f"component::{name}")
            r.__enter__()
            open_ranges.setdefault(name, []).append(r)

        def post(mod, args, out, name=name):
            open_ranges[name].pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def profile_peaks(fn, modules: dict) -> tuple[int, dict[str, int]]:
    """(peak bytes allocated by fn above what was live before it, {module: peak of its forward})."""
    from pyext import _compat

    handles = _forward_ranges(modules)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        for h in handles:
            h.remove()
    events = _compat.profiler_events(prof)
    live, total = [], 0
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        total += nbytes
        live.append((start, total))
    per: dict[str, int] = {}
    for e in events:
        if not e.name().startswith("component::"):
            continue
        name, begin, end = e.name().split("::", 1)[1], e.start_ns(), e.end_ns()
        before = next((t for s, t in reversed(live) if s < begin), 0)
        inside = [t for s, t in live if begin <= s <= end]
        per[name] = max(per.get(name, 0), max(inside, default=before) - before)
    return max((t for _, t in live), default=0), per


def measure(arch: str, scale: int = 4, dtype="auto") -> dict:
    """The planner's estimate and the measured peak of one tiny pipeline, 2 steps on the CPU, in
    `dtype` (optimize's option: "auto" is bf16 on a CPU that computes it natively, else fp32)."""
    import pyext
    from pyext import offline, planner

    call = offline.example_call(arch)
    size = {k: v * scale for k, v in call.items() if k in ("height", "width")}
    geometry = dict(size, frames=call.get("num_frames"))
    pipe = offline.build_pipeline(arch, "tiny")
    decision = pyext.plan(pipe, dtype=dtype, **geometry).decision
    compute = decision.dtype or torch.float32
    elem = torch.tensor([], dtype=compute).element_size()
    sizes = planner.component_sizes(decision.components, decision.geometry, elem, host=compute)
    pyext.optimize(pipe, dtype=dtype, **geometry)
    modules = {name: (getattr(m, "decoder", None) or m) if decision.components.roles[name] == "vae" else m
               for name, m in decision.components.modules.items()}
    weights = sum(c.weight_bytes for c in sizes)

    def generate():
        offline.run_example(pipe, arch, steps=2, **size, **CALL.get(arch, {}))

    with torch.no_grad():
        generate()  # the first call's one-time work stays out of the profile
        peak, per = profile_peaks(generate, modules)
    estimate = decision.plan.peak_bytes
    return {"arch": arch, "dtype": str(compute).removeprefix("torch."),
            "geometry": {"height": decision.geometry.height, "width": decision.geometry.width,
                         "frames": decision.geometry.frames},
            "plan": decision.plan.name, "estimate_bytes": estimate, "measured_bytes": weights + peak,
            "weight_bytes": weights, "ratio": estimate / (weights + peak),
            "components": {c.name: {"role": c.role, "class": type(decision.components.modules[c.name]).__name__,
                                    "estimate_bytes": c.activation_bytes, "measured_bytes": per.get(c.name, 0)}
                           for c in sizes}}


def measure_tiled_vae(arch: str = "sd15", side: int = 1024, dtype="auto") -> dict:
    """The decode alone, untiled and with pyext's exact tiling on the CPU (which keeps each
    stage's whole-image state in host memory), in `dtype` (optimize's option), against the
    planner's two estimates."""
    import pyext
    from pyext import offline, planner

    row = {"arch": arch, "side": side}
    for tiling in ("off", "on"):
        pipe = offline.build_pipeline(arch, "tiny")
        decision = pyext.plan(pipe, height=side, width=side, vae_tiling=tiling, dtype=dtype).decision
        compute = decision.dtype or torch.float32
        elem = torch.tensor([], dtype=compute).element_size()
        vae = next(c for c in planner.component_sizes(decision.components, decision.geometry, elem, host=compute)
                   if c.role == "vae")
        pyext.optimize(pipe, height=side, width=side, vae_tiling=tiling, dtype=dtype)
        latent = torch.randn(1, pipe.vae.config.latent_channels, side // 8, side // 8).to(pipe.vae.dtype)
        with torch.no_grad():
            pipe.vae.decode(latent)  # the first call's one-time work stays out of the profile
            peak, _ = profile_peaks(lambda: pipe.vae.decode(latent), {})
        estimate = vae.tiled_activation_bytes if tiling == "on" else vae.activation_bytes
        row["dtype"] = str(compute).removeprefix("torch.")
        row[f"tiling_{tiling}"] = {"estimate_bytes": estimate, "measured_bytes": peak, "ratio": estimate / peak}
    return row


def render(rows: list[dict]) -> str:
    mib = 2**20
    lines = ["| family | dtype | geometry | estimated peak | measured peak | estimate / measured | largest activation "
             "(estimated / measured) |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        g = r["geometry"]
        comp = max(r["components"].items(), key=lambda kv: kv[1]["measured_bytes"])
        lines.append(f"| {r['arch']} | {r['dtype']} | {g['width']}x{g['height']}" + (f"x{g['frames']}" if g["frames"] > 1 else "")
                     + f" | {r['estimate_bytes'] / mib:.1f} MiB | {r['measured_bytes'] / mib:.1f} MiB | "
                     f"{r['ratio']:.2f} | {comp[0]} ({comp[1]['class']}): {comp[1]['estimate_bytes'] / mib:.1f} / "
                     f"{comp[1]['measured_bytes'] / mib:.1f} MiB |")
    return "\n".join(lines)


def render_tiled(row: dict) -> str:
    mib = 2**20
    lines = [f"VAE decode alone ({row['arch']}, {row['side']}x{row['side']}, {row['dtype']}, CPU):", "",
             "| tiling | estimated peak | measured peak | estimate / measured |", "|---|---:|---:|---:|"]
    for mode in ("off", "on"):
        r = row[f"tiling_{mode}"]
        lines.append(f"| {mode} | {r['estimate_bytes'] / mib:.1f} MiB | {r['measured_bytes'] / mib:.1f} MiB | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines)


def render_result(result: dict) -> str:
    return "\n\n".join([render(result["rows"])] + [render_tiled(row) for row in result["tiled_vae"]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--scale", type=int, default=4, help="geometry: this many times the example's height and width")
    p.add_argument("--dtypes", default="float32,bfloat16", help="optimize's dtype option, each in turn")
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from bench.latency import save_results

    rows, dtypes = [], [getattr(torch, name) for name in args.dtypes.split(",")]
    for dtype in dtypes:
        for arch in args.archs.split(","):
            rows.append(measure(arch, args.scale, dtype))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    result = save_results("planner_peaks", "cpu", args.out, scale=args.scale, rows=rows,
                          tiled_vae=[measure_tiled_vae(dtype=dtype) for dtype in dtypes])
    print(render_result(result))
    return result


if __name__ == "__main__":
    main()
