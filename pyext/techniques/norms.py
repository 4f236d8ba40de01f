"""GroupNorm + SiLU fused into one pass in diffusers' ResnetBlock2D blocks (pyext.nn.fused_norm), and
the upsampling convolutions of Upsample2D blocks run as phases (pyext.nn.upsample)."""
from __future__ import annotations

import functools

from pyext.nn.fused_norm import describe, fuse_norms, is_fused, unfuse_norms
from pyext.nn.upsample import is_phased, phase_upsamplers, unphase_upsamplers
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
        return self.swap_entry(name, report, describe(report), functools.partial(self._undo, module),
                               "no ResnetBlock2D whose GroupNorms feed its SiLU")

    def why_not(self, name: str, module, d) -> str | None:
        reason = self.switch_reason(name, d, AUTO_ROLES, auto_cpu_only=True)
        if reason:
            return reason
        if d.options.compile in ("trace", "compile", "cudagraphs") and name in d.components.denoisers:
            return f"compile={d.options.compile!r}: the compiler fuses norms itself"
        return None

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unfuse_norms(module))} ResnetBlock2D blocks plain again"


class UpsamplePhases(PerComponent):
    """upsample_phases="auto": the VAEs of a CPU pipeline, whose decoders upsample the largest
    images (a denoiser's upsamplers run at a fraction of its time, and their phase weights would add
    16/9 of those weights); "on": every component; "off". Each shape then takes the phases only
    where dispatch measured them faster on this machine."""

    name = "upsample_phases"

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.modules[name]
        if any(is_phased(m) for m in module.modules()):
            return self.already(name, "upsampling convolutions phased before")
        phased = phase_upsamplers(module)
        if not phased:
            return self.skipped(name, "no Upsample2D with a 3x3 convolution after nearest 2x upsampling")
        return self.applied(name, f"{len(phased)} upsampling convolutions as phases where measured faster",
                            functools.partial(self._undo, module))

    def why_not(self, name: str, module, d) -> str | None:
        return self.switch_reason(name, d, ("vae",), auto_cpu_only=True)

    @staticmethod
    def _undo(module) -> str:
        return f"{len(unphase_upsamplers(module))} Upsample2D blocks plain again"
