"""pyext.ops.attention: every CPU backend against a float64 oracle, the C++ kernel at
every SIMD path, validation and dispatch errors, opcheck, and O(seq) memory.

Tolerance (the rule of flash-attention's tests): a backend's max error against the
float64 oracle may be at most twice the error of plain PyTorch math done in the
same dtype (matmul, softmax, matmul in bf16/fp16/fp32), plus a tiny epsilon.
"""
import json
import shutil
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pyext._ext import EXT, has_kernel
from pyext.dispatch import PyextError, select
from pyext.ops import attention
from pyext.reference.attention import attention_reference

needs_kernel = pytest.mark.skipif(not has_kernel("attention"), reason="pyext._C has no attention kernel (not built)")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-6}
HEAD_DIMS = [40, 64, 80, 128, 160, 1, 8, 33, 72, 100, 256]
SEQS = [(1, 77), (77, 77), (97, 33), (16, 1)]  # (q length, kv length): cross- and self-attention


def cpu_paths():
    return list(torch.ops.pyext_C.attention_paths()) if has_kernel("attention") else []


BF16_PATHS = ("amx", "avx512_bf16", "brgemm_stand_in", "brgemm_stand_in_avx512")  # bf16 inputs only


def make_qkv(b, h, sq, skv, d, dtype, spread=1.0):
    q = torch.randn(b, h, sq, d) * spread
    k = torch.randn(b, h, skv, d)
    v = torch.randn(b, h, skv, d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def oracle(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q.double() @ k.double().transpose(-1, -2) * scale
    return torch.softmax(s, -1) @ v.double()


def same_dtype_math(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, -1) @ v


def assert_close_to_oracle(out, q, k, v, scale=None):
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    exact = oracle(q, k, v, scale)
    err = (out.double() - exact).abs().max().item()
    bound = 2 * (same_dtype_math(q, k, v, scale).double() - exact).abs().max().item() + EPS[q.dtype]
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ----------------------------------------------------------------------------- C++ kernel, every path

@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,skv", SEQS)
def test_cpp_every_path(sq, skv, d, dtype):
    q, k, v = make_qkv(1, 2, sq, skv, d, dtype)
    for path in cpu_paths():
        if path in BF16_PATHS and dtype != torch.bfloat16:
            continue
        out = torch.ops.pyext_C.attention(q, k, v, d ** -0.5, path)[0]
        assert_close_to_oracle(out, q, k, v)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [40, 33, 1])
def test_cpp_every_path_reads_and_writes_strided_rows(d, dtype):
    """Every path reads q, k, v where their strides put each row (diffusers' (B, S, H, D) memory,
    k and v broadcast over the batch, a strided head dim) and writes the output in q's layout
    where q is dense, so the op returns it without a copy; in chunks of keys too."""
    bshd = [torch.randn(2, s, 3, d).to(dtype).transpose(1, 2) for s in (9, 77, 8500)]
    layouts = {"bshd": bshd[:2], "expanded_kv": [bshd[0], *[t[:1].expand(2, -1, -1, -1) for t in bshd[1:2]]],
               "keys_in_chunks": [bshd[0], bshd[2]],
               "strided_head_dim": [t.transpose(2, 3).contiguous().transpose(2, 3) for t in bshd[:2]]}
    for path in cpu_paths():
        if path in BF16_PATHS and dtype != torch.bfloat16:
            continue
        for name, (q, k) in layouts.items():
            v = torch.randn_like(k)
            out = torch.ops.pyext_C.attention(q, k, v, d ** -0.5, path)[0]
            assert_close_to_oracle(out, q, k, v)
            if d > 1 and name != "strided_head_dim":
                assert out.stride() == q.stride(), (path, name)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [40, 72, 160])
def test_cpp_long_sequences(d, dtype):
    """1025 keys: several 256-key softmax blocks plus a ragged tail; 1025 queries: a ragged query block."""
    q, k, v = make_qkv(1, 1, 1025, 1025, d, dtype)
    for path in cpu_paths():
        if path in ("scalar",) and d > 64 or path in BF16_PATHS and dtype != torch.bfloat16:
            continue  # the scalar path is covered at every size above; keep the suite fast
        assert_close_to_oracle(torch.ops.pyext_C.attention(q, k, v, d ** -0.5, path)[0], q, k, v)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,sq,skv,d", [(1, 1, 70, 2500, 512), (2, 3, 33, 2049, 500), (1, 2, 5, 8500, 64)])
def test_cpp_keys_in_chunks(b, h, sq, skv, d, dtype):
    """Keys past the glue's chunk (1 MiB packed per head: 256 fp32 keys at d=512, 512 bf16,
    2048 fp32 at d=64) are packed and attended a chunk at a time, each query row's running
    output, max and sum carried between chunks: ragged last chunks, several heads and samples
    (each with its own carry rows), every path."""
    q, k, v = make_qkv(b, h, sq, skv, d, dtype)
    for path in cpu_paths():
        if path in BF16_PATHS and dtype != torch.bfloat16:
            continue
        assert_close_to_oracle(torch.ops.pyext_C.attention(q, k, v, d ** -0.5, path)[0], q, k, v)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_large_scores_stay_stable(dtype):
    """Scores in the hundreds: the online softmax must subtract the running max, not overflow."""
    q, k, v = make_qkv(1, 2, 40, 300, 64, dtype, spread=30.0)
    for path in cpu_paths():
        if path in BF16_PATHS and dtype != torch.bfloat16:
            continue
        out = torch.ops.pyext_C.attention(q, k, v, 64 ** -0.5, path)[0]
        assert torch.isfinite(out).all()
        assert_close_to_oracle(out, q, k, v)


@needs_kernel
def test_cpp_rejects_unknown_path():
    q, k, v = make_qkv(1, 1, 4, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="not available"):
        torch.ops.pyext_C.attention(q, k, v, 1.0, "avx1024")
    for path in set(BF16_PATHS) & set(cpu_paths()):
        with pytest.raises(RuntimeError, match="bfloat16 inputs only"):
            torch.ops.pyext_C.attention(q, k, v, 1.0, path)


@needs_kernel
@pytest.mark.parametrize("level,expect", [("scalar", ["scalar", "brgemm_stand_in"]),
                                          ("avx2", ["avx2", "scalar", "brgemm_stand_in"])])
def test_simd_cap_env(level, expect):
    """PYEXT_CPU_SIMD caps the automatic choice (read per call), and results stay right."""
    if level not in EXT.cpu_capabilities():
        pytest.skip(f"this CPU has no {level}")
    script = textwrap.dedent("""
        import json, torch, pyext
        from pyext.ops import attention
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 33, 40, dtype=torch.bfloat16) for _ in range(3))
        out = attention(q, k, v, backend="cpp")
        ref = torch.ops.pyext_C.attention(q, k, v, 40 ** -0.5, "scalar" if "{level}" == "scalar" else "avx2")[0]
        print(json.dumps(dict(paths=list(torch.ops.pyext_C.attention_paths()), same=bool(torch.equal(out, ref)))))
    """).replace("{level}", level)
    env = dict(os.environ, PYEXT_CPU_SIMD=level)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"paths": expect, "same": True}


def _extra_mib(sq: int, skv: int, d: int, dtype: str) -> dict:
    """The kernel's extra peak RSS for one call (VmHWM reset before it; ru_maxrss would carry
    the pytest parent's peak over fork+exec), in a fresh process."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the RSS high-water mark")
    script = textwrap.dedent(f"""
        import json, torch, pyext
        def kib(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
        torch.manual_seed(0)
        q = torch.randn(1, 1, {sq}, {d}, dtype=torch.{dtype})
        k, v = (torch.randn(1, 1, {skv}, {d}, dtype=torch.{dtype}) for _ in range(2))
        torch.ops.pyext_C.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], 0.125, "")  # load code, threads
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS")
        out = torch.ops.pyext_C.attention(q, k, v, 0.125, "")[0]
        print(json.dumps(dict(extra_mib=(kib("VmHWM") - before) / 1024, finite=bool(torch.isfinite(out).all()))))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"]
    return result


@needs_kernel
def test_cpp_memory_is_linear_in_sequence():
    """16384 queries and keys, 1 head, dim 64: the score matrix alone would be 1 GiB in fp32."""
    result = _extra_mib(16384, 16384, 64, "bfloat16")
    # output 2 MiB + packed k/v at most 1 MiB (a chunk) + per-thread scratch; 1024 MiB if scores were materialised.
    assert result["extra_mib"] < 64, result


@needs_kernel
def test_cpp_packs_long_keys_a_chunk_at_a_time():
    """65536 fp32 keys and values of dim 512 (128 MiB each): packing them whole would take
    256 MiB more; a chunk at a time the kernel holds 1 MiB of them, plus the carry and output
    of 64 queries (128 KiB each) and per-thread scratch."""
    result = _extra_mib(64, 65536, 512, "float32")
    assert result["extra_mib"] < 16, result


# ----------------------------------------------------------------------------- the public op

@pytest.mark.parametrize("backend", ["cpp", "sdpa", "reference", None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_op_backends(backend, dtype):
    if backend == "cpp" and not has_kernel("attention"):
        pytest.skip("pyext._C has no attention kernel")
    for (sq, skv, d) in [(77, 77, 40), (97, 77, 80), (1, 33, 160), (64, 64, 33)]:
        q, k, v = make_qkv(2, 3, sq, skv, d, dtype)
        assert_close_to_oracle(attention(q, k, v, backend=backend), q, k, v)


@pytest.mark.parametrize("backend", ["cpp", "sdpa", None])
def test_non_contiguous_and_explicit_scale(backend):
    if backend == "cpp" and not has_kernel("attention"):
        pytest.skip("pyext._C has no attention kernel")
    # diffusers' layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    q = torch.randn(2, 50, 4, 40, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 77, 4, 40, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 77, 4, 40, dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous()
    out = attention(q, k, v, scale=0.3, backend=backend)
    assert_close_to_oracle(out, q, k, v, scale=0.3)


@needs_kernel
def test_auto_dispatch_on_cpu_prefers_cpp_where_it_wins():
    q, k, v = make_qkv(2, 8, 64, 64, 40, torch.bfloat16)
    expect = "cpp" if "avx512" in cpu_paths() else "sdpa"  # (an AMX CPU's first path is amx)
    assert select("attention", (q, k, v, None, None, False)).name == expect


def test_static_order_on_a_gpu_passes_triton_by_where_sdpa_fused_kernels_answer():
    """Fake CUDA tensors (no GPU needed): the rule covers half precision without a mask or the
    log-sum-exp, head dims that are multiples of 8 and equal head counts; elsewhere triton stays first."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pyext import dispatch

    slower = next(b for b in dispatch.ops()["attention"].backends if b.name == "triton").slower
    with FakeTensorMode():
        def qkv(head_dim=40, kv_heads=2, dtype=torch.bfloat16):
            return tuple(torch.empty(1, h, 9, head_dim, device="cuda", dtype=dtype) for h in (2, kv_heads, kv_heads))

        assert slower(*qkv(), None, None, False) and slower(*qkv(dtype=torch.float16), None, None, False)
        mask = torch.ones(9, 9, dtype=torch.bool, device="cuda")
        for args in ((*qkv(), None, None, True), (*qkv(), None, mask, False),
                     (*qkv(dtype=torch.float32), None, None, False), (*qkv(head_dim=33), None, None, False),
                     (*qkv(kv_heads=1), None, None, False)):
            assert slower(*args) == [], [dispatch.describe(a) for a in args]


def test_forced_backend_errors():
    q, k, v = make_qkv(1, 1, 4, 4, 8, torch.float32)
    with pytest.raises(PyextError, match="unknown backend 'nope'"):
        attention(q, k, v, backend="nope")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(PyextError, match="backend 'triton' cannot run this input.*runs on cuda"):
            attention(q, k, v, backend="triton")
    with pytest.raises(PyextError, match="backend 'xformers' cannot run this input"):
        attention(q, k, v, backend="xformers")


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: (q.int(), k, v), "dtype torch.int32"),
    (lambda q, k, v: (q, k.double(), v), "k has dtype torch.float64"),
    (lambda q, k, v: (q, k.half(), v), "share one dtype"),
    (lambda q, k, v: (q, k, v[:, :, :3]), "same shape"),
    (lambda q, k, v: (q[..., :4], k, v), "must agree in batch and head_dim"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "zero length"),
])
def test_bad_inputs_name_the_op(bad, match):
    q, k, v = make_qkv(1, 2, 5, 6, 8, torch.float32)
    with pytest.raises(PyextError, match=f"pyext.attention: .*{match}"):
        attention(*bad(q, k, v))


def test_bad_scale():
    q, k, v = make_qkv(1, 1, 4, 4, 8, torch.float32)
    with pytest.raises(PyextError, match="scale must be a finite float"):
        attention(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_empty_queries(backend):
    if backend == "cpp" and not has_kernel("attention"):
        pytest.skip("pyext._C has no attention kernel")
    q, k, v = make_qkv(1, 2, 0, 5, 8, torch.bfloat16)
    assert attention(q, k, v, backend=backend).shape == (1, 2, 0, 8)


@pytest.mark.parametrize("backend", ["cpp", "reference", None])
def test_opcheck(backend):
    if backend == "cpp" and not has_kernel("attention"):
        pytest.skip("pyext._C has no attention kernel")
    for dtype in DTYPES:
        q, k, v = make_qkv(1, 2, 9, 77, 40, dtype)
        torch.library.opcheck(torch.ops.pyext.attention.default, (q, k, v, None, backend))
        torch.library.opcheck(torch.ops.pyext.attention.default, (q, k, v, 0.2, backend))


def test_reference_matches_oracle():
    q, k, v = make_qkv(2, 2, 33, 21, 24, torch.float32)
    torch.testing.assert_close(attention_reference(q, k, v).double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the sanitizer harness")
def test_kernels_clean_under_sanitizers(tmp_path):
    """Every kernel path (scalar/avx2/avx512/avx512_bf16, the AMX path's stand-in), head dims 1..256, odd lengths, built
    without torch under AddressSanitizer + UBSan: no out-of-bounds access, no UB."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(root, "csrc")
    units = [f"attention/attention_cpu_{isa}.cpp" for isa in ("scalar", "avx2", "avx512", "avx512_bf16",
                                                                "brgemm_stand_in", "brgemm_stand_in_avx512")]
    units += ["common/cpu_features.cpp", "common/brgemm_stand_in.cpp"]
    exe = str(tmp_path / "harness")
    build = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         "-w", f"-I{src}", os.path.join(root, "tests", "attention_sanitizer_harness.cpp"),
         *[os.path.join(src, u) for u in units], "-o", exe], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "fails=0" in run.stdout, (run.stdout + run.stderr)[-3000:]


@needs_kernel
@pytest.mark.parametrize("level,auto", [("avx2", "sdpa"), ("avx512", "cpp"), ("", "cpp")])
def test_static_dispatch_takes_cpp_with_avx512_only(level, auto):
    """Below AVX-512 the C++ kernel measured slower than SDPA: static dispatch picks sdpa, forcing
    still runs cpp. With AVX-512 (and on AMX CPUs, whose first path is amx: level "") it takes cpp."""
    if (level or "avx512") not in EXT.cpu_capabilities():
        pytest.skip(f"this CPU has no {level or 'avx512'}")
    script = textwrap.dedent("""
        import json, torch
        from pyext.dispatch import select
        from pyext.ops import attention
        q = torch.randn(1, 2, 8, 40, dtype=torch.bfloat16)
        out = attention(q, q, q, backend="cpp")
        print(json.dumps(dict(auto=select("attention", (q, q, q, None, None, False)).name, forced_ok=out.shape == q.shape)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYEXT_CPU_SIMD"} | (
                              {"PYEXT_CPU_SIMD": level} if level else {}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"auto": auto, "forced_ok": True}


# ----------------------------------------------------------------------------- hardening: bad and extreme inputs

@needs_kernel
def test_nan_key_makes_nan_rows_on_every_path(simd):
    """A NaN score must stay NaN through exp2 (the SIMD clamp turned it into weight 0)."""
    q, k, v = torch.randn(3, 1, 1, 8, 64).unbind(0)
    k[0, 0, 4, 2] = float("nan")
    for dtype in DTYPES:
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="cpp")
        assert out.isnan().all(), (simd, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_first_key_block_of_neg_inf_scores(dtype):
    """The first 256 keys score -inf (fp32 overflow): exp2(-inf - -inf) must not poison the row."""
    q = torch.full((1, 1, 2, 4), 1e20)
    k = torch.rand(1, 1, 300, 4) + 0.1
    k[0, 0, :256] *= -1e20
    v = torch.randn(1, 1, 300, 4)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    expected = attention(q, k, v, backend="reference")
    assert expected.isfinite().all()
    for path in cpu_paths():  # the brgemm paths too: at scores of 1e20 the row max's exponent must be exactly 0
        if path in BF16_PATHS and dtype != torch.bfloat16:
            continue
        out = torch.ops.pyext_C.attention(q, k, v, 0.5, path)[0]
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2, msg=path)


def test_head_dim_zero_is_a_clear_error():
    q = torch.randn(1, 2, 3, 0)
    with pytest.raises(PyextError, match="pyext.attention: head_dim is 0 .* supported: head_dim >= 1"):
        attention(q, q, q)


def diffusers_layouts(dtype=torch.float32, device="cpu"):
    """(name, q, k, v) in the layouts diffusers' processors pass: (B, S, H, D) memory seen as
    (B, H, S, D), SDPA's own contiguous layout, and k/v broadcast over the batch."""
    bshd = [torch.randn(2, s, 3, 40, dtype=dtype, device=device).transpose(1, 2) for s in (9, 77, 77)]
    yield "bshd", *bshd
    yield "contiguous", *[t.contiguous() for t in bshd]
    yield "expanded_kv", bshd[0], *[t[:1].expand(2, -1, -1, -1) for t in bshd[1:]]


@pytest.mark.parametrize("backend", ["cpp", "sdpa", "reference", None])
def test_output_strides_match_the_fake_kernel(backend):
    """The fake kernel promises empty_like(q)'s strides; every backend must return them."""
    if backend == "cpp" and not has_kernel("attention"):
        pytest.skip("pyext._C has no attention kernel")
    for name, q, k, v in diffusers_layouts():
        torch.library.opcheck(torch.ops.pyext.attention.default, (q, k, v, None, backend))
        assert attention(q, k, v, backend=backend).stride() == torch.empty_like(q).stride(), name


@pytest.mark.cuda
def test_every_cuda_backend_on_the_layouts_diffusers_passes():
    """The self-check runs a contiguous sample; diffusers passes other layouts. On a GPU, every
    backend that takes them gives the reference's answer in empty_like(q)'s strides."""
    from pyext import dispatch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    op = dispatch.ops()["attention"]
    ran = []
    for b in op.backends:
        if b.name == op.reference or "cuda" not in b.devices or b.unavailable():
            continue
        for dtype in (torch.bfloat16, torch.float16):
            for name, q, k, v in diffusers_layouts(dtype, "cuda"):
                args = (q, k, v, None, None, False)
                if dispatch.input_reasons(op, b, args):
                    continue
                out = attention(q, k, v, backend=b.name)
                assert out.stride() == torch.empty_like(q).stride(), (b.name, name)
                assert op.close((out, None), (attention_reference(q, k, v), None), args) is None, (b.name, dtype, name)
                ran.append((b.name, name))
    assert {"sdpa", "triton"} <= {backend for backend, _ in ran}


@pytest.mark.parametrize("special", ["nan_q", "nan_k", "overflow"])
def test_sdpa_declines_inputs_whose_softmax_is_nan(special):
    """torch's CPU SDPA returns 0 where softmax is NaN (NaN in q or k, scores past fp32); such
    inputs go to a backend that gives NaN, and forcing sdpa says why not."""
    q, k, v = make_qkv(1, 2, 5, 7, 16, torch.float32)
    if special == "nan_q":
        q[0, 1, 3, 4] = float("nan")
    elif special == "nan_k":
        k[0, 1, 2, 4] = float("nan")
    else:  # every score of head 1 is about -1e40: -inf in fp32, and softmax over -infs is NaN
        q[0, 1], k[0, 1] = 1e20, -1e20
    expected = attention(q, k, v, backend="reference")
    assert expected.isnan().any()
    assert torch.equal(attention(q, k, v).isnan(), expected.isnan())
    with pytest.raises(PyextError, match="backend 'sdpa' cannot run this input: q, k or the mask holds NaN/inf"):
        attention(q, k, v, backend="sdpa")


@pytest.mark.skipif(not has_kernel("attention_value_bounds"), reason="pyext._C has no attention_value_bounds")
def test_value_bounds_in_cpp_are_the_torch_ones(monkeypatch):
    """The SDPA guard's (max |q|, max |k|, max bias) from the C++ op equal those torch's ops give,
    NaN and inf included, on the layouts diffusers passes, large and small."""
    import importlib
    import math

    mod = importlib.import_module("pyext.ops.attention")
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cases += [(q, k, None) for _, q, k, _ in diffusers_layouts(dtype)]
        for width in (8, 64):  # permuted dense tensors, read by a plain loop, and past its size
            big = torch.randn(2, 300, 4, width).transpose(1, 2).to(dtype)
            cases.append((big, big * 3, torch.randn(1, 4, 300, 300)))
    special = torch.randn(1, 2, 5, 8)
    special[0, 1, 2, 3] = float("nan")
    cases += [(special, -special.nan_to_num(), torch.full((1, 1, 5, 5), -math.inf)),
              (torch.full((1, 1, 2, 4), -math.inf), torch.ones(1, 1, 3, 4), torch.tensor([[math.inf, 0.0, 1.0]])),
              (torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4), torch.empty(0, 3))]
    for q, k, bias in cases:
        fast = mod.value_bounds(q, k, bias)
        monkeypatch.setattr(mod, "_VALUE_BOUNDS", None)
        slow = mod.value_bounds(q, k, bias)
        monkeypatch.undo()
        assert len(fast) == 3 and all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(fast, slow)), \
            (fast, slow, q.shape, q.dtype)


def test_no_silent_gradients():
    """The ops have no backward: outputs of inputs that require grad raise on backward, a PyextError
    naming the op, rather than leaving the inputs without gradients."""
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = attention(q, q.detach(), q.detach())
    with pytest.raises(PyextError, match="pyext.attention has no backward"):
        out.sum().backward()
    with torch.no_grad():
        assert not attention(q, q, q).requires_grad
