"""The SD1.5 UNet step and VAE decode on a CPU, under each runtime a user could pick.

    python -m bench.cpu_runtimes [--size full] [--height 256 --width 256] [--rounds 5]
                                 [--runtimes eager,pyext,pyext_fp8,pyext_compile,openvino,inductor_freezing]
                                 [--components unet,vae] [--out bench_out/cpu_runtimes] [--json PATH]

Runtimes, all on the same random weights (pyext.offline, seed 0) and inputs:
- eager: the diffusers modules as loaded;
- pyext: after `pyext.optimize(pipe)` (dtype auto: bf16 where the CPU computes it natively, else fp32);
- pyext_fp8: after `pyext.optimize(pipe, fp8="denoiser")`: the same, with the UNet's weights in fp8;
- pyext_compile: after `pyext.optimize(pipe, compile="compile")`: the same, the UNet then compiled
  by inductor with freezing (the VAE stays eager);
- openvino: `openvino.convert_model` of the same modules, compiled for the CPU in that dtype
  ("n/a" with the reason when openvino is not installed);
- inductor_freezing: `torch.compile` with `torch._inductor.config.freezing = True`.
A pyext runtime followed by `:option=value` pairs runs with those options too: `pyext:fuse_geglu=off`
beside `pyext` shows what one technique is worth.
Each runtime lives in its own process (OpenVINO's thread pool keeps spinning after a call) and
keeps its set-up. The parent then runs rounds: in each round every runtime runs each component
once, in an order that rotates from round to round, so each round gives paired ratios. The table
reports the median time, the median of the per-round ratios to openvino and to eager with their
range, set-up time, peak RSS, and each output's error against eager's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch

RUNTIMES = ("eager", "pyext", "pyext_fp8", "pyext_compile", "openvino", "inductor_freezing")
PYEXT_OPTIONS = {"pyext": {}, "pyext_fp8": {"fp8": "denoiser"}, "pyext_compile": {"compile": "compile"}}


def pyext_options(runtime: str) -> dict | None:
    """The optimize options of a pyext runtime (a name of PYEXT_OPTIONS, then any `:option=value`
    pairs), or None for another runtime."""
    base, *pairs = runtime.split(":")
    if base not in PYEXT_OPTIONS or not all("=" in pair for pair in pairs):
        return None
    return {**PYEXT_OPTIONS[base], **dict(pair.split("=", 1) for pair in pairs)}

COMPONENTS = ("unet", "vae")
SETTLE_S = 0.5  # pause between runtimes: OpenVINO's pool spins a little after each call


def example_inputs(pipe, height: int, width: int):
    """(UNet args, VAE decode args): classifier-free guidance batch 2 for the UNet, one image for
    the VAE; the same in every process."""
    g = torch.Generator().manual_seed(0)
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    unet, vae = pipe.unet.config, pipe.vae.config
    return ((torch.randn(2, unet.in_channels, h, w, generator=g), torch.tensor(500),
             torch.randn(2, 77, unet.cross_attention_dim, generator=g)),
            (torch.randn(1, vae.latent_channels, h, w, generator=g),))


def openvino_version() -> str:
    import openvino as ov

    return ov.__version__.split("-")[0]


class _OpenVINOCall:
    """A compiled OpenVINO model called with torch tensors: returns (output,) in the first input's dtype."""

    def __init__(self, compiled, precision: str):
        self.compiled, self.precision = compiled, precision

    def __call__(self, *args):
        out = self.compiled([a.float().numpy() if a.is_floating_point() else a.numpy() for a in args])[0]
        return (torch.from_numpy(out.copy()).to(args[0].dtype),)


def openvino_calls(pipe, unet_args, vae_args, threads: int = 0):
    """The pipeline's UNet step and VAE decode converted with `openvino.convert_model` from its
    fp32 modules, compiled for the CPU in bf16 where the CPU has it natively, else fp32."""
    import openvino as ov
    from pyext._compat import cpu_has_native_bf16

    precision = "bf16" if cpu_has_native_bf16() else "f32"
    config = {"INFERENCE_PRECISION_HINT": precision}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    with torch.no_grad():
        unet = core.compile_model(ov.convert_model(UNetStep(pipe.unet).eval(), example_input=unet_args), "CPU", config)
        decode = core.compile_model(ov.convert_model(Decode(pipe.vae).eval(), example_input=vae_args), "CPU", config)
    return _OpenVINOCall(unet, precision), lambda latents: _OpenVINOCall(decode, precision)(latents)[0]


class UNetStep(torch.nn.Module):
    """unet(sample, t, text) -> noise prediction: the call the pipeline makes once per step."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, text):
        return self.unet(sample, timestep, text, return_dict=False)[0]


class Decode(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents):
        return self.vae.decode(latents, return_dict=False)[0]


def _torch_calls(unet, decode, x, dtype):
    def call(module, args):
        with torch.no_grad():
            return module(*(a.to(dtype) if a.is_floating_point() else a for a in args))

    return {"unet": lambda: call(unet, x[0]), "vae": lambda: call(decode, x[1])}


def _setup(runtime: str, pipe, x, dtype, threads: int):
    """{component: a call that runs it once} for this runtime."""
    if runtime == "openvino":
        unet, decode = openvino_calls(pipe, *x, threads=threads)
        del pipe.unet, pipe.vae  # OpenVINO holds its own copy of the weights
        return {"unet": lambda: unet(*x[0])[0], "vae": lambda: decode(*x[1])}
    options = pyext_options(runtime)
    if options is not None:
        import pyext

        h, w = (n * pipe.vae_scale_factor for n in x[0][0].shape[-2:])
        pyext.optimize(pipe, height=h, width=w, **options)
        dtype = pipe.unet.dtype
    else:
        pipe.to(dtype)
    unet, decode = UNetStep(pipe.unet).eval(), Decode(pipe.vae).eval()
    if runtime == "inductor_freezing":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # this process only
        unet, decode = torch.compile(unet), torch.compile(decode)
    return _torch_calls(unet, decode, x, dtype)


def _worker(runtime: str, spec: dict, conn) -> None:
    try:
        import gc

        import pyext.offline
        from pyext.decision import auto_dtype

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        pipe = pyext.offline.build_pipeline("sd15", spec["size"], seed=0)
        x = example_inputs(pipe, spec["height"], spec["width"])
        del pipe.text_encoder
        dtype = auto_dtype(torch.device("cpu"))
        t0 = time.perf_counter()
        calls = _setup(runtime, pipe, x, dtype, spec["threads"])
        outputs = {c: calls[c]().float() for c in spec["components"]}  # warm-up (compiles), and the check
        gc.collect()
        conn.send({"setup_s": time.perf_counter() - t0, "dtype": str(dtype).removeprefix("torch."),
                   "outputs": outputs})
        while (component := conn.recv()) is not None:
            t = time.perf_counter()
            calls[component]()
            conn.send(time.perf_counter() - t)
        conn.send({"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    except Exception as err:  # the parent reports it as this runtime's reason
        conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def unavailable(runtime: str) -> str | None:
    import importlib.util

    if runtime == "openvino" and importlib.util.find_spec("openvino") is None:
        return "openvino not installed (pip install openvino)"
    return None


def _ratios(a: list[float], b: list[float]) -> dict | None:
    if not a or not b:
        return None
    r = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def _err(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def run(spec: dict) -> dict:
    from bench.latency import preloaded_forkserver

    ctx = preloaded_forkserver(["torch", "diffusers", "transformers", "pyext", "pyext.offline", "bench.cpu_runtimes",
                                "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
                                "transformers.models.clip.modeling_clip"])
    workers, results = {}, {}
    for runtime in spec["runtimes"]:  # set up one at a time: compiles and conversions do not overlap
        reason = unavailable(runtime)
        if reason:
            results[runtime] = {"reason": reason}
            continue
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(runtime, spec, child), daemon=True)
        proc.start()
        print(f"bench.cpu_runtimes: setting up {runtime} ...", flush=True)
        ready = parent.recv()
        if "error" in ready:
            results[runtime] = {"reason": ready["error"]}
            print(ready["traceback"], flush=True)
            proc.join()
            continue
        workers[runtime] = (proc, parent)
        results[runtime] = {"setup_s": ready["setup_s"], "dtype": ready["dtype"], "outputs": ready["outputs"],
                            "times": {c: [] for c in spec["components"]}}
    order = list(workers)
    for r in range(spec["rounds"]):
        turn = order[r % len(order):] + order[:r % len(order)] if order else []
        for component in spec["components"]:
            for runtime in turn:
                time.sleep(SETTLE_S)
                workers[runtime][1].send(component)
                results[runtime]["times"][component].append(workers[runtime][1].recv())
        print(f"  round {r + 1}: " + ", ".join(f"{rt} " + "/".join(f"{results[rt]['times'][c][-1]:.2f}"
                                                                        for c in spec["components"])
                                                   for rt in order), flush=True)
    for runtime, (proc, conn) in workers.items():
        conn.send(None)
        results[runtime].update(conn.recv())
        proc.join()
    return summarize(spec, results)


def summarize(spec: dict, results: dict) -> dict:
    ref = results.get("eager", {}).get("outputs")
    table = {}
    for runtime, res in results.items():
        if "reason" in res:
            table[runtime] = {"reason": res["reason"]}
            continue
        row = {"dtype": res["dtype"], "setup_s": res["setup_s"], "peak_rss_gib": res.get("peak_rss_gib")}
        for c in spec["components"]:
            times = res["times"][c]
            row[c] = {"median_s": statistics.median(times), "times_s": times,
                      "vs": {other: _ratios(times, o["times"][c]) for other, o in results.items() if "times" in o},
                      "max_rel_err_vs_eager": _err(res["outputs"][c], ref[c]) if ref else None}
        table[runtime] = row
    return {"spec": spec, "rows": table}


def markdown(report: dict) -> str:
    comps = report["spec"]["components"]
    timed = [rt for rt, row in report["rows"].items() if "reason" not in row]
    head = "| runtime | dtype | " + " | ".join(f"{c} | " + "".join(f"{c} vs {o} | " for o in timed) + f"{c} err vs eager"
                                              for c in comps) + " | set-up | peak RSS |"
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]

    def ratio(r):
        return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    def err(e):
        return "-" if e is None else f"{e:.1e}"

    for runtime, row in report["rows"].items():
        if "reason" in row:
            lines.append(f"| {runtime} | n/a: {row['reason']} |" + " |" * (columns - 2))
            continue
        cells = [f"{row[c]['median_s']:.3f} s | " + "".join(f"{ratio(row[c]['vs'][o])} | " for o in timed)
                 + err(row[c]["max_rel_err_vs_eager"]) for c in comps]
        lines.append(f"| {runtime} | {row['dtype']} | " + " | ".join(cells) +
                     f" | {row['setup_s']:.0f} s | {row['peak_rss_gib']:.2f} GiB |")
    return "\n".join(lines)


def render(result: dict) -> str:
    """docs/benchmarks.md's table of a results file (--json)."""
    line = (f"OpenVINO {result.get('openvino') or 'not installed'}; {result['spec']['rounds']} rounds; "
            f"`{result.get('command', 'python -m bench.cpu_runtimes')}`.")
    return markdown(result) + "\n\n" + line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="full", help="pyext.offline size of sd15 (tiny for a smoke run)")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="threads per runtime (0: torch's default)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES))
    p.add_argument("--components", default=",".join(COMPONENTS))
    p.add_argument("--out", default="bench_out/cpu_runtimes")
    p.add_argument("--json", help="also write a results file (machine, versions, commit) here")
    a = p.parse_args(argv)
    spec = {"size": a.size, "height": a.height, "width": a.width, "rounds": a.rounds, "threads": a.threads,
            "runtimes": a.runtimes.split(","), "components": a.components.split(",")}
    for name, known in (("runtimes", RUNTIMES), ("components", COMPONENTS)):
        bad = [v for v in spec[name] if v not in known and (name == "components" or pyext_options(v) is None)]
        if bad:
            raise SystemExit(f"bench.cpu_runtimes: unknown {name} {bad}; known: {', '.join(known)}")
    report = run(spec)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cpu_runtimes.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(a.out, "cpu_runtimes.md"), "w") as f:
        f.write(markdown(report) + "\n")
    print(markdown(report))
    if a.json:
        from bench.latency import save_results

        try:
            ov = openvino_version()
        except ImportError:
            ov = None
        save_results("cpu_runtimes", "cpu", a.json, **report, openvino=ov,
                     command="python -m bench.cpu_runtimes " + " ".join(argv if argv is not None else sys.argv[1:]))
    return report


if __name__ == "__main__":
    main()
