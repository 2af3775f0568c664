"""The fakes the tests share: a CUDA runtime as the boundary and the streams see it, and PyTorch, CuPy and
JAX arrays as each library hands them over (as seen on the GPU machines): PyTorch (a dtype object NumPy
cannot read, a version-2 interface with no stream, typestr '<V2' for bfloat16, DLPack that orders itself
on the stream it is given), JAX (DLPack only; versioned or unversioned capsules; its own attributes for
a finished array) and CuPy (a version-3 interface naming the stream it last wrote on); and backends whose
streams never finish by themselves, for the host's bounds on waits the device does not bound."""
import ctypes
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from pyhipa2a import dlpack
from pyhipa2a.dtypes import bfloat16
from pyhipa2a.inputs import Boundary
from pyhipa2a.runtime.base import Backend
from pyhipa2a.streams import Streams

OURS = 0x5000  # the stream the calls run on


class FakeCuda:
    """The backend calls the boundary makes, recorded."""
    kind, dlpack_device_type, current_device = "cuda", 2, 0

    def __init__(self):
        self.waits, self.pointer_queries, self.copies = [], 0, []

    def pointer_device(self, ptr):
        self.pointer_queries += 1
        return 0

    def stream_handle(self, stream):
        return 0 if stream is None else int(stream)

    def activate(self):  # one device, one context: nothing to switch
        pass

    def stream_from_handle(self, handle):
        return handle

    def copy_to_device(self, dst, src, stream=None):
        self.copies.append((dst, src.nbytes))

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
    afresh: Streams.follow), then takes it."""
    b.order.follow(stream)
    return b.take(name, obj, shape, dtype, stream)


def boundary(order="protocol", backend=None):
    backend = backend or FakeCuda()
    return Boundary(backend, 0, Streams(backend, OURS, False, 0), order), backend


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


class Stream:
    """A stream as the bindings wrap one: a new object for each handle asked."""

    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


class FakeRuntime(FakeCuda):
    """FakeCuda as a call and its plan see it: streams wrapped anew for each handle, captures asked about, its
    device made current, a plan's steps in Python (pyhipa2a.repeat)."""
    stream_type = Stream

    def __init__(self):
        super().__init__()
        self.capturing, self.capture_queries, self.activations = False, [], 0

    def stream_from_handle(self, handle):
        return Stream(handle)

    def capturable(self, stream):
        return True

    def stream_capturing(self, stream):
        self.capture_queries.append(stream)
        return self.capturing

    def activate(self):
        self.activations += 1

    def plan_activate(self):
        return (self.activate,)

    def plan_launch(self, launch, stream):
        return (launch.queue, stream), ()

    def raise_driver_error(self, what, code):
        from pyhipa2a.errors import RuntimeFailure
        raise RuntimeFailure(f"{what} failed with code {code}")


class PinnedMemory:
    """Pinned host memory of a fake backend: real memory, its device address its host address; what it freed is
    in `destroyed` ("words")."""

    def __init__(self):
        self.destroyed, self._buffers = [], {}

    def malloc_host_mapped(self, nbytes):
        buf = (ctypes.c_char * nbytes)()
        self._buffers[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf), ctypes.addressof(buf)

    def free_host_mapped(self, ptr):
        self.destroyed.append(self._buffers.pop(ptr) and "words")


class StandingStream(PinnedMemory):
    """A backend whose combine stream never finishes by itself (as a GPU's stream standing at a wait for a word
    nobody raises). It has no copies and no streams to lend: the bound must touch neither."""
    kind = "stuck"

    def __init__(self):
        super().__init__()
        self.finished = False

    def activate(self):
        pass

    def stream_done(self, stream):
        return False

    def event_create(self):
        return "event"

    def event_record(self, event, stream):
        assert stream == "combine"

    def event_done(self, event):
        return self.finished

    def event_destroy(self, event):
        self.destroyed.append(event)


class StuckQueue(PinnedMemory, Backend):
    """A backend of one rank whose streams all sit behind a wait that never passes (as where they share one
    hardware queue with it): what is queued on a stream never lands, and no event recorded on one is ever done.
    The stream writes of a "reached" stream (one the test names) land at once, as the GPU's do, up to its first
    wait that does not pass (batches of them, Backend.stream_word_ops, one by one). Also the heap of the Signals
    on it."""
    kind = "stuck"

    def __init__(self, reached=(), timeout: float = 0.3):
        super().__init__()
        self.reached, self.timeout, self.queued = set(reached), timeout, []
        self.backend, self.rank, self.world = self, 0, 2  # (as the heap: Signals asks it these)

    def activate(self):
        pass

    def alloc(self, shape, dtype):
        array = np.zeros(shape, dtype)
        self._buffers[array.ctypes.data] = array
        return SimpleNamespace(ptr=array.ctypes.data, shape=array.shape, dtype=array.dtype, nbytes=array.nbytes,
                               copy_from=lambda values: np.copyto(array, values))

    def translate(self, ptr, peer):
        return ptr

    def stream_write_word(self, stream, ptr, value):
        if stream in self.reached:
            ctypes.c_uint32.from_address(ptr).value = value
        else:
            self.queued.append(("write", stream, ptr, value))

    def stream_wait_word(self, stream, ptr, value, timeout, timed_out):
        if stream in self.reached and ctypes.c_uint32.from_address(ptr).value == value:
            return
        self.reached.discard(stream)  # (it stands here: nothing after lands)
        self.queued.append(("wait", stream, ptr, value))

    def copy_device(self, dst, src, nbytes, stream=None):
        self.queued.append(("copy", stream, dst, src))

    def memset(self, ptr, byte, nbytes, stream=None):
        self.queued.append(("memset", stream, ptr, byte))

    def event_create(self):
        return SimpleNamespace(stream=None)

    def event_record(self, event, stream, **_):
        event.stream = stream

    def event_done(self, event):
        return event.stream is None

    def event_destroy(self, event):
        pass



class LoweredForGpu:
    """A JaxAllToAll made on the host backend, its calls traced as on a GPU: each call a site of XLA's handler
    (numbered here, never launched), so that `legs(f, *args)` lowers `f` for CUDA on a machine without a GPU
    and names, in program order, the calls XLA would run. JAX drops an effect-free call whose results go
    unused, and only the GPU's calls are effect-free (the CPU path's callback has an effect), so this is where
    CI sees a call a GPU program would lose. Reaches into the object's GPU path on purpose: its two switches."""

    def __init__(self, a2a):
        self.calls: dict[int, tuple[str, str]] = {}  # site -> (the object's name, "dispatch" or "combine")
        self._switch(a2a, "exchange")
        if a2a._weight_rows is not None:
            self._switch(a2a._weight_rows, "weights")  # (the gradient rules' narrow exchange)

    def _switch(self, a2a, name: str) -> None:
        def site(leg, tokens, *rest, **values):
            number = len(self.calls) + 1
            self.calls[number] = (name, leg)
            return number
        a2a._on_gpu, a2a._site = True, site

    def legs(self, f, *args) -> dict[str, list[str]]:
        """Each object's calls in the program jit(f)(*args) lowered for CUDA, in program order."""
        import re

        import jax
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        legs: dict[str, list[str]] = {}
        for site in re.findall(r"site = (\d+) : i64", text):
            name, leg = self.calls[int(site)]
            legs.setdefault(name, []).append(leg)
        return legs
