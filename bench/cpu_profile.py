"""Where the SD1.5 UNet step's or VAE decode's time goes on a CPU: pyext against OpenVINO.

    python -m bench.cpu_profile [--component unet|vae] [--runtime pyext|pyext_fp8|pyext_compile|eager|openvino]
                                [--calls 3] [--size full]

The same modules and inputs as bench.cpu_runtimes. pyext: `pyext.optimize(pipe)`, then torch's
profiler over `--calls` calls, its ops grouped by name, and the time between ops (the span of the
calls less the union of the ops' intervals: Python); pyext_fp8, pyext_compile: the same with
bench.cpu_runtimes' options for them, where the kernels inductor generates are the
"## Call CompiledFxGraph" entries' own time, not counted between ops; eager: the same for the
diffusers modules as loaded, in the dtype pyext would choose. OpenVINO: its per-node counters
(PERF_COUNT), grouped by node type and kernel. Times are per call. One runtime per process (run
it twice), so the two are not interleaved: compare the shares, not small differences.
"""
from __future__ import annotations

import argparse
import collections
import warnings

import torch


def _inputs(component: str, size: str):
    from bench.cpu_runtimes import Decode, UNetStep, example_inputs
    from pyext import offline

    pipe = offline.build_pipeline("sd15", size)
    unet_args, vae_args = example_inputs(pipe, 256, 256)
    make = (lambda: UNetStep(pipe.unet).eval()) if component == "unet" else (lambda: Decode(pipe.vae).eval())
    return pipe, make, unet_args if component == "unet" else vae_args


def profile_torch(component: str, calls: int, size: str = "full", optimize: dict | None = None) -> dict:
    """{op name: ms per call} of torch's profiler, with "(between ops)" and "(wall)": after
    `pyext.optimize(pipe, **optimize)`, or (optimize None) the modules as loaded, in the dtype it
    would choose."""
    import time

    import pyext
    from pyext import _compat
    from pyext.decision import auto_dtype

    pipe, make, args = _inputs(component, size)
    if optimize is not None:
        pyext.optimize(pipe, height=256, width=256, **optimize)
    else:
        pipe.to(auto_dtype(torch.device("cpu")))
    module, dtype = make(), pipe.unet.dtype
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        for _ in range(2):
            module(*args)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                module(*args)
            wall = time.perf_counter() - start
    per = {e.key: e.self_cpu_time_total / 1e3 / calls for e in prof.key_averages()}
    spans = sorted((e.start_ns(), e.end_ns()) for e in _compat.profiler_events(prof)
                   if e.name().startswith(("aten::", "mkldnn::", "pyext")))
    busy, begin, end = 0, *spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, begin = busy + end - begin, s
        end = max(end, e)
    busy += end - begin
    generated = sum(ms for name, ms in per.items() if name.startswith("## Call CompiledFxGraph"))
    per["(between ops)"] = ((spans[-1][1] - spans[0][0]) - busy) / 1e6 / calls - generated
    per["(wall)"] = wall * 1e3 / calls
    return per


def profile_openvino(component: str, calls: int, size: str = "full") -> dict:
    """{"node type, kernel": ms per call} from OpenVINO's per-node counters, with "(wall)"."""
    import time

    import openvino as ov

    from pyext._compat import cpu_has_native_bf16

    pipe, make, args = _inputs(component, size)
    config = {"INFERENCE_PRECISION_HINT": "bf16" if cpu_has_native_bf16() else "f32", "PERF_COUNT": True}
    with torch.no_grad():
        compiled = ov.Core().compile_model(ov.convert_model(make(), example_input=args), "CPU", config)
    request, inputs = compiled.create_infer_request(), [a.numpy() for a in args]
    for _ in range(2):
        request.infer(inputs)
    per, wall = collections.Counter(), 0.0
    for _ in range(calls):
        start = time.perf_counter()
        request.infer(inputs)
        wall += time.perf_counter() - start
        for node in request.profiling_info:
            per[f"{node.node_type}, {node.exec_type}"] += node.real_time.total_seconds() * 1e3 / calls
    return dict(per, **{"(wall)": wall * 1e3 / calls})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--component", choices=["unet", "vae"], default="unet")
    from bench.cpu_runtimes import PYEXT_OPTIONS, pyext_options

    p.add_argument("--runtime", default="pyext", help=f"{', '.join(PYEXT_OPTIONS)} (each with any `:option=value` "
                                                      "pairs, as in bench.cpu_runtimes), eager or openvino")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--size", default="full", help="pyext.offline size of sd15 (tiny for a smoke run)")
    args = p.parse_args(argv)
    if args.runtime not in ("eager", "openvino") and pyext_options(args.runtime) is None:
        p.error(f"unknown runtime {args.runtime!r}")
    warnings.filterwarnings("ignore")
    if args.runtime == "openvino":
        per = profile_openvino(args.component, args.calls, args.size)
    else:
        per = profile_torch(args.component, args.calls, args.size, optimize=pyext_options(args.runtime))
    print(f"{args.runtime}, sd15 {args.component}, 256x256, ms per call:")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {ms:9.2f}  {name}")


if __name__ == "__main__":
    main()
