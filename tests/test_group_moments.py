"""pyext.ops.group_moments: the C++ kernel at every SIMD level and the reference against a float64
oracle, on channels-last tensors and crops of them (what the exact tiled VAE passes), a large mean
over a small spread, determinism across thread counts, empty and non-finite groups, opcheck on
every layout, and bad inputs."""
import pytest
import torch

from pyext._ext import has_kernel
from pyext.dispatch import PyextError, select
from pyext.ops import group_moments

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cpp = pytest.mark.skipif(not has_kernel("group_moments"), reason="pyext._C without group_moments")


def oracle(x, groups):
    """(mean, m2) in float64 of the same values."""
    g = x.double().reshape(x.shape[0], groups, -1)
    mean = g.mean(-1)
    return mean, (g - mean[..., None]).square().sum(-1)


def crop(shape, dtype, border=(0, 0, 0, 0), layout=torch.channels_last, mean=1.0, spread=3.0, seed=0):
    """An (N, C, H, W) view inside a larger tensor of that layout, `border` = (top, bottom, left,
    right) pixels around it: a tile's own pixels inside its window."""
    n, c, h, w = shape
    top, bottom, left, right = border
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, top + h + bottom, left + w + right, generator=g, dtype=torch.float64) * spread + mean)
    return x.to(dtype).contiguous(memory_format=layout)[..., top:top + h, left:left + w]


def assert_close_to_oracle(got, x, groups, mean_tol, var_tol):
    mean, m2 = got
    want_mean, want_m2 = oracle(x, groups)
    count = x[0].numel() // groups
    std = (want_m2 / count).sqrt()
    assert mean.dtype == m2.dtype == torch.float64 and mean.shape == m2.shape == (x.shape[0], groups)
    assert ((mean - want_mean).abs() <= mean_tol * (want_mean.abs() + std)).all()
    assert ((m2 - want_m2).abs() <= var_tol * want_m2 + 1e-300).all()


# (shape, groups, border): one group, one channel per group and between; odd sizes; rows longer
# than a kernel block (256 pixels) and blocks of many short rows; a crop on every side.
CASES = [((1, 1, 7, 9), 1, (0, 0, 0, 0)), ((2, 3, 1, 1), 3, (1, 0, 2, 0)), ((3, 6, 17, 23), 2, (2, 2, 2, 2)),
         ((2, 32, 9, 300), 32, (1, 3, 5, 2)), ((1, 64, 31, 7), 8, (0, 4, 0, 1)), ((2, 96, 5, 257), 1, (3, 0, 0, 0)),
         ((1, 320, 11, 13), 32, (2, 1, 1, 2)), ((1, 512, 3, 600), 32, (0, 0, 3, 3))]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpp_matches_float64(simd, case, dtype):
    """The kernel's float32 sums, corrected about a pivot, keep the mean to a few float32 roundings of
    the group's magnitude and the variance to a few relative: on the dtype's own values, so the
    tolerance is float32's for every dtype."""
    shape, groups, border = case
    x = crop(shape, dtype, border)
    assert_close_to_oracle(group_moments(x, groups, backend="cpp"), x, groups, 1e-6, 1e-5)


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64(dtype, layout):
    x = crop((2, 32, 19, 23), dtype, (1, 2, 3, 4), layout)
    for groups in (32, 8, 1):
        assert_close_to_oracle(group_moments(x, groups, backend="reference"), x, groups, 1e-6, 1e-5)


@needs_cpp
def test_cpp_keeps_a_large_mean_over_a_small_spread(simd):
    """Values of 1000 +- 0.01: E[x^2] - E[x]^2 in float32 would lose the variance entirely."""
    x = crop((1, 16, 40, 70), torch.float32, (1, 1, 1, 1), mean=1000.0, spread=0.01)
    mean, m2 = group_moments(x, 4, backend="cpp")
    want_mean, want_m2 = oracle(x, 4)
    assert ((mean - want_mean).abs() <= 1e-4).all()
    assert ((m2 - want_m2).abs() <= 1e-3 * want_m2).all()


@needs_cpp
def test_cpp_is_the_same_on_any_number_of_threads():
    x = crop((2, 64, 33, 129), torch.float32, (1, 2, 3, 4))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(group_moments(x, 8, backend="cpp"))
    finally:
        torch.set_num_threads(before)
    for mean, m2 in results[1:]:
        assert torch.equal(mean, results[0][0]) and torch.equal(m2, results[0][1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_empty_and_non_finite_groups(backend):
    empty = torch.randn(2, 4, 0, 5).contiguous(memory_format=torch.channels_last)
    mean, m2 = group_moments(empty, 2, backend=backend)
    assert mean.isnan().all() and (m2 == 0).all()
    x = crop((1, 4, 5, 6), torch.float32, (1, 1, 1, 1))
    x[0, 0, 2, 3] = float("nan")
    x[0, 3, 1, 1] = float("inf")
    mean, m2 = group_moments(x, 2, backend=backend)
    assert mean[0, 0].isnan() and m2[0, 0].isnan()  # a NaN in group 0 only
    assert not mean[0, 1].isfinite() and not m2[0, 1].isfinite()  # inf: an infinite mean, a NaN m2


@needs_cpp
def test_automatic_choice_reads_channels_last_crops_in_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("PYEXT_CACHE_DIR", str(tmp_path))
    x = crop((1, 8, 6, 7), torch.float32, (1, 1, 2, 2))
    assert select("group_moments", (x, 4)).name == "cpp"
    # a channels-first tensor goes to the reference, which says why
    plain = crop((1, 8, 6, 7), torch.float32, layout=torch.contiguous_format)
    assert select("group_moments", (plain, 4)).name == "reference"
    with pytest.raises(PyextError, match="pixels whose channels are contiguous"):
        group_moments(plain, 4, backend="cpp")


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("layout", ["channels_last", "crop", "contiguous"])
def test_opcheck(backend, layout):
    x = crop((2, 6, 5, 7), torch.float32, (1, 2, 1, 0) if layout == "crop" else (0, 0, 0, 0),
             torch.contiguous_format if layout == "contiguous" else torch.channels_last)
    if backend == "cpp" and layout == "contiguous":
        backend = None  # the kernel refuses it: automatic choice
    op = torch.ops.pyext.group_moments.default
    torch.library.opcheck(op, (x, 3, backend))
    torch.library.opcheck(op, (x.half(), 6, backend))


def _raises(match, *args):
    with pytest.raises(PyextError, match=match) as info:
        group_moments(*args)
    assert str(info.value).startswith("pyext.group_moments: ")


def test_bad_inputs_are_errors_naming_the_op():
    x = torch.randn(2, 6, 4, 4)
    _raises("does not divide the 6 channels.*multiple of num_groups", x, 4)
    _raises("num_groups must be a positive int", x, 0)
    _raises("num_groups must be a positive int", x, True)
    _raises(r"float32/float16/bfloat16 tensor \(N, C, H, W\), got int64", torch.zeros(2, 6, 4, 4, dtype=torch.long), 2)
    _raises(r"\(N, C, H, W\), got float32\[2, 6, 4\]", torch.randn(2, 6, 4), 2)
    _raises("got 'x'", "x", 2)
