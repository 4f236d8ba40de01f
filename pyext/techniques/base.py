"""A technique: a named change to a pipeline that says where it applies, why not elsewhere,
and hands back its undo.

`Technique.apply(pipe, decision)` returns one Entry per component it looked at:
"applied" (something changed; the entry holds the undo), "already" (it was so before) or
"skipped" (with the reason). Techniques that change modules (`changes_modules`) run while
offload hooks are suspended, so offload may be enabled before or after pyext.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Literal

Status = Literal["applied", "skipped", "already"]


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

    def apply(self, pipe, decision) -> list[Entry]:
        raise NotImplementedError

    def applied(self, component: str, detail: str, undo: Callable[[], str], exact: bool = True) -> Entry:
        return Entry(component, self.name, "applied", detail, undo, self.changes_modules, exact)

    def skipped(self, component: str, why: str) -> Entry:
        return Entry(component, self.name, "skipped", why)

    def already(self, component: str, detail: str) -> Entry:
        return Entry(component, self.name, "already", detail)


class PerComponent(Technique):
    """A technique that decides for each component on its own: `why_not` gives the reason to leave
    it as it is (None: change it), `change` changes it and returns its entry."""

    def apply(self, pipe, d) -> list[Entry]:
        entries = []
        for name, module in d.components.modules.items():
            why = self.why_not(name, module, d)
            entries.append(self.skipped(name, why) if why else self.change(name, module, d))
        return entries

    def why_not(self, name: str, module, d) -> str | None:
        raise NotImplementedError

    def switch_reason(self, name: str, d, auto_roles: tuple[str, ...]) -> str | None:
        """The reason an "auto"/"on"/"off" option named after the technique gives: "off", or "auto"
        on a component whose role is not in auto_roles."""
        setting = getattr(d.options, self.name)
        if setting == "off":
            return f"{self.name}='off'"
        role = d.components.roles[name]
        if setting == "auto" and role not in auto_roles:
            return f"auto: a {role}; {self.name}='on' includes it"
        return None

    def change(self, name: str, module, d) -> Entry:
        raise NotImplementedError
