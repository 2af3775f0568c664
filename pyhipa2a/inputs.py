"""Turning user arrays into (pointer, shape, dtype) with clear errors.

Accepted: NumPy arrays (copied by the caller into device staging), our own
DeviceArray, and any device array exposing `__cuda_array_interface__` or
DLPack `__dlpack__` (used in place). Everything is checked on the calling
rank before a kernel runs: dtype, shape, C-contiguity and the device.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from . import dlpack
from .array import DeviceArray
from .dtypes import resolve

DLPACK_NAMES = {1: "cpu", 2: "cuda", 10: "rocm"}


@dataclass
class DeviceInput:
    ptr: int
    shape: tuple
    dtype: np.dtype
    keepalive: object = None
    # Described by __cuda_array_interface__: each use must wait for the stream that it names then
    # (producer_stream), since the producer may have queued new writes to it since.
    cai: bool = False
    # Exported by __dlpack__, which made the reading stream wait for the producer's writes so far:
    # a later use must export again.
    dlpack: bool = False


def producer_stream(obj) -> int | None:
    """The stream (a handle: 1 and 2 are CUDA's legacy and per-thread default streams) on which the
    producer of a __cuda_array_interface__ array queued its writes, or None when it needs no wait.
    Read at each use: CuPy, for one, names its current stream."""
    stream = obj.__cuda_array_interface__.get("stream")
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int) or stream <= 0:
        # (0 is ambiguous, and the interface's version 3 forbids it)
        raise ValueError(f"__cuda_array_interface__ stream must be None or a stream handle, not {stream!r}")
    return stream


def _describe(obj) -> str:
    return type(obj).__module__ + "." + type(obj).__name__


def _contiguous(shape, strides_bytes, itemsize) -> bool:
    if strides_bytes is None:
        return True
    expect = itemsize
    for n, s in zip(reversed(shape), reversed(strides_bytes)):
        if n > 1 and s != expect:
            return False
        expect *= n
    return True


def require_array(obj, name: str) -> None:
    if not (isinstance(obj, (np.ndarray, DeviceArray)) or hasattr(obj, "__cuda_array_interface__")
            or hasattr(obj, "__dlpack__")):
        raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                        f"__dlpack__), not {_describe(obj)}")


def device_view(obj, backend, device_index: int, name: str, dlpack_stream=None) -> DeviceInput:
    """Describe a device-resident array, or raise TypeError/ValueError saying what is wrong.
    `dlpack_stream`: the stream handle that will read the array, passed to `__dlpack__` (its
    producer makes that stream wait for its pending writes)."""
    if isinstance(obj, DeviceArray):
        if obj.backend.kind != backend.kind or obj.device_id != device_index:
            raise ValueError(f"{name} lives on {obj.backend.kind} device {obj.device_id}; this AllToAll runs "
                             f"on {backend.kind} device {device_index}")
        return DeviceInput(obj.ptr, obj.shape, obj.dtype, obj)
    cai = getattr(obj, "__cuda_array_interface__", None) if backend.kind != "host" else None
    if cai is not None:
        shape = tuple(cai["shape"])
        dtype = np.dtype(cai["typestr"])
        if not _contiguous(shape, cai.get("strides"), dtype.itemsize):
            raise ValueError(f"{name} must be C-contiguous (strides {cai.get('strides')} for shape {shape})")
        ptr = int(cai["data"][0])
        owner = backend.pointer_device(ptr) if ptr else device_index
        if owner is not None and owner != device_index:
            where = f"device {owner}" if owner >= 0 else "another device"
            raise ValueError(f"{name} lives on {backend.kind} {where}; this rank uses device {device_index}")
        if hasattr(obj, "dtype") and resolve(obj.dtype).itemsize == dtype.itemsize:
            dtype = resolve(obj.dtype)  # CAI cannot spell bfloat16
        return DeviceInput(ptr, shape, dtype, obj, cai=True)
    if hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__dlpack_device__"):
            dev_type, dev_id = obj.__dlpack_device__()
            if dev_type != backend.dlpack_device_type or (dev_type != 1 and dev_id != device_index):
                raise ValueError(
                    f"{name} lives on {DLPACK_NAMES.get(dev_type, dev_type)} device {dev_id}; this AllToAll "
                    f"runs on {backend.kind} device {device_index}")
        view = dlpack.view_from_object(obj, stream=dlpack_stream)
        if view.device_type != backend.dlpack_device_type or (view.device_type != 1 and view.device_id != device_index):
            raise ValueError(f"{name} lives on {DLPACK_NAMES.get(view.device_type, view.device_type)} device "
                             f"{view.device_id}; this AllToAll runs on {backend.kind} device {device_index}")
        dtype = resolve(view.dtype)
        strides = None if view.strides is None else tuple(s * dtype.itemsize for s in view.strides)
        if not _contiguous(view.shape, strides, dtype.itemsize):
            raise ValueError(f"{name} must be C-contiguous (element strides {view.strides} for shape {view.shape})")
        return DeviceInput(view.ptr, tuple(view.shape), dtype, view, dlpack=True)
    raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                    f"__dlpack__), not {_describe(obj)}")


def check_array(name: str, shape, dtype, want_shape, want_dtype) -> None:
    """`want_shape` may hold None for a free dimension."""
    if np.dtype(dtype) != np.dtype(want_dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(want_dtype).name}, got {np.dtype(dtype).name}")
    if len(shape) != len(want_shape):
        raise ValueError(f"{name} must have {len(want_shape)} dimensions {_spell(want_shape)}, got shape {tuple(shape)}")
    for got, want in zip(shape, want_shape):
        if want is not None and got != want:
            raise ValueError(f"{name} must have shape {_spell(want_shape)}, got {tuple(shape)}")


def _spell(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_numpy(name: str, arr: np.ndarray) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass numpy.ascontiguousarray({name})")


def check_indices(indices: np.ndarray, num_experts: int) -> None:
    """Host-side check of routing: in range and distinct within each row."""
    if indices.size == 0:
        return
    bad = np.argwhere((indices < 0) | (indices >= num_experts))
    if len(bad):
        t, j = bad[0]
        raise ValueError(f"indices[{t}, {j}] = {indices[t, j]} is outside [0, {num_experts})")
    ordered = np.sort(indices, axis=1)
    dup = np.argwhere(ordered[:, 1:] == ordered[:, :-1])
    if len(dup):
        t = dup[0][0]
        raise ValueError(f"indices row {t} repeats expert {ordered[t, dup[0][1]]}: {indices[t].tolist()}; "
                         f"the experts of a token must be distinct")


def check_scale(value) -> float:
    """combine()'s expert_scale as the float32 the kernels multiply by: a finite real number that
    float32 holds, not rounded to 0 unless it is 0. In plain Python: it is checked at every call."""
    if type(value) is float and value == 1.0:  # the default, with nothing to check
        return 1.0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expert_scale must be a real number, not {_describe(value)}")
    try:
        as_f32 = struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # beyond float32 (or beyond any float, for a huge int)
        as_f32 = math.inf
    if not math.isfinite(as_f32):
        raise ValueError(f"expert_scale={value!r} is not a finite float32")
    if as_f32 == 0.0 and value != 0:
        raise ValueError(f"expert_scale={value!r} is too small for float32 (it would be 0)")
    return as_f32
