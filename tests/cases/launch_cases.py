"""Kernel launches from one argument pack (run by tests/test_launch.py under mpiexec): a pack launched
again runs with the arguments it holds at that launch, whatever the backend keeps per launch site
(CUDA: a one-node executable graph), and a capture keeps the arguments it was recorded with."""
from __future__ import annotations

import gc

import numpy as np

from pyhipa2a import SymmetricHeap
from pyhipa2a.kernels import KernelLibrary

N = 1 << 16  # bytes each copy moves


def _setup(comm):
    heap = SymmetricHeap(comm, 8 * N)
    lib = KernelLibrary(heap.backend, heap.device.arch)
    src = heap.alloc(N, np.uint8)
    src.copy_from(np.random.default_rng(comm.Get_rank()).integers(0, 256, N, dtype=np.uint8))
    return heap, lib, src


def case_relaunch_takes_new_arguments(comm):
    heap, lib, src = _setup(comm)
    backend, stream = heap.backend, heap.backend.stream_create()
    want = src.numpy()
    outs = [heap.alloc(N, np.uint8) for _ in range(3)]
    kernel = lib.kernel("copy_bytes")
    pack = kernel.pack()
    # Three launches back to back, each with other arguments and two geometries, none waited for in
    # between: each must copy what its own arguments said.
    for i, (dst, nbytes, grid) in enumerate([(outs[0], N, 8), (outs[1], N // 2, 3), (outs[2], N - 5, 8)]):
        pack.set_scalars(dst.ptr, src.ptr, nbytes)
        kernel.launch(pack, grid, 256, stream)
    backend.stream_synchronize(stream)
    np.testing.assert_array_equal(outs[0].numpy(), want)
    np.testing.assert_array_equal(outs[1].numpy()[:N // 2], want[:N // 2])
    assert not outs[1].numpy()[N // 2:].any()
    np.testing.assert_array_equal(outs[2].numpy()[:N - 5], want[:N - 5])
    assert not outs[2].numpy()[N - 5:].any()
    if backend.kind == "cuda":
        assert len(pack.sites) == 2  # one per geometry
        releases = [site.release for site in pack.sites.values()]
        assert all(r.alive for r in releases)
        del pack
        gc.collect()
        assert not any(r.alive for r in releases)  # a dropped pack's graphs are destroyed with it
        pack = kernel.pack()
        pack.set_scalars(outs[0].ptr, src.ptr, N)
        kernel.launch(pack, 8, 256, stream)
        releases = [site.release for site in pack.sites.values()]
        assert len(releases) == 1 and releases[0].alive
    backend.stream_synchronize(stream)
    backend.stream_destroy(stream)
    lib.close()
    if backend.kind == "cuda":
        assert not releases[0].alive and not pack.sites  # and a closed library's packs release theirs
    heap.close()


def case_capture_keeps_recorded_arguments(comm):
    heap, lib, src = _setup(comm)
    backend, stream = heap.backend, heap.backend.stream_create()
    want = src.numpy()
    first, second = heap.alloc(N, np.uint8), heap.alloc(N, np.uint8)
    kernel = lib.kernel("copy_bytes")
    pack = kernel.pack()
    pack.set_scalars(second.ptr, src.ptr, N)
    kernel.launch(pack, 4, 256, stream)  # eager first, so the site exists before the capture
    backend.stream_synchronize(stream)
    second.copy_from(np.zeros(N, np.uint8))
    pack.set_scalars(first.ptr, src.ptr, N)
    backend.capture_begin(stream)
    kernel.launch(pack, 4, 256, stream)
    graph = backend.capture_end(stream)
    pack.set_scalars(second.ptr, src.ptr, N)  # after the capture: the graph must not see it
    backend.graph_launch(graph, stream)
    backend.stream_synchronize(stream)
    np.testing.assert_array_equal(first.numpy(), want)
    assert not second.numpy().any()
    kernel.launch(pack, 4, 256, stream)  # and an eager launch after it takes the pack's arguments
    backend.stream_synchronize(stream)
    np.testing.assert_array_equal(second.numpy(), want)
    backend.graph_destroy(graph)
    backend.stream_destroy(stream)
    lib.close()
    heap.close()


def case_repeater_keeps_its_arguments(comm):
    """Kernel.repeater launches the arguments the pack held when it was made, at every launch and on
    any stream, whatever is written to the pack (or launched from it) in between; inside a capture it
    is recorded as a kernel of that capture; one made again from the same packs takes their new
    arguments."""
    heap, lib, src = _setup(comm)
    backend, streams = heap.backend, [heap.backend.stream_create() for _ in range(2)]
    want = src.numpy()
    first, second = heap.alloc(N, np.uint8), heap.alloc(N, np.uint8)
    kernel = lib.kernel("copy_bytes")
    pack = kernel.pack()
    pack.set_scalars(first.ptr, src.ptr, N)
    into = kernel.pack()
    repeat = kernel.repeater(pack, into, 4, 256)
    for i in range(3):
        first.copy_from(np.zeros(N, np.uint8))
        second.copy_from(np.zeros(N, np.uint8))
        pack.set_scalars(second.ptr, src.ptr, N // 2)
        kernel.launch(pack, 3, 256, streams[0])  # the pack's own launches take what it holds now
        backend.stream_synchronize(streams[0])
        repeat(streams[i % 2])
        backend.stream_synchronize(streams[i % 2])
        np.testing.assert_array_equal(first.numpy(), want)
        np.testing.assert_array_equal(second.numpy()[:N // 2], want[:N // 2])
        assert not second.numpy()[N // 2:].any()
    first.copy_from(np.zeros(N, np.uint8))
    backend.capture_begin(streams[0])
    repeat(streams[0])
    graph = backend.capture_end(streams[0])
    assert not first.numpy().any()  # recorded, not run
    backend.graph_launch(graph, streams[0])
    backend.stream_synchronize(streams[0])
    np.testing.assert_array_equal(first.numpy(), want)
    backend.graph_destroy(graph)
    del repeat
    second.copy_from(np.zeros(N, np.uint8))
    repeat = kernel.repeater(pack, into, 4, 256)  # the pack holds (second, N // 2) now
    pack.set_scalars(first.ptr, src.ptr, 0)
    repeat(streams[1])
    backend.stream_synchronize(streams[1])
    np.testing.assert_array_equal(second.numpy()[:N // 2], want[:N // 2])
    assert not second.numpy()[N // 2:].any()
    for stream in streams:
        backend.stream_destroy(stream)
    del repeat
    lib.close()
    heap.close()
