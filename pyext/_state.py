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


def replace_attributes(obj, key: str, values: dict) -> None:
    """Put `values` in obj's own __dict__ (methods replaced on the instance only), remembering
    under `key` what each name held there before, for restore_attributes."""
    put(obj, key, {name: (value, obj.__dict__.get(name)) for name, value in values.items()})
    obj.__dict__.update(values)


def restore_attributes(obj, key: str) -> dict:
    """Give obj back what replace_attributes replaced (a name something replaced since is left as it
    is); returns the values that had been put."""
    replaced = pop(obj, key) or {}
    for name, (value, before) in replaced.items():
        if obj.__dict__.get(name) is value:
            if before is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = before
    return {name: value for name, (value, _) in replaced.items()}
