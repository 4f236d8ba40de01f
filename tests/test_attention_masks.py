"""pyext.ops.attention with masks, grouped-query heads and the log-sum-exp, on every CPU backend
and every C++ SIMD path, against a float64 oracle: the error may be at most twice that of plain
PyTorch math in the same dtype (plus a tiny epsilon), as in tests/test_attention_op.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from pyext._ext import has_kernel
from pyext.dispatch import PyextError
from pyext.ops import attention

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-6}
needs_kernel = pytest.mark.skipif(not has_kernel("attention"), reason="pyext._C has no attention kernel (not built)")


def cpu_paths():
    return list(torch.ops.pyext_C.attention_paths()) if has_kernel("attention") else []


def masks(b, h, sq, skv, dtype):
    """{name: mask}: the layouts diffusers passes (key padding per sample, a bias per head and
    position) and ones with fully masked rows, boolean and additive."""
    g = torch.Generator().manual_seed(1)
    keep = torch.arange(skv) < torch.tensor([skv, skv // 2 + 1, 0][:b])[:, None]  # the last sample: no key
    rows = torch.rand(sq, skv, generator=g) > 0.4
    rows[::4] = False
    bias = torch.randn(1, h, sq, skv, generator=g).masked_fill(torch.rand(1, h, sq, skv, generator=g) < 0.2, -math.inf)
    return {"key padding": keep[:, None, None, :], "2-D rows": rows, "bias": bias.to(dtype), "bias fp32": bias,
            "per-head bias": torch.randn(1, h, 1, 1, generator=g).to(dtype),
            "expanded": keep[:, None, None, :].expand(b, h, sq, skv)}


def as_bias64(mask):
    return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf) if mask.dtype == torch.bool \
        else mask.double()


def oracle(q, k, v, mask=None, scale=None):
    """(out, lse) in float64, with k/v heads repeated for their query heads; 0 where all keys are masked."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + as_bias64(mask)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def same_dtype_math(q, k, v, mask=None):
    """What plain PyTorch computes in the inputs' dtype (SDPA's math backend)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        if mask is not None and mask.dtype not in (torch.bool, q.dtype):
            mask = mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def assert_close_to_oracle(out, q, k, v, mask):
    exact, _ = oracle(q, k, v, mask)
    err = (out.double() - exact).abs().max().item()
    bound = 2 * (same_dtype_math(q, k, v, mask).double() - exact).abs().max().item() + EPS[q.dtype]
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


def qkv(b, h, hkv, sq, skv, d, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, sq, d, generator=g)
    k, v = (torch.randn(b, hkv, skv, d, generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def backends():
    return ["reference", "sdpa", None] + (["cpp"] if has_kernel("attention") else [])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2), (4, 1)])
def test_masked_attention_matches_the_oracle(backend, dtype, h, hkv):
    for sq, skv, d in [(9, 77, 40), (33, 5, 64), (1, 300, 80)]:
        q, k, v = qkv(3, h, hkv, sq, skv, d, dtype)
        for name, mask in masks(3, h, sq, skv, dtype).items():
            out = attention(q, k, v, backend=backend, attn_mask=mask)
            assert_close_to_oracle(out, q, k, v, mask)
            assert out.shape == q.shape and not out.isnan().any(), name


@needs_kernel
@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_every_path_with_masks_groups_and_lse(path, dtype):
    if (path in ("amx", "avx512_bf16") or path.startswith("brgemm_stand_in")) and dtype != torch.bfloat16:
        pytest.skip(f"the {path} path takes bfloat16 only")
    # 5,000 keys of d=64 are packed in several chunks: the bias and lse cross chunk boundaries
    for b, h, hkv, sq, skv, d in [(3, 4, 2, 37, 45, 33), (2, 2, 1, 70, 5000, 64), (3, 1, 1, 1, 7, 1)]:
        q, k, v = qkv(b, h, hkv, sq, skv, d, dtype)
        for name, mask in masks(b, h, sq, skv, dtype).items():
            from pyext.reference.attention import mask_as_bias

            bias = mask_as_bias(mask)
            out, lse = torch.ops.pyext_C.attention(q, k, v, d ** -0.5, path, bias, True)
            assert_close_to_oracle(out, q, k, v, mask)
            exact = oracle(q, k, v, mask)[1]
            assert torch.equal(torch.isneginf(lse), torch.isneginf(exact)), name
            finite = torch.isfinite(exact)
            assert ((lse.double() - exact).abs()[finite] <= 1e-4 * exact.abs()[finite].clamp_min(1)).all(), name


@pytest.mark.parametrize("backend", ["reference", None] + (["cpp"] if has_kernel("attention") else []))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_sum_exp(backend, dtype):
    q, k, v = qkv(3, 4, 2, 17, 40, 40, dtype)
    for name, mask in [("none", None), *masks(3, 4, 17, 40, dtype).items()]:
        out, lse = attention(q, k, v, backend=backend, attn_mask=mask, return_lse=True)
        exact_out, exact = oracle(q, k, v, mask)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(exact)), name  # -inf exactly where all keys are masked
        finite = torch.isfinite(exact)
        assert ((lse.double() - exact).abs()[finite] <= 1e-4 * exact.abs()[finite].clamp_min(1)).all(), name
        assert_close_to_oracle(out, q, k, v, mask)
        if backend is not None:  # (automatic dispatch may take another backend without the lse)
            assert torch.equal(out, attention(q, k, v, backend=backend, attn_mask=mask)), name


def test_lse_merges_split_keys():
    """What ring attention does: attention over two halves of the keys, merged by their lse,
    equals attention over all keys."""
    q, k, v = qkv(2, 2, 2, 9, 64, 40, torch.float32)
    whole = attention(q, k, v)
    (o1, l1), (o2, l2) = (attention(q, k[:, :, s], v[:, :, s], return_lse=True) for s in (slice(0, 30), slice(30, None)))
    w = torch.sigmoid(l1 - l2)[..., None]
    torch.testing.assert_close(w * o1 + (1 - w) * o2, whole, atol=1e-6, rtol=0)


def test_sdpa_refuses_lse_with_its_reason():
    q, k, v = qkv(1, 2, 2, 4, 4, 8, torch.float32)
    with pytest.raises(PyextError, match="backend 'sdpa' cannot run this input.*does not return the log-sum-exp"):
        attention(q, k, v, backend="sdpa", return_lse=True)


@pytest.mark.parametrize("mask,match", [
    (torch.ones(5, 4, dtype=torch.bool), "does not broadcast"),
    (torch.ones(1, 1, 1, 1, 4, dtype=torch.bool), "does not broadcast"),
    (torch.ones(4, dtype=torch.int64), "attn_mask has dtype torch.int64"),
    (torch.zeros(4, dtype=torch.float64), "attn_mask has dtype torch.float64"),
    ([[True]], "attn_mask must be a tensor"),
])
def test_bad_masks_name_the_op(mask, match):
    q, k, v = qkv(1, 2, 2, 3, 4, 8, torch.float32)
    with pytest.raises(PyextError, match=f"pyext.attention: .*{match}"):
        attention(q, k, v, attn_mask=mask)


def test_grouped_heads_must_divide():
    q, k, v = qkv(1, 4, 3, 3, 4, 8, torch.float32)
    with pytest.raises(PyextError, match="q's heads must be a multiple of k's"):
        attention(q, k, v)


@pytest.mark.parametrize("backend", backends())
def test_opcheck_with_masks_and_lse(backend):
    for dtype in DTYPES:
        q, k, v = qkv(2, 4, 2, 9, 77, 40, dtype)
        # diffusers' layout: (B, S, H, D) memory seen as (B, H, S, D)
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)
        for mask in (masks(2, 4, 9, 77, dtype)["key padding"], masks(2, 4, 9, 77, dtype)["bias"]):
            torch.library.opcheck(torch.ops.pyext.attention.default, (qt, k, v, None, backend, mask))
            if backend != "sdpa":
                torch.library.opcheck(torch.ops.pyext.attention_lse.default, (q, k, v, 0.2, backend, mask))


def test_an_expanded_mask_is_converted_without_its_broadcast():
    from pyext.reference.attention import mask_as_bias

    keep = torch.rand(2, 1, 1, 300) > 0.5
    bias = mask_as_bias(keep.expand(2, 8, 1024, 300))
    assert bias.shape == (2, 1, 1, 300) and bias.dtype == torch.float32
    assert torch.equal(bias, torch.zeros(2, 1, 1, 300).masked_fill(~keep, -math.inf))
