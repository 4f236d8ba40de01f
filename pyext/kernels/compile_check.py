"""Compile every GPU kernel for sm_80 and sm_90 on a machine without a GPU (`python -m pyext kernels`).

Triton kernels: every candidate config of every kernel variant goes through `triton.compile`
with a `GPUTarget` (Triton's own LLVM and the ptxas shipped in its wheel); Triton's ptxas log
(`-v`) gives registers and spills, its metadata the shared memory. CUDA C++ kernels: each csrc .cu file is compiled by nvcc with
`-Xptxas -v`. One entry per kernel, variant, config and arch; tests/test_kernels_compile.py
asserts that all compile, that no default spills and that shared memory fits each arch.
Integer arguments are compiled as plain i32 (launches may specialise strides of 1 or multiples
of 16, which only lowers register use).
"""
from __future__ import annotations

import contextlib
import glob
import itertools
import io
import multiprocessing
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from pyext.kernels import Config

ARCHS = (80, 90)
# Largest dynamic shared memory one block may opt into: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Spec:
    """One compilable instance of a Triton kernel."""

    module: str  # "pyext.kernels.attention"
    function: str  # "_attention_fwd"
    variant: str  # "fp16 d64"
    config: Config
    default: bool
    signature: dict
    constexprs: dict


HEAD_DIMS = (40, 64, 72, 80, 96, 128, 160, 256)  # what diffusers' models use, and the kernel's limit
WIDEST = (64, 96, 128, 160, 256)  # per config class of attention.configs, the head dim with most registers


def triton_specs(everything: bool = False) -> list[Spec]:
    """Candidate configs of the Triton kernels. everything=True: every config of every head dim
    and dtype the op takes, for attention with and without each of bias, lse and grouped k/v heads.
    Otherwise (the CI test, about a ninth of the compiles): attention's fp16 defaults at every head dim
    (spills depend on the head dim's parts) and fp32's at the widest head dim of each config class,
    plain and with all three (the most registers, and every feature's code), and with lse and grouped
    heads where that default differs from the one with all three; every fp16 config
    plain at the widest head dims; bf16 compiles to the same registers as fp16. GroupNorm:
    the stats and apply kernels' fp16 and fp32 defaults in both layouts and every fp16
    channels-last config (the more index math), the merge once (it reads float32 moments only). The
    fp8 row quantization: every config, for bfloat16, the one dtype its op takes. GEGLU: every fp16
    config and each other dtype's default."""
    from pyext.kernels import attention, fp8_linear, fp8_quantize_rows, geglu, group_norm

    def spec(module, function, variant, cfg, default, sig_const):
        return Spec(module.__name__, function, variant, cfg, default, *sig_const)

    specs = []
    for dtype, short in DTYPES.items():
        if dtype == torch.bfloat16 and not everything:
            continue
        for d in HEAD_DIMS:
            if not everything and dtype == torch.float32 and d not in WIDEST:
                continue
            widest = d in WIDEST and dtype == torch.float16
            # where the default without a bias is not the one with every feature, it is compiled
            # with the other two features as well
            own_default = attention.configs(d, dtype, False, True)[0] != attention.configs(d, dtype, True, True)[0]
            for bias, lse, gqa in itertools.product((False, True), repeat=3):
                candidates = attention.configs(d, dtype, bias, lse)
                if everything or (widest and not (bias or lse or gqa)):
                    chosen = candidates
                elif bias == lse == gqa or (lse and gqa and not bias and own_default):
                    chosen = candidates[:1]  # the default only
                else:
                    continue
                variant = f"{short} d{d}" + " bias" * bias + " lse" * lse + " gqa" * gqa
                for i, cfg in enumerate(chosen):
                    specs.append(spec(attention, "_attention_fwd", variant, cfg, i == 0,
                                      attention.signature(dtype, d, cfg, bias, lse, gqa)))
        if dtype == torch.float32:
            continue  # the fp8 kernel takes 16-bit activations only
        for rows, m in (("small_m", 64), ("large_m", 65)):
            for i, cfg in enumerate(fp8_linear.configs(m)):
                specs.append(spec(fp8_linear, "_fp8_linear_kernel", f"{short} {rows}", cfg, i == 0,
                                  fp8_linear.signature(dtype, cfg)))
    candidates = group_norm.configs()
    for dtype, short in DTYPES.items():
        if dtype == torch.bfloat16 and not everything:
            continue
        for channels_last in (False, True):
            every = everything or (dtype == torch.float16 and channels_last)
            for function in ("_gn_stats", "_gn_apply"):
                for i, cfg in enumerate(candidates if every else candidates[:1]):
                    specs.append(spec(group_norm, function, f"{short} {'cl' if channels_last else 'cf'}", cfg, i == 0,
                                      group_norm.signature(function, dtype, cfg, channels_last)))
    merge = group_norm.MERGE_CONFIG
    specs.append(spec(group_norm, "_gn_merge", "fp64", merge, True,
                      group_norm.signature("_gn_merge", torch.float32, merge, False)))
    for dtype, short in DTYPES.items():
        for i, cfg in enumerate(geglu.configs() if everything or dtype == torch.float16 else geglu.configs()[:1]):
            specs.append(spec(geglu, "_geglu_kernel", short, cfg, i == 0, geglu.signature(dtype, cfg)))
    for i, cfg in enumerate(fp8_quantize_rows.configs()):  # its op takes bfloat16 activations only
        specs.append(spec(fp8_quantize_rows, "_quantize_rows_kernel", "bf16", cfg, i == 0,
                          fp8_quantize_rows.signature(torch.bfloat16, cfg)))
    return specs


_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def _usage(ptxas_log: str) -> dict:
    """Registers and spill bytes from a `ptxas -v` log of one kernel."""
    spills = _SPILLS.search(ptxas_log)
    return {"registers": int(_PTXAS_LINE.search(ptxas_log).group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0}


def compile_triton(spec: Spec, arch: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    entry = {"kernel": f"{spec.module}:{spec.function}", "kind": "triton", "arch": f"sm_{arch}",
             "variant": spec.variant, "config": spec.config.label, "default": spec.default,
             "signature": spec.signature, "constexprs": spec.constexprs,
             "num_warps": spec.config.num_warps, "num_stages": spec.config.num_stages,
             "compiled": False, "registers": None, "spill_bytes": None, "shared_bytes": None, "error": ""}
    try:
        fn = getattr(importlib.import_module(spec.module), spec.function)
        index = {name: i for i, name in enumerate(fn.arg_names)}
        source = ASTSource(fn, spec.signature, constexprs={(index[k],): v for k, v in spec.constexprs.items()})
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # Triton prints its own ptxas -v log (TRITON_DUMP_PTXAS_LOG)
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec.config.launch_options())
        if not _PTXAS_LINE.search(log.getvalue()):
            raise RuntimeError("Triton printed no ptxas log (a cached kernel?); run with a fresh TRITON_CACHE_DIR")
        entry.update(_usage(log.getvalue()), shared_bytes=int(kernel.metadata.shared), compiled=True)
    except Exception as err:  # reported per entry: one failing config must not hide the others
        entry["error"] = f"{type(err).__name__}: {err}"[:800]
    return entry


_NVCC_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")


def _readable(mangled: str) -> str:
    """`upcast_scalar<2>` for a mangled kernel name, where c++filt is there; else the name as is."""
    if shutil.which("c++filt") is None:
        return mangled
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    name = name.replace("(anonymous namespace)::", "").split("(")[0].removeprefix("void ")
    return name or mangled


def compile_cuda(source: str, arch: int) -> list[dict]:
    """One entry per kernel of a csrc .cu file, from nvcc -Xptxas -v."""
    base = {"kind": "cuda", "arch": f"sm_{arch}", "variant": "", "config": "as written", "default": True,
            "signature": {}, "constexprs": {}, "num_warps": None, "num_stages": None}
    name = os.path.relpath(source, os.path.dirname(CSRC))
    if shutil.which("nvcc") is None:
        return [dict(base, kernel=name, compiled=False, registers=None, spill_bytes=None, shared_bytes=None,
                     error="nvcc not found")]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["nvcc", "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                               "-Xptxas", "-v", f"-I{CSRC}", "-c", source, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return [dict(base, kernel=name, compiled=False, registers=None, spill_bytes=None, shared_bytes=None,
                     error=log[-800:])]
    entries = []
    for block in log.split("Compiling entry function")[1:]:
        function = _readable(_NVCC_FUNCTION.search("Compiling entry function" + block).group(1))
        regs, spills, smem = _PTXAS_LINE.search(block), _SPILLS.search(block), _SMEM.search(block)
        entries.append(dict(base, kernel=f"{name}:{function}", compiled=True, registers=int(regs.group(1)),
                            spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else 0,
                            shared_bytes=int(smem.group(1)) if smem else 0, error=""))
    return entries


def _triton_job(job):
    return compile_triton(*job)


def check_all(archs=ARCHS, everything: bool = False, jobs: int | None = None) -> list[dict]:
    """Entries for every Triton config and CUDA kernel on every arch, compiled in `jobs` processes.
    Triton compiles into an empty cache, so that its ptxas runs (and logs) for every entry."""
    work = [(spec, arch) for spec in triton_specs(everything) for arch in archs]
    jobs = jobs or max(1, min(len(os.sched_getaffinity(0)), 8))
    saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_DUMP_PTXAS_LOG")}
    with tempfile.TemporaryDirectory() as cache:
        os.environ.update(TRITON_CACHE_DIR=cache, TRITON_DUMP_PTXAS_LOG="1")  # the workers inherit them
        try:
            # Spawned, not forked: a fork of a process with threads (a test runner's, a pipeline's)
            # can copy a lock that another thread holds, and the worker then waits forever.
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                entries = list(pool.map(_triton_job, work))
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    for source in sorted(glob.glob(os.path.join(CSRC, "*", "*.cu"))):  # each op family's csrc/<family>/
        for arch in archs:
            entries += compile_cuda(source, arch)
    return entries


def problems(entries: list[dict]) -> list[str]:
    """What is wrong in a check: failed compiles, spilling defaults, shared memory over the arch's limit."""
    out = []
    for e in entries:
        where = f"{e['kernel']} {e['variant']} {e['config']} {e['arch']}"
        if not e["compiled"]:
            out.append(f"{where}: does not compile: {e['error']}")
            continue
        if e["default"] and e["spill_bytes"]:
            out.append(f"{where}: the default config spills {e['spill_bytes']} bytes")
        if e["shared_bytes"] > SHARED_LIMIT[int(e["arch"][3:])]:
            out.append(f"{where}: {e['shared_bytes']} bytes of shared memory exceed {e['arch']}'s limit")
    return out
