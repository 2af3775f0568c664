"""Multi-rank cases for the symmetric heap (run by tests/test_heap.py under mpiexec)."""
from __future__ import annotations

import numpy as np
import pytest

from pyhipa2a import AllocationMismatchError, SymmetricHeap
from pyhipa2a.selftest import heap_self_test


def case_exchange(comm):
    """Every rank sees every peer's allocation at bases[peer], and translate() agrees."""
    with SymmetricHeap(comm, 1 << 20) as heap:
        assert heap.world == comm.Get_size() and heap.rank == comm.Get_rank()
        assert heap.bases[heap.rank] == heap.base and len(set(heap.bases)) == heap.world
        heap.alloc((heap.world,), np.uint64, align=8)  # a first allocation, so `mine` is not at offset 0
        mine = heap.alloc((1000,), np.int32)
        other = heap.alloc((3, 5), np.float16, align=4096)
        # (an alignment is the offset's: the base's own is the driver's, 256 bytes where other memory came first)
        assert (other.ptr - heap.base) % 4096 == 0 and mine.ptr % 256 == 0 and heap.base % 256 == 0
        heap.verify()
        mine.copy_from(np.arange(1000, dtype=np.int32) * (heap.rank + 1))
        comm.Barrier()
        for peer in range(heap.world):
            assert heap.translate(mine.ptr, peer) == heap.bases[peer] + (mine.ptr - heap.base)
            got = heap.peer_array(mine, peer).numpy()
            np.testing.assert_array_equal(got, np.arange(1000, dtype=np.int32) * (peer + 1))
        comm.Barrier()
        with pytest.raises(ValueError, match="not inside"):
            heap.translate(heap.base + heap.nbytes + 16, 0)


def case_fingerprint_mismatch(comm):
    """One rank allocating differently is named on every rank; nothing is corrupted silently."""
    if comm.Get_size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    odd = comm.Get_size() - 1
    with SymmetricHeap(comm, 1 << 16) as heap:
        heap.alloc((16,), np.float32)
        heap.alloc((8,) if heap.rank != odd else (9,), np.int32)
        with pytest.raises(AllocationMismatchError, match=rf"ranks \[{odd}\] differ") as info:
            heap.verify()
        assert info.value.ranks == (odd,)


def case_exhausted(comm):
    with SymmetricHeap(comm, 4096) as heap:
        heap.alloc((512,), np.float32)
        with pytest.raises(MemoryError, match=r"requested 8192 bytes.*2048 of \d+ bytes free"):
            heap.alloc((1024,), np.float64)
        heap.alloc((512,), np.float32)  # the failed request reserved nothing


def case_self_test(comm, words="4096"):
    print(heap_self_test(comm, words=int(words), rounds=3, timeout=30.0))


def case_close_idempotent(comm):
    heap = SymmetricHeap(comm, 1 << 16)
    heap.alloc((4,), np.int32)
    heap.close()
    heap.close()
    assert heap.closed
    with pytest.raises(Exception, match="closed"):
        heap.alloc((4,), np.int32)


def case_left_open(comm):
    """A heap never closed is released at interpreter exit (the test checks /dev/shm afterwards)."""
    heap = SymmetricHeap(comm, 1 << 16)
    heap.alloc((4,), np.int32)
    comm.Barrier()
    globals()["_kept"] = heap
