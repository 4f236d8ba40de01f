"""The ranks that share an exact tiled run (TilingConfig(distributed=True)).

Each segment's tiles are dealt out in turn (tile i to rank i mod world size), and so are the
query bands of the whole-image attention. What a tile
gives the others goes to every rank: after each row of tiles, the outputs of that row's tiles
(broadcast by their owners), and after each pass, every tile's moments, which each rank then
merges in tile order, as one process does. So every rank holds the whole-image state and its
statistics, bit for bit those of one process, and returns the whole output. (A row's tiles all
have the same channels and dtype, and their sizes follow from the grid: one small all-reduce per
row tells every rank whether the row ran to the end, and with what.) One process is
a world of one (Ranks()), whose tiles are written as they are made.
"""
from __future__ import annotations

import torch

from pyext.vae.config import fail
from pyext.vae.statistics import Moments


class Ranks:
    def __init__(self, rank: int = 0, size: int = 1, device: torch.device | None = None):
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def of_world(cls, device: torch.device) -> "Ranks":
        """The ranks of torch.distributed's default process group, exchanging tensors on `device`
        (the run's: NCCL takes CUDA tensors)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            fail("distributed=True needs torch.distributed's default process group initialized in every "
                 "process (torchrun, then torch.distributed.init_process_group)")
        return cls(dist.get_rank(), dist.get_world_size(), device)

    def owns(self, tile: int) -> bool:
        return tile % self.size == self.rank

    def gather(self, items: dict) -> dict:
        """The union of every rank's {key: value} (small, picklable values)."""
        if self.size == 1:
            return dict(items)
        import torch.distributed as dist

        every: list = [None] * self.size
        dist.all_gather_object(every, items)
        return {key: value for part in every for key, value in part.items()}

    def most(self, values: list[int]) -> list[int]:
        """Each value's largest over the ranks (one small all-reduce)."""
        if self.size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather_moments(self, parts: dict[int, Moments]) -> dict[int, Moments]:
        """gather() for {tile: Moments}, sent through the host and put back on the run's device."""
        if self.size == 1:
            return parts
        every = self.gather({i: _moved(m, "cpu") for i, m in parts.items()})
        return {i: _moved(m, self.device) for i, m in every.items()}

    def share(self, tile: int, tensors: tuple | None, like: list) -> tuple:
        """The tile's tensors on every rank, sent by its owner; `like`: their (shape, dtype), which
        every rank knows."""
        if self.size == 1:
            return tensors
        import torch.distributed as dist

        owner = tile % self.size
        out = []
        for k, (shape, dtype) in enumerate(like):
            t = tensors[k].contiguous() if owner == self.rank else torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=owner)
            out.append(t)
        return tuple(out)


def _moved(m: Moments, device) -> Moments:
    return Moments.of(m.count, *(None if t is None else t.to(device) for t in (m.mean, m.m2)))
