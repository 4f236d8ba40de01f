"""The sharding diffusers' context parallelism needs, for families whose model class declares none.

    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=2),
                                        cp_plan=pyext.context_parallel_plan(pipe.transformer))

diffusers splits a model's tokens across ranks where its class says how (`_cp_plan`), and its
processors then run each attention over the ranks. Some classes declare no plan, and their
processors call SDPA directly (SD3's joint attention): pyext states the plan for them
(`Family.sequence_split`), and its attention routing runs their attention calls across the ranks
(Ulysses, ring, or both, as the config says; `pyext.ring`).
"""
from __future__ import annotations

import torch.nn as nn

from pyext import _compat
from pyext.dispatch import PyextError
from pyext.families import FAMILIES, SequenceSplitPlan, sequence_split_of


def own_plan(model: nn.Module) -> SequenceSplitPlan | None:
    """pyext's sharding of the model's tokens where its class declares none, else None. Two
    lookups by class: the attention routing asks on every forward under context parallelism."""
    if _compat.context_parallel_plan(model):
        return None
    return sequence_split_of(model)


def context_parallel_plan(model: nn.Module) -> dict:
    """The cp_plan for `model.enable_parallelism`: the one its class declares, else pyext's."""
    declared = _compat.context_parallel_plan(model)
    if declared:
        return declared
    plan = own_plan(model)
    if plan is None:
        planned = sorted(c for fam in FAMILIES if fam.sequence_split for c in fam.classes)
        raise PyextError(f"pyext.context_parallel_plan: {type(model).__name__} declares no sequence split "
                         f"(diffusers' _cp_plan) and pyext has none for it; supported: the classes that declare "
                         f"one, and {', '.join(planned)}")
    return _compat.diffusers_cp_plan(plan.split_inputs, plan.gather_outputs)
