"""Backend selection for pyext ops, in the manner of xformers' fmha dispatch.

Each op has an ordered list of backends. A backend declares whether it can run in
this process at all (`unavailable()` returns a reason or None), whether it can
take a given input (`reasons(*args)` returns a list of reasons, empty when it can),
and why automatic choice should pass it by although it could run (`advisory(*args)`:
"slower than sdpa here", "the interpreter is for tests"); forcing it overrides those.
`select` picks the first backend that can, or honours a forced one, and otherwise
raises one error that shows the input and every backend's reasons.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


class PyextError(ValueError):
    """Bad input to a pyext op, or no backend that can run it."""


@dataclass
class Backend:
    name: str
    run: Callable
    reasons: Callable[..., list[str]] = lambda *args: []
    unavailable: Callable[[], str | None] = lambda: None
    advisory: Callable[..., list[str]] = lambda *args: []
    devices: tuple[str, ...] = ("cpu", "cuda")
    doc: str = ""


@dataclass
class Op:
    name: str
    backends: list[Backend] = field(default_factory=list)


_OPS: dict[str, Op] = {}


def register(op_name: str, backend: Backend) -> None:
    """Append a backend to an op; earlier registrations are preferred."""
    op = _OPS.setdefault(op_name, Op(op_name))
    if any(b.name == backend.name for b in op.backends):
        raise RuntimeError(f"pyext: backend {backend.name!r} registered twice for {op_name}")
    op.backends.append(backend)


def ops() -> dict[str, Op]:
    return dict(_OPS)


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        layout = "contiguous" if x.is_contiguous() else f"strides={tuple(x.stride())}"
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)} on {x.device} ({layout})"
    return repr(x)


def why_not(backend: Backend, args: tuple) -> list[str]:
    missing = backend.unavailable()
    if missing:
        return [missing]
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    if device not in backend.devices:
        return [f"runs on {'/'.join(backend.devices)}, not {device}"]
    return backend.reasons(*args)


def select(op_name: str, args: tuple, forced: str | None = None) -> Backend:
    op = _OPS[op_name]
    if forced is not None:
        match = [b for b in op.backends if b.name == forced]
        if not match:
            names = ", ".join(b.name for b in op.backends)
            raise PyextError(f"pyext.{op_name}: unknown backend {forced!r}; backends are: {names}")
        reasons = why_not(match[0], args)
        if reasons:
            raise PyextError(
                f"pyext.{op_name}: backend {forced!r} cannot run this input: {'; '.join(reasons)}"
                f"\n  inputs: {', '.join(describe(a) for a in args)}"
            )
        return match[0]
    report = []
    for backend in op.backends:
        reasons = why_not(backend, args) or backend.advisory(*args)
        if not reasons:
            return backend
        report.append(f"  {backend.name}: {'; '.join(reasons)}")
    raise PyextError(
        f"pyext.{op_name}: no backend can run these inputs: {', '.join(describe(a) for a in args)}\n"
        + "\n".join(report)
    )


def status(device: str) -> dict[str, list[dict]]:
    """For `python -m pyext info`: every op's backends and whether each can run on `device`."""
    out = {}
    for name, op in _OPS.items():
        rows = []
        for b in op.backends:
            reason = b.unavailable()
            if reason is None and device not in b.devices:
                reason = f"runs on {'/'.join(b.devices)} only"
            rows.append({"backend": b.name, "available": reason is None, "reason": reason or "", "doc": b.doc})
        out[name] = rows
    return out
