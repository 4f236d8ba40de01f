"""The `pyext` operator namespace (`torch.ops.pyext.*`): each op's schema, kernel and fake kernel.

The ops are defined with torch.library.Library, not torch.library.custom_op: custom_op runs each
call through autograd, dynamo-disable and redispatch wrappers in Python, which cost more than a
small attention call itself. pyext's ops have no backward (the diffusers routing leaves calls
that need autograd to torch); the fake kernels let torch.compile trace them.
"""
from __future__ import annotations

from typing import Callable

import torch

LIBRARY = torch.library.Library("pyext", "DEF")


def define(schema: str, kernel: Callable, fake: Callable) -> None:
    """Define pyext::<schema>: `kernel` runs it on every device, without autograd (its outputs do
    not require grad, and backends may write into out= buffers), `fake` gives its outputs' metadata."""
    name = schema.split("(", 1)[0]

    def run(*args, **kwargs):
        with torch.no_grad():
            return kernel(*args, **kwargs)

    LIBRARY.define(schema)
    LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pyext::{name}", fake, lib=LIBRARY)
