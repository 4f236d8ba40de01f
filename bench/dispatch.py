"""What dispatch costs per call, and what measured dispatch costs and gains against static dispatch.

    python -m bench.dispatch --overhead [--device cpu|cuda] [--rounds 7] [--out FILE]
    python -m bench.dispatch [--device cpu|cuda]

--overhead: on a tiny input of each op, the time of one call through the raw op
(`torch.ops.pyext.*`: validation, the cached choice, the backend) against PyTorch's own call for
the same work (SDPA; F.linear on the dequantized weight; F.group_norm + SiLU; F.conv2d), against
that call made through `torch.ops.aten.*` (what any op called through `torch.ops` pays, custom
or not), and against the chosen backend called bare. For fp8_linear also the call pyext's fp8
layers make (`pyext.ops.fp8.call_linear`: the op through the extension, without torch.ops). Rounds interleave the calls (A, B, A, B, ...); each
ratio is the median of the per-round ratios, with its range. Also one tiny diffusers attention
layer of each processor kind pyext routes, plain and routed (`pyext.attention.apply`): the routing's
torch-function mode sees every torch call of a routed layer's forward, which an eager step pays per
layer. And the host work a denoiser replayed from captured CUDA graphs (compile="capture") adds to
each step: the captured forward's call (its signature, the check that the model still holds what was
captured, the input copies and output copy) around a graph replay that does nothing, on the full
SD1.5 UNet and Flux transformer (their structure, each tensor a one-element one), against that empty
replay called bare.
The results, with the machine, the commit and the versions, go to FILE (JSON) when given.

Without --overhead: attention in diffusers' layout at SD1.5 shapes. Each mode runs in its own
process with an empty dispatch cache, so the first call pays for whatever the mode does once per
shape (self-check; in measured mode, timing every backend). Per shape: the backend chosen, the
first call's time and the best of three later calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
                     "backend": dispatch.select("attention", (q, k, v, None, None, False)).name})
    return rows


def _tiny_calls(device: str) -> dict:
    """{op: (raw op call, PyTorch's call for the same work, the same through torch.ops.aten, dispatch args,
    the layers' call or None)} on tiny inputs."""
    import torch
    import torch.nn.functional as F

    from pyext.ops import fp8_quantize
    from pyext.ops.fp8 import call_linear

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q = rand(1, 2, 8, 16)
    x, w = rand(4, 32), rand(32, 32)
    wq, s = fp8_quantize(w)
    codes, dense = wq.view(torch.uint8), (wq.float() * s[:, None])
    h, gamma, beta = rand(1, 8, 4, 4), rand(8), rand(8)
    c, wc = rand(1, 8, 6, 6), rand(8, 8, 3, 3)
    P, A = torch.ops.pyext, torch.ops.aten
    return {
        "attention": (lambda: P.attention(q, q, q, None, None), lambda: F.scaled_dot_product_attention(q, q, q),
                      lambda: A.scaled_dot_product_attention.default(q, q, q), (q, q, q, None, None, False), None),
        "fp8_linear": (lambda: P.fp8_linear(x, codes, s, None, None), lambda: F.linear(x, dense),
                       lambda: A.linear.default(x, dense), (x, codes, s, None),
                       lambda: call_linear("fp8_linear", x, codes, s, None)),
        "group_norm": (lambda: P.group_norm(h, 4, gamma, beta, None, 1e-5, True, None),
                       lambda: F.silu(F.group_norm(h, 4, gamma, beta, 1e-5)),
                       lambda: A.silu.default(A.group_norm.default(h, 4, gamma, beta, 1e-5)),
                       (h, 4, gamma, beta, None, 1e-5, True), None),
        "winograd_conv3x3": (lambda: P.winograd_conv3x3(c, wc, None, None), lambda: F.conv2d(c, wc, None, padding=1),
                             lambda: A.conv2d.default(c, wc, None, [1, 1], [1, 1]), (c, wc, None), None),
    }


def _per_call(fn, calls: int, device: str) -> float:
    import torch

    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls


def overhead(device: str, rounds: int, calls: int) -> list[dict]:
    """Under torch.no_grad(), as a pipeline calls its modules."""
    import torch

    from pyext import dispatch

    rows = []
    with torch.no_grad():
        for op, (raw, torch_call, torch_op, args, layer) in _tiny_calls(device).items():
            backend = dispatch.select(op, args)
            calls_of = {"raw": raw, "torch": torch_call, "torch_op": torch_op,
                        "bare": lambda b=backend, a=args: b.run(*a)}
            if layer is not None:
                calls_of["layer"] = layer
            if backend.guard is not None and device == "cpu":  # a value check that runs on CPU inputs only
                calls_of["guard"] = lambda b=backend, a=args: b.guard(*a)
            for fn in calls_of.values():
                _per_call(fn, calls, device)  # warm: choices made, allocator primed
            times = {name: [] for name in calls_of}
            for _ in range(rounds):
                for name, fn in calls_of.items():
                    times[name].append(_per_call(fn, calls, device))
            vs_torch = sorted(r / t for r, t in zip(times["raw"], times["torch"]))
            vs_torch_op = sorted(r / t for r, t in zip(times["raw"], times["torch_op"]))
            vs_bare = sorted(r / b for r, b in zip(times["raw"], times["bare"]))
            layer = {}
            if "layer" in times:
                vs = sorted(r / t for r, t in zip(times["layer"], times["torch"]))
                layer = {"layer_vs_torch": statistics.median(vs), "layer_vs_torch_range": [vs[0], vs[-1]]}
            rows.append({"op": op, "backend": backend.name,
                         **{f"{name}_us": statistics.median(t) * 1e6 for name, t in times.items()},
                         "raw_vs_torch": statistics.median(vs_torch), "raw_vs_torch_range": [vs_torch[0], vs_torch[-1]],
                         "raw_vs_torch_op": statistics.median(vs_torch_op),
                         "raw_vs_torch_op_range": [vs_torch_op[0], vs_torch_op[-1]],
                         "raw_vs_bare": statistics.median(vs_bare), "raw_vs_bare_range": [vs_bare[0], vs_bare[-1]],
                         **layer})
    return rows


def _attention_layers(device: str) -> dict:
    """{processor kind: (layer, inputs)}: a tiny layer of each kind pyext routes, the one that calls
    SDPA itself (SD's) and one that goes through diffusers' attention dispatcher (Flux's)."""
    import torch
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    x, ctx = torch.randn(1, 64, 64, device=device), torch.randn(1, 8, 64, device=device)
    sd = Attention(query_dim=64, cross_attention_dim=64, heads=2, dim_head=32)
    flux = FluxAttention(query_dim=64, heads=2, dim_head=32, added_kv_proj_dim=64)
    return {f"{type(layer.processor).__name__} ({name})": (layer.to(device).eval(), (x, ctx))
            for name, layer in (("SD, SDXL", sd), ("Flux", flux))}


def _torch_calls(fn) -> int:
    """How many torch functions one call of fn makes (what a torch-function mode sees)."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return len(seen)


def routing_overhead(device: str, rounds: int, calls: int) -> list[dict]:
    """Each layer of _attention_layers plain and routed to pyext, under torch.no_grad()."""
    import copy

    import torch

    import pyext.attention

    rows = []
    with torch.no_grad():
        for kind, (plain, args) in _attention_layers(device).items():
            routed = copy.deepcopy(plain)
            pyext.attention.apply(routed)
            calls_of = {"plain": lambda m=plain, a=args: m(*a), "routed": lambda m=routed, a=args: m(*a)}
            for fn in calls_of.values():
                _per_call(fn, calls, device)
            times = {name: [] for name in calls_of}
            for _ in range(rounds):
                for name, fn in calls_of.items():
                    times[name].append(_per_call(fn, calls, device))
            vs = sorted(r / p for r, p in zip(times["routed"], times["plain"]))
            status = pyext.attention.status(routed)
            rows.append({"layer": kind, "torch_calls": _torch_calls(calls_of["plain"]),
                         **{f"{name}_us": statistics.median(t) * 1e6 for name, t in times.items()},
                         "routed_vs_plain": statistics.median(vs), "routed_vs_plain_range": [vs[0], vs[-1]],
                         "pyext_calls": status["pyext_calls"], "fallbacks": status["fallbacks"]})
    return rows


class _EmptyReplay:
    """A graph whose replay does nothing: what is timed around it is the captured forward's own work."""

    device_type = "meta"

    def __init__(self, fn, leaves, pool):
        self.output = fn(leaves)

    @staticmethod
    def pool():
        return None

    def replay(self):
        return self.output


def capture_overhead(rounds: int, calls: int) -> list[dict]:
    """Per model: the captured forward's call on a step's inputs against its empty replay alone."""
    import torch

    from pyext import _compat, graphs
    from pyext.offline import build_pipeline

    def meta(*shape):
        return torch.empty(shape, device="meta", dtype=torch.bfloat16)

    steps = {  # a step's call as the pipeline makes it (tensors only matter by number and layout here)
        "sd15 UNet": ("sd15", "unet", (meta(2, 4, 64, 64), meta()), dict(encoder_hidden_states=meta(2, 77, 768),
                      timestep_cond=None, cross_attention_kwargs=None, added_cond_kwargs=None, return_dict=False)),
        "flux transformer": ("flux", "transformer", (), dict(
            hidden_states=meta(1, 4096, 64), timestep=meta(1), guidance=meta(1), pooled_projections=meta(1, 768),
            encoder_hidden_states=meta(1, 512, 4096), txt_ids=meta(512, 3), img_ids=meta(4096, 3),
            joint_attention_kwargs=None, return_dict=False)),
    }
    rows = []
    with torch.no_grad():
        for name, (arch, component, args, kwargs) in steps.items():
            model = getattr(build_pipeline(arch, "full", dtype=torch.bfloat16, device="meta"), component)
            for m in model.modules():  # the structure in full, each tensor a real one-element one
                for d in _compat.module_slots(m)[:2]:
                    for key, t in d.items():
                        if t is not None:
                            d[key] = type(t)(torch.empty(1)) if isinstance(t, torch.nn.Parameter) else torch.empty(1)
            out = (meta(*(args[0] if args else kwargs["hidden_states"]).shape),)
            forward = graphs.Captured(model, lambda *a, **k: out, _EmptyReplay)
            forward(*args, **kwargs)  # eager
            forward(*args, **kwargs)  # captured
            graph = next(iter(forward.graphs.values()))[0]
            calls_of = {"captured": lambda f=forward, a=args, k=kwargs: f(*a, **k), "replay": graph.replay}
            times = {n: [] for n in calls_of}
            for _ in range(rounds):
                for n, fn in calls_of.items():
                    times[n].append(_per_call(fn, calls, "cpu"))
            held, values = forward.state
            checked = len(held) + len(values)
            rows.append({"model": f"{name} (full)", "checked": checked, "replays": forward.replays,
                         **{f"{n}_us": statistics.median(t) * 1e6 for n, t in times.items()}})
    return rows


def render_capture(rows: list[dict]) -> str:
    lines = ["| captured denoiser (host work per step) | parameters, buffers, submodules checked "
             "| captured forward's call | the replay alone |", "|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['checked']} | {r['captured_us']:.1f} us | {r['replay_us']:.1f} us |" for r in rows]
    return "\n".join(lines)


def render_routing(rows: list[dict]) -> str:
    lines = ["| attention layer (tiny) | torch calls per forward | plain | routed to pyext | routed / plain (range) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['torch_calls']} | {r['plain_us']:.1f} us | {r['routed_us']:.1f} us | "
              f"{_ratio(r, 'routed_vs_plain')} |" for r in rows]
    return "\n".join(lines)


def render_results(result: dict) -> str:
    """The tables of a results file of --overhead (one without layers: only the ops')."""
    tables = [render_overhead(result["rows"])] + ([render_routing(result["layers"])] if "layers" in result else [])
    tables += [render_capture(result["capture"])] if "capture" in result else []
    return "\n\n".join(tables)


def _ratio(r: dict, name: str) -> str:
    low, high = r[f"{name}_range"]
    return f"{r[name]:.2f}x ({low:.2f}-{high:.2f})"


def render_overhead(rows: list[dict]) -> str:
    lines = ["| op | backend | raw op | PyTorch's call | the same via torch.ops.aten | backend bare | its CPU value guard "
             "| raw / PyTorch (range) | raw / torch.ops.aten (range) | raw / bare (range) "
             "| the layers' call | layers' call / PyTorch (range) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        guard = f"{r['guard_us']:.1f} us" if "guard_us" in r else "none"
        torch_op = f"{r['torch_op_us']:.1f} us" if "torch_op_us" in r else "-"
        vs_torch_op = _ratio(r, "raw_vs_torch_op") if "raw_vs_torch_op" in r else "-"
        layer = f"{r['layer_us']:.1f} us" if "layer_us" in r else "-"
        vs_layer = _ratio(r, "layer_vs_torch") if "layer_vs_torch" in r else "-"
        lines.append(f"| `{r['op']}` | {r['backend']} | {r['raw_us']:.1f} us | {r['torch_us']:.1f} us | {torch_op} | "
                     f"{r['bare_us']:.1f} us | {guard} | {_ratio(r, 'raw_vs_torch')} | {vs_torch_op} | "
                     f"{_ratio(r, 'raw_vs_bare')} | {layer} | {vs_layer} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--overhead", action="store_true", help="per-call overhead of each op on a tiny input")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="calls per timing")
    p.add_argument("--out", help="write the results (JSON, with machine, commit and versions) here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.overhead:
        import torch

        from bench.latency import save_results

        torch.set_num_threads(1)  # a tiny input: one thread, as the op's own cost is what is measured
        result = {"rows": overhead(args.device, args.rounds, args.calls),
                  "layers": routing_overhead(args.device, args.rounds, max(1, args.calls // 10)),  # a layer: ~10 calls' work
                  "capture": capture_overhead(args.rounds, max(1, args.calls // 10))}
        print(render_results(result))
        return save_results("dispatch --overhead", args.device, args.out, rounds=args.rounds, calls=args.calls,
                            **result)
    if args.child:
        print(json.dumps(_child(args.device)))
        return {}
    results = {}
    for mode in ("static", "measured"):
        with tempfile.TemporaryDirectory(prefix="pyext_dispatch_") as cache:
            env = dict(os.environ, PYEXT_DISPATCH=mode, PYEXT_CACHE_DIR=cache)
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
