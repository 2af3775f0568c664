"""SymmetricHeap: one same-sized IPC allocation per rank, mapped by every node-local peer; kernels reach a peer's copy
at `bases[peer] + offset` (the base table opens the heap). Allocations must match on every rank (`verify()`)."""
from __future__ import annotations

import contextlib
import hashlib
import secrets
import weakref

import numpy as np

from .arguments import checked_timeout
from .array import DeviceArray, FreedMemory
from .bootstrap import agreed, bounded_barrier, node_comm
from .errors import AllocationMismatchError, A2AError
from .runtime import Backend, get_backend, select_device

TABLE_ALIGN = 256
# This process among the ranks' (not its pid: ranks in containers of their own may share one)
PROCESS = secrets.token_hex(16)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class SymmetricHeap:
    """`SymmetricHeap(comm, nbytes)`: collective over the node-local ranks of `comm`."""

    def __init__(self, comm, nbytes: int, *, backend: Backend | str | None = None,
                 device: int | None = None, timeout: float = 60.0):
        timeout = checked_timeout(timeout)  # (before anything collective)
        self.comm = node_comm(comm)
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

        def opened():
            made = get_backend(backend)
            return made, made.open_device(select_device(made, self.rank, device))
        try:  # (a rank whose device will not open tells the others, who raise too)
            self.backend, self.device = agreed(self.comm, "SymmetricHeap: opening the device", opened)
        except BaseException:
            self.comm.Free()
            raise
        # Ranks sharing this device (MPS): kernels whose blocks wait on each other need all of their blocks resident.
        self.ranks_on_device = self.comm.allgather(self.device.index).count(self.device.index)
        self.timeout = timeout
        self._fingerprint = hashlib.sha256()
        self._allocations = 0
        table_bytes = align_up(8 * self.world, TABLE_ALIGN)
        self.nbytes = table_bytes + align_up(int(nbytes), TABLE_ALIGN)
        # In their own object, so the finalizer (run at exit too) frees them without keeping the heap alive.
        self._mappings = _Mappings(self.backend, self.backend.malloc_ipc(self.nbytes))
        self._finalizer = weakref.finalize(self, self._mappings.release)
        self.base = self._mappings.base
        try:
            # A peer in this process (pyhipa2a.local) is reached at its own address where the backend can; IPC
            # handles are for other processes (CUDA opens none its own process exported).
            me = (PROCESS, self.backend.ipc_export(self.base), self.base, self.device.index)
            self.bases = [self.base if r == self.rank else self._mappings.open_peer(peer)
                          for r, peer in enumerate(self.comm.allgather(me))]
            bounded_barrier(self.comm, timeout, "SymmetricHeap: mapping peers")
            self.backend.ipc_exchanged(self.base)
            self.backend.copy_to_device(self.base, np.array(self.bases, dtype=np.uint64))
        except BaseException:
            self._finalizer()
            raise
        self.bases_ptr = self.base  # the device table of bases sits at offset 0
        self._offset = table_bytes

    def alloc(self, shape, dtype, align: int = 256) -> DeviceArray:
        """Reserve a C-contiguous array of `shape`/`dtype`; same call, same order, on every rank. `align` is the
        offset's from the heap's base (the same on every rank, as a symmetric heap needs), whose own alignment
        is the driver's, at least 256 bytes: up to 256 the address itself is aligned."""
        self._check_open()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = align_up(self._offset, align)
        if start + size > self.nbytes:
            raise MemoryError(f"symmetric heap exhausted: requested {size} bytes (aligned to {align}), "
                              f"{max(self.nbytes - start, 0)} of {self.nbytes} bytes free")
        self._offset = start + size
        self._allocations += 1
        self._fingerprint.update(f"{shape}|{dtype.str}|{align}|{start};".encode())
        return DeviceArray(self.backend, self.base + start, shape, dtype, owner=self)

    def verify(self) -> None:
        """Collective: raise on every rank if ranks made different allocations."""
        self._check_open()
        everyone = self.comm.allgather((self._fingerprint.hexdigest(), self._allocations, self._offset))
        groups: dict[str, list[int]] = {}
        for r, (digest, _, _) in enumerate(everyone):
            groups.setdefault(digest, []).append(r)
        if len(groups) > 1:
            majority = max(groups.values(), key=len)
            odd = sorted(r for g in groups.values() if g is not majority for r in g)
            detail = "; ".join(f"rank {r}: {n} allocations, {off} bytes used" for r, (_, n, off) in enumerate(everyone))
            raise AllocationMismatchError(
                f"symmetric heap allocations differ across ranks: ranks {odd} differ from ranks "
                f"{majority} ({detail}). Every rank must make the same allocations in the same order.",
                ranks=tuple(odd))

    def offset_of(self, ptr: int) -> int:
        if not self.base <= ptr < self.base + self.nbytes:
            raise ValueError(f"0x{ptr:x} is not inside this rank's symmetric heap")
        return ptr - self.base

    def translate(self, ptr: int, peer: int) -> int:
        """Address of `peer`'s copy of the symmetric object at local address `ptr`."""
        return self.bases[peer] + self.offset_of(ptr)

    def peer_array(self, array: DeviceArray, peer: int) -> DeviceArray:
        return DeviceArray(self.backend, self.translate(array.ptr, peer), array.shape, array.dtype, owner=self)

    def _check_open(self) -> None:
        if self.closed:
            raise A2AError("SymmetricHeap is closed")

    def close(self, wait_for_peers: bool = True) -> None:
        """Idempotent; waits (bounded) so nobody frees memory a peer still reads, unless `wait_for_peers=False`."""
        if self.closed:
            return
        try:
            if wait_for_peers:
                bounded_barrier(self.comm, self.timeout, "SymmetricHeap.close")
        finally:
            self._finalizer()
            FreedMemory.freed()  # (a plan that took our arrays misses from now on, and its full path refuses them)
            self.comm.Free()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Mappings:
    """This rank's allocation and its peer mappings; released once, in reverse order."""

    def __init__(self, backend: Backend, base: int):
        self.backend, self.base, self.peers = backend, base, []

    def open_peer(self, peer: tuple) -> int:
        """The address in this rank of `peer`'s heap (its process, IPC handle, address and device)."""
        process, handle, base, device = peer
        if process == PROCESS:
            reached = self.backend.reach_in_process(base, device)
            if reached is not None:
                return reached
        ptr = self.backend.ipc_open(handle)
        self.peers.append(ptr)
        return ptr

    def release(self) -> None:
        for ptr in reversed(self.peers):
            with contextlib.suppress(Exception):  # best effort: at exit a peer may already be gone
                self.backend.ipc_close(ptr)
        self.peers = []
        with contextlib.suppress(Exception):
            self.backend.free(self.base)
