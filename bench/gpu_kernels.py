"""GPU kernel bench: pyext's attention against each of SDPA's backends, pyext's fp8 linears
against cuBLAS bf16, at SD1.5, SDXL, SD3 and Flux shapes (1024x1024 for SDXL, SD3 and Flux), and
pyext's fused GroupNorm + SiLU against PyTorch's two kernels at SD1.5's UNet and VAE shapes.

    python -m bench.gpu_kernels [--json PATH]

Times are CUDA-event medians (triton.testing.do_bench), of the public op (its dispatch included,
what an eager pipeline pays per call) and of the bare kernel. Attention is timed twice through the
op: forced to pyext's Triton kernel, and as dispatch chooses among its CUDA backends; dispatch's
choice and SDPA's backends are timed again replayed from a CUDA graph, the GPU's time alone, which
is what a pipeline replaying its captured denoiser (compile="capture") pays. Each attention
row also gives the errors of both against an fp32 reference on the same inputs, beside the error
of SDPA's default in the same dtype; a row where either is more than twice SDPA's carries an
`accuracy_error`. Each fp8 row gives its SQNR against the bf16 layer. Each GroupNorm row times
what fuse_norms puts in a ResnetBlock2D (fused_norm.norm_silu, dispatch's choice) against
what diffusers runs there (F.group_norm, then F.silu), eagerly and replayed from CUDA graphs,
with both errors against an fp32 reference.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# (name, batch, heads, q tokens, kv tokens, head dim); batch 2 where the pipeline runs CFG in one batch
ATTENTION_SHAPES = [
    ("sd15 512: 64x64 self", 2, 8, 4096, 4096, 40),
    ("sd15 512: 64x64 cross (77 text)", 2, 8, 4096, 77, 40),
    ("sd15 512: 32x32 self", 2, 8, 1024, 1024, 80),
    ("sd15 512: 16x16 self", 2, 8, 256, 256, 160),
    ("sdxl 1024: 64x64 self", 2, 10, 4096, 4096, 64),
    ("sdxl 1024: 32x32 self", 2, 20, 1024, 1024, 64),
    ("sd3 1024: joint", 2, 24, 4429, 4429, 64),
    ("flux 1024: joint", 1, 24, 4608, 4608, 128),
]
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")

# (name, tokens, in, out): Flux.1 at 1024x1024 (4096 image tokens, 512 text), bf16
LINEAR_SHAPES = [
    ("flux double: q/k/v/out 3072->3072", 4096, 3072, 3072),
    ("flux double: mlp 3072->12288", 4096, 3072, 12288),
    ("flux double: mlp 12288->3072", 4096, 12288, 3072),
    ("flux single: qkv+mlp 3072->21504", 4608, 3072, 21504),
    ("flux single: out 15360->3072", 4608, 15360, 3072),
    ("flux text: 3072->3072 (512 tokens)", 512, 3072, 3072),
]

# (name, batch, channels, height, width): SD1.5 at 512x512 in float16, channels-last as optimize
# lays out the UNet and the VAE; 32 groups. The 8x8 level is below the fused layer's size floor.
GROUP_NORM_SHAPES = [
    ("sd15 unet: 64x64x320", 2, 320, 64, 64),
    ("sd15 unet: 32x32x640", 2, 640, 32, 32),
    ("sd15 unet: 16x16x1280", 2, 1280, 16, 16),
    ("sd15 unet: 8x8x1280", 2, 1280, 8, 8),
    ("sd15 vae: 256x256x256", 1, 256, 256, 256),
]


def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(fn) -> float:
    """_ms of fn captured in a CUDA graph (as compile="capture" captures) and replayed: no host work per call."""
    from pyext.graphs import CudaGraph

    return _ms(CudaGraph(lambda _: fn(), [], None).replay)


def _ms_host(fn) -> float:
    """A few calls timed on the host (ms per call): the benches' logic on CPU tensors, in tests."""
    from bench.dispatch import _per_call

    return _per_call(fn, 3, "cpu") * 1e3


def _failure(e: Exception, length: int = 200) -> str:
    """What a row records of a variant that failed: one failure must not hide the other variants."""
    return f"{type(e).__name__}: {e}"[:length]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@torch.no_grad()
def bench_attention(shapes=ATTENTION_SHAPES, dtype=torch.bfloat16, device="cuda", ms=_ms,
                    graph_ms=_graph_ms) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pyext import dispatch
    from pyext.kernels.attention import attention_triton
    from pyext.ops import attention

    rows = []
    for name, b, h, sq, skv, d in shapes:
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g) for s in (sq, skv, skv))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flops = 4 * b * h * sq * skv * d
        row = dict(bench="attention", shape=name, b=b, h=h, sq=sq, skv=skv, d=d, dtype=str(dtype)[6:])
        try:  # what a pipeline gets: dispatch's choice (measured on its first call on a GPU)
            row["auto_backend"] = dispatch.select("attention", (q, k, v, None, None, False)).name
            row["auto_ms"] = ms(lambda: attention(q, k, v))
            row["auto_err"] = _rel(attention(q, k, v), ref)
        except Exception as e:
            row["auto_error"] = _failure(e)
        try:
            row["pyext_ms"] = ms(lambda: attention(q, k, v, backend="triton"))
            row["pyext_err"] = _rel(attention(q, k, v, backend="triton"), ref)
            row["pyext_kernel_ms"] = ms(lambda: attention_triton(q, k, v, None))
        except Exception as e:
            row["pyext_error"] = _failure(e)
        row["sdpa_err"] = _rel(F.scaled_dot_product_attention(q, k, v), ref)
        for backend in SDPA_BACKENDS:
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    row[f"{backend.split('_')[0].lower()}_ms"] = ms(lambda: F.scaled_dot_product_attention(q, k, v))
            except RuntimeError as e:
                row[f"{backend.split('_')[0].lower()}_ms"] = None
                row.setdefault("refused", []).append(f"{backend}: {str(e).splitlines()[0][:80]}")
        best = min((row[f"{s.split('_')[0].lower()}_ms"] for s in SDPA_BACKENDS
                    if row[f"{s.split('_')[0].lower()}_ms"] is not None), default=None)
        if "pyext_ms" in row and best:
            row["best_sdpa_over_pyext"] = round(best / row["pyext_ms"], 3)  # >1: pyext's Triton kernel faster
            row["pyext_tflops"] = round(flops / row["pyext_ms"] / 1e9, 1)
        if "auto_ms" in row and best:
            row["best_sdpa_over_auto"] = round(best / row["auto_ms"], 3)  # >1: pyext.attention faster
        if graph_ms is not None and "auto_ms" in row and best:
            try:
                row["auto_graph_ms"] = graph_ms(lambda: attention(q, k, v))
                graphed = []
                for backend in SDPA_BACKENDS:
                    if row[f"{backend.split('_')[0].lower()}_ms"] is not None:
                        with sdpa_kernel([getattr(SDPBackend, backend)]):
                            graphed.append(graph_ms(lambda: F.scaled_dot_product_attention(q, k, v)))
                row["best_sdpa_graph_ms"] = min(graphed)
                row["best_sdpa_over_auto_graph"] = round(row["best_sdpa_graph_ms"] / row["auto_graph_ms"], 3)
            except Exception as e:
                row["graph_error"] = _failure(e)
        for key, which in (("pyext", "the Triton kernel"), ("auto", "dispatch's choice")):
            if f"{key}_err" in row:
                name = "err_vs_sdpa" if key == "pyext" else "auto_err_vs_sdpa"
                row[name] = ratio = round(row[f"{key}_err"] / max(row["sdpa_err"], 1e-12), 2)
                if not ratio <= 2.0:
                    row["accuracy_error"] = f"{which}'s error is {ratio}x SDPA's (at most 2x allowed)"
        rows.append(row)
        print(row, flush=True)
    return rows


@torch.no_grad()
def bench_fp8_linear(shapes=LINEAR_SHAPES, device="cuda", ms=_ms) -> list[dict]:
    from pyext.kernels.fp8_linear import fp8_linear_triton
    from pyext.nn import FP8Linear
    from pyext.ops import fp8_upcast

    rows = []
    for name, m, k, n in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n).to(device, torch.bfloat16)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        weight_only = FP8Linear.from_linear(lin)
        dynamic = FP8Linear.from_linear(lin, gemm="dynamic")
        codes, scale = weight_only.fp8_weight, weight_only.scale
        stored = weight_only.weight.codes  # the uint8 codes the ops take
        ref = lin(x).float()
        fns = {
            "bf16": lambda: lin(x),
            "weight_only": lambda: weight_only(x),
            "weight_only_triton": lambda: torch.ops.pyext.fp8_linear(x, stored, scale, lin.bias, "triton"),
            "triton_kernel": lambda: fp8_linear_triton(x, stored, scale, lin.bias),
            "upcast_then_cublas": lambda: F.linear(x, fp8_upcast(codes, scale, torch.bfloat16), lin.bias),
            "upcast_cublas": lambda: torch.ops.pyext.fp8_linear(x, stored, scale, lin.bias, "upcast_cublas"),
            "dynamic": lambda: dynamic(x),
            "dynamic_torch_quantize": lambda: torch.ops.pyext.fp8_linear_dynamic(x, stored, scale, lin.bias,
                                                                                 "scaled_mm"),
            "dynamic_triton_quantize": lambda: torch.ops.pyext.fp8_linear_dynamic(x, stored, scale,
                                                                                  lin.bias, "triton_scaled_mm"),
        }
        row = dict(bench="fp8_linear", shape=name, M=m, K=k, N=n)
        for key, fn in fns.items():
            try:
                row[f"{key}_ms"] = ms(fn)
                if key != "bf16":
                    y = fn().float()
                    row[f"{key}_sqnr_db"] = round((10 * torch.log10(ref.pow(2).sum() / (y - ref).pow(2).sum())).item(), 1)
                    row[f"{key}_vs_bf16"] = round(row[f"{key}_ms"] / row["bf16_ms"], 3)
            except Exception as e:
                row[f"{key}_error"] = _failure(e)
        row["bf16_tflops"] = round(2 * m * k * n / row["bf16_ms"] / 1e9, 1)
        rows.append(row)
        print(row, flush=True)
    return rows


@torch.no_grad()
def bench_group_norm(shapes=GROUP_NORM_SHAPES, dtype=torch.float16, device="cuda", ms=_ms,
                     graph_ms=_graph_ms) -> list[dict]:
    from pyext import dispatch
    from pyext.nn.fused_norm import MIN_FUSED_NUMEL, norm_silu
    from pyext.ops import group_norm

    rows = []
    for name, b, c, h, w in shapes:
        g = torch.Generator(device).manual_seed(0)
        x = torch.randn(b, c, h, w, device=device, dtype=dtype, generator=g).contiguous(memory_format=torch.channels_last)
        norm = torch.nn.GroupNorm(32, c).to(device, dtype)
        norm.weight.copy_(torch.rand(c, device=device, generator=g) + 0.5)
        norm.bias.copy_(torch.randn(c, device=device, generator=g) * 0.1)
        plain = lambda: F.silu(F.group_norm(x, 32, norm.weight, norm.bias, norm.eps))  # noqa: E731
        ref = F.silu(F.group_norm(x.float(), 32, norm.weight.float(), norm.bias.float(), norm.eps))
        row = dict(bench="group_norm", shape=name, b=b, c=c, h=h, w=w, dtype=str(dtype)[6:])
        try:
            row["plain_ms"] = ms(plain)
            row["plain_err"] = _rel(plain(), ref)
            if graph_ms is not None:
                row["plain_graph_ms"] = graph_ms(plain)
        except Exception as e:
            row["plain_error"] = _failure(e)
        try:
            args = (x, 32, norm.weight, norm.bias, None, norm.eps, True)
            row["fused_backend"] = dispatch.select("group_norm", args).name if x.numel() >= MIN_FUSED_NUMEL else "plain"
            row["fused_ms"] = ms(lambda: norm_silu(norm, x))
            row["fused_err"] = _rel(norm_silu(norm, x), ref)
            if graph_ms is not None:
                row["fused_graph_ms"] = graph_ms(lambda: norm_silu(norm, x))
        except Exception as e:
            row["fused_error"] = _failure(e)
        try:
            row["triton_ms"] = ms(lambda: group_norm(x, 32, norm.weight, norm.bias, norm.eps, "silu", backend="triton"))
        except Exception as e:
            row["triton_error"] = _failure(e)
        for key in ("", "_graph"):  # <1: the fused layer is faster
            if f"fused{key}_ms" in row and f"plain{key}_ms" in row:
                row[f"fused_over_plain{key}"] = round(row[f"fused{key}_ms"] / row[f"plain{key}_ms"], 3)
        if "fused_err" in row and "plain_err" in row:
            row["err_vs_plain"] = round(row["fused_err"] / max(row["plain_err"], 1e-12), 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    rows = [dict(bench="machine", **info)]
    for bench in (bench_attention, bench_fp8_linear, bench_group_norm):
        try:
            rows += bench()
        except Exception as e:
            rows.append(dict(bench=bench.__name__, error=_failure(e, 300)))
            print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
