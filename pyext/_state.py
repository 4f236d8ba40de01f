"""pyext's state on objects it changes, in one convention.

Everything pyext keeps on a pipeline or module lives in the instance's own __dict__ under a
"_pyext_<key>" name: never a registered submodule, parameter or config entry, so
state_dict(), save_pretrained and diffusers' component registry do not see it, and removing it
leaves the object as it was. A deep copy copies it with the object (undos are partials over the
objects they act on, so the copy's act on the copy).
"""
from __future__ import annotations

PREFIX = "_pyext_"


def get(obj, key: str, default=None):
    return obj.__dict__.get(PREFIX + key, default)


def put(obj, key: str, value) -> None:
    obj.__dict__[PREFIX + key] = value


def pop(obj, key: str, default=None):
    return obj.__dict__.pop(PREFIX + key, default)
