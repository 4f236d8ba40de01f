"""What measured dispatch costs and gains against static dispatch, for attention in diffusers' layout.

    python -m bench.dispatch [--device cpu|cuda]

Each mode runs in its own process with an empty dispatch cache, so the first call pays for
whatever the mode does once per shape (self-check; in measured mode, timing every backend).
Per shape: the backend chosen, the first call's time and the best of three later calls.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# SD1.5 at 512x512: self-attention of the two finest UNet levels, cross-attention, the coarsest level.
SHAPES = [(2, 8, 4096, 4096, 40), (2, 8, 4096, 77, 40), (2, 8, 1024, 1024, 80), (2, 8, 256, 256, 160)]


def _child(device: str) -> list[dict]:
    import torch

    from pyext import dispatch, ops

    torch.manual_seed(0)
    rows = []
    for b, h, sq, skv, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device=device).transpose(1, 2) for n in (sq, skv, skv))

        def call():
            t = time.perf_counter()
            ops.attention(q, k, v)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t

        first = call()
        rows.append({"shape": [b, h, sq, skv, d], "first_s": first, "steady_s": min(call() for _ in range(3)),
                     "backend": dispatch.select("attention", (q, k, v, None)).name})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.device)))
        return {}
    results = {}
    for mode in ("static", "measured"):
        env = dict(os.environ, PYEXT_DISPATCH=mode, PYEXT_CACHE_DIR=tempfile.mkdtemp(prefix="pyext_dispatch_"))
        out = subprocess.run([sys.executable, "-m", "bench.dispatch", "--device", args.device, "--child", mode],
                             env=env, capture_output=True, text=True, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print("| shape (B, H, Sq, Skv, D) | mode | backend | first call | steady call |")
    print("|---|---|---|---:|---:|")
    for i, shape in enumerate(SHAPES):
        for mode, rows in results.items():
            r = rows[i]
            print(f"| {tuple(shape)} | {mode} | {r['backend']} | {r['first_s']:.3f} s | {r['steady_s']:.3f} s |")
    return results


if __name__ == "__main__":
    main()
