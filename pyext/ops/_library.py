"""The `pyext` operator namespace (`torch.ops.pyext.*`): each op's schema, kernel and fake kernel.

The ops are defined with torch.library.Library, not torch.library.custom_op: custom_op runs each
call through autograd, dynamo-disable and redispatch wrappers in Python, which cost more than a
small attention call itself. pyext's ops have no backward (the diffusers routing leaves calls
that need autograd to torch); the fake kernels let torch.compile trace them.
"""
from __future__ import annotations

from typing import Callable

import torch

from pyext._ext import has_kernel
from pyext.dispatch import PyextError

LIBRARY = torch.library.Library("pyext", "DEF")
EXTENSION = torch.library.Library("pyext_C", "IMPL")  # Python kernels of ops the extension declares


class _NoBackward(torch.autograd.Function):
    """Marks an op's outputs as computed from inputs that require grad, so that a backward
    through them raises instead of leaving those inputs without gradients."""

    @staticmethod
    def forward(ctx, name: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        return out

    @staticmethod
    def backward(ctx, grad):
        raise PyextError(f"pyext.{ctx.name} has no backward; it is for inference (call it under torch.no_grad(), "
                         "or on tensors that do not require grad)")


def define(schema: str, kernel: Callable, fake: Callable, entry: str | None = None) -> None:
    """Define pyext::<schema>: `kernel` runs it on every device, without autograd (backends may
    write into out= buffers), `fake` gives its outputs' metadata. Outputs of a call on inputs that
    require grad raise on backward.

    entry: the pyext_C op through which the extension's C++ kernels of this op hands the calls
    they do not run themselves to `kernel` (see csrc/fp8/fp8_linear_entry.h); registered when the
    extension defines it."""
    name = schema.split("(", 1)[0]

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # a pipeline's call: no context to enter
            return kernel(*args, **kwargs)
        with torch.no_grad():
            out = kernel(*args, **kwargs)
        needing = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if needing and isinstance(out, torch.Tensor):
            out = _NoBackward.apply(name, out, *needing)
        elif needing and isinstance(out, tuple):
            out = tuple(_NoBackward.apply(name, o, *needing) for o in out)
        return out

    LIBRARY.define(schema)
    LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pyext::{name}", fake, lib=LIBRARY)
    if entry is not None and has_kernel(entry):
        EXTENSION.impl(entry, run, "CompositeExplicitAutograd")


_LIKE: dict[tuple, tuple[int, ...]] = {}  # (shape, strides) -> empty_like's strides


def like_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides torch.empty_like(t) has (kernels return outputs laid out so, as their fake
    kernels promise), kept per shape and strides: a repeated call reads a dict."""
    key = (t.shape, t.stride())
    strides = _LIKE.get(key)
    if strides is None:
        if len(_LIKE) >= 1024:
            _LIKE.clear()
        strides = _LIKE[key] = torch.empty_like(t, device="meta").stride()
    return strides
