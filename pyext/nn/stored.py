"""StoredWeight: a layer's weight held in another form than its values (fp8 codes and scales,
oneDNN's packed layout), which every reader other than pyext's kernels sees as its values.

A subclass says how to read its values (`values()`: a fresh dense tensor), how to take new ones
(`store(values)`: quantize or pack them into the stored form, in place) and how to alias its stored
form (`alias()`: what `.detach()`, `.data` and `nn.Parameter` return). From those, for any op:
- a read (F.linear, `w * 2`, `.float()`, `torch.equal`, printing) runs on the values; the dense
  tensor lives only as long as the op;
- a write (`copy_`, `add_`, load_state_dict, PEFT's merges, an optimizer's step) runs on the values
  and stores the result;
- a view (a slice, `t()`, an index) is a StoredView of the weight: reads see that view of the values,
  and a write into it (LoRA hotswap writes into slices) stores the whole weight with it.
"""
from __future__ import annotations

import torch

from pyext import _compat
from pyext.dispatch import PyextError

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)


class _ReadsAsValues(torch.Tensor):
    """What StoredWeight and its views share: every op sees their values."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def root(self) -> "StoredWeight":
        raise NotImplementedError

    def view_of(self, full: torch.Tensor) -> torch.Tensor:
        """This tensor's view of the root's values `full` (the root itself: `full`)."""
        return full

    def values(self) -> torch.Tensor:
        return self.view_of(self.root().values())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _ALIASES and isinstance(first, StoredWeight):
            return first.alias()
        if isinstance(first, StoredWeight):
            own = first.own_op(func, args, kwargs)
            if own is not NotImplemented:
                return own
        written = _written(func, args, kwargs)
        if not written and isinstance(first, _ReadsAsValues) and _is_view(func):
            return _view(first, func, args[1:], kwargs)
        # Each written weight's values are materialized whole, the op writes into (a view of)
        # them, and the weight stores them; everything else reads its values.
        fulls = {id(t): t.root().values() for t in written}
        dense = lambda a: (a.view_of(fulls[id(a)]) if id(a) in fulls else a.values()) \
            if isinstance(a, _ReadsAsValues) else a
        out = func(*_compat.tree_map(dense, args), **_compat.tree_map(dense, kwargs))
        if not written:
            return out
        for t in written:
            t.root().store(fulls[id(t)])
        # An in-place op returns its first argument, an out= op its out tensor(s).
        return written[0] if len(written) == 1 and not isinstance(out, (tuple, list)) else out


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _written(func, args, kwargs) -> list:
    """The weights (or their views) that func writes into: its mutable arguments."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, _ReadsAsValues):
                out.append(t)
    return out


def _view(base: _ReadsAsValues, func, rest: tuple, kwargs: dict):
    """StoredView(s) of `base` through the view op func (several for split, unbind, chunk)."""
    meta = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    shapes = func(meta, *rest, **kwargs)
    step = lambda t: func(t, *rest, **kwargs)
    if isinstance(shapes, (tuple, list)):
        return type(shapes)(StoredView(base, step, i, s) for i, s in enumerate(shapes))
    return StoredView(base, step, None, shapes)


class StoredWeight(_ReadsAsValues):
    """Subclasses make the wrapper with `_make_wrapper_subclass` (the values' shape, strides, dtype and
    device) and define values(), store(values) and alias()."""

    def root(self) -> "StoredWeight":
        return self

    def store(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    def alias(self) -> "StoredWeight":
        raise NotImplementedError

    def own_op(self, func, args, kwargs):
        """A subclass's own answer to an op on it (a device move that keeps the stored form), or NotImplemented."""
        return NotImplemented

    def stored_tensors(self) -> tuple[torch.Tensor, ...]:
        """The plain tensors holding the stored form."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())

    @property
    def data(self) -> "StoredWeight":
        return self.alias()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's `.data =` swaps the wrapper's metadata but not the stored form it keeps: take the
        # new weight's stored form when it has one, else store its values.
        if isinstance(value, type(self)):
            torch.Tensor.data.__set__(self, value)  # dtype, device, strides
            self.adopt(value)
        elif value.shape == self.shape:
            self.store(value)
        else:
            raise PyextError(f"pyext: assigning a {tuple(value.shape)} tensor to the .data of a {tuple(self.shape)} "
                             f"weight stored as {type(self).__name__}: the shape must stay")

    def adopt(self, other: "StoredWeight") -> None:
        """Share `other`'s stored form (what `.data = other` does)."""
        raise NotImplementedError


class StoredView(_ReadsAsValues):
    """A view (slice, transpose, index) of a StoredWeight or of another view."""

    @staticmethod
    def __new__(cls, base, step, index, meta: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(), dtype=meta.dtype,
                                                   device=base.device)

    def __init__(self, base, step, index, meta):
        self.base, self.step, self.index = base, step, index

    def root(self) -> StoredWeight:
        return self.base.root()

    def view_of(self, full: torch.Tensor) -> torch.Tensor:
        out = self.step(self.base.view_of(full))
        return out if self.index is None else out[self.index]

    def __repr__(self) -> str:
        return f"StoredView({tuple(self.shape)} of {self.root()!r})"


def probe_like(weight: torch.Tensor) -> torch.Tensor:
    """A small tensor of the weight's dtype, device and layout (channels-last or not): what a
    layer's `_apply` hands to Module._apply's fn to learn what it does to the weight."""
    probe = torch.empty((2,) * weight.dim(), dtype=weight.dtype, device=weight.device)
    if _compat.is_channels_last(weight):
        probe = probe.contiguous(memory_format=torch.channels_last)
    return probe


def stored_tensors(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plain tensors a parameter or buffer keeps its data in (a StoredWeight's stored form)."""
    return t.stored_tensors() if isinstance(t, StoredWeight) else (t,)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a parameter or buffer really holds (a StoredWeight's stored form, not its values)."""
    return sum(s.numel() * s.element_size() for s in stored_tensors(t))
