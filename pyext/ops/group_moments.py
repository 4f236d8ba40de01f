"""The moments of every (sample, group) of a tensor: what a GroupNorm's statistics are made of.

    mean, m2 = group_moments(x, num_groups)   # each (N, num_groups), float64

mean is the mean of each group's values (its channels at every pixel) and m2 the sum of their
squared deviations from it, so the variance is m2 / count. The exact tiled VAE
(pyext.vae.statistics) merges them over tiles into the whole image's statistics, on each tile's
own pixels: a crop of a channels-last activation, which the C++ kernel reads in place. x is
(N, C, H, W) in float32/float16/bfloat16, any strides; the kernel takes those whose pixels
hold their channels contiguously and whose rows hold their pixels (channels-last and its crops),
others go to the reference.
"""
from __future__ import annotations

from functools import partial

import torch

from pyext import dispatch
from pyext._ext import kernel_missing
from pyext.dispatch import Backend, PyextError
from pyext.ops._library import define

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg: str) -> None:
    raise PyextError(f"pyext.group_moments: {msg}")


def check_inputs(x, num_groups) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or x.dim() != 4:
        _fail(f"x must be a float32/float16/bfloat16 tensor (N, C, H, W), got {dispatch.describe(x)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        _fail(f"num_groups must be a positive int, got {num_groups!r}")
    if x.shape[1] % num_groups:
        _fail(f"num_groups={num_groups} does not divide the {x.shape[1]} channels of x {tuple(x.shape)}; "
              "the channel count must be a multiple of num_groups")


def group_moments_reference(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two passes in float32, the mean and then the squares about it (as accurate as a single
    Welford pass, and vectorised), the results in float64. Per channel it reduces the strided
    spatial dims without a reshape copy; the deviations are one temporary of x's size."""
    n = x.shape[0]
    if num_groups == x.shape[1]:
        x, dims = x.float(), (2, 3)
    else:
        x, dims = x.reshape(n, num_groups, -1).float(), (-1,)
    mean = x.mean(dims, keepdim=True)
    m2 = (x - mean).square_().sum(dims)
    return mean.reshape(n, num_groups).double(), m2.reshape(n, num_groups).double()


def _cpp(x, num_groups):
    return torch.ops.pyext_C.group_moments(x, num_groups)


def pixels_contiguous(x: torch.Tensor) -> bool:
    """Each pixel's channels are contiguous, and each row's pixels: channels-last or a crop of it."""
    n, c, h, w = x.shape
    return (c == 1 or x.stride(1) == 1) and (w == 1 or x.stride(3) == c)


def _cpp_reasons(x, num_groups):
    if not pixels_contiguous(x):
        return [f"reads pixels whose channels are contiguous and rows whose pixels are (channels-last or a crop "
                f"of it), got strides {tuple(x.stride())}"]
    return []


# (shape, groups, layout) the op tests run the backends on: channels-last and crops of it (the
# exact VAE's case), which the kernel reads; odd sizes, rows longer than a kernel block, one group,
# one channel per group. The reference also takes plain contiguous tensors.
CPP_SHAPES = (((2, 6, 5, 7), 3, "channels_last"), ((1, 32, 19, 300), 32, "crop"), ((2, 64, 17, 23), 8, "crop"),
              ((1, 3, 1, 1), 1, "channels_last"), ((1, 1, 7, 5), 1, "crop"))
TEST_SHAPES = CPP_SHAPES + (((3, 4, 9, 11), 2, "contiguous"),)

dispatch.register("group_moments", Backend(
    "cpp", _cpp, _cpp_reasons, unavailable=partial(kernel_missing, "group_moments"), devices=("cpu",), dtypes=DTYPES,
    test_shapes=CPP_SHAPES,
    doc="C++ two-pass moments over fixed blocks of pixels (AVX-512/AVX2/scalar), read in place, float64 merge"))
dispatch.register("group_moments", Backend(
    "reference", group_moments_reference, dtypes=DTYPES, test_shapes=TEST_SHAPES,
    doc="torch's reductions, two passes in float32; on GPUs too, where they are what runs"))


def example(shape, groups, layout, dtype, device):
    """Arguments of the op on random data with a mean and a spread away from 0 and 1; a crop
    drops a border of a larger channels-last tensor, as a tile's window around its own pixels."""
    g = torch.Generator(device=device).manual_seed(0)
    n, c, h, w = shape
    pad = (2, 3) if layout == "crop" else (0, 0)  # rows, columns
    x = (torch.randn(n, c, h + 2 * pad[0], w + 2 * pad[1], generator=g, device=device) * 3 + 1).to(dtype)
    x = x if layout == "contiguous" else x.contiguous(memory_format=torch.channels_last)
    return x[..., pad[0]:pad[0] + h, pad[1]:pad[1] + w], groups


def _layout(x) -> str:
    return "channels_last" if pixels_contiguous(x) else "contiguous"


# Self-check tolerance: the mean's error relative to a group's magnitude |mean| + std, the
# variance's relative to its square; both backends sum in float32.
_TOLERANCE = 1e-5


def _close(out, ref, args):
    (mean, m2), (ref_mean, ref_m2) = out, ref
    count = max(1, args[0][0].numel() // args[1])
    scale = (ref_mean.abs() + (ref_m2 / count).sqrt()).clamp_min(1e-30)
    err = max(((mean - ref_mean).abs() / scale).max().item(), ((m2 - ref_m2).abs() / count / scale ** 2).max().item())
    return None if err <= _TOLERANCE else f"relative error {err:.3g} (allowed {_TOLERANCE:.3g})"


dispatch.define("group_moments", check=check_inputs, sample=lambda args: example((2, 8, 5, 7), 4, _layout(args[0]), args[0].dtype,
                                                             args[0].device),
                close=_close, example=lambda spec, dtype, device: example(*spec, dtype, device),
                variant=lambda args: (str(args[0].dtype), _layout(args[0])))


def _moments_kernel(x, num_groups, backend=None):
    return dispatch.select("group_moments", (x, num_groups), backend).run(x, num_groups)


def _moments_fake(x, num_groups, backend=None):
    dispatch.check("group_moments", (x, num_groups))
    return x.new_empty(x.shape[0], num_groups, dtype=torch.float64), x.new_empty(x.shape[0], num_groups,
                                                                                  dtype=torch.float64)


define("group_moments(Tensor x, SymInt num_groups, str? backend=None) -> (Tensor, Tensor)", _moments_kernel,
       _moments_fake)


def group_moments(x: torch.Tensor, num_groups: int, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, m2) of each (sample, group) of x (N, C, H, W): float64 (N, num_groups) each, m2 the
    sum of squared deviations from the mean (the variance times the count, H * W * C / num_groups).
    A group of no values has a NaN mean and a zero m2."""
    if not isinstance(x, torch.Tensor):
        _fail(f"x must be a float32/float16/bfloat16 tensor (N, C, H, W), got {dispatch.describe(x)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        _fail(f"num_groups must be a positive int, got {num_groups!r}")
    return torch.ops.pyext.group_moments(x, num_groups, backend)  # which validates the rest (check_inputs)
