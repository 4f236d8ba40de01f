"""pyext.dispatch: self-check, measured choice, its cache, and run-time fallback, on a made-up op.

The op doubles its input; its backends are deliberately broken in the ways a GPU kernel can
be (raises, wrong numbers, raises only on large inputs) or merely slow, so every path of the
dispatcher runs on a CPU.
"""
import json
import os
import time

import pytest
import torch

from pyext import dispatch
from pyext.dispatch import Backend, PyextError

OP = "_test_double"


def close(out, ref, args):
    return None if torch.allclose(out, ref) else f"max error {(out - ref).abs().max().item():.3g}"


def make_op(*backends, pure=True):
    """Registers OP with `backends` then the reference; returns {name: call count}."""
    calls = {}

    def counted(name, fn):
        def run(x):
            calls[name] = calls.get(name, 0) + 1
            return fn(x)
        return run

    for b in backends + (Backend("reference", lambda x: x * 2, timed=False),):
        dispatch.register(OP, Backend(b.name, counted(b.name, b.run), slower=b.slower, timed=b.timed))
    dispatch.define(OP, sample=lambda args: (torch.arange(6.0),), close=close, pure=pure)
    return calls


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PYEXT_DISPATCH", raising=False)
    dispatch.reset()
    yield
    dispatch._OPS.pop(OP, None)
    dispatch.reset()


def raises(x):
    raise RuntimeError("ptxas: too much shared memory")


def test_a_backend_that_raises_is_marked_and_passed_over():
    make_op(Backend("broken", raises), Backend("good", lambda x: x + x))
    x = torch.randn(5)
    chosen = dispatch.select(OP, (x,))
    assert chosen.name == "good" and torch.equal(chosen.run(x), x * 2)
    [mark] = dispatch.unusable()
    assert mark["backend"] == "broken" and "too much shared memory" in mark["reason"]


def test_a_backend_with_wrong_numbers_is_marked_and_passed_over():
    make_op(Backend("wrong", lambda x: x * 2 + 1e-3), Backend("good", lambda x: x + x))
    assert dispatch.select(OP, (torch.randn(3),)).name == "good"
    assert "max error" in dispatch.unusable()[0]["reason"]


def test_the_mark_is_on_disk_for_later_processes(tmp_path):
    make_op(Backend("wrong", lambda x: x * 3), Backend("good", lambda x: x + x))
    dispatch.select(OP, (torch.randn(3),))
    [file] = os.listdir(tmp_path)
    saved = json.load(open(tmp_path / file))
    assert saved["versions"]["torch"] == torch.__version__
    assert list(saved["unusable"]) == [f"{OP}|wrong"]
    dispatch.reset()  # as a new process: no self-check runs again, the mark is read back
    assert dispatch.select(OP, (torch.randn(3),)).name == "good"


def test_a_run_time_failure_falls_back_and_the_answer_is_right():
    def large_fails(x):  # passes the small self-check, fails on the real input
        if x.numel() > 100:
            raise RuntimeError("illegal memory access")
        return x * 2

    make_op(Backend("fragile", large_fails), Backend("good", lambda x: x + x))
    x = torch.randn(1000)
    assert torch.equal(dispatch.select(OP, (x,)).run(x), x * 2)
    assert dispatch.unusable()[0]["reason"].startswith("raised at run time")
    assert dispatch.select(OP, (x,)).name == "good"


def test_an_impure_op_is_not_retried():
    make_op(Backend("fragile", lambda x: raises(x) if x.numel() > 100 else x * 2), pure=False)
    with pytest.raises(RuntimeError, match="shared memory"):
        dispatch.select(OP, (torch.randn(1000),)).run(torch.randn(1000))


def test_measured_mode_times_every_backend_and_caches_the_fastest(monkeypatch):
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")

    def slow(x):
        time.sleep(0.02)
        return x * 2

    calls = make_op(Backend("slow_first", slow), Backend("fast", lambda x: x + x))
    x = torch.randn(300)
    assert dispatch.select(OP, (x,)).name == "fast"
    [decision] = dispatch.decisions()
    assert decision["op"] == OP and decision["backend"] == "fast"
    assert decision["timings"]["slow_first"] > decision["timings"]["fast"] > 0
    assert set(decision["timings"]) == {"slow_first", "fast"}  # not the reference: timed=False
    before = dict(calls)
    dispatch.reset()
    assert dispatch.select(OP, (torch.randn(400),)).name == "fast"  # same bucket (512), from disk
    assert calls == before  # nothing re-timed or re-checked
    dispatch.select(OP, (torch.randn(700),))  # another bucket: measured anew
    assert len(dispatch.decisions()) == 2


def test_slower_is_followed_statically_and_measured_otherwise(monkeypatch):
    make_op(Backend("fast_but_flagged", lambda x: x + x, slower=lambda x: ["slower than good (measured)"]),
            Backend("good", lambda x: x * 2))
    x = torch.randn(8)
    assert dispatch.select(OP, (x,)).name == "good"
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    assert dispatch.select(OP, (x,)).name in {"fast_but_flagged", "good"}
    assert "fast_but_flagged" in dispatch.decisions()[0]["timings"]


def test_nothing_is_measured_while_compiling(monkeypatch):
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = make_op(Backend("broken", raises), Backend("good", lambda x: x + x))
    assert dispatch.select(OP, (torch.randn(4),)).name == "broken"  # static order, no self-check
    assert dispatch.decisions() == [] and calls == {}


def test_bad_mode_and_forced_backends():
    make_op(Backend("broken", raises))
    os.environ["PYEXT_DISPATCH"] = "fastest"
    try:
        with pytest.raises(PyextError, match="PYEXT_DISPATCH='fastest'.*measured, static"):
            dispatch.select(OP, (torch.randn(2),))
    finally:
        del os.environ["PYEXT_DISPATCH"]
    assert dispatch.select(OP, (torch.randn(2),), forced="broken").name == "broken"  # forcing skips the check
    assert dispatch.unusable() == []


def test_every_real_op_declares_a_self_check():
    import pyext  # noqa: F401  (registers the ops)

    for name, op in dispatch.ops().items():
        if name.startswith("_test"):
            continue
        assert op.sample is not None and op.close is not None, name
        assert any(b.name == op.reference for b in op.backends), name
