#!/usr/bin/env bash
# One-call GPU validation for a CUDA machine without network (`make gpu-check`):
#   1. installs wheels from a local folder if there is one (WHEELS, default .whl/), never from the network;
#   2. builds pyext._C with its CUDA kernels, in place, without build isolation (keeps the machine's torch);
#   3. runs the test suite, the latency table (preset gpu) and the kernel benchmarks;
#   4. leaves every log and result in one folder: $OUT if set, else gpu_check_out/.
# It does not stop at the first failure: each step's exit code is in $DEST/status.txt and the
# script exits non-zero if any step failed.
# Steps: wheels info build tests latency kernels. Arguments pick some of them, in that order, e.g.
#   bash bench/gpu_check.sh wheels build tests     # then, in a later call on the same machine:
#   bash bench/gpu_check.sh latency kernels        # (where one call has a time limit)
#
# Fetch the wheels beforehand on a machine with network (same Python minor as the GPU machine;
# torch is NOT included: the GPU machine's own CUDA torch is used):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
#       -d .whl diffusers transformers accelerate safetensors huggingface_hub tokenizers regex \
#       tqdm matplotlib pytest ninja filelock fsspec packaging pyyaml requests numpy pillow \
#       importlib_metadata zipp jinja2 markupsafe contourpy cycler fonttools kiwisolver pyparsing \
#       python-dateutil six iniconfig pluggy hf-xet typing_extensions psutil
#   (pip download resolves each package's own dependencies too; add --no-deps to fetch only these.)
set -u
cd "$(dirname "$0")/.."
DEST="${OUT:-gpu_check_out}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
touch "$DEST/status.txt"  # appended to: split runs keep one record
failed=0

WANT=" ${*:-wheels info build tests latency kernels} "
wanted() { [[ "$WANT" == *" $1 "* ]]; }

step() {  # step NAME CMD...: runs CMD, output to $DEST/NAME.log, records the exit code
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$DEST/$name.log" 2>&1
    local rc=$?
    echo "$name $rc" >> "$DEST/status.txt"
    [ $rc -eq 0 ] || { failed=1; echo "   $name FAILED (rc $rc), see $DEST/$name.log"; tail -5 "$DEST/$name.log"; }
}

if wanted wheels && [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    step install_wheels "$PY" -m pip install --no-index --find-links "$WHEELS" \
        diffusers transformers accelerate safetensors tqdm matplotlib pytest ninja
fi
wanted info && step info_before "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
wanted info && { nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || true; }
wanted build && step build env MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py build_ext --inplace
wanted build && step pyext_info "$PY" -m pyext info
wanted tests && step tests "$PY" -m pytest -q --junitxml="$DEST/tests.xml" tests
wanted latency && step latency "$PY" -m bench.latency --preset gpu --out "$DEST/latency"
wanted kernels && step kernels "$PY" -m bench.kernels --json "$DEST/kernels.json"
cat "$DEST/status.txt"
exit $failed
