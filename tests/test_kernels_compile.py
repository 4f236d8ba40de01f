"""Every GPU kernel compiles for sm_80 and sm_90 here, without a GPU (pyext.kernels.compile_check):
every Triton config of every kernel, and the CUDA C++ kernels through nvcc; no default config
spills registers, and no kernel asks for more shared memory than its arch has."""
import json

import pytest
import torch

pytest.importorskip("triton")

from pyext.kernels import compile_check  # noqa: E402

pytestmark = pytest.mark.slow  # make test runs it; make test-fast leaves it out

ENTRIES = []


@pytest.fixture(scope="module")
def entries():
    if not ENTRIES:
        ENTRIES.extend(compile_check.check_all(jobs=2))
    return ENTRIES


def test_every_config_compiles_for_both_archs_without_spilling_defaults(entries):
    assert compile_check.problems(entries) == []
    triton_keys = {(e["kernel"], e["variant"], e["config"]) for e in entries if e["kind"] == "triton"}
    for arch in ("sm_80", "sm_90"):
        assert {(e["kernel"], e["variant"], e["config"]) for e in entries
                if e["kind"] == "triton" and e["arch"] == arch} == triton_keys
    specs = compile_check.triton_specs()
    assert len(triton_keys) == len(specs)
    assert {s.function for s in specs} == {"_attention_fwd", "_fp8_linear_kernel", "_gn_stats", "_gn_merge", "_gn_apply",
                                           "_quantize_rows_kernel", "_geglu_kernel"}
    # each variant has exactly one default, and it is the first candidate
    for variant in {(s.function, s.variant) for s in specs}:
        assert [s.default for s in specs if (s.function, s.variant) == variant][0]
        assert sum(s.default for s in specs if (s.function, s.variant) == variant) == 1


def test_entries_say_what_recompiles_them(entries):
    e = next(e for e in entries if e["kind"] == "triton" and e["variant"] == "fp16 d64" and e["default"])
    assert e["kernel"] == "pyext.kernels.attention:_attention_fwd" and e["constexprs"]["D"] == 64
    assert e["signature"]["Q"] == "*fp16" and e["signature"]["D"] == "constexpr"
    assert e["num_warps"] >= 1 and e["num_stages"] >= 1 and e["registers"] > 0
    cuda = [e for e in entries if e["kind"] == "cuda"]
    if cuda and cuda[0]["error"] != "nvcc not found":
        assert all(e["compiled"] and e["registers"] > 0 for e in cuda)
        assert {e["arch"] for e in cuda} == {"sm_80", "sm_90"}


def test_a_broken_config_is_reported_not_raised():
    from pyext.kernels import attention, config

    bad = config(4, 2, BLOCK_M=64, BLOCK_N=48)  # tl.arange needs a power of two
    sig, const = attention.signature(torch.float16, 64, bad)
    spec = compile_check.Spec(attention.__name__, "_attention_fwd", "fp16 d64", bad, True, sig, const)
    entry = compile_check.compile_triton(spec, 90)
    assert not entry["compiled"] and entry["error"]
    assert compile_check.problems([entry])[0].endswith(entry["error"])


def test_spills_and_shared_memory_are_problems():
    base = {"kernel": "k", "variant": "", "config": "c", "compiled": True, "registers": 255, "error": ""}
    assert compile_check.problems([dict(base, arch="sm_90", default=True, spill_bytes=8, shared_bytes=0)])
    assert not compile_check.problems([dict(base, arch="sm_90", default=False, spill_bytes=8, shared_bytes=0)])
    assert compile_check.problems([dict(base, arch="sm_80", default=False, spill_bytes=0,
                                        shared_bytes=compile_check.SHARED_LIMIT[80] + 1)])


def test_the_cli_prints_the_check_as_json(entries, monkeypatch, capsys):
    from pyext import __main__ as cli

    monkeypatch.setattr(compile_check, "check_all", lambda **kw: entries)  # the check above, not again
    assert cli.main(["kernels", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == entries


def test_plan_is_a_dry_run_with_the_gpu_dtype(capsys):
    from pyext import __main__ as cli

    assert cli.main(["plan", "--json", "--arch", "sd15", "--device", "cuda", "--capability", "9.0"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["dtype"] == "bfloat16" and row["capability"] == [9, 0] and set(row["plans"]) >= {"8GB"}
    assert cli.main(["plan", "--json", "--arch", "sd15", "--capability", "7.5"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["dtype"] == "float16"
