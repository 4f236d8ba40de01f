"""pyext.optimize with diffusers' context parallelism (Ulysses), in 2 gloo processes on the CPU.

`bench.parallel` under torchrun: each rank builds the same tiny pipeline, turns on
`enable_parallelism` with Ulysses-2, and calls `pyext.optimize` before it on one copy and after
it on another. Rank 0's images must equal the single-process plain pipeline's, and on every rank
pyext's op must have computed the attention (no call left to torch).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAME = 1e-4  # images in [0, 1]: the sequence split changes only the order of fp32 sums


# Families that declare their sharding (`_cp_plan`) and whose tiny pipelines plain diffusers
# runs with Ulysses-2 here (LTX's text mask and Qwen-Image's odd text length fail there too).
@pytest.mark.parametrize("arch", ["flux", "wan21"])
def test_ulysses_with_optimize_before_or_after_equals_one_process(arch, tmp_path):
    out = tmp_path / "parallel.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "bench.parallel", "--arch", arch, "--orders", "before,after", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and set(result["orders"]) == {"before", "after"}
    for order, row in result["orders"].items():
        assert row["max_abs_diff"] <= SAME, (order, row)
    assert sorted((r["rank"], r["order"]) for r in result["ranks"]) == \
        [(0, "after"), (0, "before"), (1, "after"), (1, "before")]
    for row in result["ranks"]:
        assert row["pyext_calls"] > 0 and row["torch_calls"] == 0 and row["seconds"] > 0, row
