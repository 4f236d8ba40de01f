"""pyext's GEGLU against what diffusers runs in its place, eager and compiled, on a CPU.

    python -m bench.geglu [--repeats 7] [--dtype bfloat16] [--out FILE]

At the feed-forward shapes of SD1.5's UNet (256x256 and 512x512 images) and SDXL's (1024x1024),
batch 2 (classifier-free guidance): `pyext.ops.geglu(h)` (the C++ kernel) on the projection's
output h (batch, tokens, 2 * inner) against GEGLU's `a, gate = h.chunk(2, -1); a * F.gelu(gate)` in
the same dtype, eager and compiled by inductor (which fuses the two), in interleaved rounds. Each
row gives the median time of each and the median and range of the per-round ratios of pyext's
time to the others'. The results, with the machine, the commit and the versions, go to FILE
(JSON) when given; `python -m bench.render` puts them in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.fp8 import rounds

# (where, (batch, tokens, 2 * inner)).
SHAPES = (("sd15 256x256, 32x32 level", (2, 1024, 2560)), ("sd15 256x256, 16x16 level", (2, 256, 5120)),
          ("sd15 256x256, 8x8 level", (2, 64, 10240)), ("sd15 512x512, 64x64 level", (2, 4096, 2560)),
          ("sdxl 1024x1024, 64x64 level", (2, 4096, 5120)), ("sdxl 1024x1024, 32x32 level", (2, 1024, 10240)))


def plain(h: torch.Tensor) -> torch.Tensor:
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)


def _ratio(times: dict, name: str, other: str) -> dict:
    ratios = [a / b for a, b in zip(times[name], times[other])]
    return {"median": round(statistics.median(ratios), 3), "range": [round(min(ratios), 3), round(max(ratios), 3)]}


def measure(shapes=SHAPES, dtype: torch.dtype = torch.bfloat16, repeats: int = 7) -> list[dict]:
    from pyext.ops import geglu

    compiled = torch.compile(plain, dynamic=False)
    rows = []
    for where, shape in shapes:
        h = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        calls = max(1, int(8e6 // h.numel()))  # a round of about 8M elements: small shapes repeat
        fns = {"pyext": lambda: [geglu(h, backend="cpp") for _ in range(calls)],
               "eager": lambda: [plain(h) for _ in range(calls)],
               "inductor": lambda: [compiled(h) for _ in range(calls)]}
        with torch.no_grad():
            times = rounds(fns, repeats, 2)
        rows.append({"where": where, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                     **{f"{name}_ms": statistics.median(t) / calls * 1e3 for name, t in times.items()},
                     "pyext_vs_eager": _ratio(times, "pyext", "eager"),
                     "pyext_vs_inductor": _ratio(times, "pyext", "inductor")})
    return rows


def render(result: dict) -> str:
    lines = ["| where | batch, tokens, 2 x inner | dtype | pyext | torch eager | inductor | pyext / eager | "
             "pyext / inductor |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        e, i = r["pyext_vs_eager"], r["pyext_vs_inductor"]
        lines.append(f"| {r['where']} | {', '.join(map(str, r['shape']))} | {r['dtype']} | {r['pyext_ms']:.3f} ms | "
                     f"{r['eager_ms']:.3f} ms | {r['inductor_ms']:.3f} ms | {e['median']}x ({e['range'][0]}-"
                     f"{e['range'][1]}) | {i['median']}x ({i['range'][0]}-{i['range'][1]}) |")
    simd = result.get("machine", {}).get("kernel_paths", {}).get("simd", "unknown")
    lines += ["", f"pyext's SIMD level: {simd}; {result.get('repeats', '?')} interleaved rounds, per-round ratios "
                  f"median (range); `{result.get('command', 'python -m bench.geglu')}`."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.geglu", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)
    from bench.latency import save_results

    rows = measure(dtype=getattr(torch, args.dtype), repeats=args.repeats)
    command = "python -m bench.geglu" + (f" --repeats {args.repeats}" if args.repeats != 7 else "") + \
        (f" --dtype {args.dtype}" if args.dtype != "bfloat16" else "")
    result = save_results("geglu", "cpu", args.out, rows=rows, repeats=args.repeats, command=command)
    print(render(result))
    return result


if __name__ == "__main__":
    main()
