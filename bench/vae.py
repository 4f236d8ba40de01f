"""Tiled VAE decode (or encode) on CPU: full vs diffusers' tiling vs pyext's streaming tiling.

    python -m bench.vae [--sizes 1024 2048] [--tile 512] [--latents random|smooth] [--encode] [--json PATH] [--max-full 1024]

SD 1.5's AutoencoderKL architecture with seeded random weights, seeded latents: white
noise ("random") or noise on a grid 8x coarser, bilinearly upsampled ("smooth", closer to
the large-scale structure of a real image's latents).
Each decode runs in a fresh subprocess, which reports its wall time and its peak RSS
above the RSS it had just before decoding (VmHWM reset through /proc/self/clear_refs;
glibc told to return every large free block to the OS at once, so the peak is the peak
of live memory, torch's CPU allocator included, which tracemalloc cannot see).
--encode times AutoencoderKL.encode of an image made by decoding the same latents with the
full decoder (an input with an image's structure, not noise); its output is the latent
moments (mean and log-variance), and PSNR compares those.
Also (decode): the blend step alone on the same tiles (diffusers' per-row blend loops + crops +
cat vs the fused tile_blend op), and PSNR of both tiled decodes vs the full decode.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SD_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=32,
              layers_per_block=2, sample_size=512)
METHODS = ("full", "diffusers", "pyext", "one_tile")


def _vae(tile: int):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(**SD_VAE).eval()
    vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // 8  # enable_tiling defaults at 512
    return vae


def _latents(size: int, kind: str = "random") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    n = size // 8
    if kind == "random":
        return torch.randn(1, 4, n, n, generator=gen)
    coarse = torch.randn(1, 4, max(1, n // 8), max(1, n // 8), generator=gen)
    return 2 * torch.nn.functional.interpolate(coarse, size=(n, n), mode="bilinear", align_corners=False)


def _image(size: int, kind: str, tile: int) -> torch.Tensor:
    """An image to encode: the full decode of the seeded latents, cached per size/kind."""
    path = os.path.join(tempfile.gettempdir(), f"pyext_bench_vae_image_{kind}_{size}_{tile}.pt")
    if not os.path.exists(path):
        with torch.no_grad():
            img = _vae(tile).decode(_latents(size, kind)).sample.clamp(-1, 1)
        torch.save(img, path + ".part")
        os.replace(path + ".part", path)
    return torch.load(path)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(method: str, size: int, tile: int, out_path: str) -> None:
    """Runs one decode in this (fresh) process; prints a JSON line with time and peak memory."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from pyext.vae import tile_vae
    vae = _vae(tile)
    kind = os.environ.get("BENCH_LATENTS", "random")
    encode = os.environ.get("BENCH_DIRECTION") == "encode"
    n = tile if method == "one_tile" else size
    z = _image(n, kind, tile) if encode else _latents(n, kind)
    run = (lambda t: vae.encode(t).latent_dist.parameters) if encode else (lambda t: vae.decode(t).sample)
    warm_up = torch.zeros(1, 3, 64, 64) if encode else torch.zeros(1, 4, 8, 8)
    if method == "diffusers":
        vae.enable_tiling()
    elif method == "pyext":
        tile_vae(vae, **json.loads(os.environ.get("BENCH_PYEXT_KWARGS", "{}")))
    with torch.no_grad():
        run(warm_up)  # kernels/allocator paths outside the measurement
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            reset = True
        except OSError:
            reset = False
        base = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        out = run(z)
        seconds = time.perf_counter() - t0
        peak = _rss_kib("VmHWM")
    if method != "one_tile":
        torch.save(out, out_path)
    print(json.dumps({"seconds": seconds, "peak_extra_mib": (peak - base) / 1024, "hwm_reset": reset,
                      "out_mib": out.numel() * out.element_size() / 2**20}))


def _measure(method: str, size: int, tile: int, out_path: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = subprocess.run([sys.executable, "-m", "bench.vae", "--child", method, str(size), str(tile), out_path],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"bench.vae child {method} {size} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    mse = float(((a.float() - ref.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(torch.log10((ref.max() - ref.min()) ** 2 / mse))


def blend_times(size: int, tile: int, repeats: int = 3) -> dict:
    """The blend step alone, on random tiles shaped like a tiled decode's."""
    from diffusers import AutoencoderKL

    from pyext.ops.tile_blend import tile_blend_diffusers
    from pyext.vae import _spans
    f = 0.25
    lat, tl = size // 8, tile // 8
    stride, extent = int(tl * (1 - f)), int(tile * f)
    limit = tile - extent
    spans = _spans(lat, tl, stride)
    gen = torch.Generator().manual_seed(2)
    rows = [[torch.randn(1, 3, (b - a) * 8, (d - c) * 8, generator=gen) for c, d in spans] for a, b in spans]

    def diffusers_blend():
        out_rows = []
        for i, row in enumerate(rows):
            parts = []
            for j, t in enumerate(row):
                t = t.clone()  # diffusers blends in place; keep the inputs for the next repeat
                if i > 0:
                    t = AutoencoderKL.blend_v(None, above[j], t, extent)
                if j > 0:
                    t = AutoencoderKL.blend_h(None, parts_full[j - 1], t, extent)
                if j == 0:
                    parts_full.clear()
                parts_full.append(t)
                parts.append(t[:, :, :limit, :limit])
            above[:] = parts_full
            out_rows.append(torch.cat(parts, dim=3))
        return torch.cat(out_rows, dim=2)

    def pyext_blend():
        hs = [min(limit, t.shape[-2]) for t in (r[0] for r in rows)]
        ws = [min(limit, t.shape[-1]) for t in rows[0]]
        out = torch.empty(1, 3, sum(hs), sum(ws))
        bottoms = [None] * len(ws)
        for i, row in enumerate(rows):
            right = None
            for j, t in enumerate(row):
                kb = min(extent, t.shape[-2]) if i + 1 < len(rows) else 0
                kr = min(extent, t.shape[-1]) if j + 1 < len(row) else 0
                bottoms[j], right = tile_blend_diffusers(t, out, sum(hs[:i]), sum(ws[:j]),
                                                         (hs[i], ws[j]), bottoms[j], right, kb, kr)
        return out

    above, parts_full = [], []
    best = {}
    for name, fn in (("diffusers_blend_s", diffusers_blend), ("pyext_blend_s", pyext_blend)):
        times = []
        for _ in range(repeats):
            above.clear()
            parts_full.clear()
            t0 = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
        best[name.replace("_s", "_out")] = res
    same = torch.equal(best.pop("diffusers_blend_out"), best.pop("pyext_blend_out"))
    return {**best, "blend_outputs_identical": same, "tiles": len(spans) ** 2}


def run(sizes=(1024,), tile: int = 512, max_full: int = 1024, with_decodes: bool = True,
        pyext_kwargs: dict | None = None, latents: str = "random", encode: bool = False) -> list[dict]:
    """One row per size. pyext_kwargs: tile_vae options for the pyext decode (default: its defaults)."""
    os.environ["BENCH_PYEXT_KWARGS"] = json.dumps(pyext_kwargs or {})
    os.environ["BENCH_LATENTS"] = latents
    os.environ["BENCH_DIRECTION"] = "encode" if encode else "decode"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            row = {"bench": "vae_encode" if encode else "vae_decode", "size": size, "tile": tile, "device": "cpu",
                   "pyext_kwargs": pyext_kwargs or {}, "latents": latents,
                   "threads": int(os.environ.get("BENCH_THREADS", "2"))}
            if not encode:  # blend_times blends image tiles
                row.update(blend_times(size, tile))
            if with_decodes:
                paths = {m: os.path.join(tmp, f"{m}_{size}.pt") for m in METHODS}
                for m in METHODS:
                    if m == "full" and size > max_full:
                        row["full"] = f"skipped: full decode at {size} above --max-full {max_full} (CPU time/memory)"
                        continue
                    row[m] = _measure(m, size, tile, paths[m])
                if isinstance(row.get("full"), dict):
                    ref = torch.load(paths["full"])
                    for m in ("diffusers", "pyext"):
                        row[m]["psnr_vs_full_db"] = _psnr(torch.load(paths[m]), ref)
            rows.append(row)
    return rows


ABLATION = (  # each step adds one technique; PSNR vs the full decode of the same latents
    ("blend only: per-tile network and statistics, no context", dict(global_mid=False, consistent_tones=False, context=0)),
    ("+ context 8 latent px", dict(global_mid=False, consistent_tones=False, context=8)),
    ("+ subsampled whole-image statistics", dict(global_mid=False, consistent_tones=True, context=8)),
    ("global mid block, per-tile statistics, receptive-field context", dict(global_mid=True, consistent_tones=False)),
    ("global mid block + pooled subsampled statistics (previous default)",
     dict(global_mid=True, consistent_tones=True, exact_layers=0, fit_tile=False)),
    ("+ first two tiled GroupNorms exact, estimates weighted by them, diffusers' grid",
     dict(global_mid=True, consistent_tones=True, exact_layers=2, fit_tile=False)),
    ("+ windows fit one tile, cores abut (default)", dict(global_mid=True, consistent_tones=True)),
)


def ablation(size: int, tile: int, latents: str, configs=ABLATION) -> list[dict]:
    """PSNR and time of each tile_vae option set in one process (no memory figures)."""
    from pyext.vae import tiled_run
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    vae = _vae(tile)
    z = _latents(size, latents)
    rows = []
    with torch.no_grad():
        t0 = time.perf_counter()
        full = vae.decode(z).sample
        rows.append({"config": "full decode", "seconds": time.perf_counter() - t0})
        vae.enable_tiling()
        t0 = time.perf_counter()
        out = vae.decode(z).sample
        rows.append({"config": "diffusers tiled", "seconds": time.perf_counter() - t0, "psnr_vs_full_db": _psnr(out, full)})
        for name, kw in configs:
            t0 = time.perf_counter()
            out = tiled_run(vae, z, "decode", "normalized", **{"context": None, **kw})
            rows.append({"config": name, "kwargs": kw, "seconds": time.perf_counter() - t0,
                         "psnr_vs_full_db": _psnr(out, full)})
            print(rows[-1], flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| size | method | latency s | peak extra MiB | output MiB | PSNR vs full dB |", "|---|---|---|---|---|---|"]
    for r in rows:
        for m in METHODS:
            v = r.get(m)
            if isinstance(v, dict):
                lines.append(f"| {r['size']} | {m} | {v['seconds']:.1f} | {v['peak_extra_mib']:.0f} | "
                             f"{v['out_mib']:.1f} | {v.get('psnr_vs_full_db', float('nan')):.2f} |")
            elif v is not None:
                lines.append(f"| {r['size']} | {m} | {v} | | | |")
        if "tiles" not in r:
            continue
        lines.append(f"| {r['size']} | blend only ({r['tiles']} tiles) | diffusers {r['diffusers_blend_s'] * 1e3:.1f} ms, "
                     f"pyext {r['pyext_blend_s'] * 1e3:.1f} ms (identical: {r['blend_outputs_identical']}) | | | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024], help="2048 adds about 20 minutes of tiled decodes on 2 CPU cores")
    p.add_argument("--tile", type=int, default=512, help="tile_sample_min_size (diffusers' enable_tiling default 512)")
    p.add_argument("--max-full", type=int, default=1024, help="skip the full (non-tiled) decode above this size")
    p.add_argument("--blend-only", action="store_true", help="only time the blend step (no decodes)")
    p.add_argument("--pyext", default="{}", help='tile_vae options as JSON, e.g. \'{"mode": "diffusers"}\'')
    p.add_argument("--latents", choices=("random", "smooth"), default="random", help="white-noise or smooth latents")
    p.add_argument("--encode", action="store_true", help="time encode (image -> latent moments) instead of decode")
    p.add_argument("--ablation", action="store_true", help="PSNR/time of each technique at the first size, in-process")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child[0], int(a.child[1]), int(a.child[2]), a.child[3])
        return
    if a.ablation:
        if a.encode:
            p.error("--ablation runs decodes only; drop --encode")
        rows = ablation(a.sizes[0], a.tile, a.latents)
        print("| config | latency s | PSNR vs full dB |\n|---|---|---|")
        for r in rows:
            print(f"| {r['config']} | {r['seconds']:.1f} | {r.get('psnr_vs_full_db', float('nan')):.2f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    rows = run(a.sizes, a.tile, a.max_full, with_decodes=not a.blend_only, pyext_kwargs=json.loads(a.pyext),
               latents=a.latents, encode=a.encode)
    print(_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
