import pytest
import torch

from pyext._ext import EXT

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
