"""Attention routing: SDPA calls of diffusers attention layers computed by pyext's kernel."""
from __future__ import annotations

import functools
from collections import Counter

from pyext import _state, attention
from pyext.techniques.base import Entry, Step, Technique


class Attention(Technique):
    """Every diffusers attention layer whose processor ends in SDPA, directly (the
    AttnProcessor2_0 family) or through diffusers' attention dispatcher (dispatch_attention_fn,
    native backend), is routed to pyext.ops.attention; see pyext.attention. "applied" counts
    the layers actually routed; a component with none keeps no hook."""

    name = "attention"

    def plan(self, pipe, d) -> list[Step]:
        if d.options.attention == "off":
            return [self.wont("*", "attention='off'")]
        return [self.will(name) for name in d.components.modules]

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        backend = None if d.options.attention == "auto" else d.options.attention
        layers = attention.attention_layers(module)
        before = {id(m): _state.get(m, attention.STATE) for m in layers.values()}
        if before and all(s is not None and s.backend == backend for s in before.values()):
            return self.already(name, f"{len(layers)} layers routed before")
        report = attention.apply(module, backend=backend).components[type(module).__name__]
        if not report.patched:
            attention.remove(module)
            return self.skipped(name, report.skipped.get("*") or _summary(report.skipped))
        detail = f"{report.patched} layers routed to pyext attention (backend {backend or 'auto'})"
        if report.skipped:
            detail += f"; not routed: {_summary(report.skipped)}"
        return self.applied(name, detail, functools.partial(_remove, module))


def _remove(module) -> str:
    return f"pyext attention hooks removed from {len(attention.remove(module))} layers"


def _summary(skipped: dict) -> str:
    return "; ".join(f"{n} layers: {why}" for why, n in Counter(skipped.values()).items())
