"""A technique: a named change to a pipeline that says where it applies, why not elsewhere,
and hands back its undo.

`Technique.plan(pipe, decision)` says, before anything changes, what the technique will do to
each component it looks at: a Step "apply" (it will look inside and change what it finds) or
"skip" (with the reason, known from the decision and the modules as they are). `apply` carries
the plan out and returns one Entry per step: "applied" (something changed; the entry holds the
undo), "already" (it was so before) or "skipped" (the plan's reason, or what it found inside).
Techniques that change modules (`changes_modules`) run while offload hooks are suspended, so
offload may be enabled before or after pyext.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Literal

Status = Literal["applied", "skipped", "already"]
Action = Literal["apply", "skip"]


@dataclass(frozen=True)
class Step:
    """What a technique will do to one component ("*": the whole pipeline)."""

    component: str
    technique: str
    action: Action
    why: str = ""  # for "skip": the reason

    def __str__(self) -> str:
        return f"{self.component:<15} {self.technique:<14} {self.action:<8} {self.why}".rstrip()


@dataclass(frozen=True)
class Entry:
    component: str
    technique: str
    status: Status
    detail: str = ""
    undo: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    changes_modules: bool = field(default=True, repr=False, compare=False)
    exact: bool = field(default=True, repr=False, compare=False)  # the undo gives back exactly what was there

    def to_dict(self) -> dict:
        return {"component": self.component, "technique": self.technique, "status": self.status, "detail": self.detail}


def undo_by(call: Callable, *args, says: str) -> Callable[[], str]:
    """An undo that calls call(*args) and returns `says`. A partial, not a closure: a deep copy of
    the pipeline copies its arguments with it, so the copy's undo acts on the copy."""
    return functools.partial(_call_then_say, call, args, says)


def _call_then_say(call: Callable, args: tuple, says: str) -> str:
    call(*args)
    return says


class Technique:
    name: str = ""
    changes_modules: bool = True  # run with offload hooks suspended (and undone so)

    def plan(self, pipe, d) -> list[Step]:
        raise NotImplementedError

    def apply(self, pipe, d) -> list[Entry]:
        """The plan carried out: a skipped entry per "skip", `change` per "apply"."""
        return [self.skipped(s.component, s.why) if s.action == "skip" else self.change(pipe, s.component, d)
                for s in self.plan(pipe, d)]

    def change(self, pipe, component: str, d) -> Entry:
        raise NotImplementedError

    def will(self, component: str) -> Step:
        return Step(component, self.name, "apply")

    def wont(self, component: str, why: str) -> Step:
        return Step(component, self.name, "skip", why)

    def applied(self, component: str, detail: str, undo: Callable[[], str], exact: bool = True) -> Entry:
        return Entry(component, self.name, "applied", detail, undo, self.changes_modules, exact)

    def skipped(self, component: str, why: str) -> Entry:
        return Entry(component, self.name, "skipped", why)

    def already(self, component: str, detail: str) -> Entry:
        return Entry(component, self.name, "already", detail)


class PerComponent(Technique):
    """A technique that decides for each component on its own: `why_not` gives the reason to leave
    it as it is (None: change it), `change` changes it and returns its entry."""

    def plan(self, pipe, d) -> list[Step]:
        steps = []
        for name, module in d.components.modules.items():
            why = self.why_not(name, module, d)
            steps.append(self.wont(name, why) if why else self.will(name))
        return steps

    def why_not(self, name: str, module, d) -> str | None:
        raise NotImplementedError

    def swap_entry(self, name: str, report, detail: str, undo: Callable[[], str], none_found: str) -> Entry:
        """The entry of a class-swap fusion (pyext.nn.swap's SwapReport): applied, with `detail` and
        how many modules the probe left plain; or skipped, saying `none_found` and the probe's first
        reasons."""
        if report.swapped:
            return self.applied(name, detail + (f" ({len(report.skipped)} left plain)" if report.skipped else ""), undo)
        reasons = sorted(set(report.skipped.values()))
        return self.skipped(name, none_found + (" (" + "; ".join(reasons[:2]) + ")" if reasons else ""))

    def switch_reason(self, name: str, d, auto_roles: tuple[str, ...], auto_cpu_only: bool = False) -> str | None:
        """The reason an "auto"/"on"/"off" option named after the technique gives: "off", or "auto"
        on a component whose role is not in auto_roles, or (auto_cpu_only: what it does was measured
        on CPUs only) on another device."""
        setting = getattr(d.options, self.name)
        if setting == "off":
            return f"{self.name}='off'"
        role = d.components.roles[name]
        if setting == "auto" and role not in auto_roles:
            return f"auto: a {role}; {self.name}='on' includes it"
        if setting == "auto" and auto_cpu_only and d.device.type != "cpu":
            return f"auto: on {d.device.type} it is not measured yet; {self.name}='on' uses it"
        return None
