"""Attention kernel bench: throughput and latency of pyext's backends vs PyTorch.

    python -m bench.attention [--json PATH] [--repeats N] [--threads N] [--vae-tokens N] [--dtype D]
    python -m bench.attention --whole-image    # fp32, the exact tiled VAE's whole-image attention

Times every backend that can run here on SD1.5 / SDXL / Flux attention shapes (GFLOP/s counts
4*B*H*Sq*Skv*D flops), and `auto`, pyext.attention as dispatch chooses on this machine (its
choice named), in --dtype: by default the one pyext.optimize computes in here (bf16 where the CPU
has it natively, else fp32). Rounds interleave the backends (A, B, ..., A, B, ...) after one
warm-up, so machine noise hits them alike; a row gives its median time and the median and range
of its per-round speed over SDPA's. Then
measures peak extra memory at a long sequence (the VAE mid-block attention at
1024x1024: 1 head, dim 512, 16384 tokens; --vae-tokens 8192 for a 4x quicker proxy)
for pyext vs naive, each in a fresh process (VmHWM after a reset, and polled RSS,
on CPU; the allocator's high-water mark on CUDA). --whole-image times instead, in fp32, one band
of queries of the exact tiled VAE's mid-block attention over every latent pixel (pyext.vae.exact):
long keys, which the C++ kernel packs a chunk at a time.
On CPU: cpp, sdpa, naive, and OpenVINO's compiled SDPA (if installed; in a process of its own, its
speed over SDPA from that process's rounds). On CUDA: triton, sdpa, xformers (if installed), naive.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    h: int
    sq: int
    skv: int
    d: int

    @property
    def flops(self) -> int:
        return 4 * self.b * self.h * self.sq * self.skv * self.d


SHAPES = [
    Shape("sd15 self 64x64 latent", 2, 8, 4096, 4096, 40),
    Shape("sd15 cross 64x64 x 77 text", 2, 8, 4096, 77, 40),
    Shape("sd15 self 32x32", 2, 8, 1024, 1024, 80),
    Shape("sd15 self 16x16", 2, 8, 256, 256, 160),
    Shape("sdxl self 64x64", 2, 10, 4096, 4096, 64),
    # Flux at 1024^2 is (1, 24, 4608, 4608, 128): ~260 GFLOP a call, minutes on a 2-core CPU.
    Shape("flux-ish (1024 tokens proxy)", 1, 24, 1024, 1024, 128),
]
WHOLE_IMAGE = [  # one head, the keys folded into the normed tokens; a band of queries per call
    Shape("small VAE, 2048: a band x 65,536 keys", 1, 1, 4096, 65536, 64),
    Shape("SD VAE, 3840x2224: a band x half its keys", 1, 1, 1024, 66720, 512),
]
NAIVE_MAX_SCORE_BYTES = 1 << 30  # skip naive where its fp32 score matrix would exceed 1 GiB


def _backends(device: str) -> list[str]:
    from pyext import dispatch
    from pyext.ops import attention  # noqa: F401  (registers the backends)

    names = ["cpp", "sdpa", "reference"] if device == "cpu" else ["triton", "sdpa", "xformers", "reference"]
    op = dispatch.ops()["attention"]
    usable = []
    for name in names:
        backend = next(b for b in op.backends if b.name == name)
        if backend.unavailable() is None and device in backend.devices:
            usable.append(name)
    return usable


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_shape(shape: Shape, device: str, dtype, repeats: int) -> list[dict]:
    from pyext import dispatch
    from pyext.ops import attention

    q = torch.randn(shape.b, shape.h, shape.sq, shape.d, dtype=dtype, device=device)
    k = torch.randn(shape.b, shape.h, shape.skv, shape.d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    names = _backends(device)
    skipped = {}
    if "reference" in names and shape.b * shape.h * shape.sq * shape.skv * 4 > NAIVE_MAX_SCORE_BYTES:
        names.remove("reference")
        skipped["reference"] = "fp32 scores would exceed 1 GiB"
    names.append("auto")  # backend=None: what dispatch chooses here (measured on first use)
    times = {n: [] for n in names}
    for n in names:  # warm-up: code loading, Triton compilation, allocator, dispatch's measurement
        attention(q, k, v, backend=None if n == "auto" else n)
    _sync(device)
    for _ in range(repeats):
        for n in names:
            t0 = time.perf_counter()
            attention(q, k, v, backend=None if n == "auto" else n)
            _sync(device)
            times[n].append(time.perf_counter() - t0)
    rows = []
    chosen = dispatch.select("attention", (q, k, v, None, None, False)).name
    for n in names:
        ms = statistics.median(times[n]) * 1e3
        row = dict(kind="throughput", shape=shape.name, **{k_: v_ for k_, v_ in asdict(shape).items() if k_ != "name"},
                   dtype=str(dtype).removeprefix("torch."), device=device, threads=torch.get_num_threads(),
                   backend="naive" if n == "reference" else n, ms=round(ms, 3), gflops=round(shape.flops / ms / 1e6, 1))
        if "sdpa" in times:  # per round: SDPA's time over this backend's (> 1: faster than SDPA)
            ratios = [a / b for a, b in zip(times["sdpa"], times[n])]
            row.update(vs_sdpa=round(statistics.median(ratios), 2), vs_sdpa_range=[round(min(ratios), 2),
                                                                                   round(max(ratios), 2)])
        if n == "auto":
            row["chosen"] = chosen
        rows.append(row)
    for n, why in skipped.items():
        rows.append(dict(kind="throughput", shape=shape.name, backend="naive" if n == "reference" else n, skipped=why))
    return rows


_PEAK_CHILD = """
import json, os, sys, threading, time, torch
from pyext.ops import attention
backend, tokens, dim, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, tokens, dim, dtype=torch.bfloat16, device=device) for _ in range(3))
attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], backend=backend)  # code, threads, compilation
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
sampled, done = [rss()], threading.Event()
def sample():  # a second witness to the high-water mark: RSS polled every millisecond
    while not done.wait(0.001):
        sampled.append(rss())
def status_kib(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    # ru_maxrss is inherited across fork+exec (the parent's peak would hide ours): reset the
    # kernel's RSS high-water mark (VmHWM) instead, and read it after the call.
    open("/proc/self/clear_refs", "w").write("5")
    base = status_kib("VmRSS") * 1024
    threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
out = attention(q, k, v, backend=backend)
if device == "cuda":
    torch.cuda.synchronize(); extra = torch.cuda.max_memory_allocated() - base; polled = extra
else:
    done.set()
    extra = status_kib("VmHWM") * 1024 - base
    polled = max(sampled) - sampled[0]
print(json.dumps(dict(extra_mib=round(extra / 2**20, 1), polled_mib=round(polled / 2**20, 1),
                      s=round(time.perf_counter() - t0, 2))))
"""


def peak_memory(tokens: int, dim: int = 512, device: str = "cpu") -> list[dict]:
    """Extra peak memory of one attention call over (1, 1, tokens, dim) bf16, per backend, fresh processes."""
    rows = []
    for n in ["cpp" if device == "cpu" else "triton", "reference"]:
        if n not in _backends(device):
            continue
        proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, n, str(tokens), str(dim), device],
                              capture_output=True, text=True, timeout=1800)
        row = dict(kind="memory", backend="naive" if n == "reference" else n, tokens=tokens, d=dim, device=device,
                   score_matrix_mib=round(tokens * tokens * 4 / 2**20, 1))
        if proc.returncode == 0:
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            row["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"
        rows.append(row)
    return rows


def openvino_row(shape: Shape, dtype, repeats: int) -> dict:
    """The shape's row for OpenVINO's compiled SDPA (CPU; bench.openvino_ops), its speed over SDPA
    from its own process's rounds; or the reason it could not run."""
    from bench.openvino_ops import compare

    row = dict(kind="throughput", shape=shape.name, backend="openvino", **{k: v for k, v in asdict(shape).items()
                                                                           if k != "name"})
    got = compare("attention", (shape.b, shape.h, shape.sq, shape.skv, shape.d), repeats, dtype)
    if "skipped" in got:
        return dict(row, **got)
    r = got["ratios"]
    return dict(row, dtype=str(dtype).removeprefix("torch."), device="cpu", threads=torch.get_num_threads(),
                ms=round(got["ms"], 3), gflops=round(shape.flops / got["ms"] / 1e6, 1), vs_sdpa=round(statistics.median(r), 2),
                vs_sdpa_range=[round(min(r), 2), round(max(r), 2)], note=got["note"])


def run(shapes=None, repeats: int = 5, vae_tokens: int = 16384, device: str | None = None,
        dtype: torch.dtype | None = None) -> list[dict]:
    """Throughput rows for `shapes` (default SHAPES; Shape or (b, h, sq, skv, d) tuples) in
    `dtype` (by default the one pyext.optimize computes in here); with the default shapes also the
    long-sequence peak-memory rows."""
    from bench.latency import bench_dtype

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or bench_dtype()
    todo = SHAPES if shapes is None else [s if isinstance(s, Shape) else Shape(str(tuple(s)), *s) for s in shapes]
    rows = []
    for shape in todo:
        rows += _time_shape(shape, device, dtype, repeats)
        if device == "cpu":
            rows.append(openvino_row(shape, dtype, repeats))
    if shapes is None and vae_tokens:
        rows += peak_memory(vae_tokens, 512, device)
    return rows


def render(result: dict) -> str:
    """docs/benchmarks.md's table of a results file: each shape's backends, `auto` with its choice."""
    rows = [r for r in result["rows"] if r["kind"] == "throughput" and "ms" in r]
    out = ["| shape | B, H, Sq, Skv, D | dtype | backend | ms | GFLOP/s | speed over SDPA, median (range) |",
           "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        name = f"auto (chose {r['chosen']})" if r["backend"] == "auto" else r["backend"]
        name += " (own process: fp32 in and out)" if r["backend"] == "openvino" else ""
        ratio = f"{r['vs_sdpa']}x ({r['vs_sdpa_range'][0]}-{r['vs_sdpa_range'][1]})" if "vs_sdpa" in r else "-"
        out.append(f"| {r['shape']} | {r['b']}, {r['h']}, {r['sq']}, {r['skv']}, {r['d']} | {r['dtype']} | {name} | "
                   f"{r['ms']} | {r['gflops']} | {ratio} |")
    mem = [r for r in result["rows"] if r["kind"] == "memory" and "extra_mib" in r]
    if mem:
        out += ["", f"Peak extra memory of one call over (1, 1, {mem[0]['tokens']}, {mem[0]['d']}) bf16: " +
                ", ".join(f"{r['backend']} {r['extra_mib']} MiB" for r in mem) + "."]
    paths = result["machine"].get("kernel_paths", {})
    out += ["", f"pyext's C++ attention path here: {paths.get('attention', 'unknown')}; "
                f"{result.get('repeats', '?')} interleaved rounds; `{result.get('command', 'python -m bench.attention')}`."]
    return "\n".join(out)


def _print(rows: list[dict]) -> None:
    if any(r["kind"] == "throughput" for r in rows):
        print(f"{'shape':32} {'B,H,Sq,Skv,D':22} {'backend':9} {'ms':>10} {'GFLOP/s':>9} {'x sdpa':>7}")
    for r in rows:
        if r["kind"] != "throughput":
            continue
        if "skipped" in r:
            print(f"{r['shape']:32} {'':22} {r['backend']:9} skipped: {r['skipped']}")
            continue
        dims = f"{r['b']},{r['h']},{r['sq']},{r['skv']},{r['d']}"
        print(f"{r['shape']:32} {dims:22} {r['backend']:9} {r['ms']:10.2f} {r['gflops']:9.1f} {r['vs_sdpa'] or '':>7}")
    mem = [r for r in rows if r["kind"] == "memory"]
    if mem:
        print(f"\npeak extra memory, (1, 1, {mem[0]['tokens']}, {mem[0]['d']}) bf16 "
              f"(the fp32 score matrix alone is {mem[0]['score_matrix_mib']} MiB):")
        for r in mem:
            print(f"  {r['backend']:9} " + (f"{r['extra_mib']:9.1f} MiB (polled RSS {r['polled_mib']} MiB, {r['s']} s)"
                                             if "extra_mib" in r
                                             else f"failed: {r['error']}"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows, with the machine and its kernel paths, to this file")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    ap.add_argument("--vae-tokens", type=int, default=16384,
                    help="tokens for the peak-memory check (16384 = VAE at 1024x1024; 0 skips it)")
    ap.add_argument("--whole-image", action="store_true",
                    help="time the exact tiled VAE's whole-image attention shapes in fp32 instead")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                    help="auto: bf16 where the CPU computes it natively (and on a GPU), else fp32")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.whole_image:
        rows = run(WHOLE_IMAGE, args.repeats, 0, dtype=torch.float32)
    else:
        from bench.latency import bench_dtype

        rows = run(repeats=args.repeats, vae_tokens=args.vae_tokens, dtype=bench_dtype(args.dtype))
    from bench.latency import describe_machine, save_results

    print(describe_machine("cuda" if torch.cuda.is_available() else "cpu"))
    _print(rows)
    save_results("attention", "cuda" if torch.cuda.is_available() else "cpu", args.json, rows=rows,
                 repeats=args.repeats, command="python -m bench.attention " + " ".join(argv or sys.argv[1:]))


if __name__ == "__main__":
    main()
