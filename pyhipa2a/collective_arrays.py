"""CollectiveMatmul's arrays: what a call takes (pyhipa2a.inputs' boundary, NumPy copied in), what it hands back
(our buffer's rows, in the inputs' library where it has one), and the arrays the caller's GEMM is given."""
from __future__ import annotations

import numpy as np

from . import producers
from .array import DeviceArray
from .inputs import Boundary, check_writable

VIEWS_KEPT = 256  # library views of our memory kept (a call on other arrays makes its own anew)


class CallerArrays:
    def __init__(self, backend, heap, dtype, streams, settle):
        self.backend, self.heap, self.dtype = backend, heap, dtype
        self._settle = settle  # waits (bounded) for the calls before: a NumPy copy in waits for its stream
        self._boundary = Boundary(backend, heap.device.index, streams)
        self._staging: dict = {}  # argument name -> (pointer, bytes): NumPy arguments' device copies
        self._views: dict = {}
        self._kept: list = []     # what the last call read (a DLPack export, a JAX hold): ours until the next

    def taker(self, s, capturing: bool, arrays: list):
        """take(name, obj, shape) -> obj's pointer, read on stream `s` (this call's; what it took is kept, and
        (obj, how it was taken) appended to `arrays`, for the call's plan)."""
        kept = self._kept = []

        def take(name, obj, shape):
            stage = None
            if isinstance(obj, np.ndarray) and not capturing:
                self._settle()
                stage = self._stage(name, obj)
            taken = self._boundary.take(name, obj, shape, self.dtype, s, capturing=capturing, stage_ptr=stage)
            kept.append(taken.keep)
            arrays.append((obj, taken))
            return taken.ptr
        return take

    def _stage(self, name: str, host: np.ndarray) -> int:
        """Device memory a NumPy argument `name` is copied to (made at its first use, grown as needed)."""
        ptr, nbytes = self._staging.get(name, (None, 0))
        if nbytes < host.nbytes:
            if ptr is not None:
                self.backend.free(ptr)
                del self._staging[name]
            ptr = self.backend.malloc_ipc(host.nbytes)
            self._staging[name] = (ptr, host.nbytes)
        return ptr

    def output(self, take, name: str, given, ours: DeviceArray, shape, like, s):
        """(the array the call returns, its pointer): `given` (out=), else our buffer's first rows (valid until
        the next call of the operation), as an array of the library of `like` where it has one."""
        if given is not None:
            check_writable(name, given, "without out=, the result is ours: .numpy() it")
            return given, take(name, given, shape)
        probe = producers.stream_source(like)
        if probe is not None and probe.lasting_views:
            return self.ours(ours.ptr, shape, like), ours.ptr
        return DeviceArray(self.backend, ours.ptr, shape, self.dtype, owner=self.heap, stream=s), ours.ptr

    def rows(self, obj, first: int, count: int, ptr: int, cols: int, like):
        """Rows first..first+count of the caller's array `obj` (at ptr, `cols` wide) for the caller's GEMM: its
        own slice where it has one on the device, else a view of ours (a NumPy array's: of its copy, at ptr)."""
        if type(obj) is not DeviceArray and not isinstance(obj, np.ndarray) and hasattr(obj, "__getitem__"):
            return obj[first:first + count]
        return self.ours(ptr + first * cols * self.dtype.itemsize, (count, cols), like)

    def given(self, obj, ptr: int, shape):
        """The caller's argument `obj` (at ptr) as the caller's GEMM gets it: itself on the device, else (NumPy,
        copied in) its copy, as the other arrays the GEMM gets are."""
        return self.ours(ptr, shape, obj) if isinstance(obj, np.ndarray) else obj

    def ours(self, ptr: int, shape, like):
        """Our memory at `ptr` as an array of the library of `like` (made once and kept: an import costs more
        than a call's host work), else as a DeviceArray."""
        probe = producers.stream_source(like)
        key = (ptr, shape, probe)
        view = self._views.get(key)
        if view is None:
            view = DeviceArray(self.backend, ptr, shape, self.dtype, owner=self.heap)
            if probe is not None and probe.lasting_views:
                view = probe.export(view)
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            self._views[key] = view
        return view

    def close(self) -> None:
        for ptr, _ in self._staging.values():
            self.backend.free(ptr)
        self._staging, self._views, self._kept = {}, {}, []
