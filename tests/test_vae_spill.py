"""pyext.vae.spill: the exact run's state in a direct-I/O file reads back what the state in
memory reads, holds only a few pieces in memory, and gives the in-memory run's numbers."""
import gc
import os
import threading

import pytest
import torch

import pyext
from pyext.dispatch import PyextError
from pyext.vae import TilingConfig, exact, spill, stages, state, tiled_run
from pyext.vae.geometry import equal_cores, window

from test_vae_exact import _full, _smooth, _vae, psnr


@pytest.fixture
def state_dir(tmp_path):
    why = spill.unsupported(tmp_path)
    if why:
        pytest.skip(f"the test directory has no direct I/O: {why}")
    return str(tmp_path)


def _write(bands, t: torch.Tensor, rows, cols, extra=()):
    for r, (a, b) in enumerate(rows):
        for xs in cols:
            bands.write(r, xs, (t[..., a:b, xs[0]:xs[1]], *(e[..., a:b, xs[0]:xs[1]] for e in extra)))


def _state_counting_reads(state_dir, monkeypatch, t, chunk: int):
    """t in a FileBands of chunk x chunk tiles, and the list that each read from its file adds
    its bytes to."""
    rows, cols = equal_cores(t.shape[-2], chunk), equal_cores(t.shape[-1], chunk)
    disk = spill.FileBands(rows, t.shape[-1], state_dir)
    _write(disk, t, rows, cols)
    read, real = [], spill._File.read_into
    monkeypatch.setattr(spill._File, "read_into", lambda self, buf, at: read.append(buf.numel()) or real(self, buf, at))
    return disk, rows, cols, read


@pytest.mark.parametrize("compact", [False, True])
def test_file_bands_read_what_bands_in_memory_read(state_dir, compact):
    """Two tensors (an activation and a residual), a batch of 2, odd tiles, values over many
    magnitudes: every window, and the whole, reads back bit for bit what Bands in memory give."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 23, 31, generator=gen) * torch.logspace(-20, 20, 5).view(1, 5, 1, 1)
    r = torch.randn(2, 3, 23, 31, generator=gen)
    rows, cols = equal_cores(23, 7), equal_cores(31, 9)
    memory, disk = state.Bands(rows, 31, pin=False, compact=compact), spill.FileBands(rows, 31, state_dir, compact)
    _write(memory, t, rows, cols, (r,))
    _write(disk, t, rows, cols, (r,))
    assert disk.file.end >= (t.numel() + r.numel()) * (2 if compact else 4)  # the state is in the file
    for _ in range(40):
        y0, x0 = (int(torch.randint(0, n, (1,), generator=gen)) for n in (23, 31))
        ys = (y0, int(torch.randint(y0 + 1, 24, (1,), generator=gen)))
        xs = (x0, int(torch.randint(x0 + 1, 32, (1,), generator=gen)))
        for got, want in zip(disk.read(ys, xs), memory.read(ys, xs)):
            assert got.dtype == torch.float32 and torch.equal(got, want), (ys, xs)
    for got, want in zip(disk.whole(), memory.whole()):
        assert torch.equal(got, want)
    if not compact:
        assert torch.equal(disk.whole()[0], t)


def test_file_bands_keep_a_few_pieces_and_read_each_chunk_about_once(state_dir, monkeypatch):
    """A sweep of tiles with margins, as the next segment runs, reading ahead: memory holds at
    most CACHED_CHUNKS chunks' bytes of pieces, and the file is read little more than once."""
    t = torch.randn(1, 64, 64, 96)  # a row of a chunk is one block: whole blocks are read, as counted
    disk, rows, cols, read = _state_counting_reads(state_dir, monkeypatch, t, 16)
    peak = 0
    disk.plan([(window(ys, 64, 2), window(xs, 96, 2)) for ys in rows for xs in cols])  # reads ahead
    for i, ys in enumerate(rows):
        for xs in cols:
            w = (window(ys, 64, 2), window(xs, 96, 2))
            got, = disk.read(*w)
            assert torch.equal(got, t[..., w[0][0]:w[0][1], w[1][0]:w[1][1]])
            peak = max(peak, disk.cached_bytes)
        if i + 1 < len(rows):
            disk.free_above(window(rows[i + 1], 64, 2)[0])
    assert peak <= spill.CACHED_CHUNKS * disk.largest_chunk
    assert sum(read) <= 1.6 * t.numel() * 4, sum(read) / (t.numel() * 4)  # margins: 2 rows of 16, twice


def test_read_buffers_come_from_the_thread_that_reads_the_state(state_dir, monkeypatch):
    """The buffers that the I/O threads fill are made by the caller's thread (malloc's arenas of
    the I/O threads would keep those blocks apart from the main one): every _aligned call of a
    sweep of reads, reading ahead, is on this thread, and the reads still give the state."""
    t = torch.randn(1, 16, 40, 48)
    rows, cols = equal_cores(40, 10), equal_cores(48, 16)
    disk = spill.FileBands(rows, 48, state_dir)
    _write(disk, t, rows, cols)
    threads, real = [], spill._aligned
    monkeypatch.setattr(spill, "_aligned", lambda n: threads.append(threading.get_ident()) or real(n))
    windows = [(window(ys, 40, 2), window(xs, 48, 2)) for ys in rows for xs in cols]
    disk.plan(windows)
    for w in windows:
        got, = disk.read(*w)
        assert torch.equal(got, t[..., w[0][0]:w[0][1], w[1][0]:w[1][1]])
    assert threads and set(threads) == {threading.get_ident()}


def test_windows_over_many_small_chunks_read_each_piece_once(state_dir, monkeypatch):
    """A segment that tiles more coarsely than the one that wrote its state (an encoder's
    second segment): windows of 64 pixels plus margins over chunks of 32, each window spanning
    16 chunks, more than CACHED_CHUNKS of them. The pieces read ahead stay until they are used,
    so no piece is read twice (a bound of CACHED_CHUNKS chunks evicted them first and read the
    state again), and the pieces held stay within those of the window read ahead."""
    t = torch.randn(1, 32, 192, 256)  # a row of a chunk is one block
    disk, rows, cols, read = _state_counting_reads(state_dir, monkeypatch, t, 32)
    windows = [(window(ys, 192, 2), window(xs, 256, 2)) for ys in equal_cores(192, 64) for xs in equal_cores(256, 64)]
    # bytes of the pieces a window reads: its rows of every chunk it touches, whole chunk rows
    touched = [sum((min(ys[1], b) - max(ys[0], a)) * (q - p) for a, b in rows for p, q in cols
                   if max(ys[0], a) < min(ys[1], b) and max(xs[0], p) < min(xs[1], q)) * 32 * 4 for ys, xs in windows]
    assert max(touched) > spill.CACHED_CHUNKS * disk.largest_chunk  # the case in question
    disk.plan(windows)
    peak = 0
    for w in windows:
        got, = disk.read(*w)
        assert torch.equal(got, t[..., w[0][0]:w[0][1], w[1][0]:w[1][1]])
        peak = max(peak, disk.cached_bytes)
    assert sum(read) <= sum(touched)  # no piece read twice (neighbours share some: fewer)
    assert peak <= spill.READ_AHEAD * max(touched)


@torch.no_grad()
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_exact_run_with_its_state_in_a_file_is_the_run_in_memory(state_dir, kind, compact, monkeypatch):
    """Bit for bit, on grids that differ between segments (a small TILE_ELEMENTS), and the
    state's files are closed (their blocks freed) after the run. (With the same plan: by
    default a file keeps narrow resnets whole, whose convs then see other windows.)"""
    monkeypatch.setattr(exact, "TILE_ELEMENTS", 2 ** 14)
    monkeypatch.setattr(exact, "RECOMPUTE_CHANNELS", 0)
    vae = _vae("3 blocks, 8 groups")
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    x = _smooth((2, vae.config.latent_channels if kind == "decode" else 3, 2 * tile + 5, tile + 3), 1)
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    in_memory = tiled_run(vae, x, kind, TilingConfig(compact_state=compact, state_dir=None))
    in_file = tiled_run(vae, x, kind, TilingConfig(compact_state=compact, state_dir=state_dir))
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert torch.equal(in_file, in_memory)
    assert psnr(in_file, _full(vae, kind, x)) >= (70 if compact else 100)


def test_a_released_state_closes_its_file_in_the_background_and_keeps_none_of_its_reads(state_dir, monkeypatch):
    """release() closes the file in an I/O thread, after the reads still running; once that
    close is done, no piece that the file's reads filled is referenced any more (a close that
    kept its reads' futures kept their pieces until the run's end), and after wait_closed()
    the file is closed."""
    import weakref
    pieces, real = [], spill.FileBands._load
    monkeypatch.setattr(spill.FileBands, "_load", lambda self, key, chunk, bufs=None: (
        lambda got: pieces.extend(weakref.ref(p) for p in got) or got)(real(self, key, chunk, bufs)))
    t = torch.randn(1, 4, 40, 48)
    rows, cols = equal_cores(40, 10), equal_cores(48, 16)
    disk = spill.FileBands(rows, 48, state_dir)
    _write(disk, t, rows, cols)
    disk.plan([(window(ys, 40, 2), window(xs, 48, 2)) for ys in rows for xs in cols])
    for ys in rows:
        for xs in cols:
            disk.read(window(ys, 40, 2), window(xs, 48, 2))
    fd, pool, gate = disk.file.fd, spill._io(), threading.Event()

    class Gated:  # the I/O threads, holding each task until the gate opens
        def submit(self, fn, *args):
            return pool.submit(lambda: (gate.wait(), fn(*args))[1])

    monkeypatch.setattr(spill, "_io", Gated)
    try:
        disk.release()
        del disk
        gc.collect()  # the state dropped before its close ran: the task holds the file, so nothing closes it here
        os.fstat(fd)
    finally:
        gate.set()
    for closing in list(spill._closing):  # done, but still listed: the run waits at its end
        closing.result()
    gc.collect()
    assert pieces and all(p() is None for p in pieces)
    spill.wait_closed()
    assert not spill._closing
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_directory_without_direct_io_or_in_memory_is_refused_up_front(tmp_path):
    with pytest.raises(PyextError, match=r"pyext.tile_vae: state_dir '/proc': an unlinked direct-I/O file cannot be "
                                         r"made there \(.+\); give a directory on a disk file system"):
        TilingConfig(state_dir="/proc")
    shm = "/dev/shm"
    if spill._file_system(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    with pytest.raises(PyextError, match="state_dir '/dev/shm': it is on tmpfs, in memory, where the state would save none"):
        TilingConfig(state_dir=shm)


@torch.no_grad()
def test_a_memory_budget_keeps_the_first_chunks_in_memory_and_is_all_given_back(state_dir, monkeypatch):
    """With part of the state in memory and the rest in the file, the run is still the one in
    memory, bit for bit (with the same plan); every byte taken from the budget is given back by
    the end."""
    monkeypatch.setattr(exact, "RECOMPUTE_CHANNELS", 0)
    budgets = []
    monkeypatch.setattr(exact, "Budget", lambda n: budgets.append(spill.Budget(300_000)) or budgets[-1])
    taken = []
    real_take = spill.Budget.take
    monkeypatch.setattr(spill.Budget, "take", lambda self, n: taken.append(real_take(self, n)) or taken[-1])
    vae = _vae("3 blocks, 8 groups")
    z = _smooth((1, 4, 2 * vae.tile_latent_min_size + 5, vae.tile_latent_min_size + 3), 1)
    in_file = tiled_run(vae, z, "decode", TilingConfig(state_dir=state_dir, state_memory_mib=1))
    assert True in taken and False in taken  # some chunks in memory, some in the file
    assert budgets[0].left == 300_000
    assert torch.equal(in_file, tiled_run(vae, z, "decode", TilingConfig(state_dir=None)))


def test_a_failed_background_close_is_kept_until_wait_closed_raises_it(state_dir):
    """close() drops finished closes from the list the run waits on at its end, but not one that
    raised: wait_closed() raises its error rather than losing it."""
    broken, other = spill._File(state_dir), spill._File(state_dir)
    real_close = broken._close

    def fail():
        real_close()
        raise OSError("closing the state file failed")

    broken._close = fail
    broken.close()
    spill._closing[-1].exception()  # (waits for it)
    other.close()  # prunes the finished closes
    with pytest.raises(OSError, match="closing the state file failed"):
        spill.wait_closed()
    spill.wait_closed()
    assert not spill._closing


@torch.no_grad()
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_the_exact_run_reuses_its_blocks_and_gives_the_same_bits(state_dir, kind):
    """With pyext.memory's vae_block_pool, a run on a CPU keeps freed tensors for the next tiles
    (pyext._memory.reused_blocks): tiles, pieces read back and chunks written (freed by the I/O
    threads). Reused memory holds stale values, so a kernel that read a tensor it had not written
    would show here."""
    from pyext import _ext, memory
    if _ext.EXT is None:
        pytest.skip("needs the compiled extension")
    vae = _vae("3 blocks, 8 groups")
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    x = _smooth((1, vae.config.latent_channels if kind == "decode" else 3, 3 * tile + 5, 2 * tile + 3), 2)
    config = TilingConfig(state_dir=state_dir)
    with memory.using(vae_block_pool=True):
        pooled = tiled_run(vae, x, kind, config)
    stats = _ext.EXT.pool_stats()  # the last pool's
    assert stats["hits"] > 0 and not stats["open"]
    assert torch.equal(pooled, tiled_run(vae, x, kind, config))  # the default: no pool
    assert _ext.EXT.pool_stats() == stats


@torch.no_grad()
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_with_state_dir_narrow_resnets_run_whole_and_write_no_conv1_state(state_dir, kind, monkeypatch):
    """With the state on disk, a resnet whose conv1 reads at most RECOMPUTE_CHANNELS stays whole
    (conv1 runs in two passes): one state file fewer per such resnet, and the untiled result."""
    vae = _vae("3 blocks, 8 groups")
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    x = _smooth((1, vae.config.latent_channels if kind == "decode" else 3, 2 * tile + 5, tile + 3), 3)
    files, real_init = [], spill.FileBands.__init__
    monkeypatch.setattr(spill.FileBands, "__init__", lambda self, *a, **k: files.append(a[0]) or real_init(self, *a, **k))
    counts, outs = [], []
    for channels in (0, 32, 64):  # none whole; the 32-channel resnets; all (the VAE's widest is 64)
        monkeypatch.setattr(exact, "RECOMPUTE_CHANNELS", channels)
        files.clear()
        outs.append(tiled_run(vae, x, kind, TilingConfig(state_dir=state_dir)))
        counts.append(len(files))
    steps = stages.split(stages.steps_of(vae, kind), kind, exact=True)[1]
    # a state per segment (its output): a whole resnet's conv1 output is none of them
    assert counts == [len(exact.plan(steps, c)) for c in (0, 32, 64)]
    assert counts[0] > counts[1] > counts[2]
    full = _full(vae, kind, x)
    for got in outs:
        assert psnr(got, full) >= 100


@torch.no_grad()
def test_auto_keeps_a_small_state_in_memory_and_puts_a_large_one_in_a_temporary_file(state_dir, monkeypatch):
    """state_dir "auto" (the default) on a CPU, with pyext.memory's vae_state_on_disk: the states
    stay in memory while the largest fits in AUTO_MEMORY_TILES widest tiles; beyond, they go to a
    file in spill.default_dir (asked for room for two states), state_memory_mib of them kept in
    memory; in memory where no directory will do. Without the setting, in memory. Exact every way."""
    files, asked, offered = [], [], [state_dir]
    real_init = spill.FileBands.__init__
    monkeypatch.setattr(spill.FileBands, "__init__",
                        lambda self, *a, **k: files.append((a[2], a[4].left)) or real_init(self, *a, **k))
    monkeypatch.setattr(spill, "default_dir", lambda room: asked.append(room) or offered[0])
    vae = _vae("3 blocks, 8 groups")
    z = _smooth((1, 4, 2 * vae.tile_latent_min_size + 5, vae.tile_latent_min_size + 3), 1)
    full = _full(vae, "decode", z)

    def run(tiles=None, on_disk=True, **options):
        files.clear(), asked.clear()
        if tiles is not None:
            monkeypatch.setattr(exact, "AUTO_MEMORY_TILES", tiles)
        with pyext.memory.using(vae_state_on_disk=on_disk):
            out = tiled_run(vae, z, "decode", TilingConfig(**options))
        assert psnr(out, full) >= 100
        return out

    run(tiles=1, on_disk=False)
    assert files == [] and asked == []  # the default: in memory, no directory looked for
    run(tiles=10 ** 6)
    assert files == [] and asked == []  # fits: in memory, no directory looked for
    run(tiles=1)
    assert files and {d for d, _ in files} == {state_dir} and files[0][1] == 0
    tile_bytes = exact.element_budget(exact.plan(stages.split(stages.steps_of(vae, "decode"), "decode", True)[1]),
                                      vae.tile_latent_min_size, 1) * 4
    assert asked[0] > 2 * tile_bytes  # room for two states, each larger than a tile
    run(tiles=1, state_memory_mib=1)
    assert files and files[0][1] == 1 << 20
    offered[0] = None  # no directory with direct I/O and room: in memory
    run(tiles=1)
    assert files == [] and len(asked) == 1


def test_auto_is_memory_on_a_gpu_and_an_explicit_state_dir_is_taken_as_it_is(state_dir):
    gpu = type("OnGpu", (), {"is_cuda": True})()
    assert exact.placement(TilingConfig(), [], gpu, 1) == (None, 0)
    assert exact.placement(TilingConfig(state_memory_mib=3), [], gpu, 1) == (None, 0)
    assert exact.placement(TilingConfig(state_dir=None), [], gpu, 1) == (None, 0)
    assert exact.placement(TilingConfig(state_dir=state_dir, state_memory_mib=3), [], gpu, 1) == (state_dir, 3 << 20)
    assert exact.placement(TilingConfig(state_dir=state_dir), [], gpu, 1) == (state_dir, 0)


def test_the_default_directory_is_the_first_with_direct_io_and_room(state_dir, monkeypatch):
    monkeypatch.setattr(spill.tempfile, "gettempdir", lambda: state_dir)
    assert spill.default_dir(0) == state_dir
    free = spill._free_bytes(state_dir)
    assert spill.default_dir(free + (1 << 40)) is None  # no room here nor in /var/tmp
    real = spill.unsupported
    monkeypatch.setattr(spill, "unsupported", lambda d: "in memory" if d == state_dir else real(d))
    assert spill.default_dir(0) == ("/var/tmp" if os.path.isdir("/var/tmp") and real("/var/tmp") is None else None)
    monkeypatch.setattr(spill, "unsupported", lambda d: "no direct I/O")
    assert spill.default_dir(0) is None
