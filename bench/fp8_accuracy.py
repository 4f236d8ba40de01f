"""What fp8 costs in accuracy: per layer and per pipeline, weight-only against dynamic.

    python -m bench.fp8_accuracy [--archs sd15,sdxl,sd3,flux,wan21] [--out FILE]

For each tiny offline pipeline in bfloat16 (random weights, CPU):
- per layer: the denoiser's Linear layers that both GEMMs take (features multiples of 16) are
  fed the inputs they see in a 2-step generation; the SQNR of each fp8 GEMM's output against
  the float64 linear on the layer's bf16 weight (median and worst over the layers);
- per pipeline: the PSNR of the image (video) the pipeline makes after pyext.quantize_fp8 of its
  denoiser (default skips: small layers stay), in each GEMM mode, against the same pipeline
  without fp8; `fp8_layers` says how many layers that converts.
The results, with the machine, the commit and the versions, go to FILE (JSON) when given;
`python -m bench.render` puts them in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHS = ("sd15", "sdxl", "sd3", "flux", "wan21")
MODES = ("weight_only", "dynamic")


def _denoiser(pipe) -> nn.Module:
    return getattr(pipe, "unet", None) or pipe.transformer


def _sqnr_db(out: torch.Tensor, exact: torch.Tensor) -> float:
    noise = (out.double() - exact).pow(2).mean()
    return float("inf") if noise == 0 else float(10 * torch.log10(exact.pow(2).mean() / noise))


def _psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean()
    return float("inf") if mse == 0 else float(10 * torch.log10(1.0 / mse))


def _layer_inputs(pipe, arch: str) -> tuple[dict[str, tuple[nn.Linear, torch.Tensor]], torch.Tensor]:
    """{name: (layer, its first input)} for the denoiser's GEMM-aligned Linears, and the output."""
    from pyext.offline import run_example

    seen, handles = {}, []
    for name, module in _denoiser(pipe).named_modules():
        if type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0:
            def keep(mod, args, name=name):
                seen.setdefault(name, (mod, args[0].detach().clone()))
            handles.append(module.register_forward_pre_hook(keep))
    try:
        image = run_example(pipe, arch)
    finally:
        for h in handles:
            h.remove()
    return seen, image


def _layer_sqnr(layers: dict) -> dict[str, dict]:
    from pyext.ops import fp8_linear, fp8_linear_dynamic, fp8_quantize

    per_mode = {mode: [] for mode in MODES}
    for layer, x in layers.values():
        w, b = layer.weight.detach(), layer.bias
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        wq, s = fp8_quantize(w)
        per_mode["weight_only"].append(_sqnr_db(fp8_linear(x, wq, s, b), exact))
        per_mode["dynamic"].append(_sqnr_db(fp8_linear_dynamic(x, wq, s, b), exact))
    return {mode: {"layers": len(v), "median_db": statistics.median(v), "worst_db": min(v)}
            for mode, v in per_mode.items() if v}


def measure(arch: str) -> dict:
    import pyext
    from pyext.offline import build_pipeline, run_example

    layers, plain = _layer_inputs(build_pipeline(arch, "tiny", dtype=torch.bfloat16), arch)
    with torch.no_grad():
        row = {"arch": arch, "layer_sqnr": _layer_sqnr(layers), "pipeline_psnr_db": {}}
    for mode in MODES:
        pipe = build_pipeline(arch, "tiny", dtype=torch.bfloat16)
        row["fp8_layers"] = len(pyext.quantize_fp8(_denoiser(pipe), gemm=mode).converted)
        row["pipeline_psnr_db"][mode] = _psnr_db(run_example(pipe, arch), plain)
    return row


def render(rows: list[dict]) -> str:
    lines = ["| pipeline | layers measured | weight-only SQNR, median (worst) | dynamic SQNR, median (worst) | "
             "fp8 layers in the pipeline | weight-only PSNR | dynamic PSNR |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        wo, dy = r["layer_sqnr"]["weight_only"], r["layer_sqnr"]["dynamic"]
        psnr = r["pipeline_psnr_db"]
        images = (f"{psnr['weight_only']:.1f} dB | {psnr['dynamic']:.1f} dB" if r["fp8_layers"]
                  else "none converted (all below the size limit) | ")
        lines.append(f"| {r['arch']} | {wo['layers']} | {wo['median_db']:.1f} ({wo['worst_db']:.1f}) dB | "
                     f"{dy['median_db']:.1f} ({dy['worst_db']:.1f}) dB | {r['fp8_layers']} | {images} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)
    from bench.latency import save_results

    rows = [measure(arch) for arch in args.archs.split(",")]
    print(render(rows))
    return save_results("fp8_accuracy", "cpu", args.out, rows=rows)


if __name__ == "__main__":
    main()
