"""fp8 weight storage benchmarks: upcast throughput, linear layers, the SD1.5 UNet, accuracy.

    python -m bench.fp8 [--json PATH] [--skip-unet] [--dtype D]

Compared on the same inputs in one process: plain weights (torch's F.linear / conv), pyext fp8
storage (weight-only, and for bf16 linears the dynamic fp8 x fp8 GEMM), and diffusers' layerwise
casting (fp8 storage, cast back per layer call). The layers compute in --dtype: by default the
one pyext.optimize computes in here (bf16 where the CPU has it natively, else fp32); the UNet step
is bf16. The linears run on the GPU when there is one. Rounds interleave the variants after a
warm-up; a row gives median times and the median and range of the per-round ratio of pyext's
time to the plain layer's. A linear of a few rows runs from memory, as in a model: each variant
over copies of the layer whose weights exceed the last-level caches (`copies_for`); a linear of
more rows is called several times per round (`calls_for`). Weights are random.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import pyext
from pyext.nn import FP8Conv2d, FP8Linear, quantize_fp8
from pyext.nn.stored import stored_bytes
from pyext.ops import fp8_quantize, fp8_upcast

# (name, tokens M, in K, out N): SD1.5 at the cpu preset's 256x256 (latents 32x32, batch 2 for CFG), Flux scaled
LINEAR_SHAPES = [
    ("sd15 attn q 320 (32x32 latents)", 2048, 320, 320),
    ("sd15 geglu 320->2560", 2048, 320, 2560),
    ("sd15 cross k 768->640 (77 tok)", 154, 768, 640),
    ("sd15 geglu 1280->10240 (8x8)", 128, 1280, 10240),
    ("sd15 ff out 5120->1280 (8x8)", 128, 5120, 1280),
    ("flux qkv 3072->9216 (1024 tok)", 1024, 3072, 9216),
    ("flux mlp 3072->12288 (1024 tok)", 1024, 3072, 12288),
    # few rows, where fp8's half of the weight bytes should show: one, four, 16 and 64 rows, and 256
    ("3072->3072, 1 row", 1, 3072, 3072),
    ("3072->3072, 4 rows", 4, 3072, 3072),
    ("3072->3072, 16 rows", 16, 3072, 3072),
    ("3072->3072, 64 rows", 64, 3072, 3072),
    ("3072->3072, 256 rows", 256, 3072, 3072),
    ("sd15 conv-sized K 11520->1280, 32 rows", 32, 11520, 1280),
    ("1280->5120, 2048 rows", 2048, 1280, 5120),
    ("3072->3072, 8192 rows", 8192, 3072, 3072),
]


def median_time(fn, repeats: int = 7, warmup: int = 2) -> float:
    return compare({"x": fn}, repeats, warmup)["x"]


def compare(fns: dict, repeats: int = 7, warmup: int = 2) -> dict:
    """Median seconds of each function, run round-robin so machine noise hits all of them alike."""
    return {name: statistics.median(ts) for name, ts in rounds(fns, repeats, warmup).items()}


def rounds(fns: dict, repeats: int, warmup: int) -> dict:
    """Seconds of each function in each round-robin round: {name: [round 0, round 1, ...]}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def weight_bytes(module: nn.Module) -> int:
    return sum(stored_bytes(t) for t in list(module.parameters()) + list(module.buffers()))


def bench_upcast(rows=4096, cols=4096) -> list[dict]:
    """Both write into a preallocated output: a fresh 32 MB one costs ~10 ms of page faults whoever fills it."""
    w, scale = fp8_quantize(torch.randn(rows, cols))
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        buf = torch.empty(rows, cols, dtype=dtype)
        # Each timed in its own block: interleaved, PyTorch's 25 ms pass would evict the
        # caches and TLB entries before every 1 ms pyext call and time that instead.
        t_pyext = compare({"x": lambda: fp8_upcast(w, scale, out=buf)}, repeats=21, warmup=3)["x"]
        t_torch = compare({"x": lambda: buf.copy_(w)}, repeats=7, warmup=1)["x"]
        # The floor for any kernel that writes this output: PyTorch's vectorised fill of it.
        t_fill = compare({"x": lambda: buf.fill_(1.0)}, repeats=21, warmup=3)["x"]
        n = rows * cols
        out.append(dict(bench="fp8_upcast", dtype=str(dtype).removeprefix("torch."), elements=n,
                        pyext_ms=t_pyext * 1e3, torch_ms=t_torch * 1e3, fill_only_ms=t_fill * 1e3,
                        pyext_gelem_s=n / t_pyext / 1e9, torch_gelem_s=n / t_torch / 1e9, speedup=t_torch / t_pyext))
    return out


def _layerwise_cast(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(module, storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype, skip_modules_pattern=None)
    return module


@torch.no_grad()
def _synced(fn, device: str):
    """fn, then a wait for the device: a GPU call is timed to its end, not to its launch."""
    if device != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize())


def _vs_plain(per_round: dict, name: str) -> dict:
    """The per-round ratio of `name`'s time to the plain layer's: median and range."""
    ratios = [a / b for a, b in zip(per_round[name], per_round["plain"])]
    return {"median": round(statistics.median(ratios), 3), "range": [round(min(ratios), 3), round(max(ratios), 3)]}


# Up to this many rows a linear's time is reading its weight, which a model reads once per call,
# from memory; each variant then runs over copies whose weights, in the smallest variant's storage
# (fp8: a byte each), exceed twice the last-level caches (at most MAX_COPIES), so that no round
# finds a weight left in cache by the one before.
FEW_ROWS = 64
MAX_COPIES = 160


def last_level_cache_bytes() -> int:
    """The machine's last-level caches (Linux sysfs: each CPU's highest cache level, each cache
    counted once however many CPUs share it); 32 MiB where they cannot be read."""
    import glob

    caches = {}
    for cpu in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache"):
        levels = []
        for index in glob.glob(f"{cpu}/index[0-9]*"):
            try:
                with open(f"{index}/level") as f:
                    level = int(f.read())
                with open(f"{index}/size") as f:
                    text = f.read().strip()
                with open(f"{index}/shared_cpu_list") as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            levels.append((level, shared, int(text.rstrip("KMG")) * scale))
        if levels:
            level, shared, size = max(levels)
            caches[(level, shared)] = size
    return sum(caches.values()) or 32 << 20


# Beyond FEW_ROWS a linear computes: each variant then calls its layer enough times per round for
# about ROUND_FLOP of work, so that the one cold call after the variant before it (whose buffers
# swept the caches) weighs little, as in a model whose layers each run over many rows.
ROUND_FLOP = 4e9


def calls_for(m: int, k: int, n: int) -> int:
    """How many calls of a layer each variant makes per round (1 for FEW_ROWS or fewer)."""
    return 1 if m <= FEW_ROWS else max(1, round(ROUND_FLOP / (2 * m * k * n)))


def copies_for(m: int, k: int, n: int, device: str) -> int:
    """How many copies of a layer each variant runs over per round (see FEW_ROWS)."""
    if device != "cpu" or m > FEW_ROWS:
        return 1
    return max(1, min(MAX_COPIES, -(-2 * last_level_cache_bytes() // (k * n))))


@torch.no_grad()
def bench_linear(shapes=LINEAR_SHAPES, dtype: torch.dtype = torch.bfloat16, repeats: int = 7) -> list[dict]:
    """Plain F.linear, pyext fp8 weight-only (and dynamic, in bf16), and diffusers' layerwise
    casting, on the GPU when there is one (the rows' `device` says which); a few rows' layers
    from memory (copies_for)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for name, m, k, n in shapes:
        copies, calls = copies_for(m, k, n, device), calls_for(m, k, n)
        plain = [nn.Linear(k, n).to(device, dtype) for _ in range(copies)]
        x = torch.randn(m, k, dtype=dtype, device=device)
        layers = {"plain": plain, "fp8": [FP8Linear.from_linear(lin) for lin in plain]}
        if dtype == torch.bfloat16:  # the dynamic GEMM quantizes bf16 activations
            layers["dynamic"] = [FP8Linear.from_linear(lin, gemm="dynamic") for lin in plain]
        layers["diff"] = [_layerwise_cast(copy.deepcopy(lin), dtype) for lin in plain]
        variants = {key: (lambda group=group: [layer(x) for _ in range(calls) for layer in group])
                    for key, group in layers.items()}
        per_round = rounds({key: _synced(fn, device) for key, fn in variants.items()}, repeats, 2)
        per_round = {key: [t / (copies * calls) for t in ts] for key, ts in per_round.items()}
        t = {key: statistics.median(ts) for key, ts in per_round.items()}
        row = dict(bench="fp8_linear", shape=name, device=device, dtype=str(dtype).removeprefix("torch."), M=m, K=k,
                   N=n, copies=copies, calls=calls, plain_ms=t["plain"] * 1e3, pyext_fp8_ms=t["fp8"] * 1e3,
                   diffusers_fp8_ms=t["diff"] * 1e3, pyext_vs_plain=_vs_plain(per_round, "fp8"),
                   diffusers_vs_plain=_vs_plain(per_round, "diff"))
        if "dynamic" in t:
            row.update(pyext_dynamic_ms=t["dynamic"] * 1e3, dynamic_vs_plain=_vs_plain(per_round, "dynamic"))
        if device == "cpu":  # OpenVINO's linear in its own process, against F.linear there
            from bench.openvino_ops import compare

            got = compare("linear", (m, k, n), repeats, dtype)
            inverse = [1 / r for r in got.get("ratios", ())]  # OpenVINO's time over F.linear's
            row["openvino"] = ({"skipped": got["skipped"]} if "skipped" in got else {
                "ms": got["ms"], "vs_plain": {"median": round(statistics.median(inverse), 3),
                                              "range": [round(min(inverse), 3), round(max(inverse), 3)]},
                "note": got["note"]})
        out.append(row)
        del plain, layers, variants
    return out


def sd15_unet(dtype=torch.bfloat16) -> nn.Module:
    from diffusers import UNet2DConditionModel

    from pyext.offline import load_config

    torch.manual_seed(0)
    config = load_config("sd15", "full")["components"]["unet"]["config"]
    return UNet2DConditionModel.from_config(config).to(dtype).eval()


@torch.no_grad()
def bench_unet(latent=32, batch=2, repeats=5) -> list[dict]:
    """SD1.5-architecture UNet step, bf16 on CPU: bf16 vs diffusers layerwise fp8 vs pyext fp8, in NCHW
    and in channels-last (what pyext.optimize runs).

    The variants run round-robin; each ratio is the median over rounds of (variant / bf16 in the same
    round and memory format), with its range, so slow drift of the machine cancels out."""
    base = sd15_unet()
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(batch, 4, latent, latent, generator=g, dtype=torch.bfloat16), torch.tensor([500]),
            torch.randn(batch, 77, 768, generator=g, dtype=torch.bfloat16))
    args_cl = (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
    ref = base(*args).sample.float()
    cl = (lambda u: u.to(memory_format=torch.channels_last))
    variants = {"bf16": lambda u: u,
                "diffusers_layerwise_fp8": lambda u: (u.enable_layerwise_casting(
                    storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16), u)[1],
                "pyext_fp8": lambda u: (quantize_fp8(u), u)[1],
                "bf16_channels_last": cl,
                "pyext_fp8_channels_last": lambda u: cl((quantize_fp8(u), u)[1])}
    unets = {name: make(copy.deepcopy(base)) for name, make in variants.items()}
    del base
    inputs = {name: args_cl if name.endswith("channels_last") else args for name in unets}
    per_round = rounds({name: (lambda u=u, a=inputs[name]: u(*a)) for name, u in unets.items()}, repeats, warmup=1)
    t = {name: statistics.median(ts) for name, ts in per_round.items()}
    rows = []
    for name, unet in unets.items():
        y = unet(*inputs[name]).sample.float()
        rows.append(dict(bench="sd15_unet_step", variant=name, latents=f"{batch}x4x{latent}x{latent}",
                         step_s=t[name], weight_mib=weight_bytes(unet) / 2**20,
                         rel_err_vs_bf16=((y - ref).norm() / ref.norm()).item()))
    by = {r["variant"]: r for r in rows}
    for r in rows:  # each against bf16 in the same memory format
        ref_name = "bf16_channels_last" if r["variant"].endswith("channels_last") else "bf16"
        base_row = by[ref_name]
        ratios = [a / b for a, b in zip(per_round[r["variant"]], per_round[ref_name])]
        r["latency_vs_bf16"] = statistics.median(ratios)
        r["ratio_range"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
        r["weights_vs_bf16"] = r["weight_mib"] / base_row["weight_mib"]
    return rows


# (name, batch, in C, H=W, out N, stride): SD1.5 UNet 3x3 convs at the cpu preset's 32x32 latents, CFG batch 2
CONV_SHAPES = [
    ("sd15 resnet 320 (32x32)", 2, 320, 32, 320, 1),
    ("sd15 resnet 640 (16x16)", 2, 640, 16, 640, 1),
    ("sd15 resnet 1280 (8x8)", 2, 1280, 8, 1280, 1),
    ("sd15 up resnet 2560->1280 (8x8)", 2, 2560, 8, 1280, 1),
    ("sd15 downsample 640 (16x16, stride 2)", 2, 640, 16, 640, 2),
]


@torch.no_grad()
def bench_conv(shapes=CONV_SHAPES, dtype: torch.dtype = torch.bfloat16, repeats: int = 7) -> list[dict]:
    """3x3 convs, channels-last (as pyext.optimize runs them): plain vs pyext fp8 (dispatch's
    choice: the fused GEMM on the codes where the CPU has it) vs pyext fp8's upcast path (codes made
    (out, in, kh, kw) by the module's .to(memory_format=torch.contiguous_format), NCHW input:
    whole-weight upcast into a reused buffer + torch conv) vs diffusers' layerwise casting."""
    out = []
    cl = torch.channels_last
    for name, b, c, hw, n, stride in shapes:
        conv = nn.Conv2d(c, n, 3, stride, 1).to(dtype)
        x = torch.randn(b, c, hw, hw, dtype=dtype)
        fp8 = FP8Conv2d.from_conv(conv)
        fns = {"plain": (copy.deepcopy(conv).to(memory_format=cl), x.contiguous(memory_format=cl)),
               "fp8": (copy.deepcopy(fp8).to(memory_format=cl), x.contiguous(memory_format=cl)),
               "fp8_upcast": (copy.deepcopy(fp8).to(memory_format=torch.contiguous_format), x),
               "diff": (_layerwise_cast(copy.deepcopy(conv), dtype).to(memory_format=cl), x.contiguous(memory_format=cl))}
        per_round = rounds({k: (lambda m=m, xx=xx: m(xx)) for k, (m, xx) in fns.items()}, repeats, 2)
        t = {key: statistics.median(ts) for key, ts in per_round.items()}
        out.append(dict(bench="fp8_conv3x3_channels_last", shape=name, dtype=str(dtype).removeprefix("torch."),
                        plain_ms=t["plain"] * 1e3, pyext_fp8_ms=t["fp8"] * 1e3,
                        pyext_fp8_upcast_path_ms=t["fp8_upcast"] * 1e3, diffusers_fp8_ms=t["diff"] * 1e3,
                        pyext_vs_plain=_vs_plain(per_round, "fp8"), diffusers_vs_plain=_vs_plain(per_round, "diff")))
    return out


def sqnr_db(y, ref) -> float:
    return (10 * torch.log10(ref.float().pow(2).sum() / (y.float() - ref.float()).pow(2).sum())).item()


@torch.no_grad()
def bench_sqnr() -> list[dict]:
    """Output SQNR of an fp8 layer vs the bf16 layer: per-channel scaled (pyext) vs plain cast (layerwise casting).

    Real checkpoints have rows of very different magnitude; the synthetic weight
    reproduces that with log-normal row scales, the random-init one has none.
    """
    torch.manual_seed(0)
    k, n = 1280, 1280
    weights = {"random init (uniform rows)": nn.Linear(k, n).weight.detach(),
               "log-normal row scales around 0.005": torch.randn(n, k) * torch.exp(torch.randn(n, 1)) * 0.005}
    x = torch.randn(256, k, dtype=torch.bfloat16)
    rows = []
    for name, w in weights.items():
        w = w.to(torch.bfloat16)
        ref = F.linear(x, w)
        q, s = fp8_quantize(w, per_channel=True)
        qt, st = fp8_quantize(w, per_channel=False)
        outs = {"per_channel": F.linear(x, fp8_upcast(q, s, torch.bfloat16)),
                "per_tensor": F.linear(x, fp8_upcast(qt, st, torch.bfloat16)),
                "plain_cast": F.linear(x, w.to(torch.float8_e4m3fn).to(torch.bfloat16))}
        row = dict(bench="fp8_sqnr", weight=name)
        for key, y in outs.items():
            row[f"{key}_db"] = sqnr_db(y, ref)
            # each output channel matters on its own (the next norm rescales it): mean of per-channel SQNR
            row[f"{key}_chan_db"] = statistics.mean(sqnr_db(y[:, j], ref[:, j]) for j in range(0, n, 8))
        rows.append(row)
    return rows


def run(skip_unet: bool = False, dtype: torch.dtype | None = None) -> list[dict]:
    """Every suite; the layers in `dtype`, by default the one pyext.optimize computes in here."""
    from bench.latency import bench_dtype

    dtype = dtype or bench_dtype()
    rows = bench_upcast() + bench_linear(dtype=dtype) + bench_conv(dtype=dtype) + bench_sqnr()
    if not skip_unet:
        rows += bench_unet()
    return rows


def render(result: dict) -> str:
    """docs/benchmarks.md's tables of a results file: the linears and the convs, pyext's fp8 beside
    the plain layer and diffusers' layerwise casting."""
    ratio = lambda r: f"{r['median']}x ({r['range'][0]}-{r['range'][1]})"  # noqa: E731
    out = []
    linears = [r for r in result["rows"] if r["bench"] == "fp8_linear"]
    if linears:
        dynamic = all("dynamic_vs_plain" in r for r in linears)  # (bf16 runs only)
        openvino = any("vs_plain" in r.get("openvino", {}) for r in linears)  # (CPU runs with OpenVINO)

        def ov(r: dict) -> str:
            return ratio(r["openvino"]["vs_plain"]) if "vs_plain" in r.get("openvino", {}) else "-"
        out += ["| linear | M, K, N | dtype | F.linear | pyext fp8 | pyext / F.linear, median (range) "
                "| layerwise casting / F.linear |" + (" pyext dynamic fp8 / F.linear |" if dynamic else "")
                + (" OpenVINO / F.linear |" if openvino else ""),
                "|---|---|---|---:|---:|---:|---:|" + ("---:|" if dynamic else "") + ("---:|" if openvino else "")]
        out += [f"| {r['shape']} | {r['M']}, {r['K']}, {r['N']} | {r['dtype']} | {r['plain_ms']:.2f} ms | "
                f"{r['pyext_fp8_ms']:.2f} ms | {ratio(r['pyext_vs_plain'])} | {ratio(r['diffusers_vs_plain'])} |"
                + (f" {ratio(r['dynamic_vs_plain'])} |" if dynamic else "") + (f" {ov(r)} |" if openvino else "")
                for r in linears]
        copied = [r for r in linears if r.get("copies", 1) > 1]
        if copied:
            counts = sorted({r["copies"] for r in copied})
            beyond = all(r["copies"] < MAX_COPIES for r in copied)
            out += [f"\nRows of up to {FEW_ROWS} tokens ({', '.join(sorted({str(r['M']) for r in copied}, key=int))}): "
                    f"each variant runs over {'-'.join(map(str, (counts[0], counts[-1]) if len(counts) > 1 else counts))} "
                    "copies of the layer per round, "
                    + ("enough for their fp8 weights to exceed twice this machine's last-level caches"
                       if beyond else f"at most {MAX_COPIES}, which at the smallest layers stay within its caches")
                    + ", as a model's layers read theirs from memory; the times are per layer. OpenVINO's "
                    "column is one layer, warm, in its process."]
        repeated = sorted({r["calls"] for r in linears if r.get("calls", 1) > 1})
        if repeated:
            out += [f"\nLarger rows: each variant calls its layer {'-'.join(map(str, (repeated[0], repeated[-1])))} "
                    f"times per round (about {ROUND_FLOP / 1e9:g} GFLOP), so that its one cold call after the "
                    "variant before it weighs little; the times are per call."]
        notes = {r["openvino"]["note"] for r in linears if "note" in r.get("openvino", {})}
        out += [f"\nOpenVINO's column: {note}, its time over F.linear's from that process's rounds." for note in notes]
    convs = [r for r in result["rows"] if r["bench"] == "fp8_conv3x3_channels_last"]
    if convs:
        out += ["", "| 3x3 conv, channels-last | dtype | torch's conv | pyext fp8 | pyext / conv, median (range) "
                "| pyext's upcast path | layerwise casting / conv |", "|---|---|---:|---:|---:|---:|---:|"]
        out += [f"| {r['shape']} | {r['dtype']} | {r['plain_ms']:.2f} ms | {r['pyext_fp8_ms']:.2f} ms | "
                f"{ratio(r['pyext_vs_plain'])} | {r['pyext_fp8_upcast_path_ms']:.2f} ms | "
                f"{ratio(r['diffusers_vs_plain'])} |" for r in convs]
    paths = result["machine"].get("kernel_paths", {})
    out += ["", f"fp8 on torch's AMX brgemm here: {paths.get('fp8_linear_amx', 'unknown')}; pyext's SIMD level: "
                f"{paths.get('simd', 'unknown')}; `{result.get('command', 'python -m bench.fp8')}`."]
    return "\n".join(out)


def print_rows(rows: list[dict]) -> None:
    by = {}
    for r in rows:
        by.setdefault(r["bench"], []).append(r)
    for bench, items in by.items():
        print(f"\n## {bench}")
        keys = list(items[0])[1:]
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in items:
            print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows, with the machine and its kernel paths, here")
    ap.add_argument("--skip-unet", action="store_true", help="skip the full SD1.5 UNet (about a minute on 2 cores)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                    help="the layers' dtype; auto: bf16 where the CPU computes it natively (and on a GPU), else fp32")
    args = ap.parse_args(argv)
    from bench.latency import bench_dtype, describe_machine, save_results

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"pyext {pyext.__version__}, torch {torch.__version__}, weights random; {describe_machine(device)}")
    rows = run(args.skip_unet, bench_dtype(args.dtype))
    print_rows(rows)
    save_results("fp8", device, args.json, rows=rows,
                 command="python -m bench.fp8 " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
