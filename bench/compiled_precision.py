"""Why a compiled bf16 Flux transformer lands closer to fp32 than an eager one.

    python -m bench.compiled_precision [--size bench] [--out FILE]

One Flux transformer (pyext.offline, random weights, seed 0) in bf16, one input (a 256x256
image's tokens, 128 text tokens), at three timesteps; each variant's output against the same
transformer in float64:
- eager: diffusers as it runs;
- compiled: torch.compile (inductor), as the torchao rows of bench.latency compile;
- compiled_emulating_casts: the same with inductor's `emulate_precision_casts`, which rounds a
  fused value to bf16 wherever eager rounds it;
- eager_exact_timestep: eager, with the time embedder given the timestep and guidance in
  float32: what the transformer's `timestep.to(hidden_states.dtype) * 1000` rounds to bf16.
The results, with the machine, the commit and the versions, go to FILE (JSON) when given;
`python -m bench.render` puts them in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import copy

import torch

VARIANTS = ("eager", "compiled", "compiled_emulating_casts", "eager_exact_timestep")
TIMESTEPS = (0.9, 0.7, 0.3)


def _inputs(config, timestep: float) -> dict:
    g = torch.Generator().manual_seed(0)
    side, text = 16, 128  # 256x256 pixels: 32x32 latents, packed 2x2
    ids = torch.zeros(side * side, 3)
    ids[:, 1] = torch.arange(side).repeat_interleave(side)
    ids[:, 2] = torch.arange(side).repeat(side)
    return dict(hidden_states=torch.randn(1, side * side, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=g),
                timestep=torch.tensor([timestep]), guidance=torch.tensor([3.5]) if config.guidance_embeds else None,
                img_ids=ids, txt_ids=torch.zeros(text, 3), return_dict=False)


def _cast(inputs: dict, dtype) -> dict:
    # The timestep, guidance and position ids stay float32, as FluxPipeline passes its ids; the
    # transformer casts the timestep itself.
    return {k: v.to(dtype) if k in ("hidden_states", "encoder_hidden_states", "pooled_projections") else v
            for k, v in inputs.items()}


def _exact_timestep(model, current: dict) -> None:
    """Feeds the time embedder the float32 timestep and guidance of `current["inputs"]` (the call
    being made), which the transformer would round to bf16."""
    forward = model.time_text_embed.forward

    def exact(timestep, *args):
        inputs = current["inputs"]
        if inputs["guidance"] is not None:
            return forward(inputs["timestep"] * 1000, inputs["guidance"] * 1000, *args[1:])
        return forward(inputs["timestep"] * 1000, *args)

    model.time_text_embed.forward = exact


def measure(size: str = "bench", variants: tuple[str, ...] = VARIANTS) -> list[dict]:
    import torch._inductor.config as inductor_config

    from pyext.offline import build_pipeline

    reference = build_pipeline("flux", size, seed=0).transformer.eval()
    plain = copy.deepcopy(reference).to(torch.bfloat16)
    reference = reference.double()
    rows = []
    for variant in variants:
        model = copy.deepcopy(plain)
        if variant.startswith("compiled"):
            torch._dynamo.reset()
            model = torch.compile(model)
        errors, current = [], {}
        if variant == "eager_exact_timestep":
            _exact_timestep(model, current)
        # (the first call compiles: the setting is read then)
        with inductor_config.patch(emulate_precision_casts=variant == "compiled_emulating_casts"):
            for t in TIMESTEPS:
                inputs = current["inputs"] = _inputs(plain.config, t)
                with torch.no_grad():
                    exact = reference(**_cast(inputs, torch.float64))[0]
                    out = model(**_cast(inputs, torch.bfloat16))[0].double()
                errors.append(((out - exact).norm() / exact.norm()).item())
        rows.append({"variant": variant, "timesteps": list(TIMESTEPS), "relative_errors": errors,
                     "max_relative_error": max(errors)})
    return rows


def render(result: dict) -> str:
    lines = ["| variant | relative error vs float64, per timestep (" + ", ".join(map(str, TIMESTEPS)) + ") | worst |",
             "|---|---|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {', '.join(f'{e:.2e}' for e in r['relative_errors'])} | "
                     f"{r['max_relative_error']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.compiled_precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", help="pyext.offline size of the Flux transformer")
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    args = p.parse_args(argv)
    from bench.latency import save_results

    result = save_results("compiled_precision", "cpu", args.out, size=args.size, rows=measure(args.size))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
