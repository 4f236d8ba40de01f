"""Conv2d/Linear weights packed once into oneDNN's layout, on the CPU (pyext.nn.packed)."""
from __future__ import annotations

import functools

import torch.nn as nn

from pyext.nn.packed import dtype_reason, pack, skip_reason, unpack
from pyext.techniques.base import Entry, PerComponent

AUTO_ROLES = ("denoiser", "vae", "controlnet")  # where convolutions and large GEMMs carry the time


def convs_it_packs(name: str, d) -> list[nn.Conv2d]:
    """The Conv2d layers of component `name` that Prepack will pack, as the modules are now."""
    module = d.components.modules[name]
    if Prepack().why_not(name, module, d):
        return []
    return [m for n, m in module.named_modules() if isinstance(m, nn.Conv2d) and skip_reason(m, n) is None]


class Prepack(PerComponent):
    """prepack="auto": the denoisers, VAEs and controlnets of a CPU pipeline; "on": every
    component on the CPU; "off". Not with compile="trace"/"compile": a trace records plain
    weights, and inductor's freezing packs them itself."""

    name = "prepack"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        report = pack(module)
        if report.packed:
            return self.applied(name, str(report), functools.partial(self._undo, module))
        if any(r == "already packed" for r in report.skipped.values()):
            return self.already(name, "weights packed before")
        reasons = sorted(set(report.skipped.values()))
        return self.skipped(name, "no packable layers (" + "; ".join(reasons[:3] or ["none"]) + ")")

    def why_not(self, name: str, module, d) -> str | None:
        reason = self.switch_reason(name, d, AUTO_ROLES)
        if reason:
            return reason
        if d.device.type != "cpu":
            return f"on {d.device.type}: oneDNN packing is for CPU pipelines"
        if d.options.compile in ("trace", "compile", "cudagraphs") and name in d.components.denoisers:
            return f"compile={d.options.compile!r} takes the weights as they are (inductor's freezing packs them itself)"
        return dtype_reason(d.dtype) if d.dtype is not None else None

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unpack(module))} weights plain again (exact: packing only reorders)"
