"""The heap self-test kernel driven from Python (used by scripts/heap_check.py and the tests)."""
from __future__ import annotations

import numpy as np

from .bootstrap import bounded_barrier, world_size
from .errors import status_error
from .heap import SymmetricHeap
from .kernels import HeapView, KernelLibrary, timeout_ns

THREADS = 256


def heap_self_test(comm=None, *, words: int = 1 << 16, rounds: int = 3, timeout: float = 10.0, backend=None) -> str:
    """Run `rounds` epochs of write-all-peers / verify-all; returns this rank's one-line report."""
    world = world_size(comm)
    nbytes = 4 * words * world + 4 * world + 4 * 8 + 4096
    with SymmetricHeap(comm, nbytes, backend=backend, timeout=timeout) as heap:
        slots = heap.alloc((heap.world, words), np.uint32)
        flags = heap.alloc((heap.world,), np.uint32)
        counter = heap.alloc((1,), np.uint32)
        status = heap.alloc((4,), np.uint32)
        result = heap.alloc((1,), np.uint32)
        heap.verify()
        lib = KernelLibrary(heap.backend, heap.device.arch)
        try:
            kernel = lib.kernel("heap_check")
            pack = kernel.pack()
            a = pack[0]
            a.heap = HeapView.of(heap)
            a.off_slots, a.off_flags, a.off_counter = (heap.offset_of(b.ptr) for b in (slots, flags, counter))
            a.off_status, a.off_result = heap.offset_of(status.ptr), heap.offset_of(result.ptr)
            a.words, a.timeout_ns = words, timeout_ns(timeout)
            stream = heap.backend.stream_create()
            # (one block a multiprocessor, shared among the ranks that drive this device: blocks wait on flags)
            per_rank = heap.device.multiprocessors // heap.ranks_on_device
            grid = max(1, min(per_rank, (words + THREADS - 1) // THREADS))
            for epoch in range(1, rounds + 1):
                # (a fast rank must not overwrite a slow rank's slots or flag while it still verifies)
                bounded_barrier(heap.comm, timeout, f"heap self-test epoch {epoch}")
                a.epoch = epoch
                kernel.launch(pack, grid, THREADS, stream)
                heap.backend.stream_synchronize(stream)
                error = status_error(status.numpy(), heap.rank, f"heap self-test epoch {epoch}")
                if error is not None:
                    raise error
            heap.backend.stream_destroy(stream)
        finally:
            lib.close()
        return (f"rank {heap.rank}: {heap.backend.kind} {heap.device.name} ({heap.device.arch}), "
                f"{rounds} epochs x {heap.world} peers x {words} words verified, "
                f"mismatches {int(result.numpy()[0])}")
