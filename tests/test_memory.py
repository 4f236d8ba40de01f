"""pyext._memory: the pages of memory-mapped weights that no weight uses any more are reclaimed,
and nothing else: live weights and written pages keep their values."""
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from pyext._memory import release_mapped_pages, storage_spans

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
N = 1 << 20  # floats: 4 MiB, 1024 pages


@pytest.fixture
def mapped(tmp_path):
    """A private, writable mapping of a file (as safetensors' from_pretrained gives) and two weights
    on its halves, each a storage of its own (as safetensors' are)."""
    path = tmp_path / "weights.bin"
    np.arange(N, dtype=np.float32).tofile(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # written back: a dirty page is not reclaimed at once
    whole = torch.from_file(str(path), shared=False, size=N, dtype=torch.float32)
    halves = [torch.from_numpy(whole.numpy()[:N // 2]), torch.from_numpy(whole.numpy()[N // 2:])]
    for h in halves:
        h.sum()  # resident, as after a rewrite read them
    return whole, halves


def span(t):
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())


def resident_kib(t) -> int:
    """Rss of the mapping holding t, from /proc/self/smaps."""
    ptr, inside = t.untyped_storage().data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= ptr < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("no mapping holds the tensor")


def test_a_dropped_weight_s_pages_are_reclaimed_and_the_live_one_is_kept(mapped):
    whole, (dropped, live) = mapped
    before = resident_kib(whole)
    advised = release_mapped_pages({span(dropped), span(live)}, {span(live)})
    assert advised == dropped.numel() * 4  # page-aligned here: every page of it, none of the live one
    assert resident_kib(whole) <= before - advised // 1024 + 64
    assert torch.equal(live, torch.arange(N // 2, N, dtype=torch.float32))
    assert torch.equal(dropped, torch.arange(N // 2, dtype=torch.float32))  # read back from the file


def test_a_storage_a_live_one_overlaps_is_left(mapped):
    whole, (dropped, live) = mapped
    neighbour = torch.from_numpy(whole.numpy()[N // 2 - 20:N // 2 - 10])  # inside dropped's last page
    assert release_mapped_pages({span(dropped), span(live)}, {span(neighbour)}) == live.numel() * 4
    assert release_mapped_pages({span(dropped)}, {span(dropped)}) == 0


def test_written_pages_keep_their_values(mapped):
    _, (dropped, _) = mapped
    dropped.mul_(-1)  # private copies of the pages, which only swap could take away
    release_mapped_pages({span(dropped)}, set())
    assert torch.equal(dropped, -torch.arange(N // 2, dtype=torch.float32))


def test_heap_memory_is_never_advised():
    t = torch.arange(N, dtype=torch.float32)
    assert release_mapped_pages({span(t)}, set()) == 0
    assert torch.equal(t, torch.arange(N, dtype=torch.float32))


def test_storage_spans_see_parameters_buffers_and_packed_weights():
    from pyext.nn.packed import pack

    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    spans = storage_spans([model])
    assert span(model[0].weight) in spans and span(model[1].running_mean) in spans
    original = span(model[0].weight)
    pack(model)  # a plain copy until its first call gives the row count
    spans = storage_spans([model])
    assert span(model[0].weight.packed.tensor) in spans and original not in spans


def test_optimize_reclaims_the_mapped_pages_of_the_weights_it_rewrote(tmp_path):
    import pyext
    from diffusers import StableDiffusionPipeline
    from pyext.offline import build_pipeline

    build_pipeline("sd15", "tiny", seed=0).save_pretrained(tmp_path)
    for path in tmp_path.rglob("*.safetensors"):  # written back: a dirty page is not reclaimed at once
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path, safety_checker=None)  # memory-maps the files
    weight = pipe.unet.conv_in.weight
    for p in pipe.unet.parameters():
        p.sum()  # resident, as a first inference or a rewrite makes them
    before = resident_kib(weight)
    del weight, p
    with pyext.memory.using(release_after_optimize=True):
        pyext.optimize(pipe, dtype="keep")  # no cast: where "auto" picks bf16 (AVX512-BF16) the bias would be rewritten
    mapped_bias = pipe.unet.conv_in.bias  # not rewritten: still on the file's mapping
    assert resident_kib(mapped_bias) < before / 2


def test_trim_heap_hands_free_heap_pages_back():
    """Blocks freed in the middle of glibc's heap (a live one above them) stay resident until
    trimmed; malloc_trim gives their pages back."""
    import ctypes

    from pyext._memory import trim_heap
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        pytest.skip("not glibc")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 40 << 10, 800  # 32 MB in blocks below any mmap threshold
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    top = libc.malloc(size)  # keeps the heap's top in use: nothing is trimmed on free
    for b in blocks:
        libc.free(b)

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    trim_heap()
    assert before - resident() > (size * count) // 2
    libc.free(top)


# ----------------------------------------------------------------------------- what the defaults change

def _spies(monkeypatch):
    """Records every process-wide memory action optimize and the exact tiled decode can take."""
    import importlib

    import pyext.vae.exact as exact
    import pyext.vae.spill as spill

    optimize_module = importlib.import_module("pyext.optimize")  # (pyext.optimize is the function)
    taken = []

    def spy(name, real):
        def call(*args, **kwargs):
            taken.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((optimize_module, "release_freed_memory"), (optimize_module, "release_mapped_pages"),
                         (exact, "reused_blocks"), (exact, "trim_heap"), (spill, "_open")):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return taken


def _decode_tiled(pipe):
    from pyext.vae import TilingConfig, tile_vae

    tile_vae(pipe.vae, TilingConfig(method="exact", tile_size=16))
    with torch.no_grad():
        return pipe.vae.decode(torch.randn(1, 4, 12, 12)).sample


@pytest.mark.parametrize("release", [True, False], ids=["default", "release_off"])
def test_the_defaults_release_what_optimize_freed_and_leave_the_rest_alone(monkeypatch, release):
    """By default optimize gives back what its own work freed, and nothing else of the process's
    allocator, heap or mappings changes; with release_after_optimize off, nothing at all does."""
    import threading

    import pyext
    from pyext.offline import build_pipeline
    from pyext.vae import exact

    assert pyext.memory.settings().release_after_optimize
    taken = _spies(monkeypatch)
    monkeypatch.setattr(exact, "AUTO_MEMORY_TILES", 0)  # a state that would go to a file if allowed
    with pyext.memory.using(release_after_optimize=release):
        pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep")
        _decode_tiled(pipe)
    assert taken == (["release_freed_memory", "release_mapped_pages"] if release else [])
    assert not [t for t in threading.enumerate() if t.name.startswith("pyext-vae-spill")]


@pytest.mark.slow
def test_each_setting_turns_its_action_on(monkeypatch):
    import pyext
    from pyext.offline import build_pipeline
    from pyext.vae import exact, spill

    taken = _spies(monkeypatch)
    monkeypatch.setattr(exact, "AUTO_MEMORY_TILES", 0)
    monkeypatch.setattr(spill, "default_dir", lambda room: spill.tempfile.gettempdir()
                        if spill.unsupported(spill.tempfile.gettempdir()) is None else None)
    with pyext.memory.using(release_after_optimize=True, vae_block_pool=True, vae_state_on_disk=True):
        pipe = pyext.optimize(build_pipeline("sd15", "tiny"), dtype="keep")
        _decode_tiled(pipe)
    assert {"release_freed_memory", "release_mapped_pages", "reused_blocks", "trim_heap"} <= set(taken)
    assert "_open" in taken or spill.unsupported(spill.tempfile.gettempdir()) is not None
    assert pyext.memory.settings() == pyext.memory.MemorySettings()  # back to the defaults after the block


def test_settings_are_checked():
    import pyext

    with pytest.raises(pyext.PyextError, match="unknown setting 'pool'"):
        pyext.memory.configure(pool=True)
    with pytest.raises(pyext.PyextError, match="vae_block_pool=1 is not allowed"):
        pyext.memory.configure(vae_block_pool=1)
    assert pyext.memory.settings() == pyext.memory.MemorySettings()


def test_release_after_optimize_trims_the_heap_as_first_calls_repack(monkeypatch):
    """A packed convolution's first call packs it for its input shape: with release_after_optimize the
    heap is trimmed once enough has been packed, without it never."""
    import pyext
    import pyext.nn.packed as packed

    trims = []
    monkeypatch.setattr(packed, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(packed, "TRIM_AFTER_REPACKED_BYTES", 1)
    for release, expected in ((False, 0), (True, 2)):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1))
        if packed.pack(model).packed != ["0", "1"]:
            pytest.skip("the convolutions are not packable here")
        trims.clear()
        with pyext.memory.using(release_after_optimize=release), torch.no_grad():
            y = model(torch.randn(1, 3, 9, 9))
            model(torch.randn(1, 3, 9, 9))  # the same shape: no repack, no trim
        assert len(trims) == expected, release
        assert y.shape == (1, 8, 9, 9)
