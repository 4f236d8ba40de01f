# `make test` and `make bench` do all set-up on a fresh machine: a .venv that
# reuses the interpreter's torch if it has one (else torch==2.13.0), the
# dependencies, and an in-place build of pyext._C without build isolation.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export MAX_JOBS ?= 2

.PHONY: all venv build test test-fast bench bench-kernels gpu-check gpu-wheels kernels info clean fuzz

all: build

$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps

# The stamp depends on every source so an edit rebuilds; ninja rebuilds only what changed.
$(VENV)/.built: $(VENV)/.deps setup.py $(shell find csrc -type f 2>/dev/null)
	$(PY) setup.py -q build_ext --inplace
	touch $@

build: $(VENV)/.built

# One pytest-xdist worker per core, each computing on one thread (tests/conftest.py); a module's
# tests stay on one worker, so its fixtures are made once, but for modules marked independent.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test: build
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

# What to run on every change, in about two minutes on 2 cores: options, dispatch (every backend on
# its declared cases, bad inputs, host reads), checkpoints, the fp8 layers, fused norms, upsampling
# phases, the CPU kernels' own tests but attention's and fp8's larger sweeps; none of the tests
# marked slow.
FAST_TESTS := options plan dispatch dispatch_poisoning host_reads checkpoint fp8_modules fp8_conv fused_norm geglu \
              upsample_phases \
              group_moments winograd block_pool gpu_check repository_words
test-fast: build
	$(PY) -m pytest -q -x -m "not slow" $(FAST_TESTS:%=tests/test_%.py)

# The peers the latency table compares pyext with; torch pinned to the installed one, so that pip
# fails rather than replace it.
$(VENV)/.bench-deps: $(VENV)/.deps requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@

# ARCH=sdxl or ARCH=flux: the same rows at the anchors' workloads (opt-in; bench/latency.py ARCH_PRESETS).
# ROWS=a,b: those rows only, also the ones a preset leaves out of its default run (Preset.opt_in).
ARCH ?= sd15
ROWS ?=
bench: build $(VENV)/.bench-deps
	$(PY) -m bench.run --model-arch $(ARCH) $(if $(ROWS),--rows $(ROWS))

bench-kernels: build
	$(PY) -m bench.kernels

info: build
	$(PY) -m pyext info

# Random differential tests of every op against its reference and a float64 oracle
# (tests/fuzz_cases.py): FUZZ_CASES per op with a new seed each run (FUZZ_SEED=n replays
# a run); prints the counts and a minimal repro for every kind of failure.
FUZZ_CASES ?= 1000
fuzz: build
	$(PY) -m tests.fuzz_cases --cases $(FUZZ_CASES) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# Every GPU kernel config compiled for sm_80/sm_90 here, without a GPU (registers, spills, shared memory).
kernels: build
	$(PY) -m pyext kernels --everything

# On a CUDA machine without network, in one call sized for a short lease: wheels from .whl/, build,
# the CUDA tests, dispatch overhead, kernel benches, the SD1.5 rows (bench/gpu_check.py);
# STAGE=flux: Flux end to end, in a call of its own.
STAGE ?= sd15
gpu-check:
	MAX_JOBS=$$(nproc) $(PYTHON) -m bench.gpu_check --stage $(STAGE)

# On a machine with network: what the GPU machine lacks (diffusers and its one missing dependency,
# and torchao for the Flux stage's peer row; it has torch, triton, transformers, accelerate and
# pytest), for Python 3.12, into .whl/.
GPU_PLATFORMS := $(foreach n,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(n)_x86_64)
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl "diffusers==$$($(PY) -c 'import diffusers; print(diffusers.__version__)')" importlib_metadata \
		"$$(grep '^torchao==' requirements-bench.txt)"
	du -sh .whl

clean:
	rm -rf build pyext/_C*.so pyext/_build_info.py $(VENV)/.built
