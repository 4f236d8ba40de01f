"""Tiled VAE decode and encode on CPU: the untiled run vs diffusers' tiling vs pyext's, per VAE shape and size.

    python -m bench.vae --preset quick              # small sizes and tiles, a few minutes
    python -m bench.vae --preset full [--json PATH] # the issue-14 table (an hour or more on 2 cores)
    python -m bench.vae --shapes sd --sizes 1024 2048 --encode-sizes 1024 [--max-full-mpix 4.2]
    python -m bench.vae --preset quick --pyext '{}' '{"compact_state": true}'  # one pyext row per option set
    python -m bench.vae --shapes sd --sizes 1024 --pyext '{}' '{"memory": {"vae_block_pool": true, "vae_state_on_disk": true}}'  # the library's defaults, and pyext.memory's process-wide settings

Image VAEs (AutoencoderKL, seeded random weights): "sd" (SD 1.5's VAE, 512-px tiles), "flux"
(Flux's: 16 latent channels, no quant convs, 512-px tiles) and "small" (4 blocks of 32/32/64/64
channels, one layer each, 256-px tiles). Decode inputs are smooth latents (noise on a grid 8x
coarser, bilinearly upsampled; --latents random: white noise), encode inputs a smooth image with
fine noise on it. "video" decodes with a CogVideoX-2b-shaped VAE: untiled, diffusers' tiling,
and diffusers' tiling with pyext's fused blend (pyext.vae.tile_video_vae).

Each run is one fresh subprocess, which reports its wall time and its peak RSS above the RSS
just before the call (VmHWM reset through /proc/self/clear_refs). By default glibc is told to
return large free blocks at once, so the peak is that of live memory, torch's CPU allocator
included; --malloc default keeps glibc's own settings (the times users see; see MALLOC).
PSNR compares each tiled output (image, or latent moments for encode) with the untiled one;
the untiled run is skipped above --max-full-mpix output megapixels (3840x2224 with the SD VAE
would need about 31 GB).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

SD = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
          up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=32, layers_per_block=2)
SHAPES = {  # AutoencoderKL config, tile (pixels)
    "sd": (SD, 512),
    "flux": (dict(SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False), 512),
    "small": (dict(SD, block_out_channels=(32, 32, 64, 64), layers_per_block=1), 256),
}
METHODS = ("full", "diffusers", "pyext")
VIDEO_METHODS = ("full", "diffusers", "pyext")


def _size(text: str) -> tuple[int, int]:
    """"1024" or "3840x2224" (width x height) -> (height, width)."""
    w, _, h = text.partition("x")
    return (int(h or w), int(w))


PRESETS = {
    # (shape, direction, size, tile): quick halves every tile: 2 x 1.5 tiles
    "quick": {"runs": [(s, d, "512x384", SHAPES[s][1] // 2) for s in SHAPES for d in ("decode", "encode")],
              # (video tiles: width x height, each a size CogVideoX's overlap factors tile without a
              # mismatch, pyext.vae.video.tiling_mismatch)
              "video": {"frames": 5, "size": "240x160", "tile": "80x96"}},
    "full": {"runs": [(s, "decode", z, SHAPES[s][1]) for s in SHAPES for z in ("1024", "2048", "3840x2224")]
             + [(s, "encode", "1024", SHAPES[s][1]) for s in SHAPES],
             "video": {"frames": 9, "size": "720x480", "tile": None}},
}


# ----------------------------------------------------------------------------- inputs

def image_vae(shape: str, tile: int):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(**SHAPES[shape][0], sample_size=tile).eval()
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // factor
    return vae


def smooth(shape, coarse: int, seed: int = 1) -> torch.Tensor:
    """Noise on a grid `coarse` times coarser, bilinearly upsampled (per plane of the leading dims)."""
    gen = torch.Generator().manual_seed(seed)
    low = torch.randn(1, math.prod(shape[:-2]), max(1, shape[-2] // coarse), max(1, shape[-1] // coarse), generator=gen)
    up = torch.nn.functional.interpolate(low, size=shape[-2:], mode="bilinear", align_corners=False)
    return 2 * up.reshape(shape)


def image_input(vae, direction: str, hw: tuple[int, int], latents: str) -> torch.Tensor:
    if direction == "encode":
        gen = torch.Generator().manual_seed(2)
        fine = 0.1 * torch.randn(1, 3, *hw, generator=gen)
        return (0.5 * smooth((1, 3, *hw), 64) + fine).clamp(-1, 1)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (1, vae.config.latent_channels, hw[0] // factor, hw[1] // factor)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)) if latents == "random" else smooth(shape, 8)


def video_vae():
    from diffusers import AutoencoderKLCogVideoX

    from pyext.offline import load_config
    torch.manual_seed(0)
    return AutoencoderKLCogVideoX(**load_config("cogvideox", "bench")["components"]["vae"]["config"]).eval()


def video_latents(vae, frames: int, hw: tuple[int, int]) -> torch.Tensor:
    t = (frames - 1) // vae.config.temporal_compression_ratio + 1
    return smooth((1, vae.config.latent_channels, t, hw[0] // 8, hw[1] // 8), 4)


# ----------------------------------------------------------------------------- one run, in a child

def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _prepare(spec: dict):
    """(callable, input, warm-up input, facts for the row) for one run."""
    from pyext.vae import tile_vae, tile_video_vae
    method, hw = spec["method"].split()[0], _size(spec["size"])  # "pyext <options>" runs pyext
    if spec["direction"] == "video":
        vae, tile = video_vae(), spec.get("tile")
        z = video_latents(vae, spec["frames"], hw)
        kwargs = {} if tile is None else dict(zip(("tile_sample_min_height", "tile_sample_min_width"), _size(str(tile))))
        if method == "diffusers":
            vae.enable_tiling(**kwargs)
        elif method == "pyext":
            tile_video_vae(vae, **kwargs)
        return (lambda t: vae.decode(t).sample), z, z[..., :2, :4, :4], {}
    vae = image_vae(spec["shape"], spec["tile"])
    if spec.get("channels_last"):  # diffusers' own switch, for every method of the row set alike
        vae.to(memory_format=torch.channels_last)
    x = image_input(vae, spec["direction"], hw, spec.get("latents", "smooth"))
    facts = {}
    if method == "diffusers":
        vae.enable_tiling()
    elif method == "pyext":
        import pyext

        options = dict(spec.get("pyext", {}))
        pyext.memory.configure(**options.pop("memory", {}))  # this child process only
        tile_vae(vae, **options)
        if spec.get("prepack"):  # what pyext.optimize does to a CPU pipeline's VAE besides tiling
            from pyext.nn.packed import pack
            facts["packed_layers"] = len(pack(vae).packed)
    if spec["direction"] == "encode":
        return (lambda t: vae.encode(t).latent_dist.parameters), x, x[..., :64, :64], facts
    return (lambda t: vae.decode(t).sample), x, x[..., :8, :8], facts


def _child(spec: dict) -> dict:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    run, x, warm_up, facts = _prepare(spec)
    with torch.no_grad():
        run(warm_up)  # kernels and allocator paths outside the measurement
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := current RSS
            reset = True
        except OSError:
            reset = False
        base = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        out = run(x)
        seconds = time.perf_counter() - t0
        peak = _rss_kib("VmHWM")
    torch.save(out, spec["out"])
    return {"seconds": seconds, "peak_extra_mib": (peak - base) / 1024, "hwm_reset": reset,
            "out_mib": out.numel() * out.element_size() / 2**20, **facts}


def _forked_child(spec: dict, conn) -> None:
    try:
        conn.send(_child(spec))
    except Exception as err:  # noqa: BLE001 (the row reports it)
        conn.send({"error": f"{type(err).__name__}: {err}"[:300]})


# glibc's settings for a child. "live": every block above 64 KiB is its own mapping, returned when
# freed, so the peak RSS is that of live memory (torch's CPU allocator included), but each such
# allocation costs a fresh mapping's page faults. "default": glibc's own, as users run: faster
# for some runs, and a peak that includes freed memory glibc kept.
MALLOC = {"live": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}, "default": {}}


def measure(spec: dict, malloc: str = "live") -> dict:
    """One run in a process of its own. Under glibc's own settings it is forked from a server that
    imported torch, diffusers and pyext once and never computed, so no row pays the imports (many
    seconds); other settings take effect only when a process starts, so those rows start afresh."""
    if not MALLOC[malloc]:
        return _measure_forked(spec)
    env = {k: v for k, v in os.environ.items() if k not in MALLOC["live"]}
    env.update(MALLOC[malloc])
    res = subprocess.run([sys.executable, "-m", "bench.vae", "--child", json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        return {"error": f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ''}"[:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _measure_forked(spec: dict) -> dict:
    from bench.latency import preloaded_forkserver

    ctx = preloaded_forkserver(["torch", "diffusers", "pyext", "bench.vae", "diffusers.models.autoencoders"])
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked_child, args=(spec, child))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        result = None
    proc.join()
    return result if result is not None else {"error": f"exit {proc.exitcode}"}


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    mse = float(((a.double() - ref.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(torch.log10((ref.max() - ref.min()).double() ** 2 / mse))


# ----------------------------------------------------------------------------- tables

def _label(options: dict, prepack: bool = False) -> str:
    return "pyext" + " prepacked" * prepack + "".join(f" {k}={json.dumps(v)}" for k, v in options.items())


def _rows_for(base: dict, methods, max_full_mpix: float, tmp: str, pyext_options=({},), malloc: str = "live",
              prepack: bool = False) -> list[dict]:
    """One row per method, "pyext" once per option set (its label names the options; its VAE
    packed where prepack)."""
    hw = _size(base["size"])
    mpix = hw[0] * hw[1] * base.get("frames", 1) / 1e6
    rows, outs = [], {}
    runs = [(m, {}) for m in methods if m != "pyext"] + [("pyext", o) for o in pyext_options]
    for method, options in runs:
        m = _label(options, prepack) if method == "pyext" else method
        row = dict(base, method=m, pyext=options, prepack=prepack) if method == "pyext" else dict(base, method=m)
        if m == "full" and base["direction"] != "encode" and mpix > max_full_mpix:
            row["skipped"] = f"untiled run above --max-full-mpix {max_full_mpix} ({mpix:.1f} Mpix)"
        else:
            outs[m] = os.path.join(tmp, f"{len(outs)}.pt")
            row.update(measure(dict(row, out=outs[m]), malloc))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if "full" in outs and os.path.exists(outs["full"]):
        ref = torch.load(outs["full"])
        for row in rows:
            if row["method"] != "full" and os.path.exists(outs.get(row["method"], "")):
                out = torch.load(outs[row["method"]])
                if out.shape == ref.shape:
                    row["psnr_vs_full_db"] = psnr(out, ref)
                else:
                    row["note"] = f"output {tuple(out.shape)}, untiled {tuple(ref.shape)}: no PSNR"
    for path in outs.values():
        if os.path.exists(path):
            os.remove(path)
    return rows


def run(preset: str = "quick", shapes=None, sizes=None, encode_sizes=None, video: bool = True,
        max_full_mpix: float = 4.2, latents: str = "smooth", pyext_options=({},), malloc: str = "live",
        channels_last: bool = False, prepack: bool = False) -> list[dict]:
    """All rows of a preset, or of the given shapes x sizes (decode) and encode sizes; one pyext
    row per dict of tile_vae options in pyext_options; children under MALLOC[malloc]; image
    VAEs in channels-last for every method where channels_last; the pyext rows' image VAEs
    also packed (pyext.nn.packed) where prepack."""
    if len({_label(o) for o in pyext_options}) < len(pyext_options):
        raise SystemExit(f"--pyext: each option set once, got {list(pyext_options)}")
    if shapes or sizes or encode_sizes:
        shapes = shapes or list(SHAPES)
        runs = [(s, "decode", z, SHAPES[s][1]) for s in shapes for z in sizes or []] + \
               [(s, "encode", z, SHAPES[s][1]) for s in shapes for z in encode_sizes or []]
    else:
        runs = PRESETS[preset]["runs"]
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, direction, size, tile in runs:
            base = {"bench": f"vae_{direction}", "shape": shape, "direction": direction, "size": size, "tile": tile,
                    "latents": latents, "threads": threads, "malloc": malloc, "channels_last": channels_last}
            rows += _rows_for(base, METHODS, max_full_mpix, tmp, pyext_options, malloc, prepack)
        if video:
            v = PRESETS[preset]["video"]
            base = {"bench": "video_decode", "shape": "cogvideox-2b", "direction": "video", "size": v["size"],
                    "frames": v["frames"], "tile": v["tile"], "threads": threads, "malloc": malloc}
            rows += _rows_for(base, VIDEO_METHODS, max_full_mpix, tmp, malloc=malloc)
    return rows


def _ratio(row: dict, key: str, rows: list[dict]) -> str:
    ref = next((r for r in rows if r["method"] == "diffusers" and all(
        r.get(k) == row.get(k) for k in ("bench", "shape", "size", "tile", "channels_last"))), None)
    if ref is None or key not in ref or key not in row or row["method"] == "diffusers":
        return ""
    return f"{row[key] / ref[key]:.2f}x"


def table(rows: list[dict]) -> str:
    lines = ["| VAE | run | size | tile | method | latency s | vs diffusers | peak extra MiB | vs diffusers | "
             "output MiB | PSNR vs full dB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        what = r["direction"] if r["direction"] != "video" else f"video decode, {r['frames']} frames"
        what += ", channels-last" if r.get("channels_last") else ""
        head = f"| {r['shape']} | {what} | {r['size']} | {r['tile'] or 'default'} | {r['method']} |"
        if "seconds" not in r:
            lines.append(f"{head} {r.get('skipped') or r.get('error')} | | | | | |")
            continue
        db = r.get("psnr_vs_full_db")
        lines.append(f"{head} {r['seconds']:.1f} | {_ratio(r, 'seconds', rows)} | {r['peak_extra_mib']:.0f} | "
                     f"{_ratio(r, 'peak_extra_mib', rows)} | {r['out_mib']:.1f} | "
                     f"{r.get('note', '') if db is None else f'{db:.1f}'} |")
    return "\n".join(lines)


def render_runs(rows: list[dict]) -> str:
    """The rows that ran, as a table: time and peak against the first diffusers row."""
    ran = [r for r in rows if "seconds" in r]
    base = next((r for r in ran if r["method"] == "diffusers"), None)
    lines = ["| VAE | size | method | time | vs diffusers | peak above the input | vs diffusers |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in ran:
        ratio = lambda key: f"{r[key] / base[key]:.2f}x" if base else ""  # noqa: E731
        lines.append(f"| {r['shape']} | {r['size']} | {r['method']} | {r['seconds']:.1f} s | {ratio('seconds')} | "
                     f"{r['peak_extra_mib']:.0f} MiB | {ratio('peak_extra_mib')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vae", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="with --sizes / --encode-sizes instead of a preset")
    p.add_argument("--sizes", nargs="+", help="decode sizes, e.g. 1024 3840x2224 (width x height)")
    p.add_argument("--encode-sizes", nargs="+", help="encode sizes")
    p.add_argument("--no-video", action="store_true", help="skip the CogVideoX-shaped decode")
    p.add_argument("--max-full-mpix", type=float, default=4.2, help="skip untiled decodes above this many megapixels")
    p.add_argument("--latents", choices=("smooth", "random"), default="smooth")
    p.add_argument("--pyext", nargs="+", default=["{}"],
                   help='tile_vae options as JSON, one pyext row each, e.g. \'{}\' \'{"method": "tiles"}\'; '
                        'a "memory" key holds pyext.memory settings for that row')
    p.add_argument("--malloc", choices=sorted(MALLOC), default="live",
                   help="glibc's settings in each child: 'live' (default) for peaks of live memory, 'default' as users run")
    p.add_argument("--channels-last", action="store_true",
                   help="every image VAE (untiled, diffusers, pyext) in channels-last, diffusers' own switch")
    p.add_argument("--prepack", action="store_true",
                   help="pyext rows also pack the image VAE's weights (oneDNN's layout, 3x3 convs by Winograd where "
                        "faster), as pyext.optimize does on a CPU pipeline")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    rows = run(a.preset, a.shapes, a.sizes, a.encode_sizes, not a.no_video, a.max_full_mpix, a.latents,
               [json.loads(o) for o in a.pyext], a.malloc, a.channels_last, a.prepack)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
