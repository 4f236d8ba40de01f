"""A user's bad input changes nothing that dispatch keeps: one process feeds every bad input of
the fuzz suite and the raw-op list (tests/bad_inputs.py) to every op, and a later process on the
same dispatch cache picks the same backends as before, with none marked unusable."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cache: str, *args: str) -> dict:
    env = dict(os.environ, PYEXT_CACHE_DIR=cache, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tests.bad_inputs", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bad_inputs_leave_every_backend_usable_for_later_processes(tmp_path):
    first = run(str(tmp_path), "feed")
    assert first["problems"] == {}  # every bad input was a PyextError naming its op
    assert first["unusable"] == []
    later = run(str(tmp_path))
    assert later["unusable"] == []
    assert later["choices"] == first["choices"]
    assert any(backend == "cpp" for backend in first["choices"].values())  # the fast backends were in play
