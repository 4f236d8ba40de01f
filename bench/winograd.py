"""Winograd F(4x4, 3x3) against oneDNN's direct convolution (weight prepacked for the shape), per layer.

    python -m bench.winograd [--rounds 7] [--json PATH]

Shapes: the 3x3 convolutions of the SD1.5 UNet (batch 2) at 256 px and of its VAE decoder at
256 px, plus the neighbours of the rule's thresholds. fp32, channels-last, torch's thread count.
Rounds alternate the two (A, B, A, B, ...); each row gives both medians, the median of the
per-round ratios (Winograd / oneDNN) with their range, and what `winograd_reason` decides, so
the rule can be checked against the measurement it came from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# (batch, in channels, out channels, height = width)
SHAPES = ((2, 320, 320, 32), (2, 960, 320, 32), (2, 640, 640, 16), (2, 320, 640, 16), (2, 1280, 1280, 16),
          (2, 1280, 640, 16), (2, 1920, 640, 16), (2, 960, 640, 16), (2, 1280, 1280, 8), (2, 1920, 1280, 8),
          (2, 640, 1280, 8), (2, 2560, 1280, 8), (1, 512, 512, 16), (1, 512, 512, 32), (1, 512, 512, 64),
          (1, 256, 256, 128), (1, 128, 128, 256), (1, 4, 512, 32), (1, 128, 3, 256))


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(shape, rounds: int) -> dict:
    from pyext import _compat
    from pyext.ops.winograd import winograd_reason, workspace_bytes

    n, cin, cout, size = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, cin, size, size, generator=g).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(cout, cin, 3, 3, generator=g) / (3 * cin ** 0.5)
    bias = torch.randn(cout, generator=g)
    one = (1, 1)
    blocked = _compat.mkldnn_reorder_conv_weight(weight, one, one, one, 1, list(x.shape))
    hwio = weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)  # as the packed layers store it
    workspace = torch.empty(workspace_bytes(n, cin, cout, size, size) // 4)  # kept, as a packed model keeps one
    calls = {"onednn": lambda: _compat.mkldnn_conv(x, blocked, bias, one, one, one, 1),
             "winograd": lambda: torch.ops.pyext_C.winograd_conv3x3(x, hwio, bias, workspace)}
    times = {k: [] for k in calls}
    with torch.no_grad():
        for fn in calls.values():
            fn()
        for _ in range(rounds):
            for k, fn in calls.items():
                times[k].append(_time(fn))
    ratios = [w / d for w, d in zip(times["winograd"], times["onednn"])]
    return {"shape": f"{n}x{cin}->{cout} {size}x{size}", "onednn_ms": 1e3 * statistics.median(times["onednn"]),
            "winograd_ms": 1e3 * statistics.median(times["winograd"]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rule": winograd_reason(n, cin, cout, size, size) or "winograd"}


def run(rounds: int = 5) -> list[dict]:
    """Rows for bench.kernels (skipped with a reason where the kernel is not built)."""
    from pyext._ext import kernel_missing

    missing = kernel_missing("winograd_conv3x3")
    if missing:
        return [{"shape": "all", "rule": missing}]
    return [measure(shape, rounds) for shape in SHAPES]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    rows = run(args.rounds)
    print(f"threads {torch.get_num_threads()}, fp32, channels-last, {args.rounds} interleaved rounds")
    print("| layer | oneDNN ms | Winograd ms | ratio (range) | rule |\n|---|---:|---:|---:|---|")
    for r in rows:
        if "ratio" not in r:
            print(f"| {r['shape']} | | | | {r['rule']} |")
            continue
        print(f"| {r['shape']} | {r['onednn_ms']:.1f} | {r['winograd_ms']:.1f} | "
              f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['rule']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
