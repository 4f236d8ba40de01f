"""The exact tiled run split across ranks (TilingConfig(distributed=True)), in 2 gloo processes on
the CPU: every rank returns the whole output, bit for bit one process's exact run, while each
rank runs only its share of the tiles and of the mid block's query bands."""
import contextlib
from datetime import timedelta

import pytest
import torch

from bench.parallel import counting_tiles
from pyext import PyextError, ops
from pyext.vae import TilingConfig, exact, stages, tile_vae, tiled_run
from tests.conftest import run_ranks
from tests.test_vae_exact import _full, _smooth, _vae, psnr

pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

# (kind, VAE, TilingConfig options). Inputs of odd sizes, 3 x 2 tiles of the VAE's own size (more,
# and of other shapes, in the segments' own grids), so the ranks get uneven shares.
CASES = {
    "decode": ("decode", "3 blocks, 8 groups", {}),
    "decode, compact state": ("decode", "3 blocks, 8 groups", {"compact_state": True}),
    "encode": ("encode", "2 blocks, 4 groups, 2 layers", {}),
}


# Queries per band of the mid block's whole-image attention: a few rows of the small latents, so
# that there are several bands to deal out.
QUERY_BAND = 64


@contextlib.contextmanager
def _counting_bands():
    """Short query bands (in this process and in the one-process oracle alike), and the calls of
    the attention op, one per band this process runs."""
    calls, real, chunk = [], ops.attention, stages.QUERY_CHUNK
    ops.attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    stages.QUERY_CHUNK = QUERY_BAND
    try:
        yield calls
    finally:
        ops.attention, stages.QUERY_CHUNK = real, chunk


def _input(kind, vae, seed):
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    channels = vae.config.latent_channels if kind == "decode" else 3
    return _smooth((1, channels, 2 * tile + 5, tile + 3), seed)


def _run(kind, vae, x, config):
    """A decode as users make it (the VAE tiled by tile_vae), an encode through tiled_run."""
    if kind == "decode":
        tile_vae(vae, config)
        return vae.decode(x).sample
    return tiled_run(vae, x, kind, config)


@torch.no_grad()
def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    results = {}
    for name, (kind, shape, options) in CASES.items():
        vae = _vae(shape)
        with counting_tiles() as calls, _counting_bands() as bands:
            out = _run(kind, vae, _input(kind, vae, 1), TilingConfig(distributed=True, state_dir=None, **options))
        results[name] = {"out": out, "tiles": len(calls), "bands": len(bands)}
    # a tile that raises on rank 1 raises on both ranks, instead of leaving rank 0 waiting
    vae = _vae("2 blocks, 4 groups, 2 layers")
    real = exact._run_tile
    if rank == 1:
        exact._run_tile = lambda *args: (_ for _ in ()).throw(ValueError("a broken tile"))
    try:
        tiled_run(vae, _input("decode", vae, 0), "decode", TilingConfig(distributed=True, state_dir=None))
    except Exception as err:  # noqa: BLE001 (what each rank raised is the result)
        results["raised"] = f"{type(err).__name__}: {err}"
    finally:
        exact._run_tile = real
    torch.save(results, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@torch.no_grad()
def test_ranks_share_the_tiles_and_each_returns_one_process_run(tmp_path):
    run_ranks(_worker, (2, str(tmp_path / "store"), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert ranks[1].pop("raised") == "ValueError: a broken tile"
    assert "a tile raised on rank 1: ValueError: a broken tile" in ranks[0].pop("raised")
    torch.set_num_threads(1)
    for name, (kind, shape, options) in CASES.items():
        vae = _vae(shape)
        x = _input(kind, vae, 1)
        with counting_tiles() as calls, _counting_bands() as bands:
            one = _run(kind, vae, x, TilingConfig(state_dir=None, **options))
        for rank, results in enumerate(ranks):
            assert torch.equal(results[name]["out"], one), (name, rank)
        # every tile and query band ran once, on one rank, and both ranks ran some of each
        for part, count in (("tiles", len(calls)), ("bands", len(bands))):
            assert sum(r[name][part] for r in ranks) == count, (name, part)
            assert all(0 < r[name][part] < count for r in ranks), (name, part)
        if not options:
            assert psnr(one, _full(vae, kind, x)) >= 100, name


def test_distributed_needs_an_initialized_process_group_and_the_exact_method():
    vae = _vae("2 blocks, 4 groups, 2 layers")
    with pytest.raises(PyextError, match="distributed=True needs torch.distributed's default process group"):
        tiled_run(vae, _input("decode", vae, 0), "decode", TilingConfig(distributed=True, state_dir=None))
    with pytest.raises(PyextError, match="distributed applies to method 'exact' only"):
        TilingConfig(method="tiles", distributed=True)
    with pytest.raises(PyextError, match="distributed must be True or False"):
        TilingConfig(distributed=1)
