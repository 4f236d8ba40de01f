"""Tracing or torch.compile of the denoisers."""
from __future__ import annotations

from pyext import _compat
from pyext.planner import FP8_ROLES
from pyext.techniques.base import Entry, Step, Technique, undo_by
from pyext.traced import TracedUNet, trace_reason


class Compile(Technique):
    """compile="trace": torch.jit.trace per input shape (families that allow it, as the memory
    guide traces the SD UNet); "compile": torch.compile in place; "cudagraphs": torch.compile
    with CUDA graphs (inductor's "reduce-overhead"), one graph per input shape, so a step
    replays its kernels without Python or launch overhead; "auto": trace on GPUs where the
    family allows it, otherwise stay eager (compiling costs minutes up front)."""

    name = "compile"
    changes_modules = False  # runs last, on the final modules; offload hooks stay as they are

    def plan(self, pipe, d) -> list[Step]:
        steps = []
        for name, module in d.components.denoisers.items():
            why = self._why_not(name, module, d)
            steps.append(self.wont(name, why) if why else self.will(name))
        return steps

    def _why_not(self, name, module, d) -> str | None:
        mode = d.options.compile
        if mode == "off":
            return "compile='off'"
        if mode == "cudagraphs" and d.device.type != "cuda":
            return (f"cudagraphs: CUDA graphs replay CUDA kernels, and this pipeline runs on {d.device.type}; "
                    "on a CPU use compile='compile' or 'trace'")
        if mode == "cudagraphs" and d.offload != "off":
            return (f"cudagraphs: offload={d.offload!r} moves weights between calls, which a captured graph "
                    "cannot follow; use compile='compile', or offload='off'")
        if mode in ("trace", "auto") and not isinstance(module, TracedUNet):
            reason = self._trace_reason(name, module, d)
            if reason:
                return f"{'auto' if mode == 'auto' else 'trace'}: {reason}"
        return None

    @staticmethod
    def _trace_reason(name, module, d) -> str | None:
        family = d.families[name]
        if not family.trace:
            return f"the {family.name} family has no trace support"
        if "denoiser" in FP8_ROLES[d.fp8]:  # (the fp8 technique runs first)
            return "fp8 layers reinterpret their storage (dtype views), which torch.jit.trace cannot record"
        reason = trace_reason(module, d.offload)
        if not reason and d.options.compile == "auto" and d.device.type == "cpu":
            # Measured on SD1.5 (cpu bench preset, docs/benchmarks.md): the trace saves a few
            # percent of UNet time once pyext attention runs, but its graph keeps more memory
            # resident per run.
            reason = "on CPU a trace saves a few percent of UNet time for more memory; compile='trace' takes that trade"
        return reason

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.denoisers[name]
        mode = d.options.compile
        if mode == "compile":
            return self._compile(name, module, d.options.compile_backend, d.device)
        if mode == "cudagraphs":
            return self._cudagraphs(name, module)
        return self._trace(pipe, name, module)

    def _compile(self, name, module, backend, device) -> Entry:
        if _compat.is_compiled_in_place(module):
            return self.already(name, "torch.compile")
        detail = f"torch.compile(backend={backend!r})"
        options = None
        if backend == "inductor" and device.type == "cpu":
            # Freezing folds the weights into the graph as constants and packs them for oneDNN
            # once, which is what makes inductor fast on CPUs.
            options = {"freezing": True}
            detail += " with freezing: the weights are constants of the graph; after changing them " \
                      "(fuse_lora, load_state_dict) run pyext.restore and optimize again"
        module.compile(backend=backend, options=options)  # in place: hooks and attribute access keep working
        return self.applied(name, detail, undo_by(_compat.uncompile_in_place, module, says="eager again"))

    def _cudagraphs(self, name, module) -> Entry:
        if _compat.is_compiled_in_place(module):
            return self.already(name, "torch.compile")
        # dynamic=False: one graph per resolution, captured on its first call and replayed after.
        module.compile(backend="inductor", mode="reduce-overhead", dynamic=False)
        return self.applied(name, "torch.compile(mode='reduce-overhead'): CUDA graphs, one per input shape",
                            undo_by(_compat.uncompile_in_place, module, says="eager again"))

    def _trace(self, pipe, name, module) -> Entry:
        if isinstance(module, TracedUNet):
            return self.already(name, "traced")
        traced = TracedUNet(module)
        setattr(pipe, name, traced)
        return self.applied(name, traced.describe(), undo_by(setattr, pipe, name, module, says="eager again"))
