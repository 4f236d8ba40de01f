"""pyext.dispatch: self-check, measured choice, its cache, and run-time fallback, on a made-up op;
then every real op's backends on the cases they declare.

The made-up op doubles its input; its backends are deliberately broken in the ways a GPU kernel
can be (raises, wrong numbers, raises only on large inputs) or merely slow, so every path of the
dispatcher runs on a CPU.
"""
import json
import os
import time
import warnings
from dataclasses import replace

import pytest
import torch

from pyext import dispatch
from pyext.dispatch import Backend, PyextError
from pyext.graphs import CudaGraph
from pyext.kernels import interpreter_advisory
from tests.conftest import run_in_triton_interpreter

OP = "_test_double"


def close(out, ref, args):
    return None if torch.allclose(out, ref) else f"max error {(out - ref).abs().max().item():.3g}"


def make_op(*backends, pure=True, check=None):
    """Registers OP with `backends` then the reference; returns {name: call count}."""
    calls = {}

    def counted(name, fn):
        def run(x):
            calls[name] = calls.get(name, 0) + 1
            return fn(x)
        return run

    for b in backends + (Backend("reference", lambda x: x * 2, timed=False),):
        dispatch.register(OP, replace(b, run=counted(b.name, b.run)))
    dispatch.define(OP, sample=lambda args: (torch.arange(6.0, dtype=args[0].dtype),), close=close, pure=pure,
                    check=check)
    return calls


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PYEXT_DISPATCH", "static")  # the suite's mode (conftest); tests of measured set it
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
    assert mark["variant"] == "('float32', 5)" and mark["time"][:4].isdigit()


def test_a_backend_with_wrong_numbers_is_marked_and_passed_over():
    make_op(Backend("wrong", lambda x: x * 2 + 1e-3), Backend("good", lambda x: x + x))
    assert dispatch.select(OP, (torch.randn(3),)).name == "good"
    assert "max error" in dispatch.unusable()[0]["reason"]


def test_a_mark_holds_for_its_variant_only():
    make_op(Backend("no_half", lambda x: raises(x) if x.dtype == torch.float16 else x * 2),
            Backend("good", lambda x: x + x))
    assert dispatch.select(OP, (torch.randn(3).half(),)).name == "good"
    assert dispatch.select(OP, (torch.randn(3),)).name == "no_half"
    [mark] = dispatch.unusable()
    assert "float16" in mark["variant"]


def test_the_mark_is_on_disk_and_checked_again_by_a_later_process(tmp_path):
    calls = make_op(Backend("wrong", lambda x: x * 3), Backend("good", lambda x: x + x))
    dispatch.select(OP, (torch.randn(3),))
    [file] = os.listdir(tmp_path)
    saved = json.load(open(tmp_path / file))
    assert saved["versions"]["torch"] == torch.__version__
    assert list(saved["unusable"]) == [f"{OP}|wrong|('float32', 3)"]
    assert calls["wrong"] == 1
    dispatch.select(OP, (torch.randn(3),))
    assert calls["wrong"] == 1  # this process does not check it again
    dispatch.reset()  # as a new process: the mark is read back and checked once more
    assert dispatch.select(OP, (torch.randn(5, 3),)).name == "good"
    assert calls["wrong"] == 2 and len(dispatch.unusable()) == 1
    dispatch.select(OP, (torch.randn(7, 3),))
    assert calls["wrong"] == 2


def test_a_mark_that_no_longer_holds_is_dropped_by_a_later_process():
    behaviour = {"fixed": False}
    make_op(Backend("flaky", lambda x: x * 2 if behaviour["fixed"] else raises(x)), Backend("good", lambda x: x + x))
    assert dispatch.select(OP, (torch.randn(3),)).name == "good"
    behaviour["fixed"] = True  # a driver update, a rebuilt kernel: the next process sees it work
    dispatch.reset()
    assert dispatch.select(OP, (torch.randn(3),)).name == "flaky"
    assert dispatch.unusable() == []


def test_clear_marks_forgets_them_everywhere(tmp_path):
    make_op(Backend("broken", raises), Backend("good", lambda x: x + x))
    dispatch.select(OP, (torch.randn(3),))
    assert dispatch.clear_marks() == 1
    dispatch.reset()
    assert dispatch.unusable() == []


def test_bad_input_is_refused_before_any_choice_and_marks_nothing():
    def check(x):
        if x.dim() != 1:
            raise PyextError(f"pyext.{OP}: x must be 1-D")

    calls = make_op(Backend("fast", lambda x: x + x), check=check)
    with pytest.raises(PyextError, match="must be 1-D"):
        dispatch.select(OP, (torch.randn(2, 2),))
    assert calls == {} and dispatch.unusable() == []
    assert dispatch.select(OP, (torch.randn(2),)).name == "fast"


def test_a_run_time_failure_falls_back_marks_nothing_and_warns_once():
    def large_fails(x):  # passes the small self-check, fails on the real input
        if x.numel() > 100:
            raise RuntimeError("illegal memory access")
        return x * 2

    calls = make_op(Backend("fragile", large_fails), Backend("good", lambda x: x + x))
    x = torch.randn(1000)
    with pytest.warns(RuntimeWarning, match="backend 'fragile' raised RuntimeError.*next backend"):
        assert torch.equal(dispatch.select(OP, (x,)).run(x), x * 2)
    assert dispatch.unusable() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(dispatch.select(OP, (x,)).run(x), x * 2)  # no second warning
    small = torch.randn(10)
    assert dispatch.select(OP, (small,)).name == "fragile"  # the fast backend stays the choice


def test_after_a_run_time_failure_the_signature_keeps_the_next_backend():
    calls = make_op(Backend("fragile", lambda x: raises(x) if x.numel() > 100 else x * 2),
                    Backend("good", lambda x: x + x))
    x = torch.randn(1000)
    with pytest.warns(RuntimeWarning):
        dispatch.select(OP, (x,)).run(x)
    failed = calls["fragile"]
    assert dispatch.select(OP, (x,)).name == "good"
    dispatch.select(OP, (x,)).run(x)
    assert calls["fragile"] == failed  # not tried again for this signature


def test_the_choices_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "CHOSEN_MAX", 4)
    make_op(Backend("fast", lambda x: x + x))
    for n in range(1, 12):
        dispatch.select(OP, (torch.randn(n),))
    assert len(dispatch._CHOSEN) <= 4
    assert dispatch.select(OP, (torch.randn(1),)).name == "fast"  # dropped, chosen again


def test_an_impure_op_is_not_retried():
    make_op(Backend("fragile", lambda x: raises(x) if x.numel() > 100 else x * 2), pure=False)
    with pytest.raises(RuntimeError, match="shared memory"):
        dispatch.select(OP, (torch.randn(1000),)).run(torch.randn(1000))


def test_a_repeated_signature_does_no_reasoning():
    asked = []

    def reasons(x):
        asked.append(tuple(x.shape))
        return [] if x.dim() == 1 else ["1-D only"]

    make_op(Backend("fast", lambda x: x + x, reasons=reasons))
    for _ in range(3):
        assert dispatch.select(OP, (torch.randn(4),)).name == "fast"
    assert asked == [(4,)]
    assert dispatch.select(OP, (torch.randn(2, 2),)).name == "reference"
    assert dispatch.select(OP, (torch.randn(4).as_strided((2,), (2,)),)).name == "fast"  # other strides: asked anew
    assert asked == [(4,), (2, 2), (2,)]


class _Trap:
    """Stands for the lock and the environment: any use fails the test."""

    def __init__(self, what):
        self.what = what

    def __getattr__(self, name):
        raise AssertionError(f"a repeated call used {self.what}.{name}")

    def __enter__(self):
        raise AssertionError(f"a repeated call took {self.what}")


def test_a_repeated_signature_is_validated_once_and_takes_no_lock_nor_environment(monkeypatch):
    validated = []
    make_op(Backend("fast", lambda x: x + x), check=lambda x: validated.append(tuple(x.shape)))
    assert dispatch.select(OP, (torch.randn(4),)).name == "fast"
    with monkeypatch.context() as traps:
        traps.setattr(dispatch, "_LOCK", _Trap("the dispatch lock"))
        traps.setattr(dispatch.os, "environ", _Trap("os.environ"))
        for _ in range(3):
            assert dispatch.select(OP, (torch.randn(4),)).name == "fast"
    assert validated == [(4,)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_float_argument_is_validated_whatever_was_kept_before(bad):
    x, gamma = torch.randn(1, 4, 3, 3), torch.ones(4)
    torch.ops.pyext.group_norm(x, 2, gamma, gamma, None, 1e-5, False, None)
    with pytest.raises(PyextError, match="eps"):
        torch.ops.pyext.group_norm(x, 2, gamma, gamma, None, bad, False, None)
    q = torch.randn(1, 1, 3, 8)
    torch.ops.pyext.attention(q, q, q, 0.5, None)
    if bad != bad or abs(bad) == float("inf"):
        with pytest.raises(PyextError, match="scale"):
            torch.ops.pyext.attention(q, q, q, bad, None)
    else:  # a negative or zero scale is valid
        torch.testing.assert_close(torch.ops.pyext.attention(q, q, q, bad, None),
                                   torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=bad))


def test_a_guard_on_values_is_asked_on_every_call_and_never_cached():
    guarded = []

    def guard(x):
        guarded.append(1)
        return ["holds NaN"] if x.isnan().any() else []

    make_op(Backend("fast", lambda x: x + x, guard=guard))
    ok, bad = torch.ones(4), torch.full((4,), float("nan"))
    assert dispatch.select(OP, (bad,)).name == "reference"
    assert dispatch.select(OP, (ok,)).name == "fast"
    assert dispatch.select(OP, (bad,)).name == "reference"
    assert dispatch.select(OP, (ok,)).name == "fast"
    assert len(guarded) >= 4  # once per call at least


def test_measured_mode_counts_a_guards_pass_in_the_time_of_its_backend(monkeypatch):
    """A guard runs on every call of the backend it guards, so the measurement times it too: a
    backend whose run is fast but whose guard is slow loses to a plain one."""
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")

    def slow_guard(x):
        time.sleep(0.02)
        return []

    make_op(Backend("fast_run_slow_guard", lambda x: x + x, guard=slow_guard), Backend("plain", lambda x: x * 2))
    assert dispatch.select(OP, (torch.randn(300),)).name == "plain"
    assert dispatch.decisions()[0]["timings"]["fast_run_slow_guard"] >= 0.02


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


def test_kernel_configs_checked_against_a_reference_each_on_their_own(monkeypatch):
    """A compiler can miscompile a launch config, the default among them: with a check, the default
    is judged like the others instead of being the yardstick the right ones are rejected against."""
    from pyext.kernels import config, relative_close, tune

    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    x = torch.randn(64)
    wrong, right, other = config(4, 3, BLOCK=64), config(4, 2, BLOCK=32), config(8, 2, BLOCK=64)
    outputs = {wrong: x * 3, right: x * 2, other: x * 2}
    assert tune("_test_kernel", "plain", torch.device("cpu"), [wrong, right], outputs.get) == wrong
    chosen = tune("_test_kernel", "checked", torch.device("cpu"), [wrong, right, other], outputs.get,
                  check=lambda out: relative_close(out, x * 2))
    assert chosen in (right, other)
    decision = next(d for d in dispatch.decisions() if d["key"] == "checked")
    assert set(decision["timings"]) == {right.label, other.label}
    assert "max error" in decision["rejected"][wrong.label]


def test_kernel_outputs_agree_where_both_hold_the_same_nan_or_inf():
    from pyext.kernels import relative_close

    ref = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert relative_close(ref.clone(), ref) is None
    assert relative_close(ref + torch.tensor([0.005, 0, 0, 0]), ref) is None
    assert relative_close(torch.tensor([1.0, 0.0, float("inf"), -2.0]), ref) == "max error nan"
    assert relative_close(torch.tensor([1.0, float("nan"), 5.0, -2.0]), ref) == "max error inf"
    assert "max error 0.5" == relative_close(ref + torch.tensor([0.5, 0, 0, 0]), ref)


def test_slower_is_followed_statically_and_measured_otherwise(monkeypatch):
    make_op(Backend("fast_but_flagged", lambda x: x + x, slower=lambda x: ["slower than good (measured)"]),
            Backend("good", lambda x: x * 2))
    x = torch.randn(8)
    assert dispatch.select(OP, (x,)).name == "good"
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    dispatch.reset()
    assert dispatch.select(OP, (x,)).name in {"fast_but_flagged", "good"}
    assert "fast_but_flagged" in dispatch.decisions()[0]["timings"]


def test_nothing_is_measured_while_compiling(monkeypatch):
    calls = make_op(Backend("broken", raises), Backend("good", lambda x: x + x))
    with monkeypatch.context() as compiling:  # (undoes only its own changes: the cache dir stays the test's)
        compiling.setenv("PYEXT_DISPATCH", "measured")
        compiling.setattr(torch.compiler, "is_compiling", lambda: True)
        assert dispatch.select(OP, (torch.randn(4),)).name == "broken"  # static order, no self-check
        assert dispatch.decisions() == [] and calls == {}
    assert dispatch.select(OP, (torch.randn(4),)).name == "good"  # the traced choice was not kept


def test_bad_mode_and_forced_backends(monkeypatch):
    make_op(Backend("broken", raises))
    with monkeypatch.context() as bad:
        bad.setenv("PYEXT_DISPATCH", "fastest")
        with pytest.raises(PyextError, match="PYEXT_DISPATCH='fastest'.*measured, static"):
            dispatch.select(OP, (torch.randn(2),))
    assert dispatch.select(OP, (torch.randn(2),), forced="broken").name == "broken"  # forcing skips the check
    assert dispatch.unusable() == []


def real_ops() -> dict[str, dispatch.Op]:
    return {name: op for name, op in dispatch.ops().items() if not name.startswith("_test")}


def test_every_real_op_declares_a_self_check_and_its_backends_data():
    for name, op in real_ops().items():
        assert op.sample is not None and op.close is not None and op.example is not None, name
        assert any(b.name == op.reference for b in op.backends), name
        for b in op.backends:
            assert b.dtypes and b.test_shapes, (name, b.name)
            assert set(b.dtypes) <= set(dispatch.reference(op).dtypes), (name, b.name)


# ----------------------------------------------------------------------------- the real ops' declared cases
# Every backend runs on each test shape it declares in each dtype it declares, against its op's
# reference within the op's tolerance (Op.close, the self-check's), on a GPU where there is one.

def device_for(backend: Backend) -> str | None:
    """Where this process runs `backend`'s tests: a GPU if it has one and the backend runs there."""
    return next((d for d in ("cuda", "cpu") if d in backend.devices and (d == "cpu" or torch.cuda.is_available())),
                None)


def case_problem(op: dispatch.Op, backend: Backend, dtype: torch.dtype, spec, device: str) -> str | None:
    """Why `backend` fails a declared case (it refuses it, or misses the reference), or None."""
    args = op.example(spec, dtype, device)
    refused = dispatch.input_reasons(op, backend, args)
    if refused:
        return f"refuses a declared case: {refused}"
    return op.close(dispatch.run_on_copy(op, backend, args), dispatch.run_on_copy(op, dispatch.reference(op), args),
                    args)


def agreement_problems(op: dispatch.Op, backend: Backend, device: str) -> list[str]:
    """On each test shape, every dtype the op takes: refused exactly when the backend does not declare it."""
    problems = []
    for spec in backend.test_shapes:
        for dtype in dispatch.reference(op).dtypes:
            refused = dispatch.input_reasons(op, backend, op.example(spec, dtype, device))
            if bool(refused) == (dtype in backend.dtypes):
                problems.append(f"{op.name} {backend.name} {spec} {dtype}: declared {dtype in backend.dtypes}, "
                                f"refused {refused}")
    return problems


def declared_cases():
    for name, op in real_ops().items():
        for b in op.backends:
            if b.name != op.reference:
                for dtype in b.dtypes:
                    for i, spec in enumerate(b.test_shapes):
                        yield pytest.param(name, b.name, dtype, spec, id=f"{name}-{b.name}-{str(dtype)[6:]}-{i}")


def lookup(op_name: str, backend_name: str) -> tuple[dispatch.Op, Backend]:
    op = dispatch.ops()[op_name]
    return op, next(b for b in op.backends if b.name == backend_name)


@pytest.mark.cuda
@pytest.mark.parametrize("op_name,backend_name,dtype,spec", list(declared_cases()))
def test_declared_cases_match_the_reference(op_name, backend_name, dtype, spec):
    op, backend = lookup(op_name, backend_name)
    missing, device = backend.unavailable(), device_for(backend)
    if missing or device is None:
        pytest.skip(missing or f"runs on {'/'.join(backend.devices)}, which this process lacks")
    assert case_problem(op, backend, dtype, spec, device) is None


@pytest.mark.cuda
@pytest.mark.parametrize("op_name,backend_name", [(n, b.name) for n, op in real_ops().items() for b in op.backends])
def test_declared_dtypes_are_what_the_backend_takes(op_name, backend_name):
    op, backend = lookup(op_name, backend_name)
    device = device_for(backend)
    if device is None:
        pytest.skip(f"runs on {'/'.join(backend.devices)}, which this process lacks")
    assert agreement_problems(op, backend, device) == []


def cuda_cases():
    for name, op in real_ops().items():
        for b in op.backends:
            if "cuda" in b.devices and b.name != op.reference:
                for dtype in b.dtypes:
                    yield pytest.param(name, b.name, dtype, id=f"{name}-{b.name}-{str(dtype)[6:]}")


@pytest.mark.cuda
@pytest.mark.parametrize("op_name,backend_name,dtype", list(cuda_cases()))
def test_cuda_backends_replay_from_a_cuda_graph_what_they_compute_eagerly(op_name, backend_name, dtype):
    """Captured in a CUDA graph on the first declared case, then replayed on other values copied
    into the captured inputs: the replay gives what an eager call gives on those values. A kernel
    that waits on the host or allocates host memory per call fails the capture; one that bakes a
    value in at capture fails the comparison."""
    op, backend = lookup(op_name, backend_name)
    missing = backend.unavailable()
    if missing or not torch.cuda.is_available():
        pytest.skip(missing or "needs a GPU")
    static = op.example(backend.test_shapes[0], dtype, "cuda")
    assert not dispatch.input_reasons(op, backend, static)
    fresh = tuple(torch.roll(a, 1, -1) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() else a
                  for a in static)  # the same values elsewhere: valid inputs, another answer
    graph = CudaGraph(lambda inputs: backend.run(*inputs), list(static), None)  # as compile="capture" captures
    for dst, src in zip(static, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    captured = graph.replay()
    torch.cuda.synchronize()
    assert op.close(op.output(static, captured), dispatch.run_on_copy(op, backend, fresh), fresh) is None


@pytest.mark.slow
def test_interpreter_backends_on_their_declared_cases():
    """The Triton backends run on CPU only in Triton's interpreter (a subprocess: TRITON_INTERPRET
    must be set before triton is imported), where they declare float16/float32 only."""
    problems = run_in_triton_interpreter("""
import json, torch
from pyext.kernels import interpreter_advisory
from tests.test_dispatch import agreement_problems, case_problem, real_ops
torch.manual_seed(0)
problems, cases = [], 0
for op in real_ops().values():
    for b in op.backends:
        if b.advisory is interpreter_advisory:
            problems += agreement_problems(op, b, "cpu")
            for dtype in b.dtypes:
                for spec in b.test_shapes:
                    cases += 1
                    problem = case_problem(op, b, dtype, spec, "cpu")
                    problems += [f"{op.name} {b.name} {dtype} {spec}: {problem}"] if problem else []
print(json.dumps(dict(cases=cases, problems=problems)))
""")
    triton = [b for op in real_ops().values() for b in op.backends if b.advisory is interpreter_advisory]
    assert problems["problems"] == [] and problems["cases"] >= len(triton)


def test_the_default_mode_measures_on_every_device(monkeypatch):
    """No rule measured on another machine decides: without PYEXT_DISPATCH the CPU times too."""
    monkeypatch.delenv("PYEXT_DISPATCH")
    assert dispatch.mode(torch.device("cpu")) == dispatch.mode(torch.device("cuda")) == "measured"
    make_op(Backend("slow", lambda x: (time.sleep(0.02), x + x)[1]), Backend("fast", lambda x: x * 2))
    assert dispatch.select(OP, (torch.randn(8),)).name == "fast"
    [decision] = dispatch.decisions()
    assert set(decision["timings"]) == {"slow", "fast"} and decision["time"][:4].isdigit()


def test_a_cpu_cache_is_per_cpu_model_flags_and_threads(monkeypatch):
    """Decisions made on one CPU, or with another thread count, never decide for another."""
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    make_op(Backend("a", lambda x: x + x), Backend("b", lambda x: x * 2))
    cpu = torch.device("cpu")
    here = dispatch.device_name(cpu)
    model, flags = dispatch.cpu_model()
    assert model in here and all(f in here for f in flags) and f"{torch.get_num_threads()} threads" in here
    dispatch.select(OP, (torch.randn(8),))
    assert [d["device"] for d in dispatch.decisions()] == [here]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert dispatch.device_name(cpu) != here
        dispatch.select(OP, (torch.randn(9),))  # another signature, so not a kept choice
        assert sorted(d["device"] for d in dispatch.decisions()) == sorted([here, dispatch.device_name(cpu)])
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(dispatch, "cpu_model", lambda: ("Other CPU", ("avx2", "amx_bf16")))
    assert dispatch.device_name(cpu) != here and "amx_bf16" in dispatch.device_name(cpu)


def test_measuring_a_key_costs_one_call_of_a_candidate_that_cannot_win(monkeypatch):
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    runs = {"fast": 0, "slow": 0}

    def fast():
        runs["fast"] += 1

    def slow():
        runs["slow"] += 1
        time.sleep(0.05)

    decision = dispatch.measured_choice("made_up", "k", torch.device("cpu"), {"fast": fast, "slow": slow})
    assert decision["backend"] == "fast" and runs == {"fast": 1 + dispatch.TIMED_RUNS, "slow": 1}


def test_a_cpus_timed_runs_take_the_candidates_in_turn(monkeypatch):
    """Rounds of one call each (A, B, A, B, ...): a slow spell of a shared CPU slows every candidate."""
    monkeypatch.setenv("PYEXT_DISPATCH", "measured")
    # Calls of a microsecond: a scheduling hiccup in one first call would make it SLOWER_BY times
    # the fastest, and drop it from the rounds this test is about.
    monkeypatch.setattr(dispatch, "SLOWER_BY", float("inf"))
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    dispatch.measured_choice("made_up_rounds", "k", torch.device("cpu"), runs)
    assert calls == ["a", "b", "c"] * (1 + dispatch.TIMED_RUNS)
