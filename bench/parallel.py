"""pyext with diffusers' context parallelism (Ulysses and ring), launched by torchrun.

    torchrun --nproc-per-node N -m bench.parallel [--arch flux] [--size tiny] [--steps 2]
             [--splits ulysses,ring] [--orders after] [--compile BACKEND] [--out FILE]
    torchrun --nproc-per-node N -m bench.parallel --vae PIXELS [--arch flux] [--size tiny] [--out FILE]

Each rank builds the same pipeline (random weights from the config, one seed), turns on
`enable_parallelism` with `ContextParallelConfig(ulysses_degree=N)`, `(ring_degree=N)` or, for
"ulysses+ring", `(ring_degree=2, ulysses_degree=N/2)` when N > 1, with the model's sharding
(`pyext.context_parallel_plan`: its class's, else pyext's, as for SD3), and calls
`pyext.optimize` before or after that: one pipeline per split and order. With
--compile, the denoiser is then compiled with that torch.compile backend (calls inside the
compiled graph are not counted). Per pipeline and rank: the time of one generation after a
warm-up, the process's peak resident memory so far, and the attention calls pyext computed and
left to torch. Rank 0 then runs the plain
pipeline alone (no parallelism, no pyext) and reports the largest difference of each image from
it. NCCL on CUDA, gloo on CPU; without an accelerator, diffusers' device choice
(`rank % torch.accelerator.device_count()`) divides by zero, so the bench counts one device there.

--vae: instead, the pipeline's VAE decodes one random latent to a PIXELS x PIXELS image with the
exact method split across the ranks (`TilingConfig(distributed=True)`, tiles of a quarter of the
image's side). Per rank: the time of one decode after a warm-up, the peak resident memory, and
the tiles it ran. Rank 0 then decodes alone and reports the largest difference.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time

import torch
import torch.distributed as dist


def _generate(pipe, arch: str, size: str, steps: int) -> tuple[torch.Tensor, float]:
    from pyext.offline import run_example

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    run_example(pipe, arch, size, steps=steps)  # warm-up: dispatch choices, allocator
    sync()
    start = time.perf_counter()
    image = run_example(pipe, arch, size, steps=steps)
    sync()
    return image, time.perf_counter() - start


def _run(split: str, order: str, arch: str, size: str, steps: int, world: int, device: str,
         compile_backend: str | None) -> tuple[torch.Tensor, dict]:
    from diffusers import ContextParallelConfig

    import pyext
    from pyext.offline import build_pipeline

    pipe = build_pipeline(arch, size).to(device)
    if order == "before":
        pyext.optimize(pipe, dtype="keep")
    if world > 1:
        degrees = {"ulysses": {"ulysses_degree": world}, "ring": {"ring_degree": world},
                   "ulysses+ring": {"ring_degree": 2, "ulysses_degree": world // 2}}[split]
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(**degrees),
                                            cp_plan=pyext.context_parallel_plan(pipe.transformer))
    if order == "after":
        pyext.optimize(pipe, dtype="keep")
    if compile_backend:
        pipe.transformer.compile(backend=compile_backend)
    image, seconds = _generate(pipe, arch, size, steps)
    status = pyext.attention.status(pipe)
    row = {"split": split, "order": order, "compile": compile_backend, "seconds": seconds,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "pyext_calls": status["pyext_calls"], "torch_calls": status["fallbacks"]}
    return image.cpu(), row


@contextlib.contextmanager
def counting_tiles():
    """The tiles of an exact VAE run this process runs, counted (each in its own SyncedGroupNorms)."""
    from pyext.vae import exact

    calls, real = [], exact.SyncedGroupNorms

    class Counted(real):
        def __init__(self, *args):
            calls.append(1)
            super().__init__(*args)

    exact.SyncedGroupNorms = Counted
    try:
        yield calls
    finally:
        exact.SyncedGroupNorms = real


def _decode(vae, z: torch.Tensor, distributed: bool, pixels: int) -> tuple[torch.Tensor, float, int]:
    from pyext.vae import TilingConfig, tile_vae

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    tile_vae(vae, TilingConfig(tile_size=max(8, pixels // 4 // 8 * 8), state_dir=None, distributed=distributed))
    with torch.no_grad():
        vae.decode(z)  # warm-up
        sync()
        with counting_tiles() as tiles:
            start = time.perf_counter()
            image = vae.decode(z).sample
            sync()
    return image.cpu(), time.perf_counter() - start, len(tiles)


def _vae_latent(vae, pixels: int, device: str) -> torch.Tensor:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, vae.config.latent_channels, pixels // factor, pixels // factor, generator=g).to(device)


def render(result: dict) -> str:
    """A results file as a markdown table: a row per split, order and rank (per rank for --vae)."""
    world = result["world_size"]
    if "vae_pixels" in result:
        threads = result["machine"].get("torch_threads")
        lines = [f"{result['arch']} ({result['size']}) VAE, exact decode of {result['vae_pixels']}x"
                 f"{result['vae_pixels']}, {world} process(es) of {threads} thread(s)", "",
                 "| rank | seconds | peak RSS | tiles run | max abs diff from one process |", "|---:|---:|---:|---:|---:|"]
        for r in sorted(result["ranks"], key=lambda r: r["rank"]):
            lines.append(f"| {r['rank']} | {r['seconds']:.3f} | {r['peak_rss_mib']:.0f} MiB | {r['tiles']} | "
                         f"{result['max_abs_diff']:.1e} |")
        return "\n".join(lines)
    lines = [f"{result['arch']} ({result['size']}), {result['steps']} steps, {world} process(es)", "",
             "| split | pyext.optimize | rank | seconds | peak RSS | attention calls: pyext / torch | max abs diff "
             "from one plain process |", "|---|---|---:|---:|---:|---:|---:|"]
    diffs = {(r["split"], r["order"]): r["max_abs_diff"] for r in result["runs"]}
    for r in sorted(result["ranks"], key=lambda r: (r["split"], r["order"], r["rank"])):
        split = "none" if world == 1 else f"Ulysses-{world // 2} + ring-2" if r["split"] == "ulysses+ring" else \
            f"{r['split'].capitalize()}-{world}"
        when = f"{r['order']} enable_parallelism" if world > 1 else "alone"
        lines.append(f"| {split} | {when} | {r['rank']} | {r['seconds']:.3f} | {r['peak_rss_mib']:.0f} MiB | "
                     f"{r['pyext_calls']} / {r['torch_calls']} | {diffs[r['split'], r['order']]:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="flux")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--splits", default="ulysses",
                   help="how the sequence is split, comma-separated: ulysses, ring, ulysses+ring (4, 6, ... processes)")
    p.add_argument("--orders", default="after", help="when pyext.optimize runs: before, after or before,after")
    p.add_argument("--compile", help="a torch.compile backend for the denoiser, after optimize (e.g. aot_eager)")
    p.add_argument("--vae", type=int, metavar="PIXELS", help="decode a PIXELS x PIXELS image split across the ranks")
    p.add_argument("--out", help="rank 0 writes the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    device = "cuda" if cuda else "cpu"
    if args.vae:
        return _vae_main(args, rank, world, device)
    splits = args.splits.split(",") if world > 1 else ["none"]
    images, rows = {}, []
    for split in splits:
        for order in args.orders.split(","):
            images[split, order], row = _run(split, order, args.arch, args.size, args.steps, world, device,
                                             args.compile)
            rows.append(dict(row, rank=rank))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    if rank != 0:
        return None

    from bench.latency import save_results
    from pyext.offline import build_pipeline, run_example

    reference = run_example(build_pipeline(args.arch, args.size).to(device), args.arch, args.size,
                            steps=args.steps).cpu()
    per_rank = [r for rank_rows in gathered for r in rank_rows]
    runs = [{"split": split, "order": order, "max_abs_diff": float((img - reference).abs().max()),
             "shape": list(img.shape)} for (split, order), img in images.items()]
    result = save_results("parallel", device, args.out, arch=args.arch, size=args.size, steps=args.steps,
                          world_size=world, runs=runs, ranks=per_rank)
    print(json.dumps({"runs": runs, "ranks": per_rank}))
    return result


def _vae_main(args, rank: int, world: int, device: str) -> dict | None:
    from pyext.offline import build_pipeline

    vae = build_pipeline(args.arch, args.size).vae.to(device)
    z = _vae_latent(vae, args.vae, device)
    image, seconds, tiles = _decode(vae, z, True, args.vae)
    row = {"rank": rank, "seconds": seconds, "tiles": tiles,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    dist.destroy_process_group()
    if rank != 0:
        return None

    from bench.latency import save_results

    alone, _, _ = _decode(build_pipeline(args.arch, args.size).vae.to(device), z, False, args.vae)
    result = save_results("parallel --vae", device, args.out, arch=args.arch, size=args.size, world_size=world,
                          vae_pixels=args.vae, max_abs_diff=float((image - alone).abs().max()), ranks=gathered)
    print(json.dumps({"max_abs_diff": result["max_abs_diff"], "ranks": gathered}))
    return result


if __name__ == "__main__":
    main()
