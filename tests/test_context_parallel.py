"""pyext with diffusers' context parallelism, in 2 or 4 gloo processes on the CPU.

- pyext's ring, Ulysses and both together (`pyext.ring`, 4 processes) against one process's
  attention over all the keys.
- `bench.parallel` under torchrun: each rank builds the same tiny pipeline, turns on
  `enable_parallelism` with Ulysses-2, ring-2 or both (4 processes), and calls `pyext.optimize`
  before it on one copy and after it on another. Rank 0's images must equal the single-process plain pipeline's, and on
  every rank pyext's op must have computed the attention (no call left to torch).
"""
import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import run_ranks

pytestmark = pytest.mark.independent  # make test spreads its tests over the workers

pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAME = 1e-4  # images in [0, 1]: the sequence split changes only the order of fp32 sums


def _mesh(rank: int):
    """(ring group, Ulysses group) of `rank` in a world of 4 laid out as diffusers' mesh: 2 rings
    by 2 Ulysses groups, rank = ring index * 2 + Ulysses index."""
    import torch.distributed as dist

    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return rings[rank % 2], ulysses[rank // 2]


def _split_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from pyext import ops, ring
    from pyext.dispatch import PyextError
    from pyext.reference.attention import attention_reference

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a hung ring fails the test instead of stalling it
    ring_group, ulysses_group = _mesh(rank)
    results = {}
    for name, (split, dtype, mask_kind) in SPLIT_CASES.items():
        groups = {"ring": (ring_group, None), "ulysses": (None, ulysses_group),
                  "ulysses+ring": (ring_group, ulysses_group)}[split]
        n = math.prod(dist.get_world_size(g) for g in groups if g is not None)
        # this rank's chunk of the sequence: diffusers' order over the groups it splits across
        index = {"ring": rank // 2, "ulysses": rank % 2, "ulysses+ring": rank}[split]
        g = torch.Generator().manual_seed(len(name))
        # every rank draws all the keys (the same ones) and all the queries, and keeps its chunk
        q_all = torch.randn(2, 4, 7 * n, 40, generator=g).to(dtype)
        k_all = torch.randn(2, 4, 37 * n, 40, generator=g).to(dtype)
        v_all = torch.randn(2, 4, 37 * n, 40, generator=g).to(dtype)
        mask_all = None
        if mask_kind in ("keys", "key bias"):  # batch 0 sees no key of the first chunk, batch 1 none at all
            mask_all = torch.rand(2, 1, 1, 37 * n, generator=g) > 0.3
            mask_all[0, ..., :37] = False
            mask_all[1] = False
            if mask_kind == "key bias":  # additive: -inf masks a key
                mask_all = torch.zeros(mask_all.shape, dtype=dtype).masked_fill(~mask_all, -math.inf)
        elif mask_kind == "queries":  # broadcast over the keys: a masked query row is masked in every chunk
            mask_all = torch.rand(2, 4, 7 * n, 1, generator=g) > 0.2
        q, k, v = (t.chunk(n, dim=2)[index] for t in (q_all, k_all, v_all))
        whole = 0
        if mask_kind == "whole tail":  # 5 tokens every rank holds whole, after its own (SD3's text)
            tail = [torch.randn(2, 4, 5, 40, generator=g).to(dtype) for _ in range(3)]
            q, k, v = (torch.cat([t, w], dim=2) for t, w in zip((q, k, v), tail))
            k_all, v_all = (torch.cat([t, w], dim=2) for t, w in zip((k_all, v_all), tail[1:]))
            whole, mask_all = 5, None
        mask = mask_all
        if mask_kind in ("keys", "key bias"):
            mask = mask_all.chunk(n, dim=-1)[index]
        elif mask_kind == "queries":
            mask = mask_all.chunk(n, dim=2)[index]

        def attend(q, k, v, m):
            return ops.attention(q, k, v, attn_mask=m, return_lse=True)

        out = ring.split_attention(q, k, v, attend, *groups, attn_mask=mask, replicated=whole)
        whole_mask = mask_all if mask_kind in ("keys", "key bias") else mask
        whole = ops.attention(q, k_all, v_all, attn_mask=whole_mask)
        if mask_kind == "key bias":
            whole_mask = whole_mask.double()
        oracle = attention_reference(q.double(), k_all.double(), v_all.double(), attn_mask=whole_mask)
        results[name] = {"split": (out.double() - oracle).abs().max().item(),
                         "one call": (whole.double() - oracle).abs().max().item(),
                         "rounding": torch.finfo(dtype).eps / 2 * oracle.abs().max().item(),
                         "dtype": str(out.dtype), "shape": tuple(out.shape) == tuple(q.shape),
                         "finite": bool(out.isfinite().all())}
    for split, groups, bad in (("ring", (ring_group, None), torch.ones(2, 1, 7, 37, dtype=torch.bool)),
                               ("ulysses", (None, ulysses_group), torch.ones(2, 1, 7, 37, dtype=torch.bool)),
                               ("ulysses heads", (None, ulysses_group), None)):
        q, k = torch.randn(2, 3 if bad is None else 4, 7, 40), torch.randn(2, 3 if bad is None else 4, 37, 40)
        try:
            ring.split_attention(q, k, k, attend, *groups, attn_mask=bad)
        except PyextError as e:
            results[f"refused: {split}"] = str(e)
    torch.save(results, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


SPLIT_CASES = {"ring fp32": ("ring", torch.float32, None), "ring fp32 key padding": ("ring", torch.float32, "keys"),
               "ring fp16 key bias": ("ring", torch.float16, "key bias"),
               "ring bf16 query mask": ("ring", torch.bfloat16, "queries"),
               "ulysses fp16 key padding": ("ulysses", torch.float16, "keys"),
               "ulysses+ring fp32": ("ulysses+ring", torch.float32, None),
               "ulysses+ring fp32 key bias": ("ulysses+ring", torch.float32, "key bias"),
               "ulysses+ring fp16 key padding": ("ulysses+ring", torch.float16, "keys"),
               "ring fp32 whole tail": ("ring", torch.float32, "whole tail"),
               "ulysses fp16 whole tail": ("ulysses", torch.float16, "whole tail"),
               "ulysses+ring fp32 whole tail": ("ulysses+ring", torch.float32, "whole tail")}


@pytest.mark.slow
def test_ring_and_ulysses_attention_equal_one_call_over_all_keys(tmp_path):
    run_ranks(_split_worker, (4, str(tmp_path / "store"), str(tmp_path)), 4)
    for rank in range(4):
        results = torch.load(tmp_path / f"{rank}.pt")
        assert "ring attention: a mask with both query and key" in results.pop("refused: ring")
        assert "Ulysses attention: a mask with a query dimension" in results.pop("refused: ulysses")
        assert "3 query and 3 key heads do not divide by the Ulysses degree 2" in results.pop("refused: ulysses heads")
        assert set(results) == set(SPLIT_CASES)
        for name, r in results.items():
            dtype = SPLIT_CASES[name][1]
            assert r["dtype"] == str(dtype) and r["finite"] and r["shape"], (rank, name, r)
            # each chunk's output is rounded to the dtype, then merged in fp32 and rounded again: within
            # 2x one call's error and the one rounding more (half an ulp of the output)
            slack = 1e-5 if dtype == torch.float32 else r["rounding"]
            assert r["split"] <= 2 * r["one call"] + slack, (rank, name, r)


def _fake_ring(group):
    """A processor's ring config as diffusers' enable_parallelism leaves it, over `group`."""
    cp = SimpleNamespace(ring_degree=2, ulysses_degree=1, ring_anything=False, _ring_mesh=SimpleNamespace(
        get_group=lambda: group))
    return SimpleNamespace(context_parallel_config=cp)


def test_the_routing_lifts_a_ring_config_for_the_forward_and_puts_it_back(tmp_path, monkeypatch):
    """In one process (a ring of one rank, whose ring is one attention call): a routed layer whose
    processor holds a ring config computes through the ring, the image is the plain one, and the
    config is back on the processor after each forward, also after one that raised."""
    import torch.distributed as dist

    import pyext
    from pyext import _state, ring
    from pyext.attention import STATE, attention_layers
    from pyext.dispatch import PyextError
    from pyext.offline import build_pipeline, run_example

    pipe = build_pipeline("flux", "tiny")
    plain = run_example(pipe, "flux", "tiny", steps=1)
    pyext.attention.apply(pipe)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        layers = attention_layers(pipe.transformer)
        configs = {name: _fake_ring(dist.group.WORLD) for name in layers}
        for name, layer in layers.items():
            layer.processor._parallel_config = configs[name]
        ring_calls, real = [], ring.ring_attention
        monkeypatch.setattr(ring, "ring_attention", lambda *a, **k: ring_calls.append(1) or real(*a, **k))
        image = run_example(pipe, "flux", "tiny", steps=1)
        assert torch.allclose(image, plain, atol=1e-5)
        assert len(ring_calls) == pyext.attention.status(pipe)["components"]["transformer"]["pyext_calls"] > 0
        assert all(layer.processor._parallel_config is configs[name] for name, layer in layers.items())
        name, layer = next(iter(layers.items()))
        with pytest.raises(RuntimeError):
            layer(torch.randn(1, 4, 7))  # the projection fails inside the forward, after the config was lifted
        assert layer.processor._parallel_config is configs[name]
        q = torch.randn(1, 2, 4, 8)
        with pytest.raises(PyextError, match="context-parallel attention: dropout"):
            _state.get(layer, STATE).attention((q, q, q), {"dropout_p": 0.1}, (dist.group.WORLD, None))
    finally:
        dist.destroy_process_group()


def _bench_rank(rank: int, world: int, port: int, argv: list) -> None:
    """One rank of bench.parallel, with the environment torchrun would give it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from bench import parallel

    parallel.main(argv)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Flux, Wan and LTX declare their sharding (`_cp_plan`); SD3 takes pyext's
# (`pyext.context_parallel_plan`: its text stays whole, and pyext runs its joint attention across
# the ranks). Ulysses: the tiny pipelines plain diffusers runs with Ulysses-2 here (LTX's text
# mask and Qwen-Image's odd text length fail there too). Ring: plain diffusers fails every family
# (its native backend gives no log-sum-exp); with pyext it runs, LTX's text mask included.
# Ulysses and ring together: 4 processes, Ulysses-2 in each ring of 2. Wan's denoiser is compiled
# by the user after optimize (the images then show that the ring ran: each rank alone would
# attend to half the tokens). The order of optimize and enable_parallelism: both for Flux and SD3.
# Flux runs under torchrun itself; the others' ranks are forked with torchrun's environment
# (a fresh interpreter per rank imports diffusers again: seconds each).
@pytest.mark.slow
@pytest.mark.parametrize("arch,processes,splits,orders,compile_backend", [
    ("flux", 2, "ulysses,ring", "before,after", None),
    ("sd3", 2, "ulysses,ring", "before,after", None),
    ("sd3", 4, "ulysses+ring", "after", None),
    ("wan21", 2, "ring", "after", "aot_eager"),
    ("ltx", 2, "ring", "after", None)])
def test_context_parallel_with_optimize_before_or_after_equals_one_process(arch, processes, splits, orders,
                                                                           compile_backend, tmp_path):
    out = tmp_path / "parallel.json"
    compiled = ["--compile", compile_backend] if compile_backend else []
    argv = ["--arch", arch, "--splits", splits, "--orders", orders, *compiled, "--out", str(out)]
    if arch == "flux":
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(processes), "-m", "bench.parallel", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        run_ranks(_bench_rank, (processes, _free_port(), argv), processes)
    result = json.loads(out.read_text())
    runs = [(split, order) for split in splits.split(",") for order in orders.split(",")]
    assert result["world_size"] == processes and sorted((r["split"], r["order"]) for r in result["runs"]) == sorted(runs)
    for run in result["runs"]:
        assert run["max_abs_diff"] <= SAME, run
    assert sorted((r["rank"], r["split"], r["order"]) for r in result["ranks"]) == \
        sorted((rank, *run) for rank in range(processes) for run in runs)
    for row in result["ranks"]:
        assert row["torch_calls"] == 0 and row["seconds"] > 0 and row["compile"] == compile_backend, row
        assert row["pyext_calls"] > 0 or compile_backend, row  # compiled calls are not counted
