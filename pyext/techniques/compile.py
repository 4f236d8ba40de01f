"""CUDA-graph capture, tracing or torch.compile of the denoisers."""
from __future__ import annotations

import torch

from pyext import _compat, _state, graphs
from pyext.planner import FP8_ROLES
from pyext.techniques.base import Entry, Step, Technique, undo_by
from pyext.traced import TracedUNet, trace_reason


class Compile(Technique):
    """compile="capture": pyext captures the eager forward in CUDA graphs, one per input signature
    (pyext.graphs), so a step replays its kernels without Python or launch overhead and without a
    compiler; "trace": torch.jit.trace per input shape (families that allow it, as the memory
    guide traces the SD UNet); "compile": torch.compile (with inductor on a CPU, the forward with
    weight freezing: frozen_forward); "cudagraphs": torch.compile
    with CUDA graphs (inductor's "reduce-overhead"), one graph per input shape; "auto": capture
    on CUDA without offload, otherwise stay eager (compiling costs minutes up front)."""

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
        if mode in ("capture", "auto", "cudagraphs"):
            why = graphs.capture_reason(d.device, d.offload)
            if why:
                return f"{mode}: {why}"
        if mode == "auto" and not d.plan.graphs:
            return (f"auto: the memory captured CUDA graphs keep between calls would not fit ({d.plan.describe()}); "
                    "compile='capture' captures anyway")
        if mode == "trace" and not isinstance(module, TracedUNet):
            reason = self._trace_reason(name, module, d)
            if reason:
                return f"trace: {reason}"
        return None

    @staticmethod
    def _trace_reason(name, module, d) -> str | None:
        family = d.families[name]
        if not family.trace:
            return f"the {family.name} family has no trace support"
        if "denoiser" in FP8_ROLES[d.fp8]:  # (the fp8 technique runs first)
            return "fp8 layers reinterpret their storage (dtype views), which torch.jit.trace cannot record"
        return trace_reason(module, d.offload)

    def change(self, pipe, name: str, d) -> Entry:
        module = d.components.denoisers[name]
        mode = d.options.compile
        if mode == "compile":
            autotune = d.options.compile_autotune == "on" or (d.options.compile_autotune == "auto"
                                                               and d.device.type == "cpu")
            return self._compile(name, module, d.options.compile_backend, d.device, autotune)
        if mode == "cudagraphs":
            return self._cudagraphs(name, module)
        if mode in ("capture", "auto"):
            return self._capture(name, module)
        return self._trace(pipe, name, module)

    def _compile(self, name, module, backend, device, autotune: bool) -> Entry:
        if _compat.is_compiled_in_place(module) or _state.get(module, FROZEN):
            return self.already(name, "torch.compile")
        if backend == "inductor" and device.type == "cpu":
            frozen_forward(module, autotune)
            tuned = "; each GEMM shape timed on this machine, inductor's C++ template or oneDNN" if autotune else ""
            return self.applied(name, "torch.compile with inductor's freezing: the weights are constants of the "
                                f"graph, packed for oneDNN once{tuned}; after changing them (fuse_lora, "
                                "load_state_dict) run pyext.restore and optimize again",
                                undo_by(_state.restore_attributes, module, FROZEN, says="eager again"))
        if backend == "inductor" and autotune:
            module.compile(backend=backend, mode="max-autotune-no-cudagraphs")
            return self.applied(name, "torch.compile(mode='max-autotune-no-cudagraphs')",
                                undo_by(_compat.uncompile_in_place, module, says="eager again"))
        module.compile(backend=backend)  # in place: hooks and attribute access keep working
        return self.applied(name, f"torch.compile(backend={backend!r})",
                            undo_by(_compat.uncompile_in_place, module, says="eager again"))

    def _cudagraphs(self, name, module) -> Entry:
        if _compat.is_compiled_in_place(module):
            return self.already(name, "torch.compile")
        # dynamic=False: one graph per resolution, captured on its first call and replayed after.
        module.compile(backend="inductor", mode="reduce-overhead", dynamic=False)
        return self.applied(name, "torch.compile(mode='reduce-overhead'): CUDA graphs, one per input shape",
                            undo_by(_compat.uncompile_in_place, module, says="eager again"))

    def _capture(self, name, module) -> Entry:
        if graphs.captured(module) is not None:
            return self.already(name, "captured in CUDA graphs")
        if _compat.is_compiled_in_place(module):
            return self.already(name, "torch.compile")
        captured = graphs.apply_capture(module)
        return self.applied(name, captured.describe(), undo_by(graphs.remove_capture, module, says="eager again"))

    def _trace(self, pipe, name, module) -> Entry:
        if isinstance(module, TracedUNet):
            return self.already(name, "traced")
        traced = TracedUNet(module)
        setattr(pipe, name, traced)
        return self.applied(name, traced.describe(), undo_by(setattr, pipe, name, module, says="eager again"))


FROZEN = "frozen_forward"  # pyext._state key: the forward frozen_forward replaced


def frozen_forward(module, autotune: bool = False) -> None:
    """The module's forward (its hooks' wrapper included) compiled by inductor with weight freezing,
    on the instance. Freezing folds the weights into the graph and packs them for oneDNN once,
    which is what makes inductor fast on CPUs; it applies when inductor compiles a forward, not a
    module's call (torch.compile in place), and under no_grad (with grad it compiles unfrozen).
    `autotune`: each GEMM shape takes inductor's C++ template or oneDNN, as timed here when the
    forward compiles (_compat.inductor_freezing)."""
    compiled = torch.compile(module.forward, backend="inductor")

    def forward(*args, **kwargs):
        with _compat.inductor_freezing(autotune):  # (read when a call compiles or recompiles)
            return compiled(*args, **kwargs)

    _state.replace_attributes(module, FROZEN, {"forward": forward})
