"""The array boundary: each argument becomes a checked kernel pointer. NumPy arrays are copied to device staging;
DeviceArray, CUDA-array-interface and DLPack arrays are used in place, typed by their protocol (not `.dtype`).

producer_order="protocol" (default) waits for: a DeviceArray's stream; the stream a version-3 interface
names (read at every call); else a DLPack export naming the reading stream; an interface naming neither
is used as is, with a warning. producer_order="stream": the caller vouches for the call's stream.
Descriptions are cached per argument (keeping the object, so its address is not reused) while the protocol,
or for PyTorch, CuPy and JAX their attributes (pyhipa2a.producers), say the same."""
from __future__ import annotations

import math
import struct
import warnings
from typing import NamedTuple

import numpy as np

from . import dlpack, producers
from .array import DeviceArray
from .dtypes import ML_DTYPES, resolve
from .errors import A2AError

DLPACK_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 10: "rocm", 11: "rocm_host", 13: "cuda_managed"}

OWN, CAI, DLPACK, PROBED = "own", "cai", "dlpack", "probed"


class Described(NamedTuple):
    """One device argument as the kernels see it, and what a later use must find to trust it."""
    ptr: int
    shape: tuple
    dtype: np.dtype
    protocol: str            # OWN, CAI, DLPACK, or PROBED (described by its probe alone: Boundary._from_probe)
    key: tuple               # what the protocol said, compared at a later use; PROBED: the probe's key
    keepalive: object = None  # a consumed DLPack capsule or a probe's hold: the memory is ours until released


class Recheck(NamedTuple):
    """What a probed argument must still answer (key, producer stream) for a call to repeat unasked."""
    probe: object
    key: tuple
    stream: object


class Taken(NamedTuple):
    """An argument as taken, and whether a repeat on the same object and stream may take it unasked."""
    ptr: int
    keep: object
    repeatable: bool
    recheck: Recheck | None = None
    wait: object = None  # the producer stream each repeat waits for (an int, as the probe spells it)
    # f(new, recorded) -> new's pointer where a repeat may take `new` in place of this argument as it takes
    # the argument itself (the same description but the pointer: the same checks pass, the same waits
    # serve), else 0; None where no other array may stand in
    stand_in: object = None


def own_stand_in(d: Described, obj: DeviceArray, align: int):
    """Taken.stand_in of our array `obj`: another of ours of its shape, type, device and stream."""
    shape, dtype, backend, device, stream = d.shape, d.dtype, obj.backend, obj.device_id, obj.stream

    def stand_in(new, recorded) -> int:
        if (type(new) is not DeviceArray or new.stream is not stream or new.shape != shape or new.dtype != dtype
                or new.device_id != device or new.backend is not backend or new.freed):
            return 0
        return new.ptr if new.ptr % align == 0 else 0
    return stand_in


def probed_stand_in(recheck: Recheck, device: int, align: int):
    """Taken.stand_in of a probed array (PyTorch, CuPy): one of its type the probe views as it viewed the
    recorded one on our device (shape, strides, element type; compact), written on the same stream."""
    probe, rest, named = recheck.probe, recheck.key[1:], recheck.stream

    def stand_in(new, recorded) -> int:
        if type(new) is not type(recorded):
            return 0
        seen = probe.view(new)
        if seen is None or seen[0][1:] != rest or seen[1] != device or not seen[2]:
            return 0
        if probe.stream(new) != named:
            return 0
        ptr = seen[0][0]
        return ptr if ptr and ptr % align == 0 else 0
    return stand_in


class Cached(NamedTuple):
    """An argument's last array and description; with its probe, its key and the stream the export ordered."""
    obj: object
    described: Described
    probe: object = None
    probe_key: tuple = ()
    ordered_on: object = None


def producer_stream(cai: dict) -> int | None:
    """The stream handle a __cuda_array_interface__ producer queued its writes on, or None: no wait."""
    stream = cai.get("stream")
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int) or stream <= 0:
        # (0 is ambiguous; version 3 forbids it)
        raise ValueError(f"__cuda_array_interface__ stream must be None or a stream handle, not {stream!r}")
    return stream


def _describe_type(obj) -> str:
    return type(obj).__module__ + "." + type(obj).__name__


def require_array(obj, name: str) -> None:
    # The type first: hasattr on an instance evaluates PyTorch's costly __cuda_array_interface__ property.
    kind = type(obj)
    if not (isinstance(obj, (np.ndarray, DeviceArray)) or hasattr(kind, "__dlpack__")
            or hasattr(kind, "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__")
            or hasattr(obj, "__dlpack__")):
        raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                        f"__dlpack__), not {_describe_type(obj)}")


def cai_dtype(typestr: str, want_dtype, name: str) -> np.dtype:
    """The element type a typestr names; a void of the right size ('<V2') stands for a required ml_dtype."""
    dtype = np.dtype(typestr)
    if dtype.kind != "V":
        return dtype
    want = np.dtype(want_dtype)
    if want.name in ML_DTYPES and want.itemsize == dtype.itemsize:
        return want
    raise TypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} names no element type (a {dtype.itemsize}"
                    f"-byte void); {name} must be {want.name}")


def _read_cai(obj):
    """The interface's dict, or None where absent or refused (JAX refuses bfloat16): then DLPack describes it."""
    try:
        return obj.__cuda_array_interface__
    except Exception:
        return None


def _dlpack_device(device_type: int, device_id: int, backend, device_index: int, name: str) -> None:
    """Refuse a DLPack array that lives elsewhere than this rank's device."""
    if device_type != backend.dlpack_device_type or (device_type != 1 and device_id != device_index):
        raise ValueError(f"{name} lives on {DLPACK_NAMES.get(device_type, device_type)} device {device_id}; "
                         f"this AllToAll runs on {backend.kind} device {device_index}")


def _dlpack_key(view) -> tuple:
    return (view.ptr, tuple(view.shape), view.strides, view.dtype, view.device_type, view.device_id)


_warned_types: set = set()


def _warn_unordered(obj, why: str) -> None:
    kind = type(obj)
    if kind not in _warned_types:
        _warned_types.add(kind)
        warnings.warn(f"{kind.__name__} {why}: pyhipa2a cannot wait for its producer's writes; pass the "
                      "producer's stream as stream= or synchronize it before the call", RuntimeWarning, stacklevel=5)


class Boundary:
    """One AllToAll's array boundary; producers are waited for through `order`, its Streams."""

    def __init__(self, backend, device_index: int, order, producer_order: str = "protocol"):
        self.backend, self.device_index, self.order = backend, device_index, order
        self.ask_producers = producer_order == "protocol"
        self._cache: dict[str, Cached] = {}
        self._checked: dict[str, tuple] = {}  # per argument: the last (shape, dtype, wants) that passed

    def take(self, name: str, obj, want_shape, want_dtype, stream, *, capturing: bool = False,
             stage_ptr: int | None = None, align: int = 1) -> Taken:
        """Argument `name` (`want_shape`, None entries free; `want_dtype`; `align`-byte aligned) read on `stream`.
        NumPy arrays are copied into `stage_ptr` (refused without one, or while capturing)."""
        if isinstance(obj, np.ndarray):
            check_numpy_input(name, obj, want_shape, want_dtype, capturing and stage_ptr is not None)
            if stage_ptr is None:
                raise TypeError(f"{name} must be a device array")
            if obj.size:
                self.backend.copy_to_device(stage_ptr, obj, stream)
            return Taken(stage_ptr, obj, False)
        d, producer = self.describe(name, obj, want_dtype, stream, capturing)
        checked = (d.shape, d.dtype, want_shape, want_dtype)  # all that check_array reads
        if self._checked.get(name) != checked:
            check_array(name, *checked)
            self._checked[name] = checked
        if d.ptr % align:
            raise ValueError(f"{name} must be {align}-byte aligned (its data is at 0x{d.ptr:x})")
        keep = obj if d.keepalive is None else d.keepalive
        if producer is not None:
            self.order.wait_for_producer(producer, stream)
        if capturing:
            return Taken(d.ptr, keep, False)
        if d.protocol == OWN:
            # (describe() names no producer where the caller vouches for the stream)
            repeatable = producer is None or self.order.same_stream(producer, stream)
            return Taken(d.ptr, keep, repeatable, stand_in=own_stand_in(d, obj, align))
        if not self.ask_producers:
            return Taken(d.ptr, keep, True)
        recheck, wait = self._recheck(self._cache[name], obj, producer, stream)
        stand_in = None
        if recheck is not None and recheck.probe.hold is None:  # (JAX's hold, an export, is one array's own)
            stand_in = probed_stand_in(recheck, self.device_index, align)
        return Taken(d.ptr, keep, recheck is not None, recheck, wait, stand_in)

    def _recheck(self, cached: Cached, obj, producer, stream):
        """(Recheck, wait) for a probed argument's repeats, or (None, None) when it cannot repeat unasked."""
        if cached.probe is None or not (producer is None or isinstance(producer, int)):
            return None, None
        if cached.described.protocol == PROBED and producer is not None:
            named = producer  # (its probe's answer already)
        else:
            try:
                named = cached.probe.stream(obj)
            except Exception:
                return None, None
        if producer is not None and named != producer:
            return None, None
        wait = None
        if named is not None and not self.order.same_stream(named, stream):
            if self.order.named(named) is None:  # the backend cannot name it
                return None, None
            wait = named  # spelled as the full path's producer, so a call waits for it once
        return Recheck(cached.probe, cached.probe_key, named), wait

    def describe(self, name: str, obj, want_dtype, stream, capturing: bool):
        """(description, producer: our stream, a foreign handle, or None) of a device array, cached while it stands."""
        cached = self._cache.get(name)
        d = None
        if cached is not None and cached.obj is obj:
            if cached.probe is not None:  # PyTorch, CuPy, JAX: their own attributes, not their protocols
                d, producer = self._probed(cached, obj, stream, capturing)
            else:
                d, producer = self._still(name, cached.described, obj, want_dtype, stream, capturing)
        if d is None:
            probed = self._from_probe(obj, stream, capturing)
            if probed is not None:
                d, producer, self._cache[name] = probed
            else:
                d, producer = self._describe(name, obj, want_dtype, stream, capturing)
                self._cache[name] = self._cached(obj, d, producer, None if capturing else stream)
        elif cached.described is not d:
            self._cache[name] = Cached(obj, d)
        if capturing or not self.ask_producers:
            return d, None  # a capture may not wait for work outside it; "stream": the caller vouches
        return d, producer

    def _probed(self, cached: Cached, obj, stream, capturing: bool):
        """(description, producer) while the probe answers as cached (not for one made while capturing)."""
        if cached.ordered_on is None and not capturing:
            return None, None
        try:
            if cached.probe.key(obj) != cached.probe_key:
                return None, None
            producer = None if capturing or not self.ask_producers else cached.probe.stream(obj)
        except Exception:
            return None, None
        if producer is None and not capturing and cached.ordered_on is not stream:
            producer = cached.ordered_on  # (JAX) its first export made that stream wait for it
        return cached.described, producer

    def _cached(self, obj, d: Described, producer, ordered_on) -> Cached:
        """A new description's cache entry, with the probe where it agrees with the protocol (and obj is not empty)."""
        probe = producers.probe_for(obj) if d.protocol != OWN and self.backend.kind != "host" else None
        if probe is None or 0 in d.shape:
            return Cached(obj, d)
        named = d.protocol == CAI and self.ask_producers  # a DLPack export names no stream
        try:
            key = probe.key(obj)
            agrees = (key[0] == d.ptr and tuple(key[1]) == d.shape and (not named or probe.stream(obj) == producer)
                      and self._taught(probe, obj, d, key))
        except Exception:
            agrees = False
        if not agrees:
            producers.disown(obj)
            return Cached(obj, d)
        return Cached(obj, d, probe, key, ordered_on)

    def _taught(self, probe, obj, d: Described, key: tuple) -> bool:
        """Whether the probe's view of obj agrees with d (our device, compact, `key`); if so the probe learns
        d's element type for key's type object, for _from_probe. A void typestr teaches nothing."""
        if d.protocol == CAI and np.dtype(d.key[2]).kind == "V":
            return True
        seen = probe.view(obj)
        if seen is None:  # (an unfinished JAX array)
            return True
        viewed, device, compact = seen
        if viewed != key or device != self.device_index or not compact:
            return False
        return probe.element_types.setdefault(key[3], d.dtype) == d.dtype

    def _from_probe(self, obj, stream, capturing: bool):
        """(description, producer, cache entry) from the probe alone, for an element type _taught it; else None."""
        if self.backend.kind == "host":  # no probe's stream means anything for host memory
            return None
        probe = producers.probe_for(obj)
        if probe is None:
            return None
        try:
            seen = probe.view(obj)
            if seen is None or seen[1] != self.device_index or not seen[2]:  # (elsewhere, or not compact)
                return None
            key = seen[0]
            dtype, shape = probe.element_types.get(key[3]), tuple(key[1])
            if dtype is None or 0 in shape:
                return None
            producer = probe.stream(obj) if self.ask_producers and not capturing else None
            hold = None if probe.hold is None else probe.hold(obj)
        except Exception:
            return None
        d = Described(key[0], shape, dtype, PROBED, key, hold)
        return d, producer, Cached(obj, d, probe, key, None if capturing else stream)

    def _still(self, name, d: Described, obj, want_dtype, stream, capturing):
        """(`d`, with this use's capsule if any, and the producer) while `d` still describes `obj`."""
        if d.protocol == OWN:  # (our arrays never change their memory, but their owner's close() frees it)
            return (None, None) if obj.freed else (d, obj.stream)
        if not self.ask_producers:
            return d, None  # the caller vouches
        if d.protocol == CAI:
            cai = _read_cai(obj)
            if cai is None or _cai_key(cai) != d.key:
                return None, None
            return d, producer_stream(cai)
        view = dlpack.view_from_object(obj, stream=self.order.dlpack_stream(stream, capturing))
        if _dlpack_key(view) != d.key:
            return self._from_dlpack(view, name, want_dtype), None  # checked afresh, from this export
        return Described(d.ptr, d.shape, d.dtype, DLPACK, d.key, view.keepalive), None

    def _describe(self, name: str, obj, want_dtype, stream, capturing):
        """(description, producer) of an array new to this argument (or changed)."""
        backend = self.backend
        if isinstance(obj, DeviceArray):
            if obj.freed:  # (its memory may be unmapped, or another object's now)
                raise A2AError(f"{name} was freed by close() of the object that made it")
            if obj.backend.kind != backend.kind or obj.device_id != self.device_index:
                raise ValueError(f"{name} lives on {obj.backend.kind} device {obj.device_id}; this AllToAll runs "
                                 f"on {backend.kind} device {self.device_index}")
            return Described(obj.ptr, obj.shape, obj.dtype, OWN, ()), obj.stream
        cai = _read_cai(obj) if backend.kind != "host" else None
        use_cai = cai is not None and (not self.ask_producers or "stream" in cai or not hasattr(obj, "__dlpack__"))
        if use_cai:
            if self.ask_producers and "stream" not in cai:
                _warn_unordered(obj, "exposes a __cuda_array_interface__ that names no stream and no __dlpack__")
            return self._from_cai(cai, name, want_dtype), producer_stream(cai)
        if hasattr(obj, "__dlpack__"):
            if hasattr(obj, "__dlpack_device__"):  # refuse before exporting (an export may copy or wait)
                _dlpack_device(*obj.__dlpack_device__(), backend, self.device_index, name)
            # Name the reading stream (the producer orders itself), or -1 when the caller vouches.
            exported_to = self.order.dlpack_stream(stream, capturing or not self.ask_producers)
            return self._from_dlpack(dlpack.view_from_object(obj, stream=exported_to), name, want_dtype), None
        raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                        f"__dlpack__), not {_describe_type(obj)}")

    def _from_cai(self, cai: dict, name: str, want_dtype) -> Described:
        shape = tuple(cai["shape"])
        dtype = cai_dtype(cai["typestr"], want_dtype, name)
        if not dlpack.row_major(shape, cai.get("strides"), dtype.itemsize):  # (strides in bytes)
            raise ValueError(f"{name} must be C-contiguous (strides {cai.get('strides')} for shape {shape})")
        ptr = int(cai["data"][0])
        owner = self.backend.pointer_device(ptr) if ptr else self.device_index
        if owner is not None and owner != self.device_index:
            where = f"device {owner}" if owner >= 0 else "another device"
            raise ValueError(f"{name} lives on {self.backend.kind} {where}; this rank uses device {self.device_index}")
        return Described(ptr, shape, dtype, CAI, _cai_key(cai))

    def _from_dlpack(self, view, name: str, want_dtype) -> Described:
        _dlpack_device(view.device_type, view.device_id, self.backend, self.device_index, name)
        dtype = resolve(view.dtype)
        if not dlpack.is_c_contiguous(view):
            raise ValueError(f"{name} must be C-contiguous (element strides {view.strides} for shape {view.shape})")
        return Described(view.ptr, tuple(view.shape), dtype, DLPACK, _dlpack_key(view), view.keepalive)


def _cai_key(cai: dict) -> tuple:
    return (cai["data"][0], tuple(cai["shape"]), cai["typestr"], cai.get("strides"))


def check_writable(name: str, obj, numpy_hint: str) -> None:
    """An array a call writes (out=, gathered=): device memory that may be written. A NumPy one would never be
    written back (`numpy_hint`: where the result comes from instead); a JAX array never changes once made."""
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name} must be a device array; {numpy_hint}")
    probe = producers.stream_source(obj)
    if probe is not None and probe.immutable:
        raise TypeError(f"{name} must be an array that may be written: a JAX array never changes once made (let "
                        "the call return its result)")


def check_numpy_input(name: str, obj: np.ndarray, want_shape, want_dtype, capturing: bool) -> None:
    """A NumPy argument's shape, dtype and layout; refused while capturing (see the error)."""
    check_array(name, obj.shape, obj.dtype, want_shape, want_dtype)
    if not obj.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass numpy.ascontiguousarray({name})")
    if capturing:
        raise TypeError(f"inside capture(), {name} must be a device array: a NumPy array would be copied "
                        "once while capturing, not at each launch of the graph")


def _spelled(dtype) -> str:
    """A dtype's name, with its byte order where that is not the machine's (a big-endian int32 is not ours)."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


def check_array(name: str, shape, dtype, want_shape, want_dtype) -> None:
    """`want_shape` may hold None for a free dimension."""
    if dtype != want_dtype and np.dtype(dtype) != np.dtype(want_dtype):
        raise TypeError(f"{name} must have dtype {_spelled(want_dtype)}, got {_spelled(dtype)}")
    if len(shape) != len(want_shape):
        raise ValueError(f"{name} must have {len(want_shape)} dimensions {_spell(want_shape)}, "
                         f"got shape {tuple(shape)}")
    for got, want in zip(shape, want_shape):
        if want is not None and got != want:
            raise ValueError(f"{name} must have shape {_spell(want_shape)}, got {tuple(shape)}")


def _spell(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


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


def same_scale(given, last) -> bool:
    """Whether expert_scale `given` is `last` to the kernels: same object, or same type, value and sign."""
    return given is last or (type(given) is type(last) and given == last
                             and bool(given or math.copysign(1, given) == math.copysign(1, last)))


def check_scale(value) -> float:
    """combine()'s expert_scale as the float32 the kernels use: finite, and not rounded to 0 unless 0."""
    if type(value) is float and value == 1.0:  # the default
        return 1.0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expert_scale must be a real number, not {_describe_type(value)}")
    try:
        as_f32 = struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # beyond float32 (or any float, for a huge int)
        as_f32 = math.inf
    if not math.isfinite(as_f32):
        raise ValueError(f"expert_scale={value!r} is not a finite float32")
    if as_f32 == 0.0 and value != 0:
        raise ValueError(f"expert_scale={value!r} is too small for float32 (it would be 0)")
    return as_f32
