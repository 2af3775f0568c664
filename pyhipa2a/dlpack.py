"""DLPack in pure Python (ctypes and NumPy): `make_capsule` exports memory; `read_capsule` / `view_from_object`
import into a `DLPackView`.

Ownership (dlpack.h): the producer owns a `DLManagedTensor` until its `deleter` is called. A consumer takes it
by renaming the "dltensor" capsule to "used_dltensor" and then calls the deleter itself (our `keepalive`);
a capsule dropped unconsumed calls the deleter from its destructor."""
from __future__ import annotations

import ctypes
import datetime
import operator
import struct
import warnings
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "kDLCPU", "kDLCUDA", "kDLCUDAHost", "kDLROCM", "kDLROCMHost",
    "DLDevice", "DLDataType", "DLTensor", "DLManagedTensor", "DLPackVersion", "DLManagedTensorVersioned",
    "DLPackView", "make_capsule", "read_capsule", "view_from_object", "is_c_contiguous", "live_export_count",
]

# DLDeviceType values (dlpack.h) that pyhipa2a meets.
kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3   # pinned host memory
kDLROCM = 10
kDLROCMHost = 11  # pinned host memory


# The C structs of dlpack.h, field for field (the layout is the ABI).
class DLDevice(ctypes.Structure):
    # device_type is a C enum: an int, 4 bytes, on every ABI DLPack targets.
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements; NULL = compact row-major
        ("byte_offset", ctypes.c_uint64),
    ]


# void (*deleter)(DLManagedTensor *self), taking void* so one prototype serves both struct versions.
DLPackDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DLPackDeleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """DLPack >= 1.0 struct ("dltensor_versioned"), only for consumers that passed `max_version`."""
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DLPackDeleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_DLPACK_MAJOR = 1
_DLPACK_VERSION = (1, 0)  # the versioned struct we write: the 1.0 layout, no 1.1 dtypes
_FLAG_READ_ONLY = 1 << 0

# DLDataTypeCode values.
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool = 0, 1, 2, 4, 6

_NUMPY_TO_DLPACK = {np.dtype(f"{prefix}{bits}"): (code, bits)
                    for prefix, code, widths in (("float", kDLFloat, (16, 32, 64)), ("int", kDLInt, (8, 16, 32, 64)),
                                                 ("uint", kDLUInt, (8, 16, 32, 64)))
                    for bits in widths}
_NUMPY_TO_DLPACK[np.dtype(np.bool_)] = (kDLBool, 8)
# Element types NumPy has no dtype for, by the name ml_dtypes gives them (DLPack 1.1 codes for fp8).
_NAMED_TO_DLPACK = {"bfloat16": (kDLBfloat, 16), "float8_e4m3fn": (10, 8), "float8_e4m3fnuz": (11, 8),
                    "float8_e5m2": (12, 8), "float8_e5m2fnuz": (13, 8)}
# (code, bits) -> the NumPy dtype, or the ml_dtypes name of one NumPy lacks.
_DLPACK_TO_DTYPE = {code_bits: dt for dt, code_bits in [*_NUMPY_TO_DLPACK.items(), *_NAMED_TO_DLPACK.items()]}
_SUPPORTED_NAMES = ", ".join([dt.name for dt in _NUMPY_TO_DLPACK] + list(_NAMED_TO_DLPACK))


def _dlpack_dtype(dtype) -> tuple[int, int]:
    """(code, bits) for anything np.dtype accepts, or an ml_dtypes dtype or name (matched by name, unimported)."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name in _NAMED_TO_DLPACK:
        return _NAMED_TO_DLPACK[name]
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"DLPack export: unsupported dtype {dtype!r} (supported: {_SUPPORTED_NAMES})") from e
    if dt.name in _NAMED_TO_DLPACK:
        return _NAMED_TO_DLPACK[dt.name]
    if not dt.isnative:
        raise TypeError(f"DLPack export: dtype {dt.str!r} is not in native byte order; DLPack has no byte order")
    try:
        return _NUMPY_TO_DLPACK[dt]
    except KeyError:
        raise TypeError(f"DLPack export: unsupported dtype {dt.name!r} (supported: {_SUPPORTED_NAMES})") from None


def _numpy_dtype(dl: DLDataType) -> np.dtype | str:
    """The NumPy dtype for a DLDataType, or the ml_dtypes name ("bfloat16", ...) of one NumPy lacks."""
    if dl.lanes != 1:
        raise TypeError(f"DLPack import: vector dtypes (lanes={dl.lanes}) are not supported")
    try:
        return _DLPACK_TO_DTYPE[dl.code, dl.bits]
    except KeyError:
        raise TypeError(f"DLPack import: unsupported dtype (code={dl.code}, bits={dl.bits}); "
                        f"supported: {_SUPPORTED_NAMES}") from None


# Our own PYFUNCTYPE prototypes (GIL held, errors raised), not the process-wide ctypes.pythonapi.X.argtypes.
def _capi(name: str, restype, *argtypes):
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


# void destructor(PyObject *capsule), taking void*: a py_object would free the dying capsule a second time.
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_PyCapsule_New = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor)
_PyCapsule_IsValid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_PyCapsule_GetPointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_PyCapsule_GetName = _capi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
_PyCapsule_SetName = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
# The same two calls on a bare address, for use inside the destructor.
_PyCapsule_IsValid_at = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_PyCapsule_GetPointer_at = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_PyErr_Occurred = _capi("PyErr_Occurred", ctypes.c_void_p)
_Py_IncRef = _capi("Py_IncRef", None, ctypes.py_object)

# Calls a producer's deleter with the GIL held, as C consumers do: some deleters rely on it.
_call_deleter = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)

_CapsuleType = type(datetime.datetime_CAPI)  # types.CapsuleType exists only from 3.13

# A capsule stores its name as a bare char*: an extra reference keeps these bytes alive through shutdown.
_NAME = b"dltensor"
_USED_NAME = b"used_dltensor"
_VERSIONED_NAME = b"dltensor_versioned"
_USED_VERSIONED_NAME = b"used_dltensor_versioned"
for _name in (_NAME, _USED_NAME, _VERSIONED_NAME, _USED_VERSIONED_NAME):
    _Py_IncRef(_name)
del _name


# A C consumer may free our capsule or tensor with its exception set (NumPy's from_dlpack, rejecting a dtype),
# failing the callback's first C call. So each callback takes that exception, cleans up, and re-raises it
# for sys.unraisablehook: a ctypes callback cannot hand it back to the C caller.
def _take_pending_exception() -> BaseException | None:
    try:
        _PyErr_Occurred()
    except BaseException as exc:  # the exception the C caller had set
        return exc
    return None


def _report_pending(exc: BaseException | None) -> None:
    if exc is not None:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note("pyhipa2a.dlpack: this exception was in flight in C code that freed a DLPack capsule or "
                         "tensor; a ctypes callback cannot give it back, so it is reported here")
        raise exc


# Live exports by the address of their struct (what the deleter receives; also manager_ctx): what each keeps
# alive until its deleter runs, (the struct, its shape array, the owner).
_live_exports: dict[int, tuple] = {}


@DLPackDeleter
def _release_export(managed_addr):
    """The deleter of every make_capsule export; called from C, possibly on another thread."""
    pending = _take_pending_exception()
    # pop: a (buggy) second call must not raise inside C code.
    _live_exports.pop(managed_addr, None)
    _report_pending(pending)


@_CapsuleDestructor
def _destroy_capsule(capsule_addr):
    """PyCapsule destructor: a capsule nobody consumed (its name unchanged) frees its tensor."""
    pending = _take_pending_exception()
    for name, layout in ((_NAME, DLManagedTensor), (_VERSIONED_NAME, DLManagedTensorVersioned)):
        if _PyCapsule_IsValid_at(capsule_addr, name):
            managed_addr = _PyCapsule_GetPointer_at(capsule_addr, name)
            deleter = layout.from_address(managed_addr).deleter
            if deleter:
                _call_deleter(ctypes.cast(deleter, ctypes.c_void_p).value)(managed_addr)
            break
    _report_pending(pending)


# Keep the callbacks alive through shutdown, when a capsule may outlive this module's globals.
_Py_IncRef(_release_export)
_Py_IncRef(_destroy_capsule)


def _c_int(value, name: str, lo: int, hi: int) -> int:
    v = operator.index(value)
    if not lo <= v <= hi:
        raise ValueError(f"DLPack export: {name}={v} is out of range [{lo}, {hi}]")
    return v


_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64_MAX = (1 << 63) - 1


def make_capsule(ptr: int, shape: tuple[int, ...], dtype, device_type: int, device_id: int,
                 owner: object, *, max_version: tuple[int, int] | None = None):
    """A "dltensor" PyCapsule of compact row-major `shape` elements of `dtype` at `ptr` on (`device_type`,
    `device_id`), referencing `owner` until the deleter runs. A consumer `max_version` allowing 1.x gets
    "dltensor_versioned", which marks the memory writable (NumPy imports old-style capsules read-only)."""
    code, bits = _dlpack_dtype(dtype)
    dims = tuple(_c_int(d, "shape entry", 0, _INT64_MAX) for d in shape)
    versioned = max_version is not None and max_version[0] >= _DLPACK_MAJOR
    shape_array = (ctypes.c_int64 * len(dims))(*dims)
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*_DLPACK_VERSION)
        managed.flags = 0  # writable, not a copy
    else:
        managed = DLManagedTensor()
    tensor = managed.dl_tensor  # a view into `managed`
    tensor.data = _c_int(ptr, "ptr", 0, (1 << 64) - 1)
    tensor.device = DLDevice(_c_int(device_type, "device_type", *_INT32), _c_int(device_id, "device_id", *_INT32))
    tensor.ndim = len(dims)
    tensor.dtype = DLDataType(code, bits, 1)
    # A 0-d tensor gets NULL, as NumPy exports them.
    tensor.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64)) if dims else None
    tensor.strides = None
    tensor.byte_offset = 0
    key = ctypes.addressof(managed)
    managed.manager_ctx = key
    managed.deleter = _release_export
    _live_exports[key] = (managed, shape_array, owner)
    try:
        return _PyCapsule_New(key, _VERSIONED_NAME if versioned else _NAME, _destroy_capsule)
    except BaseException:
        del _live_exports[key]
        raise


def live_export_count() -> int:
    """How many make_capsule exports have not been released yet (for leak checks)."""
    return len(_live_exports)


class _ConsumedTensor:
    """`DLPackView.keepalive`: calls the producer's deleter exactly once, when released or collected."""
    __slots__ = ("capsule", "_managed_addr", "_deleter_addr")

    def __init__(self, capsule, managed_addr: int, deleter_addr: int | None):
        self.capsule = capsule
        self._managed_addr = managed_addr
        self._deleter_addr = deleter_addr

    def release(self) -> None:
        """Hand the memory back to the producer now. Any view of it dangles afterwards."""
        deleter_addr, self._deleter_addr = self._deleter_addr, None
        if deleter_addr:
            _call_deleter(deleter_addr)(self._managed_addr)

    def __del__(self):
        self.release()


@dataclass(frozen=True)
class DLPackView:
    """A consumed DLPack tensor, valid while `keepalive` is referenced. `ptr` includes byte_offset; `strides`
    are in elements (None: compact row-major); `dtype` is a NumPy dtype or an ml_dtypes name."""
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dtype: np.dtype | str
    device_type: int
    device_id: int
    keepalive: _ConsumedTensor = field(repr=False, compare=False)
    readonly: bool = False


# The structs as flat layouts, read in one unpack: ctypes field access costs microseconds a capsule.
_MANAGED = struct.Struct("=QiiiBBHQQQQQ")            # DLManagedTensor: dl_tensor, manager_ctx, deleter
_VERSIONED = struct.Struct("=IIQQQQiiiBBHQQQ")       # DLManagedTensorVersioned: version, ctx, deleter, flags, dl_tensor
assert _MANAGED.size == ctypes.sizeof(DLManagedTensor) and _VERSIONED.size == ctypes.sizeof(DLManagedTensorVersioned)


def read_capsule(capsule) -> DLPackView:
    """Consume a "dltensor" (or "dltensor_versioned") capsule. It is renamed only once everything checked out:
    a rejected capsule stays unconsumed, so its destructor returns the tensor to the producer."""
    if type(capsule) is not _CapsuleType:
        raise TypeError(f"expected a DLPack PyCapsule, got {type(capsule).__name__}")
    if _PyCapsule_IsValid(capsule, _NAME):
        name, used_name = _NAME, _USED_NAME
    elif _PyCapsule_IsValid(capsule, _VERSIONED_NAME):
        name, used_name = _VERSIONED_NAME, _USED_VERSIONED_NAME
    else:
        got = _PyCapsule_GetName(capsule)
        if got in (_USED_NAME, _USED_VERSIONED_NAME):
            raise ValueError("this DLPack capsule was already consumed (a capsule can be read only once)")
        raise TypeError(f"not a DLPack capsule: its name is {got!r}, expected {_NAME!r}")

    managed_addr = _PyCapsule_GetPointer(capsule, name)
    readonly = False
    if name == _VERSIONED_NAME:
        (major, minor, _, deleter_addr, flags, data, device_type, device_id, ndim, code, bits, lanes, shape_ptr,
         strides_ptr, byte_offset) = _VERSIONED.unpack(ctypes.string_at(managed_addr, _VERSIONED.size))
        if major != _DLPACK_MAJOR:
            raise BufferError(f"DLPack {major}.{minor} capsule; this reader understands {_DLPACK_MAJOR}.x")
        readonly = bool(flags & _FLAG_READ_ONLY)
    else:
        (data, device_type, device_id, ndim, code, bits, lanes, shape_ptr, strides_ptr, byte_offset, _,
         deleter_addr) = _MANAGED.unpack(ctypes.string_at(managed_addr, _MANAGED.size))
    dtype = _numpy_dtype(DLDataType(code, bits, lanes))
    if ndim < 0 or (ndim > 0 and not shape_ptr):
        raise BufferError(f"malformed DLTensor: ndim={ndim} with shape pointer {'set' if shape_ptr else 'NULL'}")
    shape = struct.unpack(f"={ndim}q", ctypes.string_at(shape_ptr, 8 * ndim)) if ndim else ()
    strides = struct.unpack(f"={ndim}q", ctypes.string_at(strides_ptr, 8 * ndim)) if (ndim and strides_ptr) else None

    _PyCapsule_SetName(capsule, used_name)
    keepalive = _ConsumedTensor(capsule, managed_addr, deleter_addr or None)
    return DLPackView(ptr=data + byte_offset, shape=shape, strides=strides, dtype=dtype,
                      device_type=device_type, device_id=device_id, keepalive=keepalive, readonly=readonly)


def view_from_object(obj, stream=None) -> DLPackView:
    """read_capsule(obj.__dlpack__()), passing `stream` when given (retried without it where rejected);
    a bare capsule (old `to_dlpack()` style) is read as it is."""
    if type(obj) is _CapsuleType:
        return read_capsule(obj)
    if stream is None:
        capsule = obj.__dlpack__()
    else:
        try:
            capsule = obj.__dlpack__(stream=stream)
        except TypeError:
            # An exporter older than the stream keyword cannot order its writes before our stream.
            warnings.warn(f"{type(obj).__name__}.__dlpack__ takes no stream=: pyhipa2a cannot wait for its "
                          "producer's writes; synchronize them before the call", RuntimeWarning, stacklevel=4)
            capsule = obj.__dlpack__()
    return read_capsule(capsule)


def is_c_contiguous(view: DLPackView) -> bool:
    """True when the view's elements are compact row-major (dims of size 1 may carry any stride)."""
    return row_major(view.shape, view.strides)


def row_major(shape, strides, unit: int = 1) -> bool:
    """Whether `strides` (None: compact), counted in elements of `unit` bytes each (or in bytes, with the
    element's size as `unit`), step compact row-major elements; dims of size 1 may carry any stride, and an
    empty array any strides."""
    if strides is None or 0 in shape:
        return True
    expected = unit
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True
