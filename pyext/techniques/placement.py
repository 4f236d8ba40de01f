"""Where the weights live: the device, and offload through diffusers' own APIs."""
from __future__ import annotations

from pyext import offload
from pyext.decision import device_of
from pyext.techniques.base import Entry, Step, Technique, undo_by


class Device(Technique):
    """Move the pipeline to options.device (never a device-mapped one, never under offload)."""

    name = "device"
    changes_modules = False

    def plan(self, pipe, d) -> list[Step]:
        if d.options.device is None:
            return []
        if d.multi_device:
            return [self.wont("*", "components sit on several devices (device map): pyext never moves them")]
        if d.offload != "off" or offload.detect(pipe).mode != "off":
            return [self.wont("*", "offload places the weights")]
        return [self.will("*")]

    def change(self, pipe, component: str, d) -> Entry:
        befores = {device_of(m) for m in d.components.modules.values()}
        if befores == {d.device}:
            return self.already("*", str(d.device))
        before = befores.pop()
        pipe.to(d.device)
        return self.applied("*", f"{before} -> {d.device}", undo_by(pipe.to, before, says=f"moved back to {before}"))


class Offload(Technique):
    """model / group / sequential offload as decided (by the planner under "auto")."""

    name = "offload"
    changes_modules = False  # it adds the hooks that the other techniques suspend

    def plan(self, pipe, d) -> list[Step]:
        if offload.detect(pipe).mode == "device_map" or (d.offload == "off" and offload.detect(pipe).mode == "off"):
            return [self.wont("*", d.offload_reason)]
        return [self.will("*")]

    def change(self, pipe, component: str, d) -> Entry:
        existing = offload.detect(pipe)
        if existing.mode != "off":
            return self.already("*", f"pipeline already uses {existing.mode} offload; kept as it is")
        offload.enable(pipe, d.offload, d.device, dict(d.components.modules))
        state = offload.detect(pipe)
        return self.applied("*", f"{d.offload} offload to {d.device} ({d.offload_reason})",
                            undo_by(offload.remove, pipe, state, says=f"{d.offload} offload removed"))
