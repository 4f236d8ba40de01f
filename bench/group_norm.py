"""pyext's fused GroupNorm + SiLU against what diffusers runs in its place, on a CPU.

    python -m bench.group_norm [--repeats 7] [--dtype bfloat16] [--out FILE]

At the shapes of SD1.5's UNet (256x256 images: batch 2, 32x32 latents) and of its VAE decoder (one
256x256 image), channels-last as pyext.optimize lays them out: `pyext.ops.group_norm(x, 32,
weight, bias, activation="silu")` (the C++ kernel) against `F.silu(F.group_norm(...))` in the same
dtype, in interleaved rounds. Each row gives the median time of each and the median and range of
the per-round ratio pyext / torch. The results, with the machine, the commit and the versions, go
to FILE (JSON) when given; `python -m bench.render` puts them in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.fp8 import _vs_plain, rounds

# (where, (N, C, H, W)): each GroupNorm shape the two models run, 32 groups.
SHAPES = (("unet 32x32", (2, 320, 32, 32)), ("unet 16x16", (2, 640, 16, 16)), ("unet 8x8", (2, 1280, 8, 8)),
          ("vae 32x32", (1, 512, 32, 32)), ("vae 64x64", (1, 512, 64, 64)), ("vae 128x128", (1, 256, 128, 128)),
          ("vae 128x128, 512 channels", (1, 512, 128, 128)), ("vae 256x256", (1, 128, 256, 256)),
          ("vae 256x256, 256 channels", (1, 256, 256, 256)))
GROUPS = 32


def measure(shapes=SHAPES, dtype: torch.dtype = torch.bfloat16, repeats: int = 7) -> list[dict]:
    from pyext.ops import group_norm

    rows = []
    for where, shape in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
        weight, bias = (torch.randn(shape[1], generator=g).to(dtype) for _ in range(2))
        calls = max(1, int(4e6 // x.numel()))  # a round of about 4M elements: small shapes repeat
        fns = {"pyext": lambda: [group_norm(x, GROUPS, weight, bias, 1e-6, "silu", backend="cpp") for _ in range(calls)],
               "plain": lambda: [F.silu(F.group_norm(x, GROUPS, weight, bias, 1e-6)) for _ in range(calls)]}
        with torch.no_grad():
            times = rounds(fns, repeats, 2)
        rows.append({"where": where, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                     "pyext_ms": statistics.median(times["pyext"]) / calls * 1e3,
                     "torch_ms": statistics.median(times["plain"]) / calls * 1e3,
                     "pyext_vs_torch": _vs_plain(times, "pyext")})
    return rows


def render(result: dict) -> str:
    lines = ["| where | N, C, H, W | dtype | pyext | torch GroupNorm, then SiLU | pyext / torch, median (range) |",
             "|---|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        v = r["pyext_vs_torch"]
        lines.append(f"| {r['where']} | {', '.join(map(str, r['shape']))} | {r['dtype']} | {r['pyext_ms']:.3f} ms | "
                     f"{r['torch_ms']:.3f} ms | {v['median']}x ({v['range'][0]}-{v['range'][1]}) |")
    simd = result.get("machine", {}).get("kernel_paths", {}).get("simd", "unknown")
    lines += ["", f"pyext's SIMD level: {simd}; {result.get('repeats', '?')} interleaved rounds; "
                  f"`{result.get('command', 'python -m bench.group_norm')}`."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.group_norm", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)
    from bench.latency import save_results

    rows = measure(dtype=getattr(torch, args.dtype), repeats=args.repeats)
    command = "python -m bench.group_norm" + (f" --repeats {args.repeats}" if args.repeats != 7 else "") + \
        (f" --dtype {args.dtype}" if args.dtype != "bfloat16" else "")
    result = save_results("group_norm", "cpu", args.out, rows=rows, repeats=args.repeats, command=command)
    print(render(result))
    return result


if __name__ == "__main__":
    main()
