"""Whole-image GroupNorm statistics gathered tile by tile, and GroupNorm calls that use them.

A GroupNorm normalises each (sample, group) with the mean and variance over all its pixels.
A tile sees only its own pixels, so `Moments` merges every tile's partial moments into the
whole image's (Chan et al.'s pairwise update, in float64), and `SyncedGroupNorms` (a
TorchFunctionMode around one tile's run, as pyext.attention routes SDPA) normalises the
GroupNorm calls whose whole-image statistics are known and stops the run at the first one
that is not, adding the moments of that call's input, cropped to the tile's own pixels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pyext.ops import group_moments
from pyext.ops.group_moments import DTYPES as MOMENT_DTYPES


class Stop(Exception):
    """Ends a tile's run at the first GroupNorm whose statistics are not known yet."""


class Moments:
    """Count, mean and sum of squared deviations per (sample, group), merged over tiles."""

    def __init__(self):
        self.count = 0
        self.mean = self.m2 = None

    def add(self, x: torch.Tensor, groups: int) -> None:
        """Merges in the moments of x (N, C, H, W), typically a crop of a tile (its own pixels),
        which pyext.ops.group_moments reads in place."""
        mean, m2 = group_moments(x if x.dtype in MOMENT_DTYPES else x.float(), groups)  # float64: in float32
        self.merge(Moments.of(math.prod(x.shape[2:]) * (x.shape[1] // groups), mean, m2))

    @classmethod
    def of(cls, count: int, mean: torch.Tensor, m2: torch.Tensor) -> "Moments":
        moments = cls()
        moments.count, moments.mean, moments.m2 = count, mean, m2
        return moments

    def merge(self, other: "Moments") -> None:
        """Merges in another's moments (those of other pixels)."""
        n, mean, m2 = other.count, other.mean, other.m2
        if n == 0:
            return
        if self.count == 0:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.count * n / total)
        self.count = total

    def grouped(self, groups: int) -> "Moments":
        """Moments gathered per channel (add(x, x.shape[1])) merged into `groups` groups of
        consecutive channels, as GroupNorm groups them (every channel has the same count)."""
        n, c = self.mean.shape
        mean, m2 = self.mean.view(n, groups, c // groups), self.m2.view(n, groups, c // groups)
        grouped_mean = mean.mean(-1)
        return Moments.of(self.count * (c // groups), grouped_mean,
                          m2.sum(-1) + self.count * ((mean - grouped_mean[..., None]) ** 2).sum(-1))

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, variance) per (sample, group), float64."""
        return self.mean, self.m2 / self.count


def normalize(x: torch.Tensor, groups: int, weight, bias, eps: float, mean: torch.Tensor, var: torch.Tensor):
    """group_norm(x) with the given statistics instead of x's own: one pass, x * scale + shift
    per (sample, channel), scale and shift formed in float64."""
    per = x.shape[1] // groups
    scale = torch.rsqrt(var + eps).repeat_interleave(per, dim=1)  # (N, C)
    if weight is not None:
        scale = scale * weight.double()
    shift = -mean.repeat_interleave(per, dim=1) * scale
    if bias is not None:
        shift = shift + bias.double()
    view = (*scale.shape, *[1] * (x.dim() - 2))
    return torch.addcmul(shift.to(x.dtype).view(view), x, scale.to(x.dtype).view(view))


def _group_norm_args(input, num_groups, weight=None, bias=None, eps=1e-5):
    return input, num_groups, weight, bias, eps


class SyncedGroupNorms(TorchFunctionMode):
    """Around one tile's run: the i-th F.group_norm call normalises with known[i]; the first
    call past the known ones adds the moments of its input's crop (the tile's own pixels, given
    as (top, bottom, left, right) pixels of the run's input, scaled to the call's resolution)
    to `moments` and raises Stop."""

    def __init__(self, known: list, moments: Moments, crop: tuple[int, int, int, int], in_size: tuple[int, int]):
        super().__init__()
        self.known, self.moments, self.crop, self.in_size = known, moments, crop, in_size
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.group_norm:
            return func(*args, **kwargs)
        x, groups, weight, bias, eps = _group_norm_args(*args, **kwargs)
        i, self.calls = self.calls, self.calls + 1
        if i < len(self.known):
            return normalize(x, groups, weight, bias, eps, *self.known[i])
        top, bottom, left, right = self.crop
        sy, sx = x.shape[-2] / self.in_size[0], x.shape[-1] / self.in_size[1]
        core = x[..., round(top * sy):x.shape[-2] - round(bottom * sy), round(left * sx):x.shape[-1] - round(right * sx)]
        self.moments.add(core, groups)
        raise Stop
