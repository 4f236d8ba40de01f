"""diffusers' GEGLU feed-forward activation in one pass (pyext.nn.geglu)."""
from __future__ import annotations

import functools

from pyext.nn.geglu import describe, fuse_geglu, is_fused, unfuse_geglu
from pyext.techniques.base import Entry, PerComponent


class FuseGEGLU(PerComponent):
    """fuse_geglu="auto": the denoisers and controlnets of a CPU pipeline, where the C++ kernel was
    measured (the GEGLU modules are theirs); "on": every component, any device the op runs on;
    "off". Not with compile="compile"/"cudagraphs" on a denoiser: inductor fuses the GELU and the
    product itself, and a compiled step measured no faster with the op."""

    name = "fuse_geglu"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        if any(is_fused(m) for m in module.modules()):
            return self.already(name, "GEGLU fused before")
        report = fuse_geglu(module)
        return self.swap_entry(name, report, describe(report), functools.partial(self._undo, module),
                               "no GEGLU activation")

    def why_not(self, name: str, module, d) -> str | None:
        reason = self.switch_reason(name, d, ("denoiser", "controlnet"), auto_cpu_only=True)
        if reason:
            return reason
        if d.options.compile in ("compile", "cudagraphs") and name in d.components.denoisers:
            return f"compile={d.options.compile!r}: the compiler fuses the GELU and the product itself"
        return None

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unfuse_geglu(module))} GEGLU activations plain again"
