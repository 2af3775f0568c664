"""pyhipa2a.dlpack: DLPack producer and consumer, checked against NumPy's own DLPack (no GPU needed)."""
import ctypes
import datetime
import gc
import sys
import threading
import types
import weakref

import numpy as np
import pytest

from pyhipa2a import dlpack


class Exporter:
    """Exposes a NumPy array's memory through make_capsule, the way a device array would."""

    def __init__(self, arr, dtype=None):
        self.arr = arr
        self.dtype = arr.dtype if dtype is None else dtype

    def __dlpack__(self, stream=None):
        return dlpack.make_capsule(self.arr.ctypes.data, self.arr.shape, self.dtype, dlpack.kDLCPU, 0,
                                   owner=self.arr)

    def __dlpack_device__(self):
        return (dlpack.kDLCPU, 0)


class KeywordExporter(Exporter):
    """Full modern signature, like pyhipa2a.array.DeviceArray (NumPy passes max_version etc.)."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return dlpack.make_capsule(self.arr.ctypes.data, self.arr.shape, self.dtype, dlpack.kDLCPU, 0,
                                   owner=self.arr, max_version=max_version)


class Owner:
    """Something weakref-able that stands for a device allocation."""


@pytest.fixture(autouse=True)
def no_leaked_exports():
    gc.collect()
    before = dlpack.live_export_count()
    yield
    gc.collect()
    assert dlpack.live_export_count() == before


def test_struct_layout_matches_dlpack_h():
    assert ctypes.sizeof(dlpack.DLDevice) == 8
    assert ctypes.sizeof(dlpack.DLDataType) == 4
    assert ctypes.sizeof(dlpack.DLTensor) == 48
    assert ctypes.sizeof(dlpack.DLManagedTensor) == 64
    assert ctypes.sizeof(dlpack.DLManagedTensorVersioned) == 80
    assert (dlpack.kDLCPU, dlpack.kDLCUDA, dlpack.kDLROCM) == (1, 2, 10)


@pytest.mark.parametrize("exporter", [Exporter, KeywordExporter])
def test_numpy_from_dlpack_shares_memory(exporter):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.from_dlpack(exporter(a))
    assert b.shape == a.shape and b.dtype == a.dtype
    np.testing.assert_array_equal(a, b)
    assert b.ctypes.data == a.ctypes.data
    a[1, 2, 3] = -5.0
    assert b[1, 2, 3] == -5.0
    if b.flags.writeable:
        b[0, 0, 0] = 42.0
        assert a[0, 0, 0] == 42.0


def test_versioned_export_is_writable_through_numpy():
    """NumPy asks for DLPack 1.x; a versioned capsule tells it the memory is writable."""
    a = np.arange(6, dtype=np.int32)
    b = np.from_dlpack(KeywordExporter(a))
    assert b.flags.writeable
    b[2] = 99
    assert a[2] == 99
    capsule = KeywordExporter(a).__dlpack__(max_version=(1, 0))
    assert dlpack._PyCapsule_IsValid(capsule, b"dltensor_versioned")
    v = dlpack.read_capsule(capsule)
    assert (v.ptr, v.shape, v.strides, v.dtype, v.readonly) == (a.ctypes.data, (6,), None, a.dtype, False)
    assert dlpack._PyCapsule_IsValid(capsule, b"used_dltensor_versioned")
    legacy = KeywordExporter(a).__dlpack__(max_version=None)
    assert dlpack._PyCapsule_IsValid(legacy, b"dltensor")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                   "uint8", "uint16", "uint32", "uint64", "bool"])
def test_numpy_round_trip_every_dtype(dtype):
    a = (np.arange(10) % 3).astype(dtype)
    b = np.from_dlpack(Exporter(a))
    assert b.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 5)])
def test_numpy_round_trip_odd_shapes(shape):
    a = np.ones(shape, dtype=np.int32)
    b = np.from_dlpack(Exporter(a))
    assert b.shape == shape
    np.testing.assert_array_equal(a, b)


def test_read_numpy_capsule_contiguous():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    v = dlpack.read_capsule(a.__dlpack__())
    assert v.ptr == a.ctypes.data
    assert v.shape == (3, 4)
    assert v.strides in (None, (4, 1))
    assert v.dtype == np.dtype(np.int64)
    assert (v.device_type, v.device_id) == (dlpack.kDLCPU, 0)
    assert not v.readonly
    assert dlpack.is_c_contiguous(v)


def test_read_numpy_capsule_strided_slice():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    s = a[:, ::2]
    v = dlpack.read_capsule(s.__dlpack__())
    assert v.ptr == s.ctypes.data
    assert v.shape == (4, 3)
    assert v.strides == (6, 2)
    assert v.dtype == np.dtype(np.float32)
    assert not dlpack.is_c_contiguous(v)
    # The view really addresses the slice's elements.
    buf = (ctypes.c_float * (v.shape[0] * v.strides[0])).from_address(v.ptr)
    assert buf[v.strides[0] * 2 + v.strides[1] * 1] == s[2, 1]


def test_read_versioned_numpy_capsule_and_readonly_flag():
    a = np.arange(6, dtype=np.uint8)
    a.flags.writeable = False
    try:
        capsule = a.__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip("this NumPy has no versioned DLPack")
    v = dlpack.read_capsule(capsule)
    assert v.ptr == a.ctypes.data and v.shape == (6,) and v.dtype == np.dtype(np.uint8)
    assert v.readonly


def test_consumer_calls_numpy_deleter_once():
    a = np.arange(8.0)
    s = a[::2]
    refs = sys.getrefcount(s)
    v = dlpack.read_capsule(s.__dlpack__())
    assert sys.getrefcount(s) == refs + 1  # NumPy's DLManagedTensor holds the slice
    alive = weakref.ref(s)
    del s
    assert alive() is not None
    del v
    gc.collect()
    assert alive() is None


def test_foreign_deleter_called_exactly_once():
    """A hand-built DLManagedTensor with a counting deleter, consumed through read_capsule."""
    calls = []

    @dlpack.DLPackDeleter
    def counting_deleter(addr):
        calls.append(addr)

    data = (ctypes.c_float * 4)(1, 2, 3, 4)
    shape = (ctypes.c_int64 * 1)(4)
    managed = dlpack.DLManagedTensor()
    managed.dl_tensor.data = ctypes.addressof(data)
    managed.dl_tensor.device = dlpack.DLDevice(dlpack.kDLROCM, 3)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = dlpack.DLDataType(2, 32, 1)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 4
    managed.deleter = counting_deleter
    new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
        ("PyCapsule_New", ctypes.pythonapi))
    capsule = new(ctypes.addressof(managed), b"dltensor", None)

    v = dlpack.read_capsule(capsule)
    assert v.ptr == ctypes.addressof(data) + 4  # byte_offset folded in
    assert (v.shape, v.strides, v.dtype) == ((4,), None, np.dtype(np.float32))
    assert (v.device_type, v.device_id) == (dlpack.kDLROCM, 3)
    assert calls == []
    v.keepalive.release()
    v.keepalive.release()  # idempotent
    assert calls == [ctypes.addressof(managed)]
    del v, capsule
    gc.collect()
    assert len(calls) == 1


def test_owner_lives_until_numpy_consumer_releases():
    owner_arr = np.arange(6, dtype=np.int32)
    alive = weakref.ref(owner_arr)
    b = np.from_dlpack(Exporter(owner_arr))
    before = dlpack.live_export_count()
    del owner_arr
    gc.collect()
    assert alive() is not None  # held by the export
    np.testing.assert_array_equal(b, np.arange(6))
    del b
    gc.collect()
    assert alive() is None
    assert dlpack.live_export_count() == before - 1


def test_own_round_trip_deleter_runs_once():
    data = np.arange(5, dtype=np.float64)
    owner = Owner()
    alive = weakref.ref(owner)
    base = dlpack.live_export_count()
    capsule = dlpack.make_capsule(data.ctypes.data, data.shape, data.dtype, dlpack.kDLCPU, 0, owner)
    del owner
    assert dlpack.live_export_count() == base + 1
    v = dlpack.read_capsule(capsule)
    assert v.ptr == data.ctypes.data and v.shape == (5,) and v.strides is None and v.dtype == data.dtype
    del capsule  # consumed: dropping the capsule must not free anything
    gc.collect()
    assert alive() is not None and dlpack.live_export_count() == base + 1
    v.keepalive.release()
    assert dlpack.live_export_count() == base
    v.keepalive.release()
    del v
    gc.collect()
    assert alive() is None and dlpack.live_export_count() == base


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_unconsumed_capsule_frees_owner(versioned):
    """A capsule nobody consumed keeps its owner alive, and frees it when the capsule goes."""
    owner = Owner()
    alive = weakref.ref(owner)
    if versioned:
        capsule = dlpack.make_capsule(0x1000, (2,), np.float16, dlpack.kDLCPU, 0, owner, max_version=(1, 1))
    else:
        capsule = dlpack.make_capsule(0x1000, (2, 2), np.float32, dlpack.kDLROCM, 1, owner=owner)
    del owner
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_rejected_capsule_stays_unconsumed_and_is_freed():
    a = np.zeros(3, dtype=np.complex64)  # NumPy exports it; we do not read complex
    refs = sys.getrefcount(a)
    capsule = a.__dlpack__()
    with pytest.raises(TypeError, match="unsupported dtype"):
        dlpack.read_capsule(capsule)
    assert dlpack._PyCapsule_GetName(capsule) == b"dltensor"
    del capsule
    gc.collect()
    assert sys.getrefcount(a) == refs


def test_bfloat16_round_trip():
    owner = Owner()
    capsule = dlpack.make_capsule(0x2000, (4, 8), "bfloat16", dlpack.kDLCUDA, 0, owner)
    managed = dlpack.DLManagedTensor.from_address(dlpack._PyCapsule_GetPointer(capsule, b"dltensor"))
    dt = managed.dl_tensor.dtype
    assert (dt.code, dt.bits, dt.lanes) == (4, 16, 1)
    v = dlpack.read_capsule(capsule)
    assert v.dtype == "bfloat16"
    assert (v.shape, v.device_type, v.ptr) == ((4, 8), dlpack.kDLCUDA, 0x2000)


def test_bfloat16_from_dtype_like_object():
    """ml_dtypes' bfloat16 dtype is recognised by its name (ml_dtypes itself is optional)."""
    fake = types.SimpleNamespace(name="bfloat16")
    v = dlpack.read_capsule(dlpack.make_capsule(0x10, (3,), fake, dlpack.kDLCPU, 0, None))
    assert v.dtype == "bfloat16"
    ml_dtypes = pytest.importorskip("ml_dtypes")
    v = dlpack.read_capsule(dlpack.make_capsule(0x10, (3,), np.dtype(ml_dtypes.bfloat16), dlpack.kDLCPU, 0, None))
    assert v.dtype == "bfloat16"


@pytest.mark.parametrize("bad", [np.complex64, "float128", object, "U4", np.dtype(">f4"), "bf16x"])
def test_unknown_dtype_raises_type_error(bad):
    try:
        np.dtype(bad)
    except TypeError:
        pass
    with pytest.raises(TypeError, match="DLPack export: .*dtype"):
        dlpack.make_capsule(0x10, (2,), bad, dlpack.kDLCPU, 0, None)


def test_bad_arguments():
    with pytest.raises(ValueError):
        dlpack.make_capsule(0x10, (2, -1), np.float32, dlpack.kDLCPU, 0, None)
    with pytest.raises(ValueError):
        dlpack.make_capsule(-1, (2,), np.float32, dlpack.kDLCPU, 0, None)
    with pytest.raises(TypeError):
        dlpack.make_capsule(0x10, (2.5,), np.float32, dlpack.kDLCPU, 0, None)


def test_read_capsule_rejects_non_dlpack():
    with pytest.raises(TypeError, match="PyCapsule"):
        dlpack.read_capsule(object())
    with pytest.raises(TypeError, match="not a DLPack capsule"):
        dlpack.read_capsule(datetime.datetime_CAPI)
    capsule = np.arange(3).__dlpack__()
    v = dlpack.read_capsule(capsule)
    with pytest.raises(ValueError, match="already consumed"):
        dlpack.read_capsule(capsule)
    assert v.keepalive.capsule is capsule


def test_view_from_object_stream_handling():
    a = np.arange(4, dtype=np.int16)
    seen = []

    class NoKeyword(Exporter):
        def __dlpack__(self):
            seen.append("plain")
            return super().__dlpack__()

    class WithStream(Exporter):
        def __dlpack__(self, stream=None):
            seen.append(stream)
            return super().__dlpack__()

    assert dlpack.view_from_object(NoKeyword(a)).ptr == a.ctypes.data
    with pytest.warns(RuntimeWarning, match="NoKeyword.__dlpack__ takes no stream=: pyhipa2a cannot wait"):
        assert dlpack.view_from_object(NoKeyword(a), stream=7).shape == (4,)
    assert seen == ["plain", "plain"]
    seen.clear()
    dlpack.view_from_object(WithStream(a))
    dlpack.view_from_object(WithStream(a), stream=7)
    assert seen == [None, 7]
    v = dlpack.view_from_object(a)  # NumPy arrays themselves
    assert v.ptr == a.ctypes.data and v.dtype == np.dtype(np.int16)


def test_is_c_contiguous():
    def view(shape, strides):
        return dlpack.DLPackView(ptr=0, shape=shape, strides=strides, dtype=np.dtype(np.float32),
                                 device_type=1, device_id=0, keepalive=None)

    assert dlpack.is_c_contiguous(view((3, 4), None))
    assert dlpack.is_c_contiguous(view((3, 4), (4, 1)))
    assert not dlpack.is_c_contiguous(view((3, 4), (1, 3)))
    assert not dlpack.is_c_contiguous(view((3, 4), (8, 2)))
    assert dlpack.is_c_contiguous(view((1, 4), (999, 1)))  # size-1 dims ignore strides
    assert dlpack.is_c_contiguous(view((3, 1, 4), (4, 0, 1)))
    assert dlpack.is_c_contiguous(view((), ()))
    assert dlpack.is_c_contiguous(view((0, 4), (7, 7)))


def test_release_from_another_thread():
    owner = Owner()
    alive = weakref.ref(owner)
    v = dlpack.read_capsule(dlpack.make_capsule(0x100, (1,), np.uint8, dlpack.kDLCPU, 0, owner))
    del owner
    t = threading.Thread(target=v.keepalive.release)
    t.start()
    t.join()
    gc.collect()
    assert alive() is None


def test_capsule_dropped_by_c_code_with_exception_set(monkeypatch):
    """NumPy rejects a ROCm tensor and drops our capsule while its own exception is set.

    A ctypes callback cannot hand that exception back to NumPy (the caller ends
    up with a SystemError), but the export must still be freed and the original
    exception reported through sys.unraisablehook, not silently lost."""

    class LyingAboutDevice(Exporter):
        def __dlpack__(self, stream=None):
            return dlpack.make_capsule(self.arr.ctypes.data, self.arr.shape, self.dtype, dlpack.kDLROCM, 0,
                                       owner=self.arr)

        def __dlpack_device__(self):
            return (dlpack.kDLCPU, 0)  # so NumPy goes as far as reading the capsule

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    owner_arr = np.zeros(4, dtype=np.float32)
    alive = weakref.ref(owner_arr)
    with pytest.raises(Exception):
        np.from_dlpack(LyingAboutDevice(owner_arr))
    assert len(reported) == 1
    assert "device" in str(reported[0])
    if sys.version_info >= (3, 11):
        assert any("pyhipa2a.dlpack" in note for note in reported[0].__notes__)
    del owner_arr
    gc.collect()
    assert alive() is None


def test_many_capsules_do_not_leak():
    base = dlpack.live_export_count()
    a = np.zeros(4, dtype=np.float32)
    for _ in range(10000):
        dlpack.make_capsule(a.ctypes.data, a.shape, a.dtype, dlpack.kDLCPU, 0, a)
    assert dlpack.live_export_count() == base
    for _ in range(10000):
        dlpack.read_capsule(dlpack.make_capsule(a.ctypes.data, a.shape, a.dtype, dlpack.kDLCPU, 0, a))
    gc.collect()
    assert dlpack.live_export_count() == base
    views = [np.from_dlpack(Exporter(a)) for _ in range(1000)]
    assert dlpack.live_export_count() == base + 1000
    del views
    gc.collect()
    assert dlpack.live_export_count() == base
    assert sys.getrefcount(a) == 2
