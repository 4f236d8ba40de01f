#!/usr/bin/env bash
# One-call GPU validation for a CUDA machine without network (`make gpu-check`):
#   1. installs the wheels of a local folder (WHEELS, default .whl/) whose packages this machine
#      lacks, into $SITE (default /tmp/pyext_site), never from the network;
#   2. builds pyext._C with its CUDA kernels, in place, without build isolation (keeps the machine's torch);
#   3. compiles every Triton config for sm_80/sm_90 (python -m pyext kernels), runs the test suite,
#      the latency table (preset gpu) and the kernel benchmarks, then shows dispatch's decisions;
#   4. leaves every log and result in one folder: $OUT if set, else gpu_check_out/.
# It does not stop at the first failure: each step's exit code is in $DEST/status.txt and the
# script exits non-zero if any step failed.
# Steps: wheels info build kernels_compile tests latency kernels dispatch. Arguments pick some of
# them, in that order, e.g. (where one call has a time limit):
#   bash bench/gpu_check.sh wheels build tests       # then, in a later call on the same machine:
#   bash bench/gpu_check.sh latency kernels dispatch
#
# The validation machine has torch 2.11 (CUDA 13), Triton 3.6, transformers, accelerate and pytest,
# but no diffusers: `make gpu-wheels` (on a machine with network) puts diffusers and what it needs
# beyond those into .whl/ (a few MiB).
set -u
cd "$(dirname "$0")/.."
DEST="${OUT:-gpu_check_out}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
touch "$DEST/status.txt"  # appended to: split runs keep one record
failed=0

WANT=" ${*:-wheels info build kernels_compile tests latency kernels dispatch} "
wanted() { [[ "$WANT" == *" $1 "* ]]; }

step() {  # step NAME CMD...: runs CMD, output to $DEST/NAME.log, records the exit code
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$DEST/$name.log" 2>&1
    local rc=$?
    echo "$name $rc" >> "$DEST/status.txt"
    [ $rc -eq 0 ] || { failed=1; echo "   $name FAILED (rc $rc), see $DEST/$name.log"; tail -5 "$DEST/$name.log"; }
}

SITE="${SITE:-/tmp/pyext_site}"
if wanted wheels && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    # Only the wheels whose distribution this machine lacks: its own torch, triton and others stay.
    missing=$("$PY" - "$WHEELS" <<'PYEOF'
import glob, importlib.metadata, os, sys
for wheel in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = os.path.basename(wheel).split("-")[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PYEOF
)
    if [ -n "$missing" ]; then
        step install_wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $missing
    fi
fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
wanted info && step info_before "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
wanted info && { nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || true; }
wanted build && step build env MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py build_ext --inplace
wanted build && step pyext_info "$PY" -m pyext info
wanted kernels_compile && step kernels_compile "$PY" -m pyext kernels
wanted tests && step tests "$PY" -m pytest -q --junitxml="$DEST/tests.xml" tests
wanted latency && step latency "$PY" -m bench.latency --preset gpu --out "$DEST/latency"
wanted kernels && step kernels "$PY" -m bench.kernels --json "$DEST/kernels.json"
wanted dispatch && step dispatch "$PY" -m pyext info   # measured choices and unusable backends, if any
cat "$DEST/status.txt"
exit $failed
