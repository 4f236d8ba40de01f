"""Builds pyext and its extension pyext._C.

CPU kernels are always built; CUDA kernels when torch has CUDA and nvcc is found.
Environment switches:
  PYEXT_SKIP_BUILD=1   install the pure-Python package only (reference backends)
  PYEXT_FORCE_CPU=1    do not build CUDA kernels even where possible
  MAX_JOBS, TORCH_CUDA_ARCH_LIST   honoured as by torch.utils.cpp_extension
Install without build isolation so pip never pulls another torch:
  pip install --no-build-isolation .
"""
import glob
import os
import platform
import shutil
import subprocess

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _set_cuda_home():
    """With no CUDA_HOME set, torch takes the folder above the `nvcc` on the PATH, which is wrong
    when that nvcc is a link or a script calling the toolkit's (/usr/local/bin/nvcc): the build then
    finds no CUDA headers. nvcc names its toolkit's folder itself (TOP in its dry run). Runs before
    torch reads the variable."""
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or nvcc is None:
        return
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in (dry.stdout + dry.stderr).splitlines():
        if line.startswith("#$ TOP="):
            home = os.path.realpath(line[len("#$ TOP="):].strip())
            if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
                os.environ["CUDA_HOME"] = home
            return


def _cuda_reason(torch):
    """None when the CUDA kernels can be built, else why not."""
    if _flag("PYEXT_FORCE_CPU"):
        return "PYEXT_FORCE_CPU is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which("nvcc") is None and not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return "nvcc not found"
    return None


def _write_build_info(torch, with_cuda, cuda_reason):
    info = {
        "built": True,
        "torch": torch.__version__,
        "cuda": with_cuda,
        "cuda_reason": cuda_reason or "",
        "cuda_version": torch.version.cuda or "",
        "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", "torch default") if with_cuda else "",
        "cpu_simd_units": ["scalar", "avx2", "avx512"] if platform.machine() in ("x86_64", "AMD64") else ["scalar"],
        "machine": platform.machine(),
    }
    with open(os.path.join(ROOT, "pyext", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py at build time.\nBUILD_INFO = " + repr(info) + "\n")


def _sources():
    """(CPU sources, CUDA-only sources): csrc/module.cpp and every op family's folder csrc/<family>/,
    so a new family builds with no edit here. A family's *.cpp are CPU sources (SIMD units pick their
    ISA with `#pragma GCC target`) except its *_cuda_glue.cpp, the torch side of its CUDA kernels,
    which like its *.cu needs CUDA torch."""
    cpp = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*/*.cpp"))
    cuda_glue = [s for s in cpp if s.endswith("_cuda_glue.cpp")]
    return [s for s in cpp if s not in cuda_glue], sorted(glob.glob("csrc/*/*.cu")) + cuda_glue


def _extensions():
    if _flag("PYEXT_SKIP_BUILD"):
        return [], {}
    _set_cuda_home()
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpu_sources, cuda_sources = _sources()
    cuda_reason = _cuda_reason(torch)
    with_cuda = cuda_reason is None
    # -fopenmp: at::parallel_for is inline and needs OpenMP to run in parallel; the
    # runtime resolves to the libgomp torch already loaded (same soname).
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wno-unused-parameter"]
    kwargs = dict(extra_link_args=["-fopenmp"], include_dirs=[os.path.join(ROOT, "csrc")])
    if with_cuda:
        ext = CUDAExtension(
            "pyext._C", cpu_sources + cuda_sources,
            extra_compile_args={"cxx": cxx + ["-DPYEXT_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17", "-DPYEXT_WITH_CUDA"]},
            **kwargs,
        )
    else:
        ext = CppExtension("pyext._C", cpu_sources, extra_compile_args={"cxx": cxx}, **kwargs)
    _write_build_info(torch, with_cuda, cuda_reason)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


# Guarded so that tests can load the helpers above; pip runs this file as __main__ too.
if __name__ == "__main__":
    ext_modules, cmdclass = _extensions()

    setup(
        name="pyext",
        version="0.1.0",
        description="Compiled kernels and a one-call optimizer for Hugging Face diffusers pipelines",
        packages=find_packages(include=["pyext", "pyext.*"]),
        package_data={"pyext": ["configs/*.json"]},
        python_requires=">=3.10",
        install_requires=["torch>=2.4", "diffusers>=0.32", "accelerate", "transformers", "safetensors"],
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
