"""A diffusers module given a fused forward by a __class__ swap: the module's class becomes a
subclass of its own whose forward fuses (the same module, parameters, state_dict and hooks), and
the undo swaps it back. One mechanism for the fusions of pyext.nn (fused_norm, geglu, upsample).

A fused forward is probed when it is given: on a small random input, the module must give its
plain output, else it stays plain and the report says by how much it differed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from pyext import _compat


@dataclass
class SwapReport:
    swapped: list[str] = field(default_factory=list)  # module names
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stays plain


def probe(module: nn.Module, fused: type, args: Callable[[], tuple], tolerance: float,
          context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> str | None:
    """Swap the module to `fused` if, called on args() under context(), it gives the plain
    output within tolerance (relative to the output's largest magnitude, at least 1); else keep
    its class and return why."""
    plain_class = type(module)
    if any(p.device.type == "meta" for p in module.parameters()):
        return "parameters on the meta device (offloaded): nothing to probe with"
    if any("forward" in m.__dict__ or _compat.torch_hooks(m) for m in module.modules()):
        return "hooks on it would see the probe's calls"
    try:
        inputs = args()
        with torch.no_grad(), context():
            plain = module(*inputs)
            module.__class__ = fused
            out = module(*inputs)
        err = (out.float() - plain.float()).abs().max().item()
        reason = None
        if not err <= tolerance * max(1.0, plain.float().abs().max().item()):
            reason = f"the fused output differs from the plain one's by {err:.3g}"
    except Exception as err:  # a module that wants other arguments or inputs
        reason = f"the probe could not run ({type(err).__name__}: {str(err)[:120]})"
    if reason:
        module.__class__ = plain_class
    return reason


def swap_all(model: nn.Module, can_swap: Callable[[nn.Module], bool],
             swap: Callable[[nn.Module], str | None]) -> SwapReport:
    """swap(m) (None: swapped, else why not) for every module of the model that can_swap."""
    report = SwapReport()
    for name, module in model.named_modules():
        if can_swap(module):
            reason = swap(module)
            if reason:
                report.skipped[name] = reason
            else:
                report.swapped.append(name)
    return report


def swap_back(model: nn.Module, fused: type, plain: type, forget: Callable[[nn.Module], None] = lambda m: None
              ) -> list[str]:
    """The plain class again for every module of the model swapped to `fused` (forget(m) drops what
    the fused forward kept beside it); their names."""
    names = []
    for name, module in model.named_modules():
        if type(module) is fused:
            module.__class__ = plain
            forget(module)
            names.append(name)
    return names
