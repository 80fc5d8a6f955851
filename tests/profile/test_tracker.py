import torch

from memopt.profile.tracker import MemoryTracker
from memopt.units import allocator_size


def test_allocator_rounding():
    assert allocator_size(0) == 0
    assert allocator_size(1) == 512
    assert allocator_size(512) == 512
    assert allocator_size(513) == 1024


def test_counts_new_storages_once_and_frees_them():
    x = torch.randn(256, 256)  # 256 KiB, created outside
    with MemoryTracker("cpu") as t:
        t.track(x, label="input")
        assert t.current_bytes == 256 * 1024
        y = x * 2  # new storage
        v = y.view(-1)  # a view: no new bytes
        assert t.current_bytes == 2 * 256 * 1024
        del y
        assert t.current_bytes == 2 * 256 * 1024  # the view keeps it alive
        del v
        assert t.current_bytes == 256 * 1024
        assert t.peak_bytes == 2 * 256 * 1024


def test_saved_tensors_live_until_backward():
    w = torch.randn(64, 64, requires_grad=True)
    with MemoryTracker("cpu") as t:
        t.track(w)
        h = (w @ w).relu()  # relu saves its output, mm saves inputs (w, already counted)
        loss = h.sum()
        before = t.current_bytes
        loss.backward()
        del h, loss
        assert t.current_bytes < before  # the graph and its saved tensors are gone
        assert w.grad is not None


def test_transient_and_persistent_buffers():
    with MemoryTracker("cpu") as t:
        t.transient(1000, "scratch")
        assert t.current_bytes == 0 and t.peak_bytes == 1024
        key = t.persistent(3000, "workspace")
        assert t.current_bytes == 3072
        t.release(key)
        assert t.current_bytes == 0
    assert ("scratch" in t.run.labels) and ("workspace" in t.run.labels)


def test_keys_are_unique_when_storage_ids_are_reused():
    with MemoryTracker("cpu") as t:
        for _ in range(50):
            z = torch.ones(1000) + 1
            del z
    allocs = [e[1] for e in t.run.events if e[0] == 1]
    assert len(allocs) == len(set(allocs)) == 100  # ones() and the sum, 50 times: never a reused key
