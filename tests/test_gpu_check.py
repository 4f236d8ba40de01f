"""make gpu-check's driver: its plan fits the lease, and a rerun skips what passed (run here on
its CPU-safe step)."""
import json
import subprocess
import sys

from bench import gpu_check


def test_the_plan_fits_six_minutes_and_names_every_part():
    plan = gpu_check.steps("out")
    assert sum(s.estimate_s for s in plan) <= 6 * 60
    assert [s.name for s in plan][:2] == ["wheels", "build"]
    assert {"tests", "sync_debug", "kernels", "latency", "dispatch_overhead"} <= {s.name for s in plan}


def test_a_rerun_skips_the_steps_that_passed(tmp_path):
    cmd = [sys.executable, "-m", "bench.gpu_check", "--only", "info", "--out", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=gpu_check.ROOT)
    assert first.returncode == 0, first.stdout + first.stderr
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["steps"]["info"]["rc"] == 0 and (tmp_path / "info.log").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=gpu_check.ROOT)
    assert "done, skipped" in again.stdout and "== info" not in again.stdout
