"""The array boundary: whatever a caller passes becomes a kernel argument, in one pass.

Accepted: NumPy arrays (copied into the library's device staging), our own DeviceArray, and any device
array that speaks the CUDA array interface or DLPack (PyTorch, CuPy, JAX, Numba, ...; used in place).
One `Boundary` per AllToAll turns each argument into a device pointer: element type from the protocol
that describes it (the interface's `typestr`, DLPack's type code, a NumPy array's dtype; never a foreign
object's own `.dtype`), shape, C-contiguity, the device it lives on, and the producer's writes ordered
before the call's stream. Everything is checked on the calling rank before a kernel runs.

Which protocol, and how the producer is ordered (producer_order="protocol", the default):
- our DeviceArray: the stream it names is waited for on the device;
- an interface array that names a stream (version 3: CuPy, Numba): that stream is waited for on the
  device, read again at every call (CuPy names its current stream); `stream: None` means no wait;
- otherwise DLPack where the object has it (PyTorch's and JAX's interfaces name no stream): exported
  naming the reading stream, so the producer makes that stream wait for its pending writes;
- an interface array with neither (version 2 only): used as it is, with a warning: its producer cannot
  be waited for.
With producer_order="stream" the caller promises that every device input was written on the call's
stream or ordered before it, and no producer is asked.

Arrays seen before are not described again: the cache of each argument keeps the object itself (so its
address cannot be reused by another) and its description, which stands while what the protocol says
now matches it, or, for PyTorch, CuPy and JAX arrays, while their own attributes say the same pointer,
shape, strides and type (pyhipa2a.producers: their protocols cost tens of microseconds a call; the probe
asks the producer's current stream instead, which is what their protocols wait for). A new PyTorch,
CuPy or finished JAX array of an element type its protocol named before is described by its attributes
alone. `take` says whether a repeat of the call may take the same object again unasked (`Taken`).
"""
from __future__ import annotations

import math
import struct
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import dlpack, producers
from .array import DeviceArray
from .dtypes import ML_DTYPES, resolve

DLPACK_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 10: "rocm", 11: "rocm_host", 13: "cuda_managed"}

OWN, CAI, DLPACK, PROBED = "own", "cai", "dlpack", "probed"


@dataclass(frozen=True)
class Described:
    """One device argument as the kernels see it, and what a later use must find to trust it."""
    ptr: int
    shape: tuple
    dtype: np.dtype
    protocol: str            # OWN, CAI, DLPACK, or PROBED (its producer's probe alone: Boundary._from_probe)
    key: tuple               # what the protocol said (compared at a later use); PROBED: the probe's key
    keepalive: object = None  # a consumed DLPack capsule, a probe's hold: the producer's memory is ours until released


class Recheck(NamedTuple):
    """What a PyTorch, CuPy or JAX argument must still answer for a call on it to repeat without its
    protocol (pyhipa2a.producers): the key of its description, and the producer stream it named then
    (None: nothing to wait for)."""
    probe: object
    key: tuple
    stream: object


class Taken(NamedTuple):
    """An argument as a call takes it: its pointer, what keeps its memory ours while the device may read
    it, and whether a repeat of the call on the same object and stream may take it again unasked (our own
    array on the call's stream; anything under producer_order="stream"; a probed array whose `recheck`
    still holds, each repeat waiting for the producer stream `wait` where that is not the call's)."""
    ptr: int
    keep: object
    repeatable: bool
    recheck: Recheck | None = None
    wait: object = None  # the producer stream each repeat waits for, as its probe spells it (an int)


@dataclass(frozen=True)
class Cached:
    """An argument's last array and its description; with the producer's probe, the key it gave then
    and the stream the description's use was to run on, outside a capture (a DLPack export made that
    stream wait for the producer's writes: a JAX array, which never changes, needs no other wait
    on it, and a use on another stream waits for it)."""
    obj: object
    described: Described
    probe: object = None
    probe_key: tuple = ()
    ordered_on: object = None


def producer_stream(cai: dict) -> int | None:
    """The stream (a handle: 1 and 2 are CUDA's legacy and per-thread default streams) on which the
    producer of a __cuda_array_interface__ array queued its writes, or None when it needs no wait."""
    stream = cai.get("stream")
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int) or stream <= 0:
        # (0 is ambiguous, and the interface's version 3 forbids it)
        raise ValueError(f"__cuda_array_interface__ stream must be None or a stream handle, not {stream!r}")
    return stream


def _describe_type(obj) -> str:
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
    # The type's attributes first: hasattr on an instance evaluates a property, and PyTorch's
    # __cuda_array_interface__ property costs microseconds (then the instance, for objects that carry
    # the interface as an attribute of their own).
    kind = type(obj)
    if not (isinstance(obj, (np.ndarray, DeviceArray)) or hasattr(kind, "__dlpack__")
            or hasattr(kind, "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__")
            or hasattr(obj, "__dlpack__")):
        raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                        f"__dlpack__), not {_describe_type(obj)}")


def cai_dtype(typestr: str, want_dtype, name: str) -> np.dtype:
    """The element type an interface's typestr names. The interface cannot spell bfloat16 or fp8:
    producers write them as void of their size ('<V2', PyTorch and pyhipa2a for bfloat16), which
    is taken as the argument's required type when that is one of those, and refused otherwise."""
    dtype = np.dtype(typestr)
    if dtype.kind != "V":
        return dtype
    want = np.dtype(want_dtype)
    if want.name in ML_DTYPES and want.itemsize == dtype.itemsize:
        return want
    raise TypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} names no element type (a {dtype.itemsize}"
                    f"-byte void); {name} must be {want.name}")


def _read_cai(obj):
    """The interface's dict, or None when the object has none or refuses it for this array (JAX
    does for bfloat16): then DLPack describes it."""
    try:
        return obj.__cuda_array_interface__
    except Exception:  # AttributeError, or the producer's own refusal
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
    """The array boundary of one AllToAll: `take` turns an argument into a kernel pointer. `order` is the
    object's Streams (pyhipa2a.streams): device waits for producers go through it. `producer_order` is
    "protocol" or "stream" (module docstring)."""

    def __init__(self, backend, device_index: int, order, producer_order: str = "protocol"):
        self.backend, self.device_index, self.order = backend, device_index, order
        self.ask_producers = producer_order == "protocol"
        self._cache: dict[str, Cached] = {}
        self._checked: dict[str, tuple] = {}  # per argument: the last (shape, dtype, wants) that passed

    def take(self, name: str, obj, want_shape, want_dtype, stream, *, capturing: bool = False,
             stage_ptr: int | None = None, align: int = 1) -> Taken:
        """Argument `name` of shape `want_shape` (None: any) and dtype `want_dtype`, its data `align`-byte
        aligned, to be read on `stream`. NumPy arrays are copied into `stage_ptr` (refused when there is
        none, or while capturing); the keepalive must outlive the kernel's reads."""
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
        if not self.ask_producers:
            return Taken(d.ptr, keep, True)
        if d.protocol == OWN:
            return Taken(d.ptr, keep, producer is None or self.order.same_stream(producer, stream))
        recheck, wait = self._recheck(self._cache[name], obj, producer, stream)
        return Taken(d.ptr, keep, recheck is not None, recheck, wait)

    def _recheck(self, cached: Cached, obj, producer, stream):
        """(Recheck, wait) under which a probed argument settles: what its probe must answer at the next
        use, and the stream that use waits for (None: the call's own, or none); (None, None): it does
        not settle (no probe; a probe that raises or names another stream than the protocol did; or a
        JAX array used on another stream than its first export's, which names none to recheck)."""
        if cached.probe is None or not (producer is None or isinstance(producer, int)):
            return None, None
        try:
            named = cached.probe.stream(obj)  # (a first description's DLPack export: what it names from now on)
        except Exception:
            return None, None
        if producer is not None and named != producer:
            return None, None
        wait = None
        if named is not None and not self.order.same_stream(named, stream):
            if self.order.stream_of(self.order.runtime_handle(named)) is None:  # (a stream the backend cannot name)
                return None, None
            wait = named  # (spelled as the full path's producer, so that a call waits for it once: wait_for_producer)
        return Recheck(cached.probe, cached.probe_key, named), wait

    def describe(self, name: str, obj, want_dtype, stream, capturing: bool):
        """(description, producer) of a device array, from the cache when it still stands. The
        producer is what the use must wait for on the device: a stream of ours, a foreign stream
        handle, or None (nothing, or a DLPack export that ordered it already)."""
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
                # (a replaced entry's capsule lives until here: its call was queued)
                self._cache[name] = self._cached(obj, d, producer, None if capturing else stream)
        elif cached.described is not d:
            self._cache[name] = Cached(obj, d)
        if capturing or not self.ask_producers:
            return d, None  # a capture may not wait for work outside it; "stream": the caller vouches
        return d, producer

    def _probed(self, cached: Cached, obj, stream, capturing: bool):
        """(description, producer) from the probe, when its answers are still those of the cached
        description; (None, None): describe anew (a changed answer, a probe that raised, or a
        description made inside a capture, whose export ordered nothing)."""
        if cached.ordered_on is None and not capturing:
            return None, None
        try:
            if cached.probe.key(obj) != cached.probe_key:
                return None, None
            producer = None if capturing or not self.ask_producers else cached.probe.stream(obj)
        except Exception:
            return None, None
        if producer is None and not capturing and cached.ordered_on is not stream:
            producer = cached.ordered_on  # (a JAX array) its first export made that stream wait for it
        return cached.described, producer

    def _cached(self, obj, d: Described, producer, ordered_on) -> Cached:
        """The cache entry of a new description, with the producer's probe when it answers as the
        protocol did: the same pointer and shape, and, where the protocol named a stream, that one.
        None on the host backend (its arrays live in host memory, where no probe's stream means
        anything) and for an empty array (whose pointer producers spell differently)."""
        probe = producers.probe_for(obj) if d.protocol != OWN and self.backend.kind != "host" else None
        if probe is None or 0 in d.shape:
            return Cached(obj, d)
        named = d.protocol == CAI and self.ask_producers  # (a DLPack export orders itself, naming none)
        try:
            key = probe.key(obj)
            shape = tuple(key[1])
            agrees = (key[0] == d.ptr and shape == d.shape and (not named or probe.stream(obj) == producer)
                      and self._taught(probe, obj, d, key))
        except Exception:
            agrees = False
        if not agrees:
            producers.disown(obj)
            return Cached(obj, d)
        return Cached(obj, d, probe, key, ordered_on)

    def _taught(self, probe, obj, d: Described, key: tuple) -> bool:
        """Whether the probe's view of obj agrees with d, its protocol's description (our device, compact,
        `key`, the probe's key of obj); where it does, the probe learns d's element type for the library's type object
        in the key, so that the next array of that type is described by the view alone (_from_probe).
        A void typestr ('<V2': bfloat16 through the interface) names no type of its own: nothing learned."""
        if d.protocol == CAI and np.dtype(d.key[2]).kind == "V":
            return True
        seen = probe.view(obj)
        if seen is None:  # (a JAX array not yet finished: nothing to learn from it)
            return True
        viewed, device, compact = seen
        if viewed != key or device != self.device_index or not compact:
            return False
        return probe.element_types.setdefault(key[3], d.dtype) == d.dtype

    def _from_probe(self, obj, stream, capturing: bool):
        """(description, producer, cache entry) of an array described by its producer's probe alone (a
        PyTorch or CuPy array, or a finished JAX array, new to this argument or changed in place, whose
        view shows it on our device and compact, of an element type its protocol named before as the
        view saw it: _taught; with the probe's hold, where its arrays need one); None: ask its protocol,
        which also says what is wrong with it. The producer is the stream the probe names, which the use
        waits for on the device, as the protocol's export or interface would have it wait
        (pyhipa2a.producers)."""
        if self.backend.kind == "host":  # (its arrays live in host memory: no probe's stream means anything)
            return None
        probe = producers.probe_for(obj)
        key = None if probe is None else producers.view_here(probe, obj, self.device_index)
        if key is None:
            return None
        dtype, shape = probe.element_types.get(key[3]), tuple(key[1])
        if dtype is None or 0 in shape:
            return None
        try:
            producer = probe.stream(obj) if self.ask_producers and not capturing else None
            hold = None if probe.hold is None else probe.hold(obj)
        except Exception:  # (the protocol says what is wrong, if anything)
            return None
        d = Described(key[0], shape, dtype, PROBED, key, hold)
        return d, producer, Cached(obj, d, probe, key, None if capturing else stream)

    # -- a cached description, checked against what the protocol says now ----------------------
    def _still(self, name, d: Described, obj, want_dtype, stream, capturing):
        """(`d`, or `d` with this use's capsule, and the producer) when `d` still describes `obj`;
        (None, None): describe anew."""
        if d.protocol == OWN:
            return d, obj.stream  # our arrays never change their memory
        if not self.ask_producers:
            return d, None  # the caller vouches for the producer and for the memory
        if d.protocol == CAI:
            cai = _read_cai(obj)
            if cai is None or _cai_key(cai) != d.key:
                return None, None
            return d, producer_stream(cai)
        view = dlpack.view_from_object(obj, stream=self.order.dlpack_stream(stream, capturing))
        if _dlpack_key(view) != d.key:
            return self._from_dlpack(view, name, want_dtype), None  # checked afresh, from this export
        return Described(d.ptr, d.shape, d.dtype, DLPACK, d.key, view.keepalive), None

    # -- a first description -------------------------------------------------------------------
    def _describe(self, name: str, obj, want_dtype, stream, capturing):
        """(description, producer) of an array not seen in this argument before (or changed)."""
        backend = self.backend
        if isinstance(obj, DeviceArray):
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
            # Asking producers: export naming the reading stream (the producer orders itself before it).
            # Not asking: -1, "do not synchronize" (the caller vouches).
            exported_to = self.order.dlpack_stream(stream, capturing or not self.ask_producers)
            return self._from_dlpack(dlpack.view_from_object(obj, stream=exported_to), name, want_dtype), None
        raise TypeError(f"{name} must be a NumPy array or a device array (__cuda_array_interface__ or "
                        f"__dlpack__), not {_describe_type(obj)}")

    def _from_cai(self, cai: dict, name: str, want_dtype) -> Described:
        shape = tuple(cai["shape"])
        dtype = cai_dtype(cai["typestr"], want_dtype, name)
        if not _contiguous(shape, cai.get("strides"), dtype.itemsize):
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
        strides = None if view.strides is None else tuple(s * dtype.itemsize for s in view.strides)
        if not _contiguous(view.shape, strides, dtype.itemsize):
            raise ValueError(f"{name} must be C-contiguous (element strides {view.strides} for shape {view.shape})")
        return Described(view.ptr, tuple(view.shape), dtype, DLPACK, _dlpack_key(view), view.keepalive)


def _cai_key(cai: dict) -> tuple:
    return (cai["data"][0], tuple(cai["shape"]), cai["typestr"], cai.get("strides"))


def check_numpy_input(name: str, obj: np.ndarray, want_shape, want_dtype, capturing: bool) -> None:
    """A NumPy argument, which the call copies to the device: its shape, dtype and layout, and no
    capture (the copy would happen once while capturing, not at each launch of the graph)."""
    check_array(name, obj.shape, obj.dtype, want_shape, want_dtype)
    check_numpy(name, obj)
    if capturing:
        raise TypeError(f"inside capture(), {name} must be a device array: a NumPy array would be copied "
                        "once while capturing, not at each launch of the graph")


def check_array(name: str, shape, dtype, want_shape, want_dtype) -> None:
    """`want_shape` may hold None for a free dimension."""
    if dtype != want_dtype and np.dtype(dtype) != np.dtype(want_dtype):
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


def same_scale(given, last) -> bool:
    """Whether combine()'s expert_scale `given` is the scale `last` for the kernels: the same object, or
    the same value of the same type and sign (-0.0 == 0.0, but a product's sign follows the scale's)."""
    return given is last or (type(given) is type(last) and given == last
                             and bool(given or math.copysign(1, given) == math.copysign(1, last)))


def check_scale(value) -> float:
    """combine()'s expert_scale as the float32 the kernels multiply by: a finite real number that
    float32 holds, not rounded to 0 unless it is 0. In plain Python: it is checked at every call."""
    if type(value) is float and value == 1.0:  # the default, with nothing to check
        return 1.0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expert_scale must be a real number, not {_describe_type(value)}")
    try:
        as_f32 = struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # beyond float32 (or beyond any float, for a huge int)
        as_f32 = math.inf
    if not math.isfinite(as_f32):
        raise ValueError(f"expert_scale={value!r} is not a finite float32")
    if as_f32 == 0.0 and value != 0:
        raise ValueError(f"expert_scale={value!r} is too small for float32 (it would be 0)")
    return as_f32
