"""What the Triton backends of the ops declare alike (pyext.dispatch.Backend data)."""
from __future__ import annotations

import torch

from pyext.kernels import interpreting

# A Triton backend's `notes`: why a dtype it otherwise takes is refused.
TRITON_NOTES = {torch.bfloat16: "Triton's interpreter computes bf16 tl.dot wrongly; use float16/float32 on CPU"}


def triton_dtypes(dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """A Triton kernel's dtypes in this process: without bfloat16 under the interpreter."""
    return tuple(d for d in dtypes if d != torch.bfloat16) if interpreting() else dtypes
