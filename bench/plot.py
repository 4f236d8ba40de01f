"""latency.md and latency.png from the report bench.latency builds."""
from __future__ import annotations


def _check_steps(report: dict) -> str:
    steps = report.get("preset_parameters", {}).get("check_steps")
    return f" of a {steps}-step run" if steps else ""


def _bytes(n):
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _fmt(value, spec, unit=""):
    return "-" if value is None else f"{value:{spec}}{unit}"


ARCH_TITLES = {"sd15": "SD1.5", "sdxl": "SDXL", "flux": "Flux"}


def _workload(report: dict) -> str:
    """'SD1.5 256x256, 2 DDIM steps': the arch, size and steps (the scheduler: DDIM for SD1.5,
    the pipeline's own for the others)."""
    p = report["preset_parameters"]
    arch = p.get("arch", "sd15")
    return (f"{ARCH_TITLES.get(arch, arch)} {p['width']}x{p['height']}, {p['steps']} "
            f"{'DDIM steps' if arch == 'sd15' else 'steps'}")


def _command(report: dict) -> str:
    arch = report["preset_parameters"].get("arch", "sd15")
    return (f"python -m bench.latency --preset {report['preset']}"
            + (f" --model-arch {arch}" if arch != "sd15" else ""))


def _label(name: str, row: dict) -> str:
    dtype = row.get("dtype")
    if dtype == "bfloat16":  # CPU rows run bf16 where the guide ran fp16
        return f"{name} (bf16)"
    return name


def table(report: dict) -> str:
    """The rows' table and what each row's steps did (its notes): latency.md's body, and what
    docs/benchmarks.md shows of a results file."""
    rows = report["rows"]
    base = rows.get("original", {}).get("latency_s")
    rounds = any("vs_original" in row for row in rows.values())  # interleaved rounds: their ratio column
    lines = [
        "| row | dtype | latency | speed-up | " + ("time / original's, per round (median, range) | " if rounds else "")
        + "denoiser it/s | text | denoise | VAE decode | peak mem | weights "
        "| max abs diff | PSNR vs original | check | guide, Titan RTX |",
        "|---|---|---:|---:|" + ("---:|" if rounds else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, row in rows.items():
        guide = _fmt(report.get("guide_titan_rtx_s", {}).get(name), ".2f", " s")
        if "latency_s" not in row:
            lines.append(f"| {name} | | n/a: {row['reason']} | | " + ("| " if rounds else "")
                         + f"| | | | | | | | | {guide} |")
            continue
        st = row["stages_s"]
        psnr = row.get("psnr_db")
        ratio = row.get("vs_original")
        per_round = [f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}, {ratio['rounds']} rounds)"
                     if ratio else "-"] if rounds else []
        lines.append(" | ".join([
            f"| {name}", row["dtype"], _fmt(row["latency_s"], ".3f", " s"),
            _fmt(base / row["latency_s"] if base else None, ".2f", "x"), *per_round,
            _fmt(row["denoiser_it_per_s"], ".2f"),
            _fmt(st.get("text_encoding"), ".3f", " s"), _fmt(st.get("denoising"), ".3f", " s"),
            _fmt(st.get("vae_decode"), ".3f", " s"), _bytes(row["peak_memory_bytes"]), _bytes(row["weight_bytes"]), _fmt(row.get("max_abs_diff"), ".2e"),
            "identical" if psnr == float("inf") else _fmt(psnr, ".1f", " dB"), row.get("check", ""), guide + " |",
        ]))
    notes = [f"- `{name}`: {note[:300]}" + ("..." if len(note) > 300 else "")
             for name, row in rows.items() for note in row.get("notes", {}).values()]
    return "\n".join(lines + ([""] + notes if notes else []))


def write_markdown(report: dict, path: str) -> None:
    rows = report["rows"]
    p = report["preset_parameters"]
    m = report["machine"]
    guidance = ("guidance-distilled (one denoiser call per step)" if p.get("arch") == "flux"
                else "classifier-free guidance (denoiser batch 2)")
    lines = [
        f"# {_workload(report).split(' ')[0]} latency, preset `{report['preset']}`",
        "",
        f"{report['model']}, weights: **{report['weights']}**; {_workload(report).split(' ', 1)[1]}, "
        f"batch 1 with {guidance}, median of {report['repeats']} run(s) after a "
        f"{p['warmup_steps']}-step warm-up; each row in its own process. Prompt: \"{report['prompt']}\".",
        f"Machine: {m.get('gpu') or m.get('cpu')}, {m['cpu_count']} CPUs, torch threads {m['torch_threads']}"
        + (f", load average at the end {', '.join(f'{x:.1f}' for x in m['load_average'])}" if "load_average" in m else "")
        + ". " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        "",
        table(report),
    ]
    unrelated = report.get("unrelated_psnr_db")
    lines += [
        "",
        f"Peak memory: {next((r['peak_memory_kind'] for r in rows.values() if 'peak_memory_kind' in r), '-')}. "
        "Weights: bytes of parameters and buffers of the denoiser, text encoders and VAE.",
        f"Check: image{_check_steps(report)} vs the `original` row's (same seed and latents, pixel values in [0, 1]); "
        f"a row fails when "
        f"its image is non-finite or its PSNR is below {report['min_psnr_db']:g} dB. For scale, an image from "
        f"another seed scores {_fmt(unrelated, '.1f', ' dB')}."
        + (" Weights are random, so images are noise-like: the check compares numerics, not quality."
           if report["weights"] == "random" else ""),
        "The guide column is the published Titan RTX table (512x512, 50 DDIM steps, real SD1.5 weights), for "
        "reference only: different machine, and on other presets a different workload.",
    ]
    loads = [r["load_average_1m"] for r in rows.values() if "load_average_1m" in r]
    if loads:
        lines.append(f"1-minute load average at the end of each row: {min(loads):.1f} to {max(loads):.1f} "
                     f"on {m['cpu_count']} CPUs (above the CPU count, other processes shared the machine).")
    missing = [r for r in report.get("rows_planned", []) if r not in rows]
    if missing:
        lines += ["", f"**Incomplete: rows not run (yet): {', '.join(missing)}.**"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def results_block(report: dict) -> str:
    """A results file's block in docs/benchmarks.md: the workload, the table, and how loaded the
    machine was (on a shared machine, the noise)."""
    rows = report["rows"]
    lines = [f"Preset `{report['preset']}` ({report['model']}, {report['weights']} weights): "
             f"{_workload(report).split(' ', 1)[1]}, median of {report['repeats']} run(s); "
             f"`{_command(report)} --rows {','.join(rows)}`.", "", table(report)]
    loads = [r["load_average_1m"] for r in rows.values() if "load_average_1m" in r]
    if loads:
        lines += ["", f"1-minute load average at the end of each row: {min(loads):.1f} to {max(loads):.1f} on "
                      f"{report['machine']['cpu_count']} CPUs."]
    return "\n".join(lines)


def write_chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = list(rows)[::-1]  # first row on top
    base = rows.get("original", {}).get("latency_s")
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.6))
    top = max((r["latency_s"] for r in rows.values() if "latency_s" in r), default=1.0)
    for i, name in enumerate(names):
        row = rows[name]
        if "latency_s" not in row:
            ax.text(0.01 * top, i, f"n/a: {row['reason'][:70]}", va="center", fontsize=8, color="gray")
            continue
        failed = row.get("check", "ok") != "ok"
        ax.barh(i, row["latency_s"], color="tab:red" if failed else "tab:blue")
        note = f" {row['latency_s']:.2f} s" + (f"  x{base / row['latency_s']:.2f}" if base else "")
        ax.text(row["latency_s"], i, note + ("  CHECK FAILED" if failed else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(names)), [_label(n, rows[n]) for n in names], fontsize=9)
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("end-to-end latency, seconds (lower is better)")
    ax.set_title(f"{_workload(report)}, preset {report['preset']} "
                 f"({report['weights']} weights)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
