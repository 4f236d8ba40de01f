"""GroupNorm + SiLU fused into one pass in diffusers' ResnetBlock2D blocks (pyext.nn.fused_norm)."""
from __future__ import annotations

import functools

from pyext.nn.fused_norm import fuse_norms, is_fused, unfuse_norms
from pyext.techniques.base import Entry, PerComponent
from pyext.techniques.packing import AUTO_ROLES  # the conv models, built of ResnetBlock2D


class FuseNorms(PerComponent):
    """fuse_norms="auto": the denoisers, VAEs and controlnets of a CPU pipeline, where the C++ kernel
    was measured; "on": every component, any device (the op's dispatch self-checks its kernels);
    "off". Not with compile="trace"/"compile" on a denoiser: the compiler fuses norms itself."""

    name = "fuse_norms"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        if any(is_fused(m) for m in module.modules()):
            return self.already(name, "GroupNorm+SiLU fused before")
        report = fuse_norms(module)
        if report.fused:
            detail = str(report) + (f" ({len(report.skipped)} blocks left plain)" if report.skipped else "")
            return self.applied(name, detail, functools.partial(self._undo, module))
        reasons = sorted(set(report.skipped.values()))
        return self.skipped(name, "no ResnetBlock2D whose GroupNorms feed its SiLU"
                            + (" (" + "; ".join(reasons[:2]) + ")" if reasons else ""))

    def why_not(self, name: str, module, d) -> str | None:
        reason = self.switch_reason(name, d, AUTO_ROLES)
        if reason:
            return reason
        if d.options.fuse_norms == "auto" and d.device.type != "cpu":
            return f"auto: on {d.device.type} the fused kernel is not measured yet; fuse_norms='on' uses it"
        if d.options.compile in ("trace", "compile", "cudagraphs") and name in d.components.denoisers:
            return f"compile={d.options.compile!r}: the compiler fuses norms itself"
        return None

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unfuse_norms(module))} ResnetBlock2D blocks plain again"
