"""bench.video end to end on the tiny preset (all rows, seconds on a CPU)."""
import json
import os
import subprocess
import sys

import pytest

from bench import video
from tests.test_bench import assert_rows_well_formed

pytestmark = pytest.mark.slow  # make test runs it; make test-fast leaves it out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_preset_reports_every_row(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.video", "--preset", "tiny", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=300, stdout=subprocess.DEVNULL)
    report = json.loads((tmp_path / "video.json").read_text())
    rows = report["rows"]
    assert list(rows) == list(video.ROWS)
    assert_rows_well_formed(rows)
    for name in ("original", "bf16", "diffusers_layerwise_fp8", "pyext_fp8"):  # nothing here may be missing
        assert "latency_s" in rows[name], (name, rows[name])
    # bf16 halves the text encoder and transformer (the VAE decodes in fp32; "about": the transformer's
    # small float64 buffers become bf16 too).
    cast = {name: row["component_weight_bytes"]["text_encoder"] + row["component_weight_bytes"]["transformer"]
            for name, row in rows.items() if "latency_s" in row}
    assert cast["bf16"] == pytest.approx(cast["original"] / 2, rel=0.05)
    # fp8 shrinks the transformer below the same pipeline without it
    for name, base in (("diffusers_layerwise_fp8", "bf16"), ("pyext_fp8", "bf16"),
                       ("pyext_optimize_fp8", "pyext_optimize")):
        if "latency_s" in rows[name] and "latency_s" in rows[base]:
            assert (rows[name]["component_weight_bytes"]["transformer"]
                    < rows[base]["component_weight_bytes"]["transformer"]), name
            assert rows[name]["weight_bytes"] < rows[base]["weight_bytes"], name
    assert rows["original"]["psnr_db"] == float("inf")  # the reference against itself
    assert report["unrelated_psnr_db"] < report["min_psnr_db"]  # the threshold separates unrelated videos
    md = (tmp_path / "video.md").read_text()
    assert "random" in md
    for name in video.ROWS:
        assert f"| {name} |" in md
