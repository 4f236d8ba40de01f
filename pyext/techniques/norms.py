"""GroupNorm + SiLU fused into one pass in ResnetBlock2D-shaped blocks (pyext.nn.fused_norm)."""
from __future__ import annotations

import functools

from pyext.nn.fused_norm import GroupNormSiLU, fuse_norms, unfuse_norms
from pyext.techniques.base import Entry, Technique

AUTO_ROLES = ("denoiser", "vae", "controlnet")  # the conv models built of ResnetBlock2D


class FuseNorms(Technique):
    """fuse_norms="auto": the denoisers, VAEs and controlnets of a CPU pipeline, where the C++ kernel
    was measured; "on": every component, any device (the op's dispatch self-checks its kernels);
    "off". Not with compile="trace"/"compile" on a denoiser: the compiler fuses norms itself."""

    name = "fuse_norms"

    def apply(self, pipe, d) -> list[Entry]:
        entries = []
        for name, module in d.components.modules.items():
            why = self._why_not(name, d)
            if why:
                entries.append(self.skipped(name, why))
                continue
            if any(type(m) is GroupNormSiLU for m in module.modules()):
                entries.append(self.already(name, "GroupNorm+SiLU fused before"))
                continue
            report = fuse_norms(module)
            if report.fused:
                detail = str(report) + (f" ({len(report.skipped)} blocks left plain)" if report.skipped else "")
                entries.append(self.applied(name, detail, functools.partial(self._undo, module)))
            else:
                reasons = sorted(set(report.skipped.values()))
                entries.append(self.skipped(name, "no GroupNorm -> SiLU pair in a ResnetBlock2D-shaped block"
                                            + (" (" + "; ".join(reasons[:2]) + ")" if reasons else "")))
        return entries

    @staticmethod
    def _why_not(name: str, d) -> str | None:
        setting = d.options.fuse_norms
        if setting == "off":
            return "fuse_norms='off'"
        if setting == "auto" and d.device.type != "cpu":
            return f"auto: on {d.device.type} the fused kernel is not measured yet; fuse_norms='on' uses it"
        if d.options.compile in ("trace", "compile") and name in d.components.denoisers:
            return f"compile={d.options.compile!r}: the compiler fuses norms itself"
        if setting == "auto" and d.components.roles[name] not in AUTO_ROLES:
            return f"auto: a {d.components.roles[name]}; fuse_norms='on' fuses it too"
        return None

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unfuse_norms(module))} GroupNorm+SiLU pairs plain again"
