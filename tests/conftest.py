import atexit
import os
import shutil
import tempfile

import pytest
import torch

from pyext._ext import EXT

# Dispatch's choices and marks go to a directory of this test run's own, never to the user's
# (~/.cache/pyext): tests register made-up broken backends on purpose. Subprocesses (the xdist
# workers among them) inherit it; the process that made it removes it when it exits.
if "PYEXT_CACHE_DIR" not in os.environ:
    os.environ["PYEXT_CACHE_DIR"] = tempfile.mkdtemp(prefix="pyext_test_dispatch_")
    atexit.register(shutil.rmtree, os.environ["PYEXT_CACHE_DIR"], ignore_errors=True)

# The suite dispatches in the static order, the same on every machine, so that each test takes
# the path it names: measured dispatch (the default) would pick by timings on a busy machine.
# Tests of measured dispatch set it themselves; tests of backends force them by name.
os.environ.setdefault("PYEXT_DISPATCH", "static")

# Under pytest-xdist (`make test` runs one worker per core), each worker computes on one thread:
# workers with torch's default of a thread per core would oversubscribe the cores, and OpenMP's
# waiting threads spin. Tests of threaded code set the thread counts they need themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the tests' subprocesses
    os.environ["BENCH_THREADS"] = "1"  # the VAE bench's children, which set their own count


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    """Modules with tests marked slow first, each module's tests kept together and in order (one
    xdist group per module, for `make test`'s --dist loadgroup), so module fixtures are made once;
    a module marked `independent` has its tests spread over the workers one by one. With several
    workers the long ones then overlap the many short ones instead of running alone at the end."""
    slow = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in slow)
    for item in items:
        if item.get_closest_marker("independent") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


SIMD_LEVELS = ["scalar", "avx2", "avx512"]


@pytest.fixture(params=SIMD_LEVELS)
def simd(request, monkeypatch):
    """Runs a test at each CPU SIMD level the machine has (the C++ kernels read PYEXT_CPU_SIMD per call)."""
    if EXT is None:
        pytest.skip("pyext._C is not built")
    if request.param not in EXT.cpu_capabilities():
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("PYEXT_CPU_SIMD", request.param)
    return request.param


needs_ext = pytest.mark.skipif(EXT is None, reason="pyext._C is not built")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_ranks(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes, as torch.multiprocessing.spawn runs it, but forked from
    a server that imported torch, diffusers and pyext once: a spawned process imports them again,
    which costs seconds each."""
    from bench.latency import preloaded_forkserver

    preloaded_forkserver(["torch", "diffusers", "pyext"])
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def run_in_triton_interpreter(script: str, timeout: int = 900) -> dict:
    """Runs `script` in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before triton is
    imported, and other test modules may have imported it already); returns the JSON of its last line."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    broken = _interpreter_problem()
    if broken:
        pytest.skip(broken)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PROBE = """
import triton, triton.language as tl, torch
@triton.jit
def k(x, n, B: tl.constexpr):
    for i in range(0, n, B):
        tl.store(x + i + tl.arange(0, B), tl.arange(0, B))
x = torch.zeros(8, dtype=torch.int32)
k[(1,)](x, 8, B=4)
"""
_INTERPRETER_PROBLEM = []


def _interpreter_problem() -> str:
    """Why this Triton's interpreter cannot run a loop over a runtime int here, or "" when it can.
    (Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy 2.4+ refuses.)"""
    import os
    import subprocess
    import sys

    if not _INTERPRETER_PROBLEM:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
        import numpy
        import triton
        _INTERPRETER_PROBLEM.append("" if proc.returncode == 0 else
                                    f"Triton {triton.__version__}'s interpreter fails here (NumPy {numpy.__version__}): "
                                    + proc.stderr.strip().splitlines()[-1][:200])
    return _INTERPRETER_PROBLEM[0]
