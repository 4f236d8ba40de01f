"""One op compiled by OpenVINO beside torch's own, for the kernel benches (bench.attention, bench.fp8).

    python -m bench.openvino_ops attention B H SQ SKV D REPEATS DTYPE
    python -m bench.openvino_ops linear M K N REPEATS DTYPE

Runs in a process of its own: OpenVINO's thread pool spins after each call, which would slow
whatever ran next in the caller's. torch's op (SDPA, `F.linear`) and OpenVINO's compiled one take
turns with a pause between them, after a warm-up round, so each round gives a ratio. OpenVINO's
inputs and outputs are fp32 arrays; in a bf16 run it computes in bf16 inside (its inference
precision hint), as the openvino rows of bench.latency and bench.cpu_runtimes do. Prints one JSON
line: OpenVINO's median time, the per-round ratios of torch's time to OpenVINO's, its precision
and version. `compare` runs it and gives the reason where it cannot.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

PAUSE_S = 0.2  # between the two ops: OpenVINO's pool settles


def _modules(kind: str, dims: list[int]):
    """(the torch.nn.Module OpenVINO converts, its fp32 example inputs)."""
    g = torch.Generator().manual_seed(0)
    if kind == "attention":
        b, h, sq, skv, d = dims

        class Sdpa(torch.nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v)

        return Sdpa(), (torch.randn(b, h, sq, d, generator=g), torch.randn(b, h, skv, d, generator=g),
                        torch.randn(b, h, skv, d, generator=g))
    m, k, n = dims
    linear = torch.nn.Linear(k, n)
    return linear, (torch.randn(m, k, generator=g),)


def _measure(kind: str, dims: list[int], repeats: int, dtype: torch.dtype) -> dict:
    import openvino as ov

    module, inputs = _modules(kind, dims)
    precision = "bf16" if dtype == torch.bfloat16 else "f32"
    compiled = ov.Core().compile_model(ov.convert_model(module, example_input=inputs), "CPU",
                                       {"INFERENCE_PRECISION_HINT": precision})
    arrays = [t.numpy() for t in inputs]
    module, typed = module.to(dtype), [t.to(dtype) for t in inputs]
    runs = {"torch": lambda: module(*typed), "openvino": lambda: compiled(arrays)}
    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(repeats + 1):
            for name, fn in runs.items():
                time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {"ms": statistics.median(times["openvino"][1:]) * 1e3,
            "ratios": [a / b for a, b in zip(times["torch"][1:], times["openvino"][1:])],
            "precision": precision, "version": ov.__version__.split("-")[0]}


def compare(kind: str, dims: tuple, repeats: int, dtype: torch.dtype) -> dict:
    """{ms, ratios (torch's time over OpenVINO's, per round), note} for OpenVINO's `kind` op over
    `dims`, measured in a process of its own; {skipped: reason} where OpenVINO is missing or fails."""
    from bench.cpu_runtimes import unavailable

    reason = unavailable("openvino")
    if reason:
        return {"skipped": reason}
    proc = subprocess.run([sys.executable, "-m", "bench.openvino_ops", kind, *map(str, dims), str(repeats),
                           str(dtype).removeprefix("torch.")], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"skipped": f"failed: {(proc.stderr.strip().splitlines() or ['rc ' + str(proc.returncode)])[-1]}"}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ms": got["ms"], "ratios": got["ratios"],
            "note": f"OpenVINO {got['version']} in its own process, {got['precision']} inside, fp32 in and out"}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    kind, dtype, repeats = argv[0], getattr(torch, argv[-1]), int(argv[-2])
    print(json.dumps(_measure(kind, [int(x) for x in argv[1:-2]], repeats, dtype)))


if __name__ == "__main__":
    main()
