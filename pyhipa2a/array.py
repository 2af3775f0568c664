"""DeviceArray: a C-contiguous device array (NumPy dtype and shape) whose `owner` keeps its memory alive, until the
owner is closed where it can be (an owner with a `closed` attribute: a heap, an AllToAll); every read, write and
export of the array refuses after that. It speaks the CUDA array interface and DLPack (host arrays are kDLCPU); an
AllToAll output's `health` makes `.numpy()`, DLPack and the interface raise the error of a failed call."""
from __future__ import annotations

import ctypes
import math
import weakref

import numpy as np

from . import dlpack
from .errors import A2AError


class Pinned:
    """Pinned host memory the device reads and writes too (Backend.malloc_host_mapped): `host`, a NumPy array over
    it, for the host's plain loads and stores; `device`, its address for kernels and stream operations. Freed by
    free() or with this object; keep() leaves it allocated for good (memory a stuck stream may still write)."""

    def __init__(self, backend, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        ptr, self.device = backend.malloc_host_mapped(nbytes)
        self.host = np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype).reshape(shape)
        self._free = weakref.finalize(self, backend.free_host_mapped, ptr)

    def free(self) -> None:
        self._free()

    def keep(self) -> None:
        self._free.detach()


class FreedMemory:
    """`epoch`: a new object each time an owner frees its arrays' memory (a heap's close()). What was checked of our
    arrays before (by a repeated call's plan) still holds while `epoch` is the object it was then: one look, however
    many arrays a call takes."""
    epoch = object()

    @classmethod
    def freed(cls) -> None:
        cls.epoch = object()


class DeviceArray:
    __slots__ = ("backend", "ptr", "shape", "dtype", "owner", "stream", "device_id", "health", "__weakref__")

    def __init__(self, backend, ptr: int, shape, dtype, owner=None, stream=None, device_id: int | None = None,
                 health=None):
        self.backend, self.ptr = backend, int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.owner, self.stream = owner, stream
        self.device_id = backend.current_device if device_id is None else device_id
        self.health = health  # None, or what check()s the failures of the call that wrote this array

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self.dtype.itemsize * math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, {self.backend.kind}:{self.device_id}, "
                f"0x{self.ptr:x})")

    def view(self, shape, dtype=None) -> "DeviceArray":
        """The same memory with another shape (and dtype); must not be larger."""
        out = DeviceArray(self.backend, self.ptr, shape, dtype or self.dtype, self.owner, self.stream, self.device_id,
                          self.health)
        if out.nbytes > self.nbytes:
            raise ValueError(f"view {out.shape} {out.dtype} is larger than {self.shape} {self.dtype}")
        return out

    def rows(self, n: int) -> "DeviceArray":
        """The first `n` entries along the first axis (still contiguous)."""
        if not 0 <= n <= self.shape[0]:
            raise ValueError(f"rows({n}) outside 0..{self.shape[0]}")
        return self.view((n, *self.shape[1:]))

    @property
    def freed(self) -> bool:
        """Whether its owner was closed, which freed its memory: no call may read or write it since."""
        return bool(getattr(self.owner, "closed", False))

    def _refuse_if_freed(self) -> None:
        if self.freed:
            raise A2AError(f"{self!r}: its memory was freed by close()")

    def numpy(self) -> np.ndarray:
        """A host copy, after the work queued on this array's stream; raises the error of a failed writing call."""
        self._refuse_if_freed()
        out = np.empty(self.shape, self.dtype)
        self.backend.activate()
        try:
            if self.health is not None:
                self.health.settle(self.stream)
            if out.nbytes:
                self.backend.copy_to_host(out, self.ptr, self.stream)
        except Exception as e:  # a trapped kernel fails the copy: say why, when we know
            self._refuse_if_failed(cause=e)
            raise
        self._refuse_if_failed()
        return out

    def _refuse_if_failed(self, cause: BaseException | None = None) -> None:
        """Raise the error of the call that wrote this array, if it is known to have failed."""
        if self.health is not None:
            self.health.check(cause)

    def copy_from(self, host: np.ndarray) -> None:
        self._refuse_if_freed()
        host = np.ascontiguousarray(host, dtype=self.dtype)
        if host.shape != self.shape:
            raise ValueError(f"shape {host.shape} does not match {self.shape}")
        if host.nbytes:
            self.backend.activate()
            self.backend.copy_to_device(self.ptr, host, self.stream)

    def fill_bytes(self, byte: int) -> None:
        self._refuse_if_freed()
        self.backend.activate()
        self.backend.memset(self.ptr, byte, self.nbytes, self.stream)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.backend.kind != "cuda":
            raise AttributeError("__cuda_array_interface__ is only for arrays on an NVIDIA GPU")
        self._refuse_if_freed()
        self._refuse_if_failed()  # a failure known now; later ones show as poisoned data
        # (the interface has no bfloat16: a 2-byte void, which consumers reinterpret)
        typestr = "<V2" if self.dtype.name == "bfloat16" else self.dtype.str
        cai = {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "strides": None, "version": 3}
        handle = self.backend.stream_handle(self.stream) if self.stream is not None else 0
        if handle:
            cai["stream"] = handle  # consumers order their work after ours
        return cai

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.backend.dlpack_device_type, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("pyhipa2a arrays are exported without copies")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"pyhipa2a arrays are exported on their own device {self.__dlpack_device__()}, "
                              f"without copies: dl_device={tuple(dl_device)} asks for another")
        self._refuse_if_freed()
        self._refuse_if_failed()  # a failure known now; later ones show as poisoned data
        if stream != -1 and self.stream is not None and self.backend.kind != "host":
            # The consumer's `stream` (None: legacy default, per DLPack) waits on the device for ours.
            handle = (1 if self.backend.kind == "cuda" else 0) if stream is None else stream
            self.backend.activate()
            self.backend.stream_wait_stream(self.backend.stream_from_handle(handle), self.stream)
        return dlpack.make_capsule(self.ptr, self.shape, self.dtype, self.backend.dlpack_device_type,
                                   self.device_id, owner=self, max_version=max_version)
