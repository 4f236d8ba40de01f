"""Typed options: every bad value is refused with a PyextError naming the option, the value and
what is allowed, before anything changes; the caller's options object is never mutated."""
import re

import pytest
import torch
import torch.nn as nn

import pyext
from pyext import PyextError
from pyext.offline import build_pipeline
from pyext.options import OptimizeOptions

BAD = [
    ("offload", "x"), ("offload", "none"), ("compile", "fast"), ("compile", None), ("vae_tiling", "maybe"),
    ("vae_tiling", True), ("channels_last", "yes"), ("channels_last", True), ("vae_slicing", 1),
    ("height", -64), ("height", 0), ("height", 64.0), ("height", True), ("width", 10**6), ("frames", 0),
    ("batch", 0), ("batch", None), ("devices", 0), ("devices", "2"), ("devices", True), ("memory_budget", -3),
    ("memory_budget", "lots"), ("memory_budget", 0),
    ("attention", "nope"), ("attention", None), ("fp8", "maybe"), ("fp8", True), ("dtype", "fp16"),
    ("dtype", torch.int8), ("fp8_skip", "norm"), ("fp8_skip", ("(",)), ("fp8_layers", "conv"), ("fp8_layers", ("linear",)),
    ("keep_original_weights", "yes"),
    ("device", "gpu"), ("compile_backend", ""),
]


@pytest.mark.parametrize("option,value", BAD, ids=[f"{o}={v!r}" for o, v in BAD])
def test_bad_values_are_refused_by_name(option, value):
    with pytest.raises(PyextError) as err:
        OptimizeOptions(**{option: value})
    message = str(err.value)
    assert f"option {option}=" in message and "allowed" in message and repr(value) in message


def state(pipe):
    return {name: {k: (v.dtype, v.stride(), v.clone()) for k, v in m.state_dict().items()}
            for name, m in pipe.components.items() if isinstance(m, nn.Module)}


def same(a, b):
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
                                           for x, y in zip(a[n].values(), b[n].values())) for n in a)


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline("sd15", "tiny")


@pytest.mark.parametrize("option,value", [("attention", "nope"), ("fp8", "maybe"), ("offload", "x"),
                                          ("height", -64), ("unknown_option", 1)])
def test_optimize_refuses_before_changing_anything(pipe, option, value):
    before = state(pipe)
    processors = dict(pipe.unet.attn_processors)
    with pytest.raises(PyextError, match=option):
        pyext.optimize(pipe, **{option: value})
    assert same(before, state(pipe))  # no dtype, channels-last or fp8 change
    assert pipe.unet.attn_processors == processors
    assert not any(m._forward_pre_hooks for m in pipe.unet.modules())
    assert pyext.report(pipe).plan == "not optimized by pyext"


@pytest.mark.parametrize("call", [pyext.optimize, pyext.plan])
def test_options_that_are_not_an_options_object_are_refused(pipe, call):
    before = state(pipe)
    for options in ("fast", {"fp8": "denoiser"}):
        message = rf"pyext\.{call.__name__}: options={re.escape(repr(options))} is not an OptimizeOptions.*keyword"
        with pytest.raises(PyextError, match=message):
            call(pipe, options)
    assert same(before, state(pipe))


def test_unavailable_backend_is_refused_before_changes(pipe):
    before = state(pipe)
    with pytest.raises(PyextError, match="attention='triton' is unavailable"):
        pyext.optimize(pipe, attention="triton")  # no CUDA here
    assert same(before, state(pipe))


def test_a_failing_technique_is_rolled_back(monkeypatch):
    from pyext.techniques.routing import Attention

    pipe = build_pipeline("sd15", "tiny")
    before = state(pipe)

    def broken(self, pipe, d):
        raise RuntimeError("boom")

    monkeypatch.setattr(Attention, "apply", broken)  # runs after dtype, fp8 and channels-last
    with pytest.raises(RuntimeError, match="boom"):
        pyext.optimize(pipe, fp8="denoiser", keep_original_weights=True)
    assert same(before, state(pipe))
    assert not any(isinstance(m, pyext.FP8Linear) for m in pipe.unet.modules())


def test_the_callers_options_are_not_mutated(pipe):
    opts = OptimizeOptions(dtype="keep")
    pyext.optimize(build_pipeline("sd15", "tiny"), opts, fp8="off", attention="off")
    assert opts == OptimizeOptions(dtype="keep") and opts.fp8 == "auto"
    with pytest.raises(Exception):
        opts.fp8 = "off"  # frozen


def test_not_a_pipeline_is_a_clear_error():
    for call in (pyext.optimize, pyext.report, pyext.restore):
        for obj in (None, nn.Linear(2, 2)):
            with pytest.raises(PyextError, match="expected a diffusers pipeline"):
                call(obj)
