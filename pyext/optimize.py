"""pyext.optimize(pipe): one call that composes every technique on one pipeline instance.

    pipe = pyext.optimize(pipe)          # or optimize(pipe, OptimizeOptions(...)), optimize(pipe, fp8="denoiser")
    print(pyext.report(pipe))            # what was decided, applied, skipped and why
    pyext.restore(pipe)                  # undo, newest first

The options are checked when they are made (pyext.options), the pipeline is read and every
"auto" resolved before anything changes (pyext.decision), then each technique of
pyext.techniques applies itself and hands back its undo. Techniques that change modules run
with offload hooks suspended (pyext.offload), so offload may be enabled before or after. If a
technique fails, what this call did is undone before the error propagates. The state lives on
the pipeline (pyext._state, key "optimize"): `report` reads it, `restore` runs the undos, and a
second `optimize` gives what one call with its options would (see optimize).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch.nn as nn

from pyext import _state, memory, offload
from pyext._memory import release_freed_memory, release_mapped_pages, storage_spans
from pyext.decision import Decision, check_pipeline, decide
from pyext.dispatch import PyextError
from pyext.families import modules_of
from pyext.nn.stored import stored_bytes
from pyext.options import OptimizeOptions
from pyext.planner import FP8_ROLES
from pyext.techniques import TECHNIQUES, Entry
from pyext.techniques.base import Step

STATE = "optimize"


@dataclass
class State:
    decision: Decision
    entries: list[Entry] = field(default_factory=list)


def optimize(pipe, options: OptimizeOptions | None = None, **changes):
    """Make this pipeline faster and leaner in place; returns it. See OptimizeOptions.

    Called again on a pipeline it optimized, the result is that of one call with the new options:
    what the first call did is undone and done again as the new options say, except what cannot
    be undone exactly (a dtype cast or fp8 storage without keep_original_weights). Those the new
    options must ask for alike, else a PyextError says so before anything changes."""
    check_pipeline(pipe)
    opts = _options("pyext.optimize", options, changes)
    state = _state.get(pipe, STATE)
    again = state is not None
    if not again:
        decision = decide(pipe, opts)
        state = State(decision)
    else:  # refused before anything changes; decided again once the first call's exact changes are undone
        _check_again(state, decide(pipe, opts, state.decision.device))
        _undo(pipe, [e for e in state.entries if e.exact])
        state.entries = [e for e in state.entries if not e.exact]
        decision = _check_again(state, decide(pipe, opts, state.decision.device))
    release = memory.settings().release_after_optimize  # (pyext.memory: on unless turned off)
    before = storage_spans(modules_of(pipe).values()) if release else set()
    try:
        new = _apply(pipe, decision)
    except BaseException:
        if again:  # what stays of the earlier call: put the rest of it back as it was decided
            with contextlib.suppress(Exception):
                state.entries += _apply(pipe, state.decision)
            _state.put(pipe, STATE, state)
        raise
    state.decision = decision
    kept = {(e.component, e.technique) for e in state.entries}
    state.entries += [e for e in new if not (e.status == "already" and (e.component, e.technique) in kept)]
    _state.put(pipe, STATE, state)
    if release:
        release_freed_memory()
        release_mapped_pages(before, storage_spans(modules_of(pipe).values()))
    return pipe


def _options(where: str, options, changes: dict) -> OptimizeOptions:
    """`options` with `changes` applied, a new object: the caller's is never changed."""
    if options is not None and not isinstance(options, OptimizeOptions):
        raise PyextError(f"{where}: options={options!r} is not an OptimizeOptions; pass pyext.OptimizeOptions(...) "
                         f"or None, or each option as a keyword ({where}(pipe, fp8=\"denoiser\", ...))")
    return (options or OptimizeOptions()).replace(**changes)


@dataclass(frozen=True)
class OptimizePlan:
    """What `optimize` would do with these options: the decision (every "auto" resolved, the
    memory plan) and each technique's step per component, in the order they would run."""

    pipeline: str
    decision: Decision
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        lines = [f"pyext plan for {self.pipeline}", f"  {self.decision.describe()}", f"  {self.decision.plan.describe()}"]
        return "\n".join(lines + [f"  {s}" for s in self.steps])


def plan(pipe, options: OptimizeOptions | None = None, **changes) -> OptimizePlan:
    """What optimize(pipe, options, **changes) would do, decided before anything changes; this call
    changes nothing. A step "apply" means the technique will look inside that component (it may
    find nothing to change: the report then says why); "skip" gives the reason. The same
    PyextErrors as optimize's are raised for options the pipeline cannot take."""
    check_pipeline(pipe)
    opts = _options("pyext.plan", options, changes)
    state = _state.get(pipe, STATE)
    decision = decide(pipe, opts) if state is None else _check_again(state, decide(pipe, opts, state.decision.device))
    steps = tuple(step for technique in TECHNIQUES for step in technique.plan(pipe, decision))
    return OptimizePlan(type(pipe).__name__, decision, steps)


def _apply(pipe, decision: Decision) -> list[Entry]:
    """Every technique on the pipeline, module changes with offload hooks suspended; if one
    fails, what this call did is undone before the error propagates (never a half-changed pipeline)."""
    new: list[Entry] = []
    try:
        with offload.suspended(pipe):
            for technique in TECHNIQUES:
                if technique.changes_modules:
                    new += technique.apply(pipe, decision)
        for technique in TECHNIQUES:
            if not technique.changes_modules:
                new += technique.apply(pipe, decision)
    except BaseException:
        _undo(pipe, new)
        raise
    return new


def _check_again(state: State, decision: Decision) -> Decision:
    """The decision of a second optimize, given what the first did that cannot be undone exactly:
    the new options must keep it (same dtype; fp8 for the same components, by the same rule), or
    PyextError. An fp8="auto" asked again keeps the first call's resolution (and its plan): the
    planner now sees fp8 weights."""
    before = state.decision
    lossy = [e for e in state.entries if not e.exact]
    if any(e.technique == "fp8" for e in lossy) and decision.options.fp8 == before.options.fp8:
        decision = replace(decision, fp8=before.fp8, plan=before.plan)
    conflicts = []
    if any(e.technique == "dtype" for e in lossy) and decision.dtype != before.dtype:
        conflicts.append(f"dtype: the weights were cast to {before.dtype}, {decision.dtype or 'keep'} is asked")
    fp8_components = sorted(e.component for e in lossy if e.technique == "fp8")
    covered = FP8_ROLES[decision.fp8]
    lost = [c for c in fp8_components if decision.components.roles.get(c) not in covered]
    if lost:
        conflicts.append(f"fp8: {', '.join(lost)} store fp8 weights, fp8={decision.options.fp8!r} leaves them out")
    if fp8_components and decision.options.fp8_skip != before.options.fp8_skip:
        conflicts.append("fp8_skip: the fp8 layers were chosen with other patterns")
    if fp8_components and decision.options.fp8_layers != before.options.fp8_layers:
        conflicts.append(f"fp8_layers: the fp8 layers were chosen as {before.options.fp8_layers!r}")
    if conflicts:
        raise PyextError(
            "pyext.optimize: this pipeline was optimized before, and a second optimize cannot undo exactly what "
            f"the new options would change ({'; '.join(conflicts)}). Ask for the same dtype and fp8 again, or "
            "start from the original pipeline (load it again; or pass keep_original_weights=True to the first "
            "optimize, so that pyext.restore gives back the exact weights)")
    return decision


@dataclass
class Report:
    pipeline: str
    decision: str
    plan: str
    entries: list[Entry]
    weight_bytes: dict[str, int]

    def to_dict(self) -> dict:
        return dict(pipeline=self.pipeline, decision=self.decision, plan=self.plan,
                    entries=[e.to_dict() for e in self.entries], weight_bytes=self.weight_bytes)

    def __str__(self) -> str:
        lines = [f"pyext report for {self.pipeline}", f"  {self.decision}", f"  {self.plan}"]
        lines += [f"  {e.component:<15} {e.technique:<14} {e.status:<8} {e.detail}" for e in self.entries]
        total = sum(self.weight_bytes.values())
        lines.append("  weights: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in self.weight_bytes.items())
                     + f" (total {total / 2**20:.0f} MiB)")
        return "\n".join(lines)


def _weight_bytes(module: nn.Module) -> int:
    return sum(stored_bytes(t) for t in list(module.parameters()) + list(module.buffers()))


def report(pipe) -> Report:
    check_pipeline(pipe, "pyext.report")
    weights = {name: _weight_bytes(m) for name, m in modules_of(pipe).items()}
    state = _state.get(pipe, STATE)
    if state is None:
        return Report(type(pipe).__name__, "", "not optimized by pyext", [], weights)
    return Report(type(pipe).__name__, state.decision.describe(), state.decision.plan.describe(),
                  list(state.entries), weights)


def _undo(pipe, entries: list[Entry]) -> list[str]:
    """Run the undos of `entries`, newest first: module changes with offload hooks suspended,
    then placement (pyext's own offload and moves) outside."""
    done = [e for e in entries if e.undo is not None]
    notes = []
    with offload.suspended(pipe):
        notes += [f"{e.component}: {e.technique}: {e.undo()}" for e in reversed(done) if e.changes_modules]
    notes += [f"{e.component}: {e.technique}: {e.undo()}" for e in reversed(done) if not e.changes_modules]
    return notes


def restore(pipe) -> list[str]:
    """Undo what optimize did, newest first; returns what each undo did (and what stays lossy)."""
    check_pipeline(pipe, "pyext.restore")
    state = _state.pop(pipe, STATE)
    if state is None:
        return ["nothing to restore: pipeline was not optimized by pyext"]
    return _undo(pipe, state.entries)
