"""Memory shared between an op's inputs and the tensors it writes.

torch's own `out=` ops refuse overlapping arguments; pyext's mutating ops read such
inputs as they were before the call instead (a copy), which is what their
out-of-place reference computes, so every backend gives the same answer.
"""
from __future__ import annotations

from typing import Optional

import torch

from pyext.dispatch import PyextError


def _byte_span(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """[first, end) of the bytes `t` may touch; None when it has no elements."""
    if t.numel() == 0:
        return None
    last = t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    return t.data_ptr(), last + t.element_size()


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b may share bytes. Conservative: interleaved views count as overlapping."""
    if a.device != b.device:
        return False
    sa, sb = _byte_span(a), _byte_span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def apart_from(written: list[torch.Tensor], *inputs: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """`inputs`, each copied if it shares memory with a tensor the op writes."""
    return [x if x is None or not any(may_overlap(x, w) for w in written) else x.clone() for x in inputs]


def check_disjoint(op: str, **written: torch.Tensor) -> None:
    """Tensors an op writes must not share memory: the result would depend on the write order."""
    names = list(written)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if may_overlap(written[a], written[b]):
                raise PyextError(f"pyext.{op}: {a} and {b} share memory; the tensors the op writes "
                                 f"({', '.join(names)}) must be separate")
