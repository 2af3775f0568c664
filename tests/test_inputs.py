"""The array boundary (pyhipa2a.inputs) with fake producers: no GPU needed.

The fakes mimic what each library hands over, as seen on the H200 machine:
PyTorch (a dtype object NumPy cannot read, a version-2 interface with no
stream, typestr '<V2' for bfloat16, DLPack that orders itself on the stream
it is given), JAX (DLPack only here; versioned or unversioned capsules) and
CuPy (a version-3 interface naming the stream it last wrote on).
"""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from pyhipa2a import dlpack
from pyhipa2a.array import DeviceArray
from pyhipa2a.dtypes import bfloat16
from pyhipa2a.errors import A2ATimeoutError, Health
from pyhipa2a.inputs import Boundary, check_scale, producer_stream
from pyhipa2a.ordering import StreamOrder

OURS = 0x5000  # the stream the calls run on


class FakeCuda:
    """The backend calls the boundary makes, recorded."""
    kind, dlpack_device_type, current_device = "cuda", 2, 0

    def __init__(self):
        self.waits, self.pointer_queries = [], 0

    def pointer_device(self, ptr):
        self.pointer_queries += 1
        return 0

    def stream_handle(self, stream):
        return 0 if stream is None else int(stream)

    def activate(self):  # one device, one context: nothing to switch
        pass

    def stream_from_handle(self, handle):
        return handle

    def stream_wait_stream(self, waiter, producer):
        if self.stream_handle(waiter) != self.stream_handle(producer):
            self.waits.append((self.stream_handle(producer), self.stream_handle(waiter)))


class Unreadable:
    """A dtype object as torch's: np.dtype() cannot read it, and the boundary must not try."""

    def __getattr__(self, name):
        raise AssertionError("the boundary read a foreign object's own dtype")


class TorchLike:
    def __init__(self, ptr, shape, dtype="float16"):
        self.ptr, self.shape, self.np_dtype = ptr, shape, np.dtype(bfloat16() if dtype == "bfloat16" else dtype)
        self.asked, self.cai_reads = [], 0

    @property
    def dtype(self):
        return Unreadable()

    @property
    def __cuda_array_interface__(self):
        self.cai_reads += 1
        typestr = "<V2" if self.np_dtype.name == "bfloat16" else self.np_dtype.str
        return {"typestr": typestr, "shape": self.shape, "strides": None, "data": (self.ptr, False), "version": 2}

    def __dlpack_device__(self):
        return (2, getattr(self, "device", 0))

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(stream)
        return dlpack.make_capsule(self.ptr, self.shape, self.np_dtype, 2, getattr(self, "device", 0), owner=self)


class JaxLike:
    def __init__(self, ptr, shape, dtype="float16", versioned=False):
        self.ptr, self.shape, self.np_dtype, self.versioned = ptr, shape, np.dtype(dtype), versioned
        self.asked = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(stream)
        return dlpack.make_capsule(self.ptr, self.shape, self.np_dtype, 2, 0, owner=self,
                                   max_version=(1, 0) if self.versioned else None)


class CupyLike:
    def __init__(self, ptr, shape, typestr="<f2", stream=1):
        self.cai = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3, "strides": None,
                    "stream": stream}

    @property
    def __cuda_array_interface__(self):
        return dict(self.cai)


def take_in_call(b, name, obj, shape, dtype, stream=OURS):
    """One call's use of `obj` as argument `name`: the call starts (its producers are waited for
    afresh: StreamOrder.follow), then takes it."""
    b.order.follow(stream)
    return b.take(name, obj, shape, dtype, stream)


def boundary(order="protocol"):
    backend = FakeCuda()
    return Boundary(backend, 0, StreamOrder(backend, OURS), order), backend


def test_torch_tensors_are_described_by_dlpack_and_ordered_by_their_export():
    b, backend = boundary()
    for dtype in ("float16", "bfloat16"):
        t = TorchLike(0x1000, (2, 4), dtype)
        want = bfloat16() if dtype == "bfloat16" else np.float16
        for _ in range(3):
            ptr, keep = b.take("x", t, (2, 4), want, OURS)
            assert ptr == 0x1000 and keep is not t  # the consumed capsule keeps the tensor's memory
        assert t.asked == [OURS] * 3  # exported at every call, naming the reading stream
    assert backend.waits == [] and backend.pointer_queries == 0


def test_torch_tensors_with_producer_order_stream_cost_nothing_once_seen():
    b, backend = boundary("stream")
    t = TorchLike(0x1000, (2, 4), "bfloat16")  # typestr '<V2': the interface cannot spell bfloat16
    for _ in range(3):
        assert b.take("x", t, (2, 4), bfloat16(), OURS)[0] == 0x1000
    assert t.cai_reads == 1 and t.asked == [] and backend.waits == []
    with pytest.raises(TypeError, match="names no element type"):  # '<V2' is not float16
        boundary("stream")[0].take("x", TorchLike(0x1000, (2, 4), "bfloat16"), (2, 4), np.float16, OURS)


@pytest.mark.parametrize("versioned", [False, True])
def test_jax_arrays_through_dlpack_only(versioned):
    b, backend = boundary()
    a = JaxLike(0x2000, (3, 8), "int32", versioned)
    assert b.take("indices", a, (3, 8), np.int32, OURS)[0] == 0x2000
    a.ptr = 0x2400  # new memory behind the same object: described again from the new export
    assert b.take("indices", a, (3, 8), np.int32, OURS)[0] == 0x2400
    assert a.asked == [OURS, OURS]
    with pytest.raises(TypeError, match="must have dtype float32"):
        b.take("weights", a, (3, 8), np.float32, OURS)


def test_cupy_arrays_wait_for_the_stream_they_name_at_each_call():
    b, backend = boundary()
    a = CupyLike(0x3000, (2, 4), stream=7)
    b.take("x", a, (2, 4), np.float16, OURS)
    b.take("w", CupyLike(0x3800, (2, 4), stream=7), (2, 4), np.float16, OURS)  # same producer, same call
    b.order.follow(OURS)
    a.cai["stream"] = 9  # CuPy names its current stream: read again at every use
    b.take("x", a, (2, 4), np.float16, OURS)
    b.order.follow(OURS)
    a.cai["stream"] = None  # "no synchronization needed"
    b.take("x", a, (2, 4), np.float16, OURS)
    b.order.follow(OURS)
    a.cai["stream"] = OURS  # written on the call's own stream: in order already
    b.take("x", a, (2, 4), np.float16, OURS)
    assert backend.waits == [(7, OURS), (9, OURS)]  # once a call for a producer
    assert backend.pointer_queries == 2  # the device check ran once an array: x's description stood


def test_the_cache_never_mistakes_one_array_for_another():
    b, backend = boundary()
    first, second = CupyLike(0x4000, (2, 4)), CupyLike(0x4000, (4, 2))  # one address, two arrays
    b.take("x", first, (2, 4), np.float16, OURS)
    with pytest.raises(ValueError, match=r"must have shape \(2, 4\), got \(4, 2\)"):
        b.take("x", second, (2, 4), np.float16, OURS)
    first.cai["typestr"] = "<i4"  # the same object now says another type: described again
    with pytest.raises(TypeError, match="must have dtype float16, got int32"):
        b.take("x", first, (2, 4), np.float16, OURS)
    first.cai["typestr"], first.cai["shape"] = "<f2", (1, 4)
    with pytest.raises(ValueError, match=r"got \(1, 4\)"):
        b.take("x", first, (2, 4), np.float16, OURS)
    assert backend.pointer_queries == 4  # every array, and every change, described afresh


def test_interface_without_stream_or_dlpack_warns_once():
    class NumbaV2:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0x10, False), "version": 2}
    b, _ = boundary()
    with pytest.warns(RuntimeWarning, match="cannot wait for its producer"):
        b.take("weights", NumbaV2(), (2,), np.float32, OURS)


def test_producer_stream_as_the_interface_names_it():
    assert producer_stream({}) is None                      # version 2: no stream key
    assert producer_stream({"stream": None}) is None        # "no synchronization needed"
    assert producer_stream({"stream": 1}) == 1              # the legacy default stream
    for bad in ("7", True, -1, 0, 1.5):  # 0 is ambiguous: version 3 forbids it
        with pytest.raises(ValueError, match="stream must be None or a stream handle"):
            producer_stream({"stream": bad})


def test_our_outputs_hand_over_on_the_device_and_refuse_after_a_failure():
    backend = FakeCuda()
    status = np.zeros(4, np.uint32)
    out = DeviceArray(backend, 0x9000, (2, 4), np.float16, stream=OURS, health=Health(status, rank=0))
    out.__dlpack__(stream=0x77)   # the consumer's stream waits for ours, on the device
    out.__dlpack__(stream=None)   # DLPack's None: the legacy default stream (1)
    out.__dlpack__(stream=-1)     # "do not synchronize"
    assert backend.waits == [(OURS, 0x77), (OURS, 1)]
    status[:] = (1, 1, 1, 0)      # a kernel reported: timed out waiting for rank 1
    for read in (lambda: out.__dlpack__(stream=0x77), lambda: out.__cuda_array_interface__):
        with pytest.raises(A2ATimeoutError, match="rank 1 never arrived"):
            read()
    assert backend.waits == [(OURS, 0x77), (OURS, 1)]


def test_expert_scale_is_checked_as_the_float32_the_kernels_use():
    assert check_scale(1.0) == 1.0 and check_scale(2) == 2.0 and check_scale(np.float16(1.5)) == 1.5
    assert check_scale(0) == 0.0 and check_scale(-3.25) == -3.25
    assert check_scale(0.1) == float(np.float32(0.1))  # what the kernel multiplies by
    for bad in (True, np.bool_(False), "2", None, 1j, np.array([1.0])):
        with pytest.raises(TypeError, match="expert_scale must be a real number"):
            check_scale(bad)
    for bad in (float("nan"), float("inf"), -1e39, 10**400):
        with pytest.raises(ValueError, match="is not a finite float32"):
            check_scale(bad)
    with pytest.raises(ValueError, match="too small for float32"):
        check_scale(1e-46)


def test_a_settled_array_is_taken_again_only_for_the_same_use():
    """The fast path of a loop (the same array again) holds only while nothing about the use changed:
    a producer on another stream is waited for at every use, a new stream or shape is looked at anew."""
    b, backend = boundary()
    mine = DeviceArray(backend, 0x6000, (2, 4), np.float16, stream=OURS)
    elsewhere = DeviceArray(backend, 0x7000, (2, 4), np.float16, stream=0x77)
    for _ in range(3):
        assert take_in_call(b, "x", mine, (2, 4), np.float16)[0] == 0x6000
        assert b.take("y", elsewhere, (2, 4), np.float16, OURS)[0] == 0x7000
    assert backend.waits == [(0x77, OURS)] * 3  # its producer's stream, at every call
    b.take("x", mine, (2, 4), np.float16, 0x88)  # another calling stream: ordered after the producer
    assert backend.waits[-1] == (OURS, 0x88)
    with pytest.raises(ValueError, match=r"must have shape \(3, 4\), got \(2, 4\)"):
        b.take("x", mine, (3, 4), np.float16, OURS)  # (a call with more tokens)
    with pytest.raises(TypeError, match="must have dtype float32"):
        b.take("x", mine, (2, 4), np.float32, OURS)
    t = TorchLike(0x1000, (2, 4))
    for _ in range(2):
        b.take("w", t, (2, 4), np.float16, OURS)
        b.take("w", t, (2, 4), np.float16, OURS, capturing=True)
    assert t.asked == [OURS, -1, OURS, -1]  # asked at every use: the export is what orders it


def test_alignment_is_checked_before_an_array_settles():
    """A misaligned array is refused at every use (a refused use never settles), an aligned one once
    and then taken by identity."""
    b, backend = boundary("stream")
    odd = DeviceArray(backend, 0x6002, (2, 4), np.float32, stream=OURS)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"weights must be 4-byte aligned \(its data is at 0x6002\)"):
            b.take("weights", odd, (2, 4), np.float32, OURS, align=4)
    even = DeviceArray(backend, 0x6004, (2, 4), np.float32, stream=OURS)
    for _ in range(2):
        assert b.take("weights", even, (2, 4), np.float32, OURS, align=4)[0] == 0x6004


def test_dispatch_results_are_made_once_per_stream_and_token_count():
    """Repeated calls hand back the same (immutable) DispatchResult; another T or stream, another one."""
    import dataclasses

    from pyhipa2a.calls import OutputViews
    backend = FakeCuda()
    def view(shape, dtype=np.int32):
        return DeviceArray(backend, 0x1000, shape, dtype, stream=OURS)
    views = OutputViews(view((2,)), view((2, 8, 4), np.float16), view((2, 8, 3)), None, view((4, 4), np.float16))
    first = views.dispatch_result(3)
    assert views.dispatch_result(3) is first and first.num_tokens == 3
    assert views.dispatch_result(2) is not first and views.dispatch_result(2).num_tokens == 2
    assert [r.shape for r in views.y_rows] == [(t, 4) for t in range(5)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.num_tokens = 4


# -- producer probes (pyhipa2a.producers): PyTorch and CuPy asked through their own attributes ---------
def fake_producer_module(monkeypatch, name: str, array_type: type, **attributes):
    """`name` as an imported library whose arrays are `array_type`, for the probes to find."""
    import sys
    import types

    from pyhipa2a import producers
    module = types.ModuleType(name)
    array_type.__module__ = name
    setattr(module, array_type.__name__, array_type)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(producers, "_by_type", {})  # nothing remembered from other tests
    monkeypatch.setattr(producers, "_disowned", set())


STRIDED = object()  # the fake torch's torch.strided


class Tensor(TorchLike):
    """TorchLike with what PyTorch's own attributes say; its dtype one object, as torch's are."""

    def __init__(self, ptr, shape, dtype="float16"):
        super().__init__(ptr, shape, dtype)
        self.torch_dtype = "torch." + dtype

    dtype = property(lambda self: self.torch_dtype)

    def data_ptr(self):
        return self.ptr

    strides = None  # (None: compact)

    def stride(self):
        return self.strides or tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def get_device(self):
        return self.device

    device, is_cuda, requires_grad, is_nested, neg, conj = 0, True, False, False, False, False
    layout = STRIDED

    def is_neg(self):
        return self.neg

    def is_conj(self):
        return self.conj

    def __dlpack__(self, stream=None, max_version=None):
        if self.strides is not None:  # (the fake's capsules are compact: a strided export is PyTorch's to make)
            self.asked.append(stream)
            raise BufferError("the fake exports no strided tensor")
        return super().__dlpack__(stream, max_version)

    def is_contiguous(self):
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride())):
            if n > 1 and s != expect:
                return False
            expect *= n
        return True


def fake_torch(monkeypatch, current: list):
    from types import SimpleNamespace
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED,
                         _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda device: current[0]))


def test_torch_tensors_are_exported_once_then_asked_their_current_stream(monkeypatch):
    current = [0x55]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    x, w = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4))
    for stream in (0x55, 0, OURS, 0x55):
        current[0] = stream
        assert take_in_call(b, "x", x, (2, 4), np.float16)[0] == 0x1000
        assert b.take("w", w, (2, 4), np.float16, OURS)[0] == 0x1800
    # x's export ordered the first call and taught the probe what torch.float16 is: w, another float16
    # tensor, is described by its attributes and never exported, its producer waited for on the device.
    assert x.asked == [OURS] and w.asked == []
    # Later calls wait once for the producer's current stream (0 is the legacy default stream, 1),
    # and not at all when that is the call's own.
    assert backend.waits == [(0x55, OURS), (1, OURS), (0x55, OURS)]


def test_a_torch_tensor_changed_in_place_is_described_again(monkeypatch):
    fake_torch(monkeypatch, [OURS])
    b, backend = boundary()
    t = Tensor(0x1000, (2, 4))
    b.take("x", t, (2, 4), np.float16, OURS)
    t.ptr = 0x2000  # new memory behind the same tensor (t.set_(), t.data = ...): its attributes describe it
    assert b.take("x", t, (2, 4), np.float16, OURS)[0] == 0x2000 and len(t.asked) == 1
    t.strides = (1, 2)  # the same memory seen transposed (t.as_strided_()): left to its protocol
    with pytest.raises(BufferError, match="strided"):
        b.take("x", t, (2, 4), np.float16, OURS)
    assert len(t.asked) == 2
    t.strides = None
    t.shape = (4, 2)  # one address, another shape
    with pytest.raises(ValueError, match=r"must have shape \(2, 4\), got \(4, 2\)"):
        b.take("x", t, (2, 4), np.float16, OURS)
    t.shape, t.torch_dtype, t.np_dtype = (2, 4), "torch.int16", np.dtype(np.int16)  # another type, same bytes
    for exports in (3, 3):  # its protocol names the new type once; from then on the attributes describe it
        with pytest.raises(TypeError, match="must have dtype float16, got int16"):
            b.take("x", t, (2, 4), np.float16, OURS)
        assert len(t.asked) == exports


def test_torch_tensors_are_exported_at_every_call_without_the_probe(monkeypatch):
    fake_torch(monkeypatch, [OURS])
    import sys
    monkeypatch.setattr(sys.modules["torch"], "_C", object())  # a build without the raw stream query
    b, _ = boundary()
    t = Tensor(0x1000, (2, 4))
    for _ in range(3):
        b.take("x", t, (2, 4), np.float16, OURS)
    assert t.asked == [OURS] * 3


class ndarray(CupyLike):  # noqa: N801 (CuPy's name)
    def __init__(self, ptr, shape, stream):
        super().__init__(ptr, shape, stream=stream)
        self.cai_reads = 0

    @property
    def __cuda_array_interface__(self):
        self.cai_reads += 1
        return dict(self.cai)

    data = property(lambda self: type("Memory", (), {"ptr": self.cai["data"][0]})())
    shape = property(lambda self: self.cai["shape"])
    strides = property(lambda self: (8, 2))
    dtype = property(lambda self: np.dtype(self.cai["typestr"]))
    device = property(lambda self: type("Device", (), {"id": 0})())
    flags = property(lambda self: type("Flags", (), {"c_contiguous": self.strides == (8, 2)})())


def fake_cupy(monkeypatch, current: list):
    from types import SimpleNamespace
    cuda = SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=current[0]),
                           runtime=SimpleNamespace(getDevice=lambda: 0))
    fake_producer_module(monkeypatch, "cupy", ndarray, cuda=cuda)


def test_cupy_arrays_read_their_interface_once_then_their_current_stream(monkeypatch):
    current = [7]
    fake_cupy(monkeypatch, current)
    b, backend = boundary()
    a = ndarray(0x3000, (2, 4), stream=7)
    for stream in (7, 9, 0):
        current[0] = stream
        assert take_in_call(b, "x", a, (2, 4), np.float16)[0] == 0x3000
    assert a.cai_reads == 1 and backend.waits == [(7, OURS), (9, OURS), (1, OURS)]
    a.cai["data"] = (0x3400, False)  # new memory: its attributes describe it (float16 is known by now)
    assert b.take("x", a, (2, 4), np.float16, OURS)[0] == 0x3400 and a.cai_reads == 1
    other = ndarray(0x3800, (2, 4), stream=7)  # a new array of a known type: its interface is never read
    current[0] = 7
    assert take_in_call(b, "x", other, (2, 4), np.float16)[0] == 0x3800 and other.cai_reads == 0
    assert backend.waits[-1] == (7, OURS)
    strided = ndarray(0x3c00, (2, 4), stream=7)
    strided.cai["strides"] = (2, 4)  # (the fake's strides say (8, 2): its view is not compact)
    type(strided).strides = property(lambda self: self.cai["strides"] or (8, 2))
    with pytest.raises(ValueError, match="C-contiguous"):  # a view that is not compact: the interface says
        b.take("x", strided, (2, 4), np.float16, OURS)
    assert strided.cai_reads == 1


def test_a_probe_that_disagrees_with_the_protocol_is_not_used(monkeypatch):
    fake_cupy(monkeypatch, [9])  # CuPy's current stream says 9 where the interface names 7
    b, backend = boundary()
    a = ndarray(0x3000, (2, 4), stream=7)
    for _ in range(3):
        take_in_call(b, "x", a, (2, 4), np.float16)
    assert a.cai_reads == 3 and backend.waits == [(7, OURS)] * 3  # the protocol's answer, every call
    from pyhipa2a import producers
    assert producers.probe_for(ndarray(0x3000, (2, 4), stream=7)) is None  # the type goes without


_LAYOUTS: dict = {}  # (jaxlib's layout objects compare by value; here one object per layout)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class JaxDevice:
    local_hardware_id: int
    dlpack_kind: int  # (a CPU device is device 0 of its kind too)


@dataclasses.dataclass(frozen=True)
class Sharding:  # (hashable, as JAX's shardings are; equal where their device and memory kind are)
    device: JaxDevice
    memory_kind: str
    devices: int = 1  # (2: the array's shards on this device and the next)

    device_set = property(lambda self: {JaxDevice(self.device.local_hardware_id + i, self.device.dlpack_kind)
                                        for i in range(self.devices)})


class ArrayImpl(JaxLike):
    """JaxLike with what a JAX array's own attributes say: finished, row-major, in GPU 0's memory, unless
    told otherwise (`ready` "missing": a build without is_ready; `failed`: its computation failed, which
    its export says)."""
    deleted = False
    ready = True
    failed = False
    major_to_minor = None  # (None: row-major)
    tiling = ()
    memory_kind = "device"
    dlpack_kind = KDL_CUDA
    hardware_id = 0
    format_reads = 0  # (the public format's reads, over all arrays)
    dtype = property(lambda self: self.np_dtype)

    def unsafe_buffer_pointer(self):
        if self.deleted:
            raise RuntimeError("Array has been deleted")
        return self.ptr

    def is_deleted(self):
        return self.deleted

    def is_ready(self):
        if self.deleted:
            pytest.fail("is_ready() of a deleted array: jaxlib's kills the process")
        if self.ready == "missing":
            raise AttributeError("is_ready")
        return self.ready

    def _layout(self):
        return (tuple(range(len(self.shape))) if self.major_to_minor is None else self.major_to_minor), self.tiling

    _pjrt_layout = property(lambda self: _LAYOUTS.setdefault(self._layout(), object()))
    devices = 1
    sharding = property(lambda self: Sharding(JaxDevice(self.hardware_id, self.dlpack_kind), self.memory_kind,
                                              self.devices))

    @property
    def format(self):
        ArrayImpl.format_reads += 1
        order, tiling = self._layout()
        return SimpleNamespace(layout=SimpleNamespace(major_to_minor=order, tiling=tiling,
                                                      sub_byte_element_size_in_bits=0))

    def __dlpack_device__(self):
        return (self.dlpack_kind, self.hardware_id)

    def __dlpack__(self, stream=None, max_version=None):
        if self.deleted:
            raise RuntimeError("Array has been deleted with shape=int32[3,8].")
        if self.failed:
            raise RuntimeError("the computation that makes this array failed")
        self.asked.append(stream)
        return dlpack.make_capsule(self.ptr, self.shape, self.np_dtype, self.dlpack_kind, self.hardware_id,
                                   owner=self, max_version=(1, 0) if self.versioned else None)


def fake_jax(monkeypatch):
    import sys
    import types
    fake_producer_module(monkeypatch, "jaxlib.xla_extension", ArrayImpl)
    jax = types.ModuleType("jax")
    jax.Array = ArrayImpl
    monkeypatch.setitem(sys.modules, "jax", jax)


def test_jax_arrays_are_exported_once_outside_a_capture_and_never_waited_for_again(monkeypatch):
    """A JAX array whose computation is still queued (not is_ready): its export makes the stream of its
    first use wait for it."""
    fake_jax(monkeypatch)
    b, backend = boundary()
    a = ArrayImpl(0x2000, (3, 8), "int32")
    a.ready = False
    b.take("indices", a, (3, 8), np.int32, OURS, capturing=True)  # a capture's export orders nothing
    for _ in range(3):
        assert take_in_call(b, "indices", a, (3, 8), np.int32)[0] == 0x2000
    # Exported again at the first use outside the capture, which ordered its write; never after (a JAX
    # array does not change once written).
    assert a.asked == [-1, OURS] and backend.waits == []
    assert take_in_call(b, "indices", a, (3, 8), np.int32, 0x88)[0] == 0x2000  # on another stream: after the first
    assert a.asked == [-1, OURS] and backend.waits == [(OURS, 0x88)]
    take_in_call(b, "indices", a, (3, 8), np.int32)  # settled on our stream again
    assert b.settled("indices") is not None
    a.deleted = True  # donated: its memory is no longer the array's; its probe raises, its export says so
    with pytest.raises(RuntimeError, match="deleted with shape"):
        b.take("indices", a, (3, 8), np.int32, OURS)


def test_calls_on_the_current_stream_take_the_first_input_that_names_one(monkeypatch):
    """AllToAll(stream="current"): a call given no stream= runs on the current stream of its first input
    whose library names one; where none does, on the last call's (the object's own before any)."""
    from types import SimpleNamespace

    from pyhipa2a.a2a import AllToAll
    current = [0x55]
    fake_torch(monkeypatch, current)
    order = StreamOrder(FakeCuda(), OURS)

    me = SimpleNamespace(_order=order, _library_device=0)  # (what AllToAll sets up on device 0 of a GPU backend)

    answers = []

    def pick(*inputs):
        stream, asked = AllToAll._current_stream_of(me, inputs)
        answers.append(asked)
        return stream
    mine = DeviceArray(FakeCuda(), 0x6000, (2, 4), np.float16, stream=0x99)
    t = Tensor(0x1000, (2, 4))
    assert pick(np.zeros(2), mine, t) == 0x55
    # The probe's answer goes with the stream: a repeat's rechecks of the call's tensors take it
    from pyhipa2a import producers
    assert answers == [{producers.stream_source(t): 0x55}]
    current[0] = 0
    assert pick(Tensor(0x1000, (2, 4))) == 1  # PyTorch's default stream: the legacy one, which CUDA spells 1
    assert answers[-1] == {producers.stream_source(t): 1}  # as the probe's stream() spells it (Recheck compares so)
    hip = FakeCuda()
    hip.kind = "hip"  # HIP's null stream is 0: the call runs there, while the probe still answers 1
    assert AllToAll._current_stream_of(SimpleNamespace(_order=StreamOrder(hip, OURS), _library_device=0), (t,)) == (
        0, {producers.stream_source(t): 1})
    assert pick(np.zeros(2), mine, None) == OURS  # none names one, no call yet: our own
    assert answers[-1] is None
    elsewhere = Tensor(0x1000, (2, 4))
    elsewhere.get_device = lambda: 1
    assert pick(elsewhere) == OURS  # on another device: not its stream (the call's checks refuse it)
    order.queued(0x77)
    assert pick(mine) == 0x77  # the last call's, so that calls on our own arrays keep their order


def test_a_probed_array_that_needs_no_wait_settles_and_is_asked_again_at_every_use(monkeypatch):
    """A PyTorch tensor written on the call's own stream (AllToAll(stream="current")) settles: its next
    use costs its probe's answers, and a changed answer (new memory, another current stream) takes the
    full path again."""
    current = [OURS]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    t = Tensor(0x1000, (2, 4))
    for _ in range(3):
        assert take_in_call(b, "x", t, (2, 4), np.float16)[0] == 0x1000
    assert t.asked == [OURS] and b.settled("x") is not None and b.settled("x")[6].holds(t)
    t.ptr = 0x2000  # new memory behind the same tensor: the settled entry no longer holds
    assert not b.settled("x")[6].holds(t)
    assert b.take("x", t, (2, 4), np.float16, OURS)[0] == 0x2000 and len(t.asked) == 1  # (described by the probe)
    current[0] = 0x55  # PyTorch's current stream is no longer the call's: a wait, settled with it
    assert take_in_call(b, "x", t, (2, 4), np.float16)[0] == 0x2000
    assert backend.waits == [(0x55, OURS)] and b.settled("x").wait == 0x55


def test_a_probed_array_on_another_stream_settles_with_a_wait_at_every_use(monkeypatch):
    """A PyTorch tensor written on PyTorch's current stream, used by calls on our own stream (the default
    AllToAll(stream="own")): every use waits for that stream on the device, and nothing else is asked
    but the probe (the full path cost 20 us of Python a call on two H100s). A wait is made once a call
    for a producer its arguments share, and a changed answer takes the full path again."""
    current = [0x55]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    x, w = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4))
    for _ in range(4):
        assert take_in_call(b, "x", x, (2, 4), np.float16)[0] == 0x1000
        assert b.take("w", w, (2, 4), np.float16, OURS)[0] == 0x1800
    assert x.asked == [OURS] and w.asked == []  # x's export ordered the first call; w, described by its probe,
    assert backend.waits == [(0x55, OURS)] * 4  # waited for on the device; then one wait a call, shared by x and w
    assert b.settled("x").wait == 0x55 and b.settled("w").wait == 0x55
    current[0] = OURS  # PyTorch now writes on the call's stream: nothing to wait for, settled without
    assert take_in_call(b, "x", x, (2, 4), np.float16)[0] == 0x1000
    assert b.settled("x").wait is None and len(backend.waits) == 4


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_new_arrays_of_a_known_type_are_described_by_their_attributes(monkeypatch, lib):
    """A loop that hands over new arrays at every call (a layer's activations, a router's output; every
    array of a JAX program) pays for one export per element type: after it, each new array is described
    by its own attributes (pointer, shape, strides or layout, type, device), exactly as its export would
    describe it. A tensor's producer's current stream is waited for on the device, as the export would
    have it wait; a JAX array whose computation has finished needs no wait (its layout is asked through
    the public format once, then known by its layout object), and its buffer is held by its plain export
    (naming no stream), under which JAX does not donate it."""
    if lib == "torch":
        fake_torch(monkeypatch, [0x55])
        make, waits, held = Tensor, [(0x55, OURS)] * 3, []
    else:
        fake_jax(monkeypatch)
        make, waits, held = ArrayImpl, [], [None]
    b, backend = boundary()
    reads = ArrayImpl.format_reads
    first = make(0x1000, (2, 4))
    assert take_in_call(b, "x", first, (2, 4), np.float16)[0] == 0x1000 and first.asked == [OURS]
    for i in range(3):
        t = make(0x2000 + 0x100 * i, (2, 4))
        ptr, keep = take_in_call(b, "x", t, (2, 4), np.float16)
        assert ptr == t.ptr and t.asked == held and getattr(t, "cai_reads", 0) == 0
        assert keep is t if lib == "torch" else type(keep).__name__ == "PyCapsule"  # (the hold: t's export)
    assert backend.waits == waits and ArrayImpl.format_reads == reads + (lib == "jax")
    ints = make(0x3000, (2, 4), "int32")  # another element type: its export names it, once
    assert b.take("indices", ints, (2, 4), np.int32, OURS)[0] == 0x3000 and ints.asked == [OURS]
    again = make(0x3400, (2, 4), "int32")
    assert b.take("indices", again, (2, 4), np.int32, OURS)[0] == 0x3400 and again.asked == held
    with pytest.raises(TypeError, match="must have dtype float16, got int32"):  # the learned type, checked
        b.take("x", make(0x3800, (2, 4), "int32"), (2, 4), np.float16, OURS)
    with pytest.raises(ValueError, match=r"must have shape \(2, 4\), got \(2, 8\)"):
        b.take("x", make(0x3c00, (2, 8)), (2, 4), np.float16, OURS)


@pytest.mark.parametrize("odd", ["not finished", "column-major", "tiled", "a build without is_ready", "over two GPUs"])
def test_a_jax_array_its_attributes_cannot_vouch_for_is_left_to_its_export(monkeypatch, odd):
    from pyhipa2a import producers
    fake_jax(monkeypatch)
    b, _ = boundary()
    take_in_call(b, "x", ArrayImpl(0x1000, (2, 4)), (2, 4), np.float16)  # (float16 known from here)
    a = ArrayImpl(0x2000, (2, 4))
    if odd == "not finished":
        a.ready = False
    elif odd == "column-major":  # (a row of it reads as the export says: the export decides)
        a.major_to_minor = (1, 0)
    elif odd == "tiled":
        a.tiling = ((8, 128),)
    elif odd == "a build without is_ready":
        a.ready = "missing"
    elif odd == "over two GPUs":  # (the fake's export says GPU 0 alone: the view must not be the one to decide)
        a.devices = 2
    assert take_in_call(b, "x", a, (2, 4), np.float16)[0] == 0x2000
    assert a.asked == [OURS] and producers.probe_for(a) is not None  # exported; the probe still kept for the type


@pytest.mark.parametrize("odd, error", [("another GPU", "lives on cuda device 1"), ("a CPU array", "lives on cpu"),
                                        ("pinned host memory", "lives on cuda_host"),
                                        ("deleted", "deleted with shape"), ("failed", "computation .* failed")])
def test_a_jax_array_its_export_refuses_is_refused_whatever_its_attributes_say(monkeypatch, odd, error):
    """A finished JAX array of a known element type that is not in our GPU's memory (a CPU device is
    device 0 of its kind too), deleted (donated: is_ready() of a deleted array would kill the process),
    or whose computation failed (is_ready() is True then too) is refused as its export refuses it."""
    fake_jax(monkeypatch)
    b, _ = boundary()
    take_in_call(b, "x", ArrayImpl(0x1000, (2, 4)), (2, 4), np.float16)  # (float16 known from here)
    a = ArrayImpl(0x2000, (2, 4))
    if odd == "another GPU":
        a.hardware_id = 1
    elif odd == "a CPU array":
        a.dlpack_kind = KDL_CPU
    elif odd == "pinned host memory":
        a.memory_kind, a.dlpack_kind = "pinned_host", KDL_CUDA_HOST
    elif odd == "deleted":
        a.deleted = True
    else:
        a.failed = True
    with pytest.raises((ValueError, RuntimeError), match=error):
        take_in_call(b, "x", a, (2, 4), np.float16)


@pytest.mark.parametrize("odd", ["another device", "requires grad", "negated view", "conjugated view", "nested",
                                 "not compact", "empty", "another layout"])
def test_a_tensor_its_attributes_cannot_vouch_for_is_left_to_its_protocol(monkeypatch, odd):
    fake_torch(monkeypatch, [OURS])
    b, _ = boundary()
    take_in_call(b, "x", Tensor(0x1000, (2, 4)), (2, 4), np.float16)  # (float16 known from here)
    t = Tensor(0x2000, (0, 4) if odd == "empty" else (2, 4))
    if odd == "another device":
        t.device = 1
    elif odd == "requires grad":
        t.requires_grad = True
    elif odd == "negated view":
        t.neg = True
    elif odd == "conjugated view":
        t.conj = True
    elif odd == "nested":
        t.is_nested = True
    elif odd == "not compact":
        t.strides = (1, 2)
    elif odd == "another layout":
        t.layout = object()
    if odd == "another device":
        with pytest.raises(ValueError, match="lives on cuda device 1"):  # (refused before an export)
            take_in_call(b, "x", t, (2, 4), np.float16)
        return
    if odd == "not compact":
        with pytest.raises(BufferError):  # (the fake's export of a strided tensor)
            take_in_call(b, "x", t, (2, 4), np.float16)
    else:
        take_in_call(b, "x", t, t.shape, np.float16)
    assert t.asked == [OURS]  # exported: its protocol described it, or refused it


def test_a_probe_whose_view_disagrees_with_its_protocol_describes_nothing(monkeypatch):
    """A view that saw an array otherwise than its protocol (here: on another device than the export
    said) disowns the probe for the type, which is then described through its protocol every time."""
    fake_torch(monkeypatch, [OURS])
    b, _ = boundary()

    class Misplaced(Tensor):
        def get_device(self):
            return 3
    Misplaced.__module__ = "torch"
    import sys
    sys.modules["torch"].Tensor = Misplaced  # (the fake library's own tensor type, for this test)
    tensors = [Misplaced(0x1000 + 0x100 * i, (2, 4)) for i in range(3)]
    for t in tensors:
        take_in_call(b, "x", t, (2, 4), np.float16)
    assert [t.asked for t in tensors] == [[OURS]] * 3
    from pyhipa2a import producers
    assert producers.probe_for(tensors[0]) is None


def test_an_interface_that_names_no_element_type_teaches_none(monkeypatch):
    """bfloat16 through the interface ('<V2', producer_order="stream") is the argument's required type,
    not the array's own: a probe learns nothing from it, and the next tensor is read through it too."""
    fake_torch(monkeypatch, [OURS])
    b, _ = boundary("stream")
    tensors = [Tensor(0x1000 + 0x100 * i, (2, 4), "bfloat16") for i in range(2)]
    for t in tensors:
        b.take("x", t, (2, 4), bfloat16(), OURS)
    assert [t.cai_reads for t in tensors] == [1, 1]
    with pytest.raises(TypeError, match="names no element type"):
        b.take("x", Tensor(0x1800, (2, 4), "bfloat16"), (2, 4), np.float16, OURS)


def test_a_probe_that_raises_leaves_the_array_to_its_protocol(monkeypatch):
    fake_torch(monkeypatch, [OURS])
    b, _ = boundary()

    class Odd(Tensor):  # a tensor whose attributes fail (a wrapper subclass would be skipped: exact types only)
        def data_ptr(self):
            raise RuntimeError("no storage")
    Odd.__module__ = "torch"
    import sys
    sys.modules["torch"].Tensor = Odd  # (the fake library's own tensor type, for this test)
    t = Odd(0x1000, (2, 4))
    for _ in range(3):
        assert take_in_call(b, "x", t, (2, 4), np.float16)[0] == 0x1000
    assert t.asked == [OURS] * 3  # the protocol at every call
    from pyhipa2a import producers
    assert producers.probe_for(t) is None


def test_a_probe_that_starts_raising_sends_the_array_back_to_its_protocol(monkeypatch):
    current = [OURS]
    fake_torch(monkeypatch, current)
    b, _ = boundary()
    t = Tensor(0x1000, (2, 4))
    for _ in range(2):
        take_in_call(b, "x", t, (2, 4), np.float16)
    assert t.asked == [OURS]
    t.data_ptr = lambda: (_ for _ in ()).throw(RuntimeError("storage gone"))
    assert take_in_call(b, "x", t, (2, 4), np.float16)[0] == 0x1000  # the protocol's answer
    assert t.asked == [OURS, OURS]


def test_a_repeated_call_asks_its_probed_arguments_again(monkeypatch):
    """Repeat (the whole call's fast path) holds only while every probed argument answers as it did."""
    from pyhipa2a.calls import Repeat
    current = [OURS]
    fake_torch(monkeypatch, current)
    b, _ = boundary()
    t = Tensor(0x1000, (2, 4))
    take_in_call(b, "x", t, (2, 4), np.float16)  # first described, on PyTorch's current stream: settles
    record = Repeat.of((t, OURS), ("x",), b, 2)
    assert record is not None and record.holds((t, OURS))
    t.ptr = 0x2000
    assert not record.holds((t, OURS))  # new memory
    t.ptr = 0x1000
    current[0] = 0x55
    assert not record.holds((t, OURS))  # another producer stream: the call must wait for it
    current[0] = OURS
    t.data_ptr = lambda: (_ for _ in ()).throw(RuntimeError("storage gone"))
    assert not record.holds((t, OURS))  # a probe that raises holds nothing (and raises nothing)


def test_a_repeated_call_waits_for_its_arguments_producers_again(monkeypatch):
    """A repeat of a call whose PyTorch arguments were written on another stream than the call's makes
    that stream's wait again (once for arguments that share it), and holds only while the probe still
    names that stream."""
    from pyhipa2a.calls import Repeat
    current = [0x55]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    x, i = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4), "int32")
    take_in_call(b, "x", x, (2, 4), np.float16)
    b.take("indices", i, (2, 4), np.int32, OURS)
    take_in_call(b, "x", x, (2, 4), np.float16)  # (the first use's export ordered it; this one waits)
    b.take("indices", i, (2, 4), np.int32, OURS)
    record = Repeat.of((x, i, OURS), ("x", "indices"), b, 2)
    assert record is not None and record.holds((x, i, OURS)) and record.waits == (0x55,)
    waited = len(backend.waits)
    for _ in range(2):
        record.resume(b.order, OURS)
    assert backend.waits[waited:] == [(0x55, OURS)] * 2
    current[0] = 0x66
    assert not record.holds((x, i, OURS))  # another producer stream: the full path, which waits for it


def test_a_repeated_call_asks_each_producer_its_stream_once(monkeypatch):
    """A repeat asks a producer's current stream once for all its arguments of one call, and not at all
    when the call already asked it to find its own stream (AllToAll(stream="current"): `asked`); any
    other answer than the recorded one still breaks the repeat."""
    from pyhipa2a import producers
    from pyhipa2a.calls import Repeat
    current, asks = [OURS], []

    def current_stream(device):
        asks.append(device)
        return current[0]
    from types import SimpleNamespace
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED,
                         _C=SimpleNamespace(_cuda_getCurrentRawStream=current_stream))
    b, _ = boundary()
    x, i = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4), "int32")
    for _ in range(2):  # described, then settled
        take_in_call(b, "x", x, (2, 4), np.float16)
        b.take("indices", i, (2, 4), np.int32, OURS)
    record = Repeat.of((x, i, OURS), ("x", "indices"), b, 2)
    asks.clear()
    assert record.holds((x, i, OURS)) and len(asks) == 1  # x's answer serves i
    asks.clear()
    assert record.holds((x, i, OURS), {producers.stream_source(x): OURS}) and asks == []
    assert not record.holds((x, i, OURS), {producers.stream_source(x): 0x55})  # the call follows another stream
    current[0] = 0x55
    assert not record.holds((x, i, OURS))


def test_repeated_calls_hand_their_stream_answer_to_their_rechecks(monkeypatch):
    """AllToAll(stream="current"): a repeated dispatch and combine of PyTorch tensors ask PyTorch's current
    stream once each, to choose the call's stream; their arguments' rechecks take that answer."""
    import functools
    from types import SimpleNamespace

    from pyhipa2a import producers
    from pyhipa2a.a2a import AllToAll
    from pyhipa2a.calls import Repeat
    asks = []

    def current_stream(device):
        asks.append(device)
        return 0x55
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED,
                         _C=SimpleNamespace(_cuda_getCurrentRawStream=current_stream))
    b, _ = boundary()
    x, i, y, w = (Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4), "int32"), Tensor(0x2000, (2, 4)),
                  Tensor(0x2800, (2, 4), "float32"))
    for _ in range(2):  # described, then settled on the call's stream, PyTorch's current one
        take_in_call(b, "x", x, (2, 4), np.float16, 0x55)
        b.take("indices", i, (2, 4), np.int32, 0x55)
        take_in_call(b, "expert_y", y, (2, 4), np.float16, 0x55)
        b.take("weights", w, (2, 4), np.float32, 0x55)
    launched, result, prepared, scale = [], SimpleNamespace(num_tokens=2), object(), (1.0, 1.0)
    repeater = lambda *a: None  # noqa: E731  (the quick form each leg's first repeat makes: pyhipa2a.quick)
    me = SimpleNamespace(_capturing=None, _on_current_stream=True, _library_device=0, _order=b.order, _pending=None,
                         _pending_weights=None, _joined=None, _pending_joined=None,
                         _dispatch_kernel=SimpleNamespace(launch=lambda *a: launched.append(a), repeater=repeater),
                         _dispatch_pack=None, _repeat_packs=(None, None), blocks=1, block_threads=32, _last_scale=scale,
                         stream=OURS, backend=SimpleNamespace(capturable=lambda s: True), _combine_repeater=repeater)
    me._moved_packs, me._combine_pack = (SimpleNamespace(copy_from=lambda pack: None),) * 2, None
    for name in ("_call_stream", "_current_stream_of", "_stream_outside_capture", "_launch_dispatch", "_queued",
                 "_checked_scale", "_capturable_elsewhere", "_with_quick"):
        setattr(me, name, functools.partial(getattr(AllToAll, name), me))
    me._repeat_dispatch = Repeat.of((x, i, None, None, 0x55), ("x", "indices"), b, 2, result)
    asks.clear()
    assert AllToAll._dispatch(me, x, i, None, None, None) is result and len(launched) == 1
    assert len(asks) == 1  # the call's stream; x's and indices' rechecks took its answer
    assert me._repeat_dispatch.quick.lead[::2] == (producers.stream_source(x), 0x55)  # asked of x's library
    me._repeat_combine = Repeat.of((y, w, None, 0x55, scale, None), ("expert_y", "weights"), b, 2, prepared)
    asks.clear()
    assert AllToAll._prepare_combine(me, y, w, None, None, scale[0]) is prepared
    assert len(asks) == 1 and me._repeat_combine.quick.lead[::2] == (producers.stream_source(y), 0x55)
