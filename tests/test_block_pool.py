"""pyext._memory.reused_blocks (csrc/common/block_pool): freed large CPU tensors are handed out
again while a scope is open, within its bound and never beyond the peak of the tensors in use;
tensors keep their values whichever thread frees them and whenever; torch's own allocator is back
after the scope."""
import threading

import pytest
import torch
import torch.nn.functional as F

from pyext import _ext
from pyext._memory import reused_blocks
from pyext.dispatch import PyextError

pytestmark = pytest.mark.skipif(_ext.EXT is None, reason="needs the compiled extension")
MIB = 1 << 20


def stats() -> dict:
    return _ext.EXT.pool_stats()


def test_a_freed_block_serves_the_next_tensor_of_its_size():
    with reused_blocks(64 * MIB) as opened:
        assert opened and stats()["open"]
        a = torch.empty(MIB // 4)  # 1 MiB
        where = a.data_ptr()
        del a
        assert stats()["cached_bytes"] >= MIB
        b = torch.empty(MIB // 4 - 100)  # a few bytes less: the same size class
        assert b.data_ptr() == where and stats()["hits"] == 1
        assert stats()["cached_bytes"] == 0


def test_a_block_serves_a_tensor_at_most_a_quarter_smaller():
    with reused_blocks(64 * MIB):
        a = torch.empty(MIB // 4)  # 1 MiB
        where = a.data_ptr()
        del a
        b = torch.empty(MIB // 4 - MIB // 32)  # 896 KiB
        assert b.data_ptr() == where and stats()["hits"] == 1
        del b
        half = torch.empty(MIB // 8)  # 512 KiB: a new block
        assert stats()["hits"] == 1 and stats()["misses"] == 2
        del half


def test_small_tensors_and_tensors_after_the_scope_are_torch_s():
    with reused_blocks(64 * MIB):
        small = torch.empty(1000)  # 4 KB: below the pool's 64 KiB
        del small
        assert stats()["cached_bytes"] == 0 and stats()["misses"] == 0
    assert not stats()["open"]
    a = torch.empty(MIB)
    del a
    assert stats()["cached_bytes"] == 0
    with reused_blocks(64 * MIB):
        torch.empty(MIB)
        assert stats()["hits"] == 0 and stats()["misses"] == 1  # nothing was kept from outside the scope


def test_the_cache_holds_at_most_its_bound_and_a_bound_of_zero_nothing():
    with reused_blocks(0):
        a = torch.empty(MIB)
        del a
        assert stats()["cached_bytes"] == 0
    with reused_blocks(3 * MIB):
        ts = [torch.empty(MIB // 4) for _ in range(5)]  # 1 MiB each
        del ts
        assert 2 * MIB <= stats()["cached_bytes"] <= 3 * MIB


def test_a_new_size_first_frees_as_much_of_the_cache():
    """So the pool and the tensors in use never hold more than the tensors in use did at their peak."""
    with reused_blocks(64 * MIB):
        ts = [torch.empty(MIB // 4) for _ in range(4)]  # 4 x 1 MiB
        del ts
        before = stats()["cached_bytes"]
        big = torch.empty(3 * MIB // 4)  # 3 MiB: more than twice a cached block, so a miss
        assert stats()["misses"] == 5
        assert stats()["cached_bytes"] <= before - 3 * MIB
        del big


def test_values_survive_the_scope_and_any_thread_may_free_them():
    with reused_blocks(64 * MIB):
        kept = torch.arange(MIB, dtype=torch.float32)
        others = [torch.full((MIB // 2,), float(i)) for i in range(4)]
    assert not stats()["open"]
    assert torch.equal(kept, torch.arange(MIB, dtype=torch.float32))
    threads = [threading.Thread(target=others.pop) for _ in range(4)]  # freed off the main thread
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert others == []
    del kept


def test_threads_allocating_at_once_keep_their_own_values():
    errors = []

    def work(k: int):
        for i in range(50):
            t = torch.full((MIB // 8 + 1000 * k,), float(k * 1000 + i))
            u = t * 2
            if not bool((u == 2 * (k * 1000 + i)).all()):
                errors.append((k, i))

    with reused_blocks(16 * MIB):
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert stats()["hits"] > 0
    assert errors == []


def test_scopes_nest_and_the_outermost_puts_torch_s_allocator_back():
    with reused_blocks(MIB):
        with reused_blocks(8 * MIB):
            ts = [torch.empty(MIB // 4) for _ in range(4)]
            del ts
            assert stats()["cached_bytes"] > MIB  # the widest bound of the open scopes
        assert stats()["open"] and stats()["cached_bytes"] <= MIB
    assert not stats()["open"] and stats()["cached_bytes"] == 0


def test_onednn_convolutions_before_in_and_after_a_scope():
    """oneDNN takes raw memory from torch's CPU allocator and may free it in another scope."""
    x = torch.randn(1, 32, 96, 96).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3).contiguous(memory_format=torch.channels_last)
    ref = F.conv2d(x, w, padding=1)
    with reused_blocks(64 * MIB):
        inside = [F.conv2d(x, w, padding=1) for _ in range(3)]
    after = F.conv2d(x, w, padding=1)
    for y in (*inside, after):
        assert torch.equal(y, ref)


def test_without_a_bound_the_cache_keeps_what_the_peak_held_and_no_more():
    with reused_blocks() as opened:
        assert opened
        big = [torch.empty(64 * MIB // 4) for _ in range(4)]  # 4 x 64 MiB in use
        del big
        assert stats()["cached_bytes"] >= 256 * MIB  # a bound of 8 MiB would have kept none
        other = torch.empty(100 * MIB // 4)  # no block of its size: cached blocks go first
        assert stats()["misses"] == 5 and stats()["cached_bytes"] <= 156 * MIB + MIB
        del other
    assert stats()["cached_bytes"] == 0 and not stats()["open"]


def test_a_bad_bound_is_refused_and_nothing_opens():
    for bad in (-1, 1.5, True, "8", 1 << 64):
        with pytest.raises(PyextError, match="cache_bytes"):
            with reused_blocks(bad):
                pass
        assert not stats()["open"]


def test_without_the_extension_nothing_changes(monkeypatch):
    monkeypatch.setattr(_ext, "EXT", None)
    with reused_blocks(MIB) as opened:
        assert opened is False
