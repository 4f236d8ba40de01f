"""Ring attention on torch.distributed, computed by pyext's attention with its log-sum-exp.

Each rank of the ring group holds its own queries and its own chunk of keys and values. The
chunks travel around the ring, one step per rank: at each step a rank attends its queries to the
chunk it holds, sends that chunk to the next rank and receives the previous rank's, and merges
the partial results exactly through their log-sum-exp. A rank holds two chunks at a time, and
the transfer of the next chunk overlaps the attention on the current one.

A mask travels with the keys it masks when it has a key dimension (key padding: its query
dimension must then be 1); a mask that broadcasts over the keys stays where it is.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from pyext.dispatch import PyextError

# attend(q, k, v, attn_mask) -> (out in q's layout, lse float32 (batch, heads, q length))
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], tuple]


def mask_travels(attn_mask: torch.Tensor | None, key_len: int) -> bool:
    """Whether the mask goes around the ring with its keys; PyextError for a mask it cannot take."""
    if attn_mask is None or attn_mask.dim() == 0 or attn_mask.shape[-1] == 1:
        return False
    if attn_mask.shape[-1] != key_len:
        raise PyextError(f"pyext ring attention: the mask's key length {attn_mask.shape[-1]} is neither 1 nor this "
                         f"rank's key length {key_len}")
    if attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1:
        raise PyextError("pyext ring attention: a mask with both query and key dimensions cannot follow its keys "
                         f"around the ring (shape {tuple(attn_mask.shape)}); supported: key-padding masks "
                         "(query dimension 1) and masks without a key dimension")
    return True


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor):
    """Softmax over the union of two key sets from the results over each: (out, lse) in float32.
    A row masked in every key so far keeps output 0 and log-sum-exp -inf."""
    part = part.float()
    if out is None:
        return part, part_lse
    total = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    return out * torch.exp(lse - finite).unsqueeze(-1) + part * torch.exp(part_lse - finite).unsqueeze(-1), total


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attend: Attend,
                   attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention, as `attend` computes it (scale, mask), of this rank's queries over the keys and
    values of every rank of `group`. Each rank passes its q (batch, heads, q length, dim), k and v
    (batch, heads, key length, dim), with the same key length on every rank; the output is this
    rank's, in q's dtype."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)
    with_mask = mask_travels(attn_mask, k.shape[-2])
    chunk = [k.contiguous(), v.contiguous()] + ([attn_mask.contiguous()] if with_mask else [])
    spare = None  # two receive buffers at most, used in turn (the first chunk may be the caller's k)
    out = lse = None
    for step in range(world):
        pending, incoming = [], None
        if step + 1 < world:
            incoming = spare or [torch.empty_like(t) for t in chunk]
            ops = [dist.P2POp(dist.isend, t, send_to, group) for t in chunk]
            ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in incoming]
            pending = dist.batch_isend_irecv(ops)
        try:
            part, part_lse = attend(q, chunk[0], chunk[1], chunk[2] if with_mask else attn_mask)
        finally:  # the transfers complete even when attend raises, so the ring can start over
            for work in pending:
                work.wait()
        out, lse = merge(out, lse, part, part_lse)
        if incoming is not None:
            spare = chunk if step > 0 else None
            chunk = incoming
    return out.to(q.dtype)
