"""bench.latency end to end on the tiny preset, and its image check on synthetic images."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench import latency, plot
from pyext._ext import has_kernel

pytestmark = pytest.mark.slow  # make test runs it; make test-fast leaves it out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Rows that must produce a number on any machine (CPU included).
ALWAYS_RUN = ("original", "fp16", "channels_last", "traced_unet", "sdpa_attention", "pyext_fp8", "diffusers_layerwise_fp8")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    subprocess.run([sys.executable, "-m", "bench.latency", "--preset", "tiny", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL)
    with open(out / "latency.json") as f:
        return out, json.load(f)


def assert_rows_well_formed(rows: dict) -> None:
    """Each row measured (positive finite latency, stage times, memory above weights, check ok)
    or carrying the reason it was not."""
    for name, row in rows.items():
        if "latency_s" in row:
            assert row["latency_s"] > 0 and math.isfinite(row["latency_s"]), name
            assert set(row["stages_s"]) >= {"text_encoding", "denoising", "vae_decode"}, name
            assert row["peak_memory_bytes"] > row["weight_bytes"] > 0, name
            assert row["check"] == "ok", (name, row["check"])
        else:
            assert isinstance(row["reason"], str) and row["reason"], name


def test_tiny_preset_reports_every_row(tiny_report):
    out, report = tiny_report
    assert list(report["rows"]) == list(latency.ROWS)
    assert_rows_well_formed(report["rows"])
    for name in ALWAYS_RUN:
        assert "latency_s" in report["rows"][name], (name, report["rows"][name])
    assert report["rows"]["original"]["psnr_db"] == float("inf")  # the reference against itself
    assert report["rows"]["fp16"]["dtype"] == "bfloat16"  # CPU runs bf16 for the half-precision rows
    assert report["rows"]["pyext_fp8"]["weight_bytes"] < report["rows"]["fp16"]["weight_bytes"]
    peers = {name: report["rows"][name] for name in ("quanto_fp8", "diffusers_layerwise_fp8")}
    for name, row in peers.items():  # the eager peers run where installed, their weights in fp8
        assert "latency_s" in row or "not installed" in row["reason"], (name, row)
        assert "latency_s" not in row or row["weight_bytes"] < report["rows"]["fp16"]["weight_bytes"], name
    assert "torchao" in report["rows"]["torchao_fp8_dynamic"]["reason"]  # torchao refuses the CPU, or is missing
    assert report["weights"] == "random"
    assert report["unrelated_psnr_db"] < latency.MIN_PSNR_DB  # the threshold separates unrelated images
    assert {"torch", "diffusers", "pyext"} <= set(report["versions"])


def test_tiny_preset_writes_table_and_chart(tiny_report):
    out, report = tiny_report
    md = (out / "latency.md").read_text()
    for name in latency.ROWS:
        assert f"| {name} |" in md
    assert "9.50 s" in md and "random" in md  # the guide's figure beside ours; weights declared
    png = (out / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def _fake_row(**extra):
    return {"latency_s": 1.0, "stages_s": {}, "denoiser_it_per_s": 1.0, "peak_memory_bytes": 2, "weight_bytes": 1,
            "dtype": "float32", **extra}


def test_image_check_flags_wrong_and_non_finite_rows(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    ref = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.save(ref, images / "original.pt")
    torch.save(ref + 1e-3, images / "close.pt")
    torch.save(torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1)), images / "wrong.pt")
    torch.save(torch.full_like(ref, float("nan")), images / "nan.pt")
    rows = {n: _fake_row() for n in ("original", "close", "wrong", "nan")} | {"missing": {"reason": "n/a here"}}
    latency.compare_images(str(tmp_path), rows)
    assert rows["original"]["check"] == "ok" and rows["close"]["check"] == "ok"
    assert rows["close"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert rows["close"]["psnr_db"] == pytest.approx(60.0, abs=0.1)
    assert rows["wrong"]["check"].startswith("FAIL") and rows["nan"]["check"].startswith("FAIL")
    assert "check" not in rows["missing"]


def test_check_steps_choose_the_run_whose_image_is_checked(tmp_path):
    """With check_steps, a row saves the image of a run of that many steps for the check, not the
    timed run's: equal to the timed image when the step counts agree, another image when not."""
    from dataclasses import asdict, replace

    preset = replace(latency.PRESETS["tiny"], steps=2)
    model, _ = latency.prepare_model(None, preset, str(tmp_path))
    threads, images = torch.get_num_threads(), {}
    try:
        for check_steps in (0, 2, 1):
            out = tmp_path / f"check_{check_steps}"
            spec = {"preset": asdict(replace(preset, check_steps=check_steps)), "model_path": model, "out": str(out),
                    "repeats": 1}
            latency.run_row("original", spec)
            images[check_steps] = torch.load(out / "images" / "original.pt")
    finally:
        torch.set_num_threads(threads)  # the row sets the preset's
    assert torch.equal(images[0], images[2]) and not torch.allclose(images[0], images[1], atol=1e-3)


def test_unavailable_rows_say_why():
    cpu = latency.PRESETS["cpu"]
    assert "CUDA" in latency.unavailable("xformers", cpu) or "not installed" in latency.unavailable("xformers", cpu)
    assert latency.unavailable("original", cpu) is None
    assert "tiny" in latency.unavailable("torch_compile", latency.PRESETS["tiny"])
    for row in ("pyext_cudagraphs", "torch_compile_cudagraphs"):
        assert "CUDA" in latency.unavailable(row, cpu) and latency.unavailable(row, latency.PRESETS["gpu"]) is None
    for row in ("torchao_int8_weight_only", "torchao_int8_dynamic"):  # the CPU presets' peers only
        assert "CPU" in latency.unavailable(row, latency.PRESETS["gpu"])


def test_a_presets_opt_in_rows_run_only_when_named(monkeypatch):
    """What a preset leaves out of its default run says how to run it, and runs when --rows names it."""
    monkeypatch.setattr(latency, "_installed", lambda module: True)  # a peer's package need not be here
    cpu = latency.PRESETS["cpu"]
    assert cpu.opt_in, "the cpu preset keeps make bench's default run short by leaving rows out"
    for row, why in cpu.opt_in:
        assert row in latency.ROWS
        reason = latency.unavailable(row, cpu)
        assert why in reason and f"--rows {row}" in reason
        assert latency.unavailable(row, cpu, named=True) != reason


def test_peer_rows_name_the_package_they_miss(monkeypatch):
    monkeypatch.setattr(latency, "_installed", lambda module: False)
    cpu = latency.PRESETS["cpu"]
    for row, package in latency.PEER_PACKAGES.items():
        assert latency.unavailable(row, cpu) == f"{package} not installed (pip install -r requirements-bench.txt)"
    assert latency.unavailable("diffusers_layerwise_fp8", cpu) is None  # diffusers' own: nothing to install


def test_torchao_rows_quantize_the_unet_or_say_why_before_compiling():
    """Each torchao row's quantization on the tiny UNet, on CPU: the fp8 dynamic config is refused with
    torchao's own reason; the others convert the UNet's linears, shrink its weights and keep its output."""
    pytest.importorskip("torchao")
    import pyext.offline

    preset = latency.PRESETS["cpu"]
    pipe = pyext.offline.build_pipeline("sd15", "tiny", dtype=torch.bfloat16)
    inputs = (torch.randn(2, 4, 8, 8, dtype=torch.bfloat16), torch.tensor(10),
              torch.randn(2, 77, pipe.unet.config.cross_attention_dim, dtype=torch.bfloat16))
    with torch.no_grad():
        expected = pipe.unet(*inputs).sample
    with pytest.raises(latency.RowUnavailable, match="torchao refuses .* requires CUDA compute capability"):
        latency._apply_step(pipe, "torchao_fp8_dynamic", preset, {})
    for row in ("torchao_fp8_weight_only", "torchao_int8_weight_only", "torchao_int8_dynamic"):
        unet = pipe.unet
        pipe.unet = pyext.offline.build_pipeline("sd15", "tiny", dtype=torch.bfloat16).unet
        before, notes = latency.component_weight_bytes(pipe, ("unet",))["unet"], {}
        latency._apply_step(pipe, row, preset, notes)
        assert latency.ROWS[row][1][-2:] == (row, "torchao_compile")
        assert latency.component_weight_bytes(pipe, ("unet",))["unet"] < before, row  # linears only: convs stay bf16
        assert "weights of" in notes[row] and "MiB" in notes[row]
        with torch.no_grad():
            out = pipe.unet(*inputs).sample
        psnr = 10 * torch.log10(expected.float().pow(2).mean() / (out - expected).float().pow(2).mean())
        assert psnr > 20, (row, psnr)
        pipe.unet = unet


# Bytes per output channel beyond the one-byte codes: (scales and zero points, module buffers).
QUANTIZED_LINEARS = {
    "quanto_qfloat8": (2, 4),   # a bf16 scale per channel; the layer's bf16 input and output scales
    "torchao_float8": (4, 0),   # an fp32 scale per channel
    "torchao_int8": (5, 0),     # an fp32 scale and an int8 zero point per channel
}


@pytest.mark.parametrize("quantizer", list(QUANTIZED_LINEARS))
def test_weight_bytes_count_a_quantized_subclass_by_its_inner_tensors(quantizer):
    """A quantized weight reports its compute dtype (bf16, 2 bytes); its codes take one byte each."""
    import types

    model = torch.nn.Sequential(torch.nn.Linear(256, 512)).to(torch.bfloat16)
    if quantizer.startswith("quanto"):
        quanto = pytest.importorskip("optimum.quanto")
        quanto.quantize(model, weights=quanto.qfloat8)
        quanto.freeze(model)
    else:
        quantization = pytest.importorskip("torchao.quantization")
        quantization.quantize_(model, quantization.Float8WeightOnlyConfig() if quantizer == "torchao_float8"
                               else quantization.Int8WeightOnlyConfig())
    weight = model[0].weight
    assert weight.dtype == torch.bfloat16 and type(weight) is not torch.nn.Parameter
    per_channel, buffers = QUANTIZED_LINEARS[quantizer]
    expected = 512 * 256 + 512 * per_channel + 512 * 2 + buffers  # codes, scales, the bf16 bias, buffers
    assert latency.component_weight_bytes(types.SimpleNamespace(components={"unet": model})) == {"unet": expected}


def test_interleaved_rounds_give_the_median_and_the_per_round_ratio_to_the_original():
    original = [_fake_row(latency_s=t) for t in (2.0, 4.0, 3.0)]
    row = [_fake_row(latency_s=t) for t in (1.0, 1.0, 3.0)]
    merged = latency.merge_rounds(row, original)
    assert merged["latency_s"] == 1.0 and merged["round_latencies_s"] == [1.0, 1.0, 3.0]
    assert merged["vs_original"] == {"median": 0.5, "min": 0.25, "max": 1.0, "rounds": 3}
    assert latency.merge_rounds(row[:1], original) == row[0]  # one round: the row as it ran
    report = {"rows": {"original": latency.merge_rounds(original, original), "fp16": merged,
                       "xformers": {"reason": "xformers not installed"}}, "guide_titan_rtx_s": {}}
    lines = plot.table(report).splitlines()
    assert "per round" in lines[0] and "0.50x (0.25-1.00, 3 rounds)" in lines[3]
    assert len({line.count("|") for line in lines}) == 1  # every row has every column


def test_markdown_shows_reasons_and_failures(tmp_path):
    report = {
        "preset": "tiny", "preset_parameters": {"width": 64, "height": 64, "steps": 2, "warmup_steps": 1},
        "repeats": 1, "model": "sd15 tiny", "weights": "random", "prompt": "p", "min_psnr_db": 20.0,
        "machine": {"cpu": "x", "cpu_count": 2, "torch_threads": 2}, "versions": {"torch": "t"},
        "guide_titan_rtx_s": latency.GUIDE_TITAN_RTX, "unrelated_psnr_db": 12.0,
        "rows": {"original": _fake_row(check="ok", psnr_db=float("inf")),
                 "fp16": _fake_row(latency_s=0.5, check="FAIL: PSNR < 20 dB", psnr_db=3.0),
                 "xformers": {"reason": "xformers not installed"}},
    }
    plot.write_markdown(report, tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "n/a: xformers not installed" in md and "FAIL: PSNR < 20 dB" in md and "2.00x" in md
    plot.write_chart(report, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_kernels_table_runs_suites_and_reports_missing_ones(monkeypatch):
    import types

    from bench import kernels

    fake = types.ModuleType("bench.fake")
    fake.run = lambda: [{"bench": "upcast", "n": 4, "ms": 0.25}, {"bench": "upcast", "n": 8, "ms": 0.5},
                        {"bench": "linear", "shape": "(2, 3)", "gflops": 1.5}]
    broken = types.ModuleType("bench.broken")
    broken.run = lambda: 1 / 0
    monkeypatch.setitem(sys.modules, "bench.fake", fake)
    monkeypatch.setitem(sys.modules, "bench.broken", broken)
    results = {n: kernels.run_suite(n) for n in ("fake", "broken", "no_such_suite")}
    assert len(results["fake"]["rows"]) == 3
    assert results["broken"]["reason"].startswith("failed: ZeroDivisionError")
    assert results["no_such_suite"]["reason"].startswith("not available")
    table = kernels.format_table(results)
    assert "### fake: upcast" in table and "### fake: linear" in table
    assert "| 8 | 0.5 |" in table and "| (2, 3) | 1.5 |" in table
    assert "| broken | failed: ZeroDivisionError" in table


def test_make_bench_picks_the_preset_from_the_machine(monkeypatch):
    from bench import run

    seen = []
    monkeypatch.setattr(latency, "main", lambda argv: seen.append(argv))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run.main([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run.main(["--rows", "original"])
    run.main(["--preset", "tiny", "--out", "x"])
    assert seen == [["--preset", "cpu", "--out", "bench_out"],
                    ["--rows", "original", "--preset", "gpu", "--out", "bench_out"],
                    ["--preset", "tiny", "--out", "x"]]


def test_results_name_the_cpus_isa_and_the_kernel_paths_pyext_takes():
    from pyext import dispatch
    from pyext._ext import has_kernel

    info = latency.machine_info("cpu")
    assert set(info["cpu_flags"]) <= set(dispatch.CPU_FLAGS)
    line = latency.describe_machine("cpu")
    assert info["cpu"] in line and all(flag in line for flag in info["cpu_flags"])
    if has_kernel("attention"):
        paths = info["kernel_paths"]
        assert paths["attention"] == torch.ops.pyext_C.attention_paths()[0] and paths["attention"] in line
        assert paths["fp8_linear_amx"] <= ("amx_bf16" in info["cpu_flags"])  # torch's AMX brgemm only with AMX


def test_attention_bench_times_dispatchs_choice_beside_sdpa_in_interleaved_rounds():
    from bench import attention
    from pyext import dispatch

    rows = attention.run([(1, 2, 20, 12, 40)], repeats=3, device="cpu", dtype=torch.float32)
    by = {r["backend"]: r for r in rows}
    assert {"sdpa", "auto", "openvino"} <= set(by) and by["sdpa"]["vs_sdpa"] == 1.0
    assert by["auto"]["chosen"] in {b.name for b in dispatch.ops()["attention"].backends}
    # OpenVINO's SDPA in its own process where it is installed, else the reason
    assert "f32 inside" in by["openvino"].get("note", "") or "not installed" in by["openvino"]["skipped"]
    timed = [row for row in rows if "skipped" not in row]
    for row in timed:
        low, high = row["vs_sdpa_range"]
        assert low <= row["vs_sdpa"] <= high and row["dtype"] == "float32"
    table = attention.render({"rows": rows, "machine": latency.machine_info("cpu"), "repeats": 3})
    assert f"auto (chose {by['auto']['chosen']})" in table and table.count("| float32 |") == len(timed)


def test_openvino_kernel_rows_say_why_they_cannot_run(monkeypatch):
    from bench import attention, cpu_runtimes, openvino_ops

    monkeypatch.setattr(cpu_runtimes, "unavailable", lambda runtime: f"{runtime} not installed (pip install openvino)")
    assert openvino_ops.compare("linear", (5, 32, 48), 2, torch.float32) == {
        "skipped": "openvino not installed (pip install openvino)"}
    row = attention.openvino_row(attention.Shape("small", 1, 2, 20, 12, 40), torch.float32, 2)
    assert row["backend"] == "openvino" and "not installed" in row["skipped"] and "ms" not in row


def test_fp8_layer_benches_run_on_small_shapes():
    from bench import fp8

    for dtype in (torch.bfloat16, torch.float32):
        conv = fp8.bench_conv([("small", 1, 8, 6, 16, 1)], dtype, repeats=3)
        lin = fp8.bench_linear([("small", 5, 32, 48)], dtype, repeats=3)
        for row in conv + lin:
            times = [v for k, v in row.items() if k.endswith("_ms")]
            assert times and all(math.isfinite(t) and t > 0 for t in times), row
            low, high = row["pyext_vs_plain"]["range"]
            assert low <= row["pyext_vs_plain"]["median"] <= high and row["dtype"] == str(dtype)[6:]
        assert ("pyext_dynamic_ms" in lin[0]) == (dtype == torch.bfloat16)  # the dynamic GEMM takes bf16
        assert lin[0]["copies"] == fp8.copies_for(5, 32, 48, "cpu") > 1  # a few rows: from memory
        ov = lin[0]["openvino"]  # OpenVINO's linear where it is installed, else the reason
        assert ("vs_plain" in ov and ov["ms"] > 0) or "not installed" in ov["skipped"], ov
        table = fp8.render({"rows": conv + lin, "machine": latency.machine_info("cpu")})
        assert "| small | 5, 32, 48 |" in table and "| small | " + str(dtype)[6:] in table
        assert ("OpenVINO / F.linear" in table) == ("vs_plain" in ov)


@pytest.mark.parametrize("component", ["unet", "vae"])
def test_cpu_profile_splits_a_call_into_ops_and_the_time_between(component):
    from bench import cpu_profile

    for optimize in ({}, None):
        per = cpu_profile.profile_torch(component, calls=1, size="tiny", optimize=optimize)
        ops = {name: ms for name, ms in per.items() if not name.startswith("(")}
        assert ops and all(ms >= 0 for ms in per.values()) and any("convolution" in name for name in ops)
        assert 0 <= per["(between ops)"] <= per["(wall)"]
        assert any(name.startswith("pyext") for name in ops) == (optimize is not None)  # eager runs no pyext op


def test_few_rows_linears_run_over_copies_beyond_the_cache(monkeypatch):
    from bench import fp8

    assert fp8.last_level_cache_bytes() > 0
    monkeypatch.setattr(fp8, "last_level_cache_bytes", lambda: 32 << 20)
    assert fp8.copies_for(fp8.FEW_ROWS + 1, 3072, 3072, "cpu") == 1  # compute, not reading
    assert fp8.copies_for(4, 3072, 3072, "cuda") == 1
    copies = fp8.copies_for(4, 3072, 3072, "cpu")  # fp8 bytes over twice the caches, not one more
    assert copies * 3072 * 3072 >= 2 * (32 << 20) > (copies - 1) * 3072 * 3072
    assert fp8.copies_for(1, 64, 64, "cpu") == fp8.MAX_COPIES
    # more rows: computing, called about ROUND_FLOP's worth per round, at least once
    assert fp8.calls_for(fp8.FEW_ROWS, 3072, 3072) == 1 and fp8.calls_for(8192, 3072, 3072) == 1
    assert fp8.calls_for(2048, 320, 320) == round(fp8.ROUND_FLOP / (2 * 2048 * 320 * 320)) > 1


def test_winograd_bench_pairs_rounds_and_reports_the_rule():
    from bench import winograd
    from pyext._ext import has_kernel

    if not has_kernel("winograd_conv3x3"):
        assert "rule" in winograd.run(1)[0]
        return
    row = winograd.measure((1, 8, 40, 9), rounds=3)
    assert row["onednn_ms"] > 0 and row["winograd_ms"] > 0
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert "under 32" in row["rule"]


def test_cpu_runtimes_pairs_rounds_and_checks_outputs(tmp_path):
    """bench.cpu_runtimes on the tiny sd15: each runtime in its own process, paired ratios per
    round, every output checked against eager's, and a missing runtime reported with its reason."""
    from bench import cpu_runtimes

    report = cpu_runtimes.main(["--size", "tiny", "--height", "64", "--width", "64", "--rounds", "2",
                                "--threads", "1", "--runtimes", "eager,pyext,pyext_fp8", "--out", str(tmp_path)])
    from pyext.decision import auto_dtype

    rows = report["rows"]
    dtype = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")
    tolerance = 1e-4 if dtype == "float32" else 5e-2  # bf16 where the CPU has it natively
    assert set(rows) == {"eager", "pyext", "pyext_fp8"}
    for c in ("unet", "vae"):
        assert all(len(row[c]["times_s"]) == 2 and all(t > 0 for t in row[c]["times_s"]) for row in rows.values())
        versus = rows["pyext"][c]["vs"]["eager"]
        assert versus["min"] <= versus["median"] <= versus["max"]
        assert rows["pyext"][c]["max_rel_err_vs_eager"] < tolerance  # pyext computes what eager does
    # fp8 weights in the UNet only: its step carries their rounding, the VAE's decode none
    assert 0 < rows["pyext_fp8"]["unet"]["max_rel_err_vs_eager"] < 0.25
    assert rows["pyext_fp8"]["vae"]["max_rel_err_vs_eager"] < tolerance
    assert f"| pyext | {dtype} |" in (tmp_path / "cpu_runtimes.md").read_text()
    fake = {"spec": {"components": ["unet"]}, "rows": {"openvino": {"reason": "openvino not installed"}}}
    assert "| openvino | n/a: openvino not installed |" in cpu_runtimes.markdown(fake)


def test_cpu_runtimes_pyext_runtimes_take_options():
    from bench import cpu_runtimes

    assert cpu_runtimes.pyext_options("pyext") == {}
    assert cpu_runtimes.pyext_options("pyext_compile:fuse_geglu=off:prepack=off") == {
        "compile": "compile", "fuse_geglu": "off", "prepack": "off"}
    assert cpu_runtimes.pyext_options("openvino") is None
    assert cpu_runtimes.pyext_options("pyext:fuse_geglu") is None
    with pytest.raises(SystemExit, match="unknown runtimes"):
        cpu_runtimes.main(["--runtimes", "pyext,openvino:x=y"])


@pytest.mark.parametrize("channels_last, prepack", [(True, True)])  # the default run is this one without both
def test_vae_bench_rows_compare_each_tiled_run_with_the_untiled_one(channels_last, prepack):
    """bench.vae on the small VAE at 512x256 (2 x 1 tiles): a row per method and per pyext option
    set, each in its own process under the chosen allocator (and layout, and with the pyext rows'
    weights packed); the exact row gives the untiled image, diffusers' tiling does not. (The exact
    run with its state in a file gives the same bits: tests/test_vae_spill.py.)"""
    from bench import vae

    options = [{}]
    rows = vae.run(shapes=["small"], sizes=["512x256"], video=False, pyext_options=options, malloc="default",
                   channels_last=channels_last, prepack=prepack)
    assert [r["method"] for r in rows] == ["full", "diffusers"] + [vae._label(o, prepack) for o in options]
    for row in rows:
        assert row["malloc"] == "default" and row["seconds"] > 0 and "peak_extra_mib" in row, row
        assert row["channels_last"] is channels_last
        pyext = row["method"].startswith("pyext")
        assert (row.get("packed_layers", 0) > 0) is (prepack and pyext), row
        assert row.get("prepack", False) is (prepack and pyext), row  # only the rows that packed say so
    assert rows[1]["psnr_vs_full_db"] < 60
    assert all(r["psnr_vs_full_db"] >= 100 for r in rows[2:])
    run = "decode, channels-last" if channels_last else "decode"
    label = "pyext prepacked" if prepack else "pyext"
    assert f"| small | {run} | 512x256 | 256 | {label} |" in vae.table(rows)


def test_the_benchmarks_page_shows_what_the_results_files_hold():
    from bench import render

    with open(render.PAGE) as f:
        page = f.read()
    assert render.rendered(page) == page, "docs/benchmarks.md is out of date: python -m bench.render"
    assert render.main(["--check"]) == 0


def test_rendering_replaces_a_block_with_its_file(tmp_path):
    from bench import render

    stale = "".join(f"x\n<!-- rendered from bench/results/{name}.json -->\nold table\n{render.END}\ny\n"
                    for name in render._renderers())
    new = render.rendered(stale)
    assert "old table" not in new and "| sd15 |" in new and "| `attention` |" in new and "| small | 2048 |" in new
    assert new.count("at commit") == len(render._renderers())
    assert render.rendered(new) == new


def test_routing_overhead_times_each_attention_layer_kind_plain_and_routed_to_pyext():
    from bench.dispatch import _attention_layers, render_routing, routing_overhead

    rows = routing_overhead("cpu", rounds=2, calls=2)
    assert [r["layer"] for r in rows] == list(_attention_layers("cpu"))
    for r in rows:
        # routed: every timed forward's attention went to pyext's op, none to torch's SDPA
        assert r["pyext_calls"] > 0 and r["fallbacks"] == 0
        assert r["torch_calls"] > 1 and min(r["plain_us"], r["routed_us"]) > 0
        assert r["routed_vs_plain_range"][0] <= r["routed_vs_plain"] <= r["routed_vs_plain_range"][1]
    assert render_routing(rows).count("\n") == len(rows) + 1


def test_dispatch_overhead_times_every_op_through_its_chosen_backend():
    from bench.dispatch import _tiny_calls, overhead
    from pyext import dispatch

    rows = overhead("cpu", rounds=2, calls=3)
    assert [r["op"] for r in rows] == list(_tiny_calls("cpu"))
    for r, (raw, torch_call, torch_op, args, layer) in zip(rows, _tiny_calls("cpu").values()):
        assert r["backend"] == dispatch.select(r["op"], args).name
        assert min(r["raw_us"], r["torch_us"], r["torch_op_us"], r["bare_us"]) > 0
        assert r["raw_vs_torch_range"][0] <= r["raw_vs_torch"] and r["raw_vs_torch_op_range"][0] <= r["raw_vs_torch_op"]
        torch.testing.assert_close(raw(), torch_call(), atol=1e-3, rtol=1e-3)  # the same work on every side
        torch.testing.assert_close(torch_op(), torch_call(), atol=1e-6, rtol=1e-6)
        assert (layer is None) == ("layer_us" not in r) == (r["op"] != "fp8_linear")
        if layer is not None:
            assert r["layer_vs_torch_range"][0] <= r["layer_vs_torch"] and torch.equal(layer(), raw())


def test_capture_overhead_times_replays_of_each_full_denoiser():
    from bench.dispatch import capture_overhead, render_capture

    rows = capture_overhead(rounds=2, calls=3)
    assert [r["model"] for r in rows] == ["sd15 UNet (full)", "flux transformer (full)"]
    for r in rows:
        assert r["replays"] == 1 + 2 * 3  # the capturing call's, then every timed call's
        assert r["checked"] > 1000 and min(r["captured_us"], r["replay_us"]) > 0
    assert render_capture(rows).count("\n") == len(rows) + 1


DEVICE_QUERIES = """
import importlib, json, multiprocessing.forkserver, sys
import torch
calls = []

def spy(owner, name):
    fn = getattr(owner, name)
    def asked(*args, **kwargs):
        if name != "current_accelerator" or kwargs.get("check_available") or any(args):
            calls.append(name)
        return fn(*args, **kwargs)
    setattr(owner, name, asked)

for owner, name in ((torch.cuda, "is_available"), (torch.cuda, "device_count"), (torch.accelerator, "is_available"),
                    (torch.accelerator, "device_count"), (torch.accelerator, "current_accelerator")):
    spy(owner, name)
from bench import latency
preloaded = {}
for device in ("cpu", "cuda"):  # (only the modules' names: nothing is started)
    latency._row_context(device)
    preloaded[device] = list(multiprocessing.forkserver._forkserver._preload_modules)
asked = {}
for module in preloaded["cuda"]:
    importlib.import_module(module)
    asked[module], calls[:] = list(calls), []
importlib.import_module("diffusers")
print(json.dumps(dict(preloaded=preloaded, asked=asked, diffusers=calls)))
"""


def test_the_server_of_cuda_rows_imports_nothing_that_asks_for_devices():
    """A process that asked CUDA for its devices cannot fork a process that uses CUDA; the server
    that CUDA rows are forked from imports torch, transformers and pyext, and not diffusers, which
    asks (the control: the spies see its question)."""
    result = subprocess.run([sys.executable, "-c", DEVICE_QUERIES], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=True)
    found = json.loads(result.stdout.splitlines()[-1])
    assert {"torch", "transformers", "pyext", "bench.latency"} <= set(found["preloaded"]["cuda"])
    assert {module: asked for module, asked in found["asked"].items() if asked} == {}
    assert found["diffusers"], "the control: importing diffusers asks for the devices"
    assert "diffusers" in found["preloaded"]["cpu"]  # CPU rows fork freely: diffusers is preloaded too


def test_stage_clock_sums_each_stage_over_its_calls():
    import time

    class Owner:
        def step(self, seconds):
            time.sleep(seconds)
            return seconds

    owner = Owner()
    clock = latency.StageClock("cpu")
    clock.wrap(owner, "step", "denoising")
    assert owner.step(0.01) == 0.01 and owner.step(0.02) == 0.02
    assert clock.totals["denoising"] >= 0.03 and set(clock.totals) == {"denoising"}
    clock.reset()
    assert clock.totals == {}


@pytest.mark.cuda
def test_stage_clock_on_a_gpu_times_without_waiting_for_it():
    """The host queues the next call while the GPU works: a timed call makes no host sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layer = torch.nn.Linear(1024, 1024, device="cuda")
    clock = latency.StageClock("cuda")
    clock.wrap(layer, "forward", "denoising")
    x = torch.randn(256, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for _ in range(3):
                x = layer(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert clock.totals["denoising"] > 0 and len(clock.marks) == 3


@pytest.mark.parametrize("arch", sorted(latency.ARCH_PRESETS))
def test_arch_presets_plan_their_rows(arch):
    """The SDXL and Flux presets: every row runs or says why; the rows that take SD1.5's UNet call
    say so on both devices, and the int8 peers are the CPU preset's only."""
    for name in ("cpu", "gpu"):
        preset = latency.preset_of(name, arch)
        assert preset.arch == arch and preset.device == ("cuda" if name == "gpu" else "cpu")
        for row in ("traced_unet", "openvino"):
            assert "SD1.5's UNet call" in latency.unavailable(row, preset)
        for row in ("original", "pyext_fp8", "pyext_optimize", "pyext_fp8_compile", "pyext_fp8_all_compile"):
            assert latency.unavailable(row, preset) is None
        linear_only = latency.unavailable("pyext_fp8_linear_compile", preset)
        assert (linear_only is None) if arch == "sdxl" else ("no convolutions" in linear_only)
    gpu = latency.preset_of("gpu", arch)
    assert (gpu.height, gpu.steps) == ((1024, 30) if arch == "sdxl" else (1024, 28))
    assert "CPU" in latency.unavailable("torchao_int8_dynamic", gpu)
    with pytest.raises(SystemExit, match="no preset 'tiny'"):
        latency.preset_of("tiny", arch)


@pytest.mark.parametrize("arch", sorted(latency.ARCH_PRESETS))
def test_bench_sizes_keep_the_published_widths_with_fewer_layers(arch):
    """What the CPU presets scale: layers, never widths (meta pipelines: shapes only)."""
    from pyext.offline import build_pipeline

    bench, full = (build_pipeline(arch, size, dtype=torch.bfloat16, device="meta") for size in ("bench", "full"))
    denoiser = latency.denoiser_name(bench)
    assert latency.denoiser_name(full) == denoiser
    b, f = getattr(bench, denoiser).config, getattr(full, denoiser).config
    if arch == "flux":
        assert (b.num_layers, b.num_single_layers) == (1, 2) and (f.num_layers, f.num_single_layers) == (19, 38)
        widths = ("num_attention_heads", "attention_head_dim", "joint_attention_dim", "pooled_projection_dim")
    else:
        assert tuple(b.transformer_layers_per_block) == (1, 2, 2) and tuple(f.transformer_layers_per_block) == (1, 2, 10)
        widths = ("block_out_channels", "cross_attention_dim", "attention_head_dim", "layers_per_block")
    assert all(b[k] == f[k] for k in widths)
    assert bench.vae.config == full.vae.config
    for encoder in latency.TEXT_ENCODERS:
        assert getattr(bench, encoder).config.hidden_size == getattr(full, encoder).config.hidden_size


def test_a_transformer_row_runs_on_the_generic_path(tmp_path):
    """A Flux row (tiny sizes, on CPU): the steps reach the transformer, the stages are timed,
    the image is written."""
    from dataclasses import asdict, replace

    preset = replace(latency.preset_of("cpu", "flux"), size="tiny", height=64, width=64, steps=1, repeats=1,
                     call=(("max_sequence_length", 16),), threads=1)
    model, _ = latency.prepare_model(None, preset, str(tmp_path))
    spec = {"preset": asdict(preset), "model_path": model, "out": str(tmp_path / "out"), "repeats": 1}
    threads = torch.get_num_threads()
    try:
        result = latency.run_row("pyext_fp8", spec)
    finally:
        torch.set_num_threads(threads)  # the row sets the preset's
    assert "transformer layers in fp8" in result["notes"]["pyext_fp8"]
    assert "keeps its own attention processors" in result["notes"]["attention"]
    assert result["stages_s"]["denoising"] > 0 and result["stages_s"]["text_encoding"] > 0
    assert (tmp_path / "out" / "images" / "pyext_fp8.pt").exists()


def test_the_flux_gpu_preset_makes_weights_on_the_device_and_passes_prompt_embeddings(tmp_path):
    """The gpu Flux preset's rows on CPU tensors (tiny sizes): every row loads the half dtype, the
    weights are made where the row runs (nothing saved by the parent), the text encoders are left
    out and the call gets seeded prompt embeddings, the same in every row."""
    from dataclasses import asdict, replace

    gpu = latency.preset_of("gpu", "flux")
    assert gpu.on_device and gpu.load_half and latency.half_dtype(gpu) == torch.bfloat16
    assert "original row is this row" in latency.unavailable("fp16", gpu)
    assert "fp8 tensor cores" in latency.unavailable("pyext_fp8_dynamic", latency.preset_of("cpu", "flux"))
    preset = replace(gpu, device="cpu", size="tiny", height=64, width=64, steps=1, warmup_steps=1, repeats=1,
                     check_steps=0, call=(("max_sequence_length", 16),), threads=1)
    assert latency.prepare_model(None, preset, str(tmp_path)) == ("", latency.prepare_model(None, gpu, "")[1])
    assert not os.listdir(tmp_path)
    spec = {"preset": asdict(preset), "model_path": "", "out": str(tmp_path / "out"), "repeats": 1}
    threads = torch.get_num_threads()
    try:
        results = {row: latency.run_row(row, spec) for row in ("original", "pyext_optimize")}
    finally:
        torch.set_num_threads(threads)
    assert results["original"]["dtype"] == "bfloat16"  # pyext_optimize's is what optimize chose for this CPU
    for row, result in results.items():
        assert "text_encoding" not in result["stages_s"] and result["stages_s"]["denoising"] > 0, row
    images = [torch.load(tmp_path / "out" / "images" / f"{row}.pt") for row in results]
    assert images[0].shape == (1, 3, 64, 64) and not torch.equal(images[0], images[1]) and \
        (images[0] - images[1]).abs().max() < 0.25
    from pyext.dispatch import PyextError
    from pyext.offline import build_pipeline

    pipe = build_pipeline("flux", "tiny", dtype=torch.bfloat16, on_device=True, without=latency.PROMPT_ENCODERS["flux"])
    assert pipe.text_encoder is None and pipe.tokenizer_2 is None
    first, again = latency.prompt_inputs(pipe, preset), latency.prompt_inputs(pipe, preset)
    assert first["prompt_embeds"].shape == (1, 16, pipe.transformer.config.joint_attention_dim)
    assert torch.equal(first["prompt_embeds"], again["prompt_embeds"])
    with pytest.raises(PyextError, match="without=.*names no component"):
        build_pipeline("flux", "tiny", without=("text_encoder_3",))


@pytest.mark.parametrize("native_bf16", [True, False], ids=["native_bf16", "no_native_bf16"])
def test_the_fp16_row_runs_only_where_it_differs_from_the_original_row(monkeypatch, native_bf16):
    """On a CPU without native bf16 the cpu preset's half rows run fp32, so the fp16 row (the original
    row's steps in the half dtype) would run the original row again: it says so instead. Where bf16
    is native it runs, in bf16; the rows with steps of their own run either way."""
    import pyext._compat

    monkeypatch.setattr(pyext._compat, "cpu_has_native_bf16", lambda: native_bf16)
    cpu = latency.preset_of("cpu", "sd15")
    assert latency.row_dtype("fp16", cpu) == (torch.bfloat16 if native_bf16 else torch.float32)
    reason = latency.unavailable("fp16", cpu)
    assert (reason is None) == native_bf16
    if reason:
        assert "float32" in reason and "original row's configuration" in reason
    assert latency.unavailable("original", cpu) is None and latency.unavailable("channels_last", cpu) is None
    assert latency.unavailable("fp16", latency.preset_of("tiny", "sd15")) is None  # emulated bf16: a row of its own
    assert latency.unavailable("fp16", latency.preset_of("gpu", "sd15")) is None  # fp16 on a GPU


@pytest.mark.skipif(not has_kernel("group_norm"), reason="pyext._C without group_norm")
def test_group_norm_bench_times_both_and_renders():
    """bench.group_norm on two small shapes, one round: each row times pyext and torch and renders."""
    from bench import group_norm

    rows = group_norm.measure((("a", (1, 64, 5, 7)), ("b", (2, 96, 3, 3))), torch.float32, repeats=1)
    assert [r["where"] for r in rows] == ["a", "b"]
    assert all(r["pyext_ms"] > 0 and r["torch_ms"] > 0 and r["pyext_vs_torch"]["range"][0] > 0 for r in rows)
    text = group_norm.render({"rows": rows, "repeats": 1, "machine": {"kernel_paths": {"simd": "avx2"}}})
    assert "| b | 2, 96, 3, 3 | float32 |" in text and "SIMD level: avx2" in text


@pytest.mark.skipif(not has_kernel("geglu"), reason="pyext._C without geglu")
def test_geglu_bench_times_pyext_eager_and_inductor_and_renders():
    """bench.geglu on two small shapes, one round: each row times the three and renders."""
    from bench import geglu

    rows = geglu.measure((("a", (1, 5, 14)), ("b", (2, 3, 40))), torch.float32, repeats=1)
    assert [r["where"] for r in rows] == ["a", "b"]
    assert all(r[f"{name}_ms"] > 0 for r in rows for name in ("pyext", "eager", "inductor"))
    assert all(r["pyext_vs_eager"]["range"][0] > 0 and r["pyext_vs_inductor"]["range"][0] > 0 for r in rows)
    text = geglu.render({"rows": rows, "repeats": 1, "machine": {"kernel_paths": {"simd": "avx2"}}})
    assert "| b | 2, 3, 40 | float32 |" in text and "SIMD level: avx2" in text


def test_compiled_precision_compares_each_variant_with_float64():
    """bench.compiled_precision on the tiny Flux, its eager variants (the compiled ones take
    minutes on a CPU): each gives finite errors per timestep, and the exact timestep removes
    the bf16 rounding of the timestep that the eager transformer does, so it is closer."""
    from bench import compiled_precision

    rows = compiled_precision.measure("tiny", ("eager", "eager_exact_timestep"))
    errors = {r["variant"]: r["relative_errors"] for r in rows}
    assert all(len(e) == len(compiled_precision.TIMESTEPS) and all(0 < x < 1 for x in e) for e in errors.values())
    assert max(errors["eager_exact_timestep"]) < max(errors["eager"])
    assert "| eager_exact_timestep |" in compiled_precision.render({"rows": rows})
