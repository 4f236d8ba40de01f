"""Tracing or torch.compile of the denoisers."""
from __future__ import annotations

from pyext import _compat
from pyext.techniques.base import Entry, Technique, undo_by
from pyext.traced import TracedUNet, trace_reason


class Compile(Technique):
    """compile="trace": torch.jit.trace per input shape (families that allow it, as the memory
    guide traces the SD UNet); "compile": torch.compile in place; "cudagraphs": torch.compile
    with CUDA graphs (inductor's "reduce-overhead"), one graph per input shape, so a step
    replays its kernels without Python or launch overhead; "auto": trace on GPUs where the
    family allows it, otherwise stay eager (compiling costs minutes up front)."""

    name = "compile"
    changes_modules = False  # runs last, on the final modules; offload hooks stay as they are

    def apply(self, pipe, d) -> list[Entry]:
        mode = d.options.compile
        entries = []
        for name, module in d.components.denoisers.items():
            if mode == "off":
                entries.append(self.skipped(name, "compile='off'"))
            elif mode == "compile":
                entries.append(self._compile(name, module, d.options.compile_backend, d.device))
            elif mode == "cudagraphs":
                entries.append(self._cudagraphs(name, module, d))
            else:
                entries.append(self._trace(pipe, name, module, d, auto=mode == "auto"))
        return entries

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

    def _cudagraphs(self, name, module, d) -> Entry:
        if _compat.is_compiled_in_place(module):
            return self.already(name, "torch.compile")
        if d.device.type != "cuda":
            return self.skipped(name, f"cudagraphs: CUDA graphs replay CUDA kernels, and this pipeline runs on "
                                      f"{d.device.type}; on a CPU use compile='compile' or 'trace'")
        if d.offload != "off":
            return self.skipped(name, f"cudagraphs: offload={d.offload!r} moves weights between calls, which a "
                                      "captured graph cannot follow; use compile='compile', or offload='off'")
        # dynamic=False: one graph per resolution, captured on its first call and replayed after.
        module.compile(backend="inductor", mode="reduce-overhead", dynamic=False)
        return self.applied(name, "torch.compile(mode='reduce-overhead'): CUDA graphs, one per input shape",
                            undo_by(_compat.uncompile_in_place, module, says="eager again"))

    def _trace(self, pipe, name, module, d, auto: bool) -> Entry:
        if isinstance(module, TracedUNet):
            return self.already(name, "traced")
        family = d.families[name]
        reason = (f"the {family.name} family has no trace support" if not family.trace
                  else trace_reason(module, d.offload))
        if not reason and auto and d.device.type == "cpu":
            # Measured on SD1.5 (cpu bench preset): the trace saves ~4% of UNet time once
            # pyext attention runs, but its graph keeps ~0.2 GB more resident per run.
            reason = "on CPU a trace saves ~4% of UNet time for ~0.2 GB more memory; compile='trace' takes that trade"
        if reason:
            return self.skipped(name, f"{'auto' if auto else 'trace'}: {reason}")
        traced = TracedUNet(module)
        setattr(pipe, name, traced)
        return self.applied(name, traced.describe(), undo_by(setattr, pipe, name, module, says="eager again"))
