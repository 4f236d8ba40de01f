"""Attention's semantics: softmax(q @ k^T * scale + mask) @ v in fp32, materialising the scores.

The reference backend of pyext.ops.attention, the oracle of its tests, and what the Triton
kernel checks its launch configs against (in float64).
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def mask_as_bias(mask: torch.Tensor) -> torch.Tensor:
    """A mask as the additive float32 bias the kernels take, 4-D, still broadcastable: a boolean
    mask's False is -inf. Dims an expanded mask broadcasts over (stride 0) shrink to size 1 first,
    so only the mask's own values are converted."""
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    else:
        bias = mask.float()
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _grouped(k: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v with each head repeated for its group of query heads (SDPA's enable_gqa)."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def attention_reference(q, k, v, scale: Optional[float] = None, attn_mask=None, return_lse: bool = False):
    """Naive attention in fp32, or float64 for float64 inputs (materialises the scores): the
    oracle, not a fast path. Returns the output, or (output, log-sum-exp) with return_lse."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(ct), _grouped(k, q.shape[1]).to(ct).transpose(-1, -2)) * scale
    if attn_mask is not None:
        s = s + mask_as_bias(attn_mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, _grouped(v, q.shape[1]).to(ct))
    if attn_mask is not None:  # every key masked: 0, whatever v holds (without a mask, all -inf is
        out.masked_fill_(torch.isneginf(lse)[..., None], 0.0)  # fp32 overflow: NaN)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
