# `make test` and `make bench` do all set-up on a fresh machine: a .venv that
# reuses the interpreter's torch if it has one (else torch==2.13.0), the
# dependencies, and an in-place build of pyext._C without build isolation.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export MAX_JOBS ?= 2

.PHONY: all venv build test test-fast bench bench-kernels gpu-check info clean

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

test: build
	$(PY) -m pytest -q tests

bench: build
	$(PY) -m bench.run

bench-kernels: build
	$(PY) -m bench.kernels

info: build
	$(PY) -m pyext info

# On a CUDA machine without network: wheels from .whl/ (see bench/gpu_check.sh), build, GPU tests, gpu bench preset.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf build pyext/_C*.so pyext/_build_info.py $(VENV)/.built
