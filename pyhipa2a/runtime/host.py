"""CPU backend: "device memory" is a /dev/shm file mapped here, named by its IPC handle; kernels are Python functions
(pyhipa2a.host_kernels) following the GPU kernels' protocol on it, run at launch. Cross-process atomics are POSIX
record locks on the word, whose system calls also order a flag store after the data it publishes."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from ..errors import RuntimeFailure
from .base import Backend, DeviceInfo

SHM_DIR = "/dev/shm"
HANDLE_BYTES = 64


@dataclass
class _Mapping:
    name: str
    fd: int
    map: mmap.mmap
    anchor: ctypes.Array  # holds the buffer export that gives us the address
    size: int
    owned: bool           # created here: unlink the file when freed


@dataclass(eq=False)
class HostStream:
    """Only an identity (work runs at launch), unless capturing: then launches and event records await graph_launch."""
    captured: list | None = None


@dataclass(eq=False)
class HostGraph:
    steps: list


@dataclass(eq=False)
class HostEvent:
    time: float | None = None


class HostBackend(Backend):
    kind = "host"
    stream_type = HostStream

    def __init__(self):
        self._maps: dict[int, _Mapping] = {}
        self._streams: dict[int, HostStream] = {}
        self._host_buffers: dict[int, ctypes.Array] = {}
        self._trapped: str | None = None
        # id(a capture's list of steps) -> the streams that joined that capture (from its stream, or from a stream
        # that joined it before: every one leaves it when it ends)
        self._forked: dict[int, list] = {}

    def plan_activate(self):
        return None  # (no device to make current)

    def trap(self, reason: str) -> None:
        """Fail every later launch, copy, memset, allocation and synchronize (not a free), as a trapped GPU context."""
        self._trapped = reason

    def _alive(self) -> None:
        if self._trapped is not None:
            raise RuntimeFailure(f"host: the device is unusable after a kernel aborted ({self._trapped})")

    def device_count(self) -> int:
        return 1

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        if index != 0:
            raise RuntimeFailure(f"host backend has one device; asked for {index}")
        return DeviceInfo(name="host CPU", arch="host", index=0, count=1, multiprocessors=1, warp_size=1)

    def _map(self, name: str, size: int | None, create: bool) -> int:
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)  # owner-only: other users cannot map our heap
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RuntimeFailure(f"host shared memory {path}: {e.strerror or e}") from e
        anchor = (ctypes.c_char * size).from_buffer(m)
        ptr = ctypes.addressof(anchor)
        self._maps[ptr] = _Mapping(name, fd, m, anchor, size, create)
        return ptr

    def malloc_ipc(self, nbytes: int) -> int:
        self._alive()
        # A fresh file is zero-filled, as the GPU backends' allocations are after their memset.
        return self._map(f"pyhipa2a-{os.getpid()}-{secrets.token_hex(8)}", max(nbytes, 1), create=True)

    def _release(self, ptr: int, unlink: bool = True) -> None:
        """Unmap `ptr`; with `unlink`, also remove its file where this process created it."""
        m = self._maps.pop(ptr, None)
        if m is None:
            raise RuntimeFailure(f"host: 0x{ptr:x} is not a mapping of this process")
        del m.anchor
        m.map.close()
        os.close(m.fd)
        if unlink and m.owned:
            self.ipc_unlink_name(m)

    @staticmethod
    def ipc_unlink_name(m: _Mapping) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, m.name))

    def free(self, ptr: int) -> None:
        self._release(ptr)

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        buf = (ctypes.c_char * max(nbytes, 1))()  # zeroed; host and "device" share the address
        ptr = ctypes.addressof(buf)
        self._host_buffers[ptr] = buf
        return ptr, ptr

    def free_host_mapped(self, host_ptr: int) -> None:
        self._host_buffers.pop(host_ptr, None)

    def ipc_export(self, ptr: int) -> bytes:
        return self._maps[ptr].name.encode().ljust(HANDLE_BYTES, b"\0")

    def ipc_open(self, handle: bytes) -> int:
        return self._map(handle.rstrip(b"\0").decode(), None, create=False)

    def ipc_close(self, ptr: int) -> None:
        self._release(ptr, unlink=False)

    def ipc_exchanged(self, ptr: int) -> None:
        """Every peer has mapped `ptr`: drop its name so a killed job leaves nothing in /dev/shm."""
        self.ipc_unlink_name(self._maps[ptr])

    def _locate(self, ptr: int) -> tuple[_Mapping, int]:
        for base, m in self._maps.items():
            if base <= ptr < base + m.size:
                return m, ptr - base
        raise RuntimeFailure(f"host: address 0x{ptr:x} is not in any shared mapping")

    def memory_in_use(self) -> int:
        return sum(m.size for m in self._maps.values()) + sum(len(b) for b in self._host_buffers.values())

    def pointer_device(self, ptr: int) -> int | None:
        try:
            self._locate(ptr)
            return 0
        except RuntimeFailure:
            return None

    def _copyable(self, stream, what: str) -> None:
        """Copies with the host run at once: a capturing stream refuses them, as CUDA and HIP do a copy that waits
        for the host (copies and memsets within the device are recorded, as there)."""
        self._alive()
        if self.stream_capturing(stream):
            raise RuntimeFailure(f"host: {what} on a capturing stream is not supported")

    def copy_to_device(self, dst: int, src: np.ndarray, stream=None) -> None:
        self._copyable(stream, "copy_to_device")
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def copy_to_host(self, dst: np.ndarray, src: int, stream=None) -> None:
        self._copyable(stream, "copy_to_host")
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        self.enqueue(stream, lambda: ctypes.memset(ptr, byte, nbytes))

    # -- cross-process word operations used by the host kernels --------------
    def _locked(self, ptr: int):
        """A lock on the word at `ptr` among the processes that map it; none for this process's pinned memory
        (malloc_host_mapped), which no other process sees."""
        try:
            m, offset = self._locate(ptr)
        except RuntimeFailure:
            if any(base <= ptr < base + len(buf) for base, buf in self._host_buffers.items()):
                return contextlib.nullcontext()
            raise
        return _WordLock(m.fd, offset)

    def store_release_u32(self, ptr: int, value: int) -> None:
        with self._locked(ptr):
            ctypes.c_uint32.from_address(ptr).value = value

    def load_acquire_u32(self, ptr: int) -> int:
        with self._locked(ptr):
            return ctypes.c_uint32.from_address(ptr).value

    def stream_write_word(self, stream, ptr: int, value: int) -> None:
        self.enqueue(stream, lambda: self.store_release_u32(ptr, value))

    def stream_wait_word(self, stream, ptr: int, value: int, timeout: float, timed_out) -> None:
        def wait() -> None:
            deadline, pause = time.monotonic() + timeout, 1e-5
            while self.load_acquire_u32(ptr) != value:
                if time.monotonic() > deadline:
                    raise timed_out()
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        self.enqueue(stream, wait)

    def open_blas(self):
        from .blas import HostBlas
        return HostBlas(self)

    def stream_create(self):
        s = HostStream()
        self._streams[id(s)] = s
        return s

    def stream_destroy(self, stream) -> None:
        self._streams.pop(id(stream), None)

    def stream_handle(self, stream) -> int:
        return 0 if stream is None else id(stream)

    def stream_from_handle(self, handle: int):
        return self._streams.get(handle)

    def stream_synchronize(self, stream) -> None:
        self._alive()

    def stream_done(self, stream) -> bool:
        return True  # work runs at launch

    def enqueue(self, stream, step) -> None:
        """Run host work of a call's sequence (the MPI exchange between nodes) now, or keep it in a capturing graph."""
        self._alive()
        if self.stream_capturing(stream):
            stream.captured.append(step)
            return
        step()

    def event_create(self):
        return HostEvent()

    def event_destroy(self, event) -> None:
        pass

    def event_record(self, event, stream, *, within_capture: bool = False) -> None:
        if self.stream_capturing(stream):
            stream.captured.append(lambda: self.event_record(event, None))
            return
        event.time = time.perf_counter()

    def event_synchronize(self, event) -> None:
        pass

    def event_done(self, event) -> bool:
        return True  # work runs at launch

    def stream_wait_event(self, stream, event) -> None:
        pass  # host streams run their work as it is queued, so every stream is already in order

    def stream_wait_stream(self, waiter, producer, *, within_capture: bool = False) -> None:
        """In order already (the event is recorded and waited for all the same); but a stream that waits for a
        capturing one joins its capture until it ends (as CUDA's fork does): its work is then the graph's,
        queued among the capturing stream's in the order given."""
        super().stream_wait_stream(waiter, producer, within_capture=within_capture)  # (an event, as GPUs order)
        if self.stream_capturing(producer) and isinstance(waiter, HostStream) and waiter.captured is None:
            waiter.captured = producer.captured
            self._forked.setdefault(id(producer.captured), []).append(waiter)

    def event_elapsed_ms(self, start, end) -> float:
        if start.time is None or end.time is None:
            raise RuntimeFailure("host: event was never recorded")
        return (end.time - start.time) * 1e3

    def module_load(self, image: bytes):
        """`image` is the module's name: its kernels live in pyhipa2a.host_kernels.<name>."""
        try:
            return importlib.import_module(f"pyhipa2a.host_kernels.{image.decode()}")
        except ImportError as e:
            raise RuntimeFailure(f"host: no host kernels for module {image.decode()!r}") from e

    def module_unload(self, module) -> None:
        pass

    def module_function(self, module, name: str):
        fn = getattr(module, name, None)
        if fn is None:
            raise RuntimeFailure(f"host: module {module.__name__} has no kernel {name!r}")
        return fn

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        self._alive()
        if self.stream_capturing(stream):
            args = tuple(type(a).from_buffer_copy(a) for a in pack.arguments)  # as now: later calls rewrite the pack
            stream.captured.append(lambda: function(self, *args))
            return
        function(self, *pack.arguments)

    def resident_blocks(self, function, block_threads: int) -> int:
        return 1  # a host grid is one block of one thread

    def capture_begin(self, stream) -> None:
        if not isinstance(stream, HostStream) or stream.captured is not None:
            raise RuntimeFailure("host: capture needs a stream of this backend that is not capturing already")
        stream.captured = []

    def capture_end(self, stream, keep: bool = True):
        if not isinstance(stream, HostStream) or stream.captured is None:
            raise RuntimeFailure("host: capture_end on a stream that is not capturing")
        steps, stream.captured = stream.captured, None
        for joined in self._forked.pop(id(steps), []):
            joined.captured = None
        return HostGraph(steps) if keep else None

    def stream_capturing(self, stream) -> bool:
        return isinstance(stream, HostStream) and stream.captured is not None

    def graph_launch(self, graph, stream) -> None:
        self._alive()
        for step in graph.steps:
            step()

    def graph_destroy(self, graph) -> None:
        graph.steps = []

    def close(self) -> None:
        for ptr in list(self._maps):
            self._release(ptr)


class _WordLock:
    """An exclusive POSIX record lock on 4 bytes of a shared file."""

    def __init__(self, fd: int, offset: int):
        self.fd, self.offset = fd, offset

    def __enter__(self):
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 4, self.offset, os.SEEK_SET)

    def __exit__(self, *exc):
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 4, self.offset, os.SEEK_SET)
