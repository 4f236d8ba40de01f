"""make gpu-check's driver: its plan fits the lease, and a rerun skips what passed (run here on
its CPU-safe step)."""
import json
import os
import sys

from bench import gpu_check
from tests.conftest import run_in_triton_interpreter


def test_the_plan_fits_its_budget_and_names_every_part():
    for stage in gpu_check.STAGES:
        plan = gpu_check.steps("out", stage)
        assert sum(s.estimate_s for s in plan) <= gpu_check.PLAN_S <= gpu_check.BUDGET_S
        assert [s.name for s in plan][:2] == ["wheels", "build"]
    assert {"tests", "kernels", "latency", "dispatch_overhead"} <= {s.name for s in gpu_check.steps("out")}
    assert [s.name for s in gpu_check.steps("out", "flux")][2:] == ["flux_latency"]


def test_the_flux_stage_runs_the_rows_it_names_each_planned_on_the_gpu_preset(tmp_path, monkeypatch, capsys):
    """The stage's bench call names the rows it has estimates for, each one a row the Flux gpu
    preset runs (none skipped), and the plan printed first gives every step's estimate."""
    from bench import latency

    step = gpu_check.steps("out", "flux")[-1]
    rows = step.command[step.command.index("--rows") + 1].split(",")
    assert rows == list(gpu_check.FLUX_ROWS_S) and step.estimate_s == sum(gpu_check.FLUX_ROWS_S.values())
    assert {"original", "pyext_optimize", "pyext_fp8_dynamic", "torch_compile", "torchao_fp8_dynamic"} == set(rows)
    preset = latency.preset_of("gpu", "flux")
    assert all(dict(preset.skip).get(row) is None for row in rows)
    monkeypatch.setenv("WHEELS", str(tmp_path / "no_wheels"))
    assert gpu_check.main(["--stage", "flux", "--only", "wheels", "--out", str(tmp_path / "out"),
                           "--resume", str(tmp_path / "none")]) == 0
    plan = capsys.readouterr().out
    assert "stage flux: 1 steps" in plan and "wheels" in plan


def test_a_rerun_skips_the_steps_that_passed_on_the_same_sources(tmp_path, capsys):
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    args = ["--only", "info"]
    assert gpu_check.main([*args, "--out", str(first_out), "--resume", str(tmp_path / "none")]) == 0
    record = json.loads((first_out / "gpu_check.json").read_text())
    assert record["steps"]["info"]["rc"] == 0 and "==== info" in (first_out / "gpu_check.log").read_text()
    capsys.readouterr()
    assert gpu_check.main([*args, "--out", str(second_out), "--resume", str(first_out)]) == 0
    again = capsys.readouterr().out
    assert "skipped" in again and "== info" not in again
    assert json.loads((second_out / "gpu_check.json").read_text())["steps"]["info"]["rc"] == 0


def test_each_step_measures_with_a_fresh_dispatch_cache(tmp_path, monkeypatch):
    """A step's dispatch decisions (and marks) never reach another step, or a rerun after a fix;
    they stay under the output folder with the results."""
    script = ("import os, sys; d = os.environ['PYEXT_CACHE_DIR']; assert not os.listdir(d); "
              "open(os.path.join(d, 'cpu.json'), 'w').write('{}'); open(sys.argv[1], 'w').write(d)")
    seen = [tmp_path / "a.txt", tmp_path / "b.txt"]
    monkeypatch.setattr(gpu_check, "steps", lambda out, stage: [
        gpu_check.Step(p.stem, 1, (sys.executable, "-c", script, str(p)), "writes into its cache") for p in seen])
    for _ in range(2):  # the second call reruns both steps (no --resume folder): each cache empty again
        assert gpu_check.main(["--out", str(tmp_path / "out"), "--resume", str(tmp_path / "none")]) == 0
    caches = [p.read_text() for p in seen]
    assert len(set(caches)) == 2 and all(os.path.isfile(os.path.join(c, "cpu.json")) for c in caches)
    assert all(os.path.commonpath([c, str(tmp_path / "out")]) == str(tmp_path / "out") for c in caches)


def test_the_sources_hash_follows_the_sources(tmp_path, monkeypatch):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "a.cpp").write_text("int a;")
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    before = gpu_check.sources_hash(["csrc"])
    (tmp_path / "csrc" / "a.so").write_text("built")
    assert gpu_check.sources_hash(["csrc"]) == before
    (tmp_path / "csrc" / "a.cpp").write_text("int b;")
    assert gpu_check.sources_hash(["csrc"]) != before


def test_a_step_past_its_limit_is_stopped_with_the_processes_it_started(tmp_path):
    import os
    import time

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        t = time.monotonic()
        assert gpu_check._run_step([sys.executable, "-c", script], dict(os.environ), log, timeout=3) == 124
    assert time.monotonic() - t < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild got SIGTERM with its group; give it a moment to go
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the step's own child process outlived the step")


def test_the_kernel_bench_builds_every_row_on_cpu_tensors():
    """bench.gpu_kernels' own code, every variant it times, on tiny shapes on CPU (Triton's
    interpreter runs the Triton kernels): on a GPU, a slip there costs a step of a short lease."""
    attention, linear, fused, small = rows = run_in_triton_interpreter("""
import json, torch
from bench.gpu_kernels import bench_attention, bench_fp8_linear, bench_group_norm, _ms_host
# (bf16 dots: wrong in the interpreter; the host's timer stands in for the CUDA-graph replay's)
rows = bench_attention([("tiny", 1, 2, 20, 12, 40)], torch.float16, "cpu", _ms_host, _ms_host)
rows += bench_fp8_linear([("tiny", 5, 32, 48)], "cpu", _ms_host)
import pyext.nn.fused_norm
pyext.nn.fused_norm.MIN_FUSED_NUMEL = 1000  # (the interpreter's Triton kernel at the true floor: half a minute a call)
rows += bench_group_norm([("fused", 2, 64, 5, 7), ("small", 1, 64, 3, 5)], torch.float16, "cpu", _ms_host, _ms_host)
print(json.dumps(rows))
""")
    assert not [k for k in attention if k.endswith("error")], attention
    assert attention["pyext_ms"] > 0 and attention["pyext_kernel_ms"] > 0 and attention["err_vs_sdpa"] <= 2.0
    timed_sdpa = [name for name in ("flash", "efficient", "cudnn") if attention[f"{name}_ms"] is not None]
    assert timed_sdpa and len(timed_sdpa) + len(attention.get("refused", [])) == 3  # each SDPA backend: timed or refused
    assert "best_sdpa_over_pyext" in attention
    assert attention["auto_ms"] > 0 and attention["auto_backend"] in ("cpp", "sdpa")
    assert attention["auto_err_vs_sdpa"] <= 2.0
    assert "best_sdpa_over_auto" in attention and attention["best_sdpa_over_auto_graph"] > 0
    # Refused here only: the CUDA upcast kernel (CUDA only), and the Triton backend in bf16 (the
    # interpreter's bf16 dots are wrong; the bare kernel still runs, its answer unchecked).
    assert {k for k in linear if k.endswith("error")} == {"upcast_cublas_error", "weight_only_triton_error"}
    timed = ("weight_only", "triton_kernel", "upcast_then_cublas", "dynamic", "dynamic_torch_quantize",
             "dynamic_triton_quantize")
    assert all(linear[f"{key}_ms"] > 0 and linear[f"{key}_vs_bf16"] > 0 for key in timed)
    assert linear["weight_only_sqnr_db"] > 25
    assert linear["dynamic_torch_quantize_sqnr_db"] == linear["dynamic_triton_quantize_sqnr_db"] > 20  # the same codes
    # GroupNorm + SiLU: the fused layer above its size floor (dispatch's choice), plain below it
    for row in (fused, small):
        assert not [k for k in row if k.endswith("error")], row
        assert all(row[k] > 0 for k in ("plain_ms", "plain_graph_ms", "fused_ms", "fused_graph_ms", "triton_ms",
                                         "fused_over_plain", "fused_over_plain_graph"))
    assert fused["fused_backend"] == "cpp" and small["fused_backend"] == "plain"
    assert fused["err_vs_plain"] <= 2.0 and small["err_vs_plain"] == 1.0  # below the floor: the same two kernels
    table = gpu_check.render({"steps": {"kernels": {"rc": 0, "results": {"kernels.json": rows}}}})
    for title in ("| attention (bf16)", "| fp8 linear", "| GroupNorm + SiLU"):
        assert title in table
    assert "| fused | 2, 64, 5, 7 |" in table and "(cpp)" in table
