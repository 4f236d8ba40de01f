"""pyext with diffusers' context parallelism (Ulysses and ring), launched by torchrun.

    torchrun --nproc-per-node N -m bench.parallel [--arch flux] [--size tiny] [--steps 2]
             [--splits ulysses,ring] [--orders after] [--compile BACKEND] [--out FILE]

Each rank builds the same pipeline (random weights from the config, one seed), turns on
`enable_parallelism` with `ContextParallelConfig(ulysses_degree=N)` or `(ring_degree=N)` when
N > 1, and calls `pyext.optimize` before or after that: one pipeline per split and order. With
--compile, the denoiser is then compiled with that torch.compile backend (calls inside the
compiled graph are not counted). Per pipeline and rank: the time of one generation after a
warm-up, the process's peak resident memory so far, and the attention calls pyext computed and
left to torch. Rank 0 then runs the plain
pipeline alone (no parallelism, no pyext) and reports the largest difference of each image from
it. NCCL on CUDA, gloo on CPU; without an accelerator, diffusers' device choice
(`rank % torch.accelerator.device_count()`) divides by zero, so the bench counts one device there.
"""
from __future__ import annotations

import argparse
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
        degree = {"ulysses": "ulysses_degree", "ring": "ring_degree"}[split]
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(**{degree: world}))
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


def render(result: dict) -> str:
    """A results file as a markdown table: a row per split, order and rank."""
    world = result["world_size"]
    lines = [f"{result['arch']} ({result['size']}), {result['steps']} steps, {world} process(es)", "",
             "| split | pyext.optimize | rank | seconds | peak RSS | attention calls: pyext / torch | max abs diff "
             "from one plain process |", "|---|---|---:|---:|---:|---:|---:|"]
    diffs = {(r["split"], r["order"]): r["max_abs_diff"] for r in result["runs"]}
    for r in sorted(result["ranks"], key=lambda r: (r["split"], r["order"], r["rank"])):
        split = f"{r['split'].capitalize()}-{world}" if world > 1 else "none"
        when = f"{r['order']} enable_parallelism" if world > 1 else "alone"
        lines.append(f"| {split} | {when} | {r['rank']} | {r['seconds']:.3f} | {r['peak_rss_mib']:.0f} MiB | "
                     f"{r['pyext_calls']} / {r['torch_calls']} | {diffs[r['split'], r['order']]:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="flux")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--splits", default="ulysses", help="how the sequence is split: ulysses, ring or ulysses,ring")
    p.add_argument("--orders", default="after", help="when pyext.optimize runs: before, after or before,after")
    p.add_argument("--compile", help="a torch.compile backend for the denoiser, after optimize (e.g. aot_eager)")
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


if __name__ == "__main__":
    main()
