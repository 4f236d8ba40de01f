"""The build: the CUDA glue compiles, CMake builds csrc/, the package works without _C (the CUDA
kernels themselves are compiled for sm_80/sm_90 in tests/test_kernels_compile.py)."""
import glob
import json
import os
import runpy
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
GLUE_FILES = sorted(glob.glob(os.path.join(CSRC, "*", "*_cuda_glue.cpp")))
TORCH_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include")


@pytest.fixture
def cuda_home(monkeypatch):
    """The CUDA toolkit setup.py builds against when the user sets no CUDA_HOME."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup_helpers")["_set_cuda_home"]()
    return os.environ.get("CUDA_HOME")


def test_setup_finds_the_toolkit_of_the_nvcc_on_the_path(cuda_home):
    """torch's own guess (the folder above `which nvcc`) has no headers where nvcc is a link or a
    wrapper script; setup.py asks nvcc, and gets the folder whose compiler and headers match."""
    assert cuda_home is not None
    assert os.path.exists(os.path.join(cuda_home, "include", "cuda_runtime_api.h"))
    ours = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True)
    on_path = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
    assert ours.stdout.splitlines()[-1] == on_path.stdout.splitlines()[-1]


@pytest.mark.parametrize("glue", GLUE_FILES, ids=os.path.basename)
def test_cuda_glue_compiles_against_torch_headers(glue, cuda_home):
    """The torch side of the CUDA kernels uses only device-generic c10 APIs, so it compiles here."""
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-w", f"-I{TORCH_INCLUDE}",
           f"-I{os.path.join(TORCH_INCLUDE, 'torch', 'csrc', 'api', 'include')}",
           f"-I{os.path.join(cuda_home, 'include')}", f"-I{CSRC}", glue]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found")
def test_cmake_configures_and_builds(tmp_path):
    build = tmp_path / "build"
    # Unoptimised: this checks the build, not the kernels (the package's own build is -O3).
    cfg = subprocess.run(["cmake", "-S", ROOT, "-B", str(build), "-DPYEXT_OPT=-O0",
                          f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                          f"-DPython3_EXECUTABLE={sys.executable}"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout[-2000:] + cfg.stderr[-2000:]
    jobs = os.environ.get("MAX_JOBS", "2")
    bld = subprocess.run(["cmake", "--build", str(build), "-j", jobs], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout[-3000:] + bld.stderr[-3000:]
    built = glob.glob(str(build / "_C*.so"))
    assert built, os.listdir(build)
    # the CMake-built library registers the same kernels
    check = subprocess.run([sys.executable, "-c", f"import torch; torch.ops.load_library({built[0]!r}); "
                            "print(torch.ops.pyext_C.fp8_upcast_out)"], capture_output=True, text=True)
    assert check.returncode == 0 and "fp8_upcast_out" in check.stdout, check.stderr[-2000:]


NO_EXT = textwrap.dedent("""
    import sys, warnings, json
    class Block:  # makes `import pyext._C` fail as if the extension were not built
        def find_spec(self, name, path=None, target=None):
            if name == "pyext._C":
                raise ImportError("blocked for the test")
    sys.meta_path.insert(0, Block())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import pyext
    import torch
    from pyext.ops import fp8_quantize, fp8_upcast, fp8_linear
    from pyext import dispatch
    w, s = fp8_quantize(torch.randn(8, 16))
    y = fp8_linear(torch.randn(2, 16), w, s)
    chosen = dispatch.select("fp8_upcast", (w.view(torch.uint8), s, torch.empty(8, 16)), None).name
    print(json.dumps(dict(warned=[str(c.message) for c in caught], chosen=chosen, ok=bool(torch.isfinite(y).all()))))
""")


def test_package_works_without_extension():
    proc = subprocess.run([sys.executable, "-c", NO_EXT], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["chosen"] == "reference" and out["ok"]
    assert any("pyext._C could not be imported" in w for w in out["warned"])


def test_import_does_not_initialise_cuda():
    code = "import pyext, torch, sys; print(torch.cuda.is_initialized())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


@pytest.mark.slow
def test_info_lists_every_backend_with_reason():
    proc = subprocess.run([sys.executable, "-m", "pyext", "info", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    from pyext import dispatch

    for op, rows in info["ops"]["cpu"].items():
        assert [r["backend"] for r in rows] == [b.name for b in dispatch.ops()[op].backends]
        for row in rows:
            assert row["available"] or row["reason"], row  # every unavailable backend says why
    assert info["build"].get("built") in (True, False)


def test_info_prints_every_op(capsys):
    from pyext import __main__ as cli

    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "fp8_linear" in text and "reference" in text
