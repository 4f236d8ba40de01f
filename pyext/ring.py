"""Ring and Ulysses attention on torch.distributed, computed by pyext's attention with its log-sum-exp.

Each rank of the ring group holds its own queries and its own chunk of keys and values. The
chunks travel around the ring, one step per rank: at each step a rank attends its queries to the
chunk it holds, sends that chunk to the next rank and receives the previous rank's, and merges
the partial results exactly through their log-sum-exp. A rank holds two chunks at a time, and
the transfer of the next chunk overlaps the attention on the current one.

A mask travels with the keys it masks when it has a key dimension (key padding: its query
dimension must then be 1); a mask that broadcasts over the keys stays where it is.

Ulysses (`split_attention` with a Ulysses group): before the attention, an all-to-all trades
heads for sequence, so each rank of the group holds 1/n of the heads over the group's whole
sequence; after it, the reverse all-to-all gives each rank its own tokens with every head back.
With both groups, the ring then runs over the Ulysses-gathered sequences (Unified Sequence
Parallelism: `ContextParallelConfig(ring_degree=r, ulysses_degree=u)`).
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
                   attn_mask: torch.Tensor | None = None, whole: tuple | None = None) -> torch.Tensor:
    """Attention, as `attend` computes it (scale, mask), of this rank's queries over the keys and
    values of every rank of `group`. Each rank passes its q (batch, heads, q length, dim), k and v
    (batch, heads, key length, dim), with the same key length on every rank; the output is this
    rank's, in q's dtype. whole: (keys, values) every rank holds alike, attended once (unmasked)
    and not passed around."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)
    with_mask = mask_travels(attn_mask, k.shape[-2])
    chunk = [k.contiguous(), v.contiguous()] + ([attn_mask.contiguous()] if with_mask else [])
    spare = None  # two receive buffers at most, used in turn (the first chunk may be the caller's k)
    out = lse = None
    if whole is not None:
        out, lse = merge(None, None, *attend(q, whole[0], whole[1], None))
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


def _heads_for_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads, tokens, dim) on each rank of `group` -> (batch, heads / n, n * tokens, dim):
    this rank's share of the heads over the tokens of every rank, in rank order."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _sequence_for_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The reverse of _heads_for_sequence: this rank's tokens, every head."""
    n = dist.get_world_size(group)
    b, h, ns, d = x.shape
    send = x.reshape(b, h, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: this rank's tokens, rank j's heads
    return recv.transpose(0, 1).reshape(b, n * h, ns // n, d)


def check_split(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, ring_group=None,
                ulysses_group=None, replicated: int = 0) -> None:
    """PyextError, before any transfer, for what split_attention cannot take."""
    if replicated and attn_mask is not None:
        raise PyextError("pyext context-parallel attention: a mask with tokens every rank holds whole is not "
                         "supported; supported: masks when every token is split across the ranks")
    if ulysses_group is not None:
        n = dist.get_world_size(ulysses_group)
        if q.shape[1] % n or k.shape[1] % n:
            raise PyextError(f"pyext Ulysses attention: {q.shape[1]} query and {k.shape[1]} key heads do not divide "
                             f"by the Ulysses degree {n}; supported: head counts that are multiples of it")
        if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1:
            raise PyextError("pyext Ulysses attention: a mask with a query dimension cannot be split by heads "
                             f"(shape {tuple(attn_mask.shape)}); supported: key-padding masks (query dimension 1) "
                             "and masks that broadcast over the keys and queries")
    if ring_group is not None:
        mask_travels(attn_mask, k.shape[-2])  # the Ulysses gather lengthens the mask's keys as the keys


def _mask_for_ulysses(attn_mask: torch.Tensor | None, heads: int, group) -> torch.Tensor | None:
    """The mask of this rank's heads over the gathered sequence: a key dimension is gathered
    (key padding), a heads dimension is cut to this rank's share."""
    if attn_mask is None or attn_mask.dim() == 0:
        return attn_mask
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if attn_mask.dim() == 4 and attn_mask.shape[1] == heads:
        attn_mask = attn_mask.chunk(n, dim=1)[rank]
    if attn_mask.shape[-1] == 1:
        return attn_mask
    parts = [torch.empty_like(attn_mask) for _ in range(n)]
    dist.all_gather(parts, attn_mask.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads / n, tokens, dim), each rank of `group` its share of the heads -> every head."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, ring_group=None,
                    ulysses_group=None, attn_mask: torch.Tensor | None = None, replicated: int = 0) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of the context-
    parallel groups: Ulysses over `ulysses_group` (its size must divide the q and k/v heads), then
    the ring over `ring_group`; either may be None. Same arguments as ring_attention.

    replicated: the last tokens of q, k and v that every rank holds whole (SD3's text, appended to
    the split image tokens by its joint attention). Their keys are attended once, and their
    queries' output is the same on every rank."""
    check_split(q, k, attn_mask, ring_group, ulysses_group, replicated)
    whole = None
    if replicated:
        (q, q_whole), (k, k_whole), (v, v_whole) = (t.split([t.shape[2] - replicated, replicated], dim=2)
                                                   for t in (q, k, v))
    if ulysses_group is not None:
        attn_mask = _mask_for_ulysses(attn_mask, q.shape[1], ulysses_group)
        q, k, v = (_heads_for_sequence(t, ulysses_group) for t in (q, k, v))
        if replicated:  # this rank's share of the heads of the whole tokens
            n, rank = dist.get_world_size(ulysses_group), dist.get_rank(ulysses_group)
            q_whole, k_whole, v_whole = (t.chunk(n, dim=1)[rank] for t in (q_whole, k_whole, v_whole))
    split = q.shape[2]
    if replicated:
        q, whole = torch.cat([q, q_whole], dim=2), (k_whole, v_whole)
    if ring_group is not None:
        out = ring_attention(q, k, v, ring_group, attend, attn_mask, whole)
    else:
        if whole is not None:
            k, v = torch.cat([k, whole[0]], dim=2), torch.cat([v, whole[1]], dim=2)
        out = attend(q, k, v, attn_mask)[0].to(q.dtype)
    if ulysses_group is None:
        return out
    out, out_whole = out[:, :, :split], out[:, :, split:]
    out = _sequence_for_heads(out, ulysses_group)
    return torch.cat([out, _gather_heads(out_whole, ulysses_group)], dim=2) if replicated else out
