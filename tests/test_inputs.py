"""The array boundary (pyhipa2a.inputs) with fake producers (tests/fakes.py): no GPU needed."""

import numpy as np
import pytest

from pyhipa2a.array import DeviceArray
from pyhipa2a.dtypes import bfloat16
from pyhipa2a.errors import A2ATimeoutError, Health
from pyhipa2a.inputs import check_scale, producer_stream
from tests.fakes import (KDL_CPU, KDL_CUDA_HOST, OURS, ArrayImpl, CupyLike, FakeCuda, JaxLike, Tensor, TorchLike,
                         boundary, fake_cupy, fake_jax, fake_torch, ndarray, take_in_call)

def test_torch_tensors_are_described_by_dlpack_and_ordered_by_their_export():
    b, backend = boundary()
    for dtype in ("float16", "bfloat16"):
        t = TorchLike(0x1000, (2, 4), dtype)
        want = bfloat16() if dtype == "bfloat16" else np.float16
        for _ in range(3):
            ptr, keep, *_ = b.take("x", t, (2, 4), want, OURS)
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
    out.__dlpack__(stream=-1, dl_device=out.__dlpack_device__())  # (where it is: as without dl_device)
    with pytest.raises(BufferError, match=r"dl_device=\(1, 0\) asks for another"):
        out.__dlpack__(stream=-1, dl_device=(1, 0))  # (to host memory: a copy, which we never make)
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


def test_an_array_is_taken_again_only_for_the_same_use():
    """What a repeat of a use may take unasked: our array on the call's stream; one on another stream is
    waited for at every use and never repeats; a new stream or shape is looked at anew."""
    b, backend = boundary()
    mine = DeviceArray(backend, 0x6000, (2, 4), np.float16, stream=OURS)
    elsewhere = DeviceArray(backend, 0x7000, (2, 4), np.float16, stream=0x77)
    for _ in range(3):
        taken = take_in_call(b, "x", mine, (2, 4), np.float16)
        assert taken.ptr == 0x6000 and taken.repeatable and taken.recheck is None and taken.wait is None
        taken = b.take("y", elsewhere, (2, 4), np.float16, OURS)
        assert taken.ptr == 0x7000 and not taken.repeatable
    assert backend.waits == [(0x77, OURS)] * 3  # its producer's stream, at every call
    assert not b.take("x", mine, (2, 4), np.float16, 0x88).repeatable  # another calling stream: after the producer
    assert backend.waits[-1] == (OURS, 0x88)
    with pytest.raises(ValueError, match=r"must have shape \(3, 4\), got \(2, 4\)"):
        b.take("x", mine, (3, 4), np.float16, OURS)  # (a call with more tokens)
    with pytest.raises(TypeError, match="must have dtype float32"):
        b.take("x", mine, (2, 4), np.float32, OURS)
    t = TorchLike(0x1000, (2, 4))
    for _ in range(2):
        assert not b.take("w", t, (2, 4), np.float16, OURS).repeatable  # (no probe: asked at every use)
        assert not b.take("w", t, (2, 4), np.float16, OURS, capturing=True).repeatable
    assert t.asked == [OURS, -1, OURS, -1]  # asked at every use: the export is what orders it
    host = np.zeros((2, 4), np.float16)
    assert not b.take("x", host, (2, 4), np.float16, OURS, stage_ptr=0x9000).repeatable  # (copied at every use)


def test_alignment_is_checked_at_every_use():
    """A misaligned array is refused at every use, an aligned one taken (under producer_order="stream", a
    repeat takes it again unasked)."""
    b, backend = boundary("stream")
    odd = DeviceArray(backend, 0x6002, (2, 4), np.float32, stream=OURS)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"weights must be 4-byte aligned \(its data is at 0x6002\)"):
            b.take("weights", odd, (2, 4), np.float32, OURS, align=4)
    even = DeviceArray(backend, 0x6004, (2, 4), np.float32, stream=OURS)
    for _ in range(2):
        taken = b.take("weights", even, (2, 4), np.float32, OURS, align=4)
        assert taken.ptr == 0x6004 and taken.repeatable


def test_dispatch_results_are_made_once_per_stream_and_token_count():
    """Repeated calls hand back the same (immutable) DispatchResult; another T or stream, another one."""
    import dataclasses

    from pyhipa2a.buffers import OutputViews
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
    taken = take_in_call(b, "indices", a, (3, 8), np.int32)  # on our stream again: a repeat may take it unasked
    assert taken.repeatable and taken.wait is None
    a.deleted = True  # donated: its memory is no longer the array's; its probe raises, its export says so
    with pytest.raises(RuntimeError, match="deleted with shape"):
        b.take("indices", a, (3, 8), np.int32, OURS)





def test_a_probed_array_that_needs_no_wait_repeats_while_its_probe_answers_as_then(monkeypatch):
    """A PyTorch tensor written on the call's own stream (AllToAll(stream="current")): a repeat may take
    it again while its probe's key and stream are as they were; a changed answer (new memory, another
    current stream) is described again."""
    current = [OURS]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    t = Tensor(0x1000, (2, 4))
    for _ in range(3):
        taken = take_in_call(b, "x", t, (2, 4), np.float16)
        assert taken.ptr == 0x1000 and taken.repeatable and taken.wait is None
    probe, key, named = taken.recheck
    assert t.asked == [OURS] and probe.key(t) == key and probe.stream(t) == named == OURS
    t.ptr = 0x2000  # new memory behind the same tensor: the recheck no longer holds
    assert probe.key(t) != key
    assert b.take("x", t, (2, 4), np.float16, OURS).ptr == 0x2000 and len(t.asked) == 1  # (described by the probe)
    current[0] = 0x55  # PyTorch's current stream is no longer the call's: a wait, at every repeat too
    taken = take_in_call(b, "x", t, (2, 4), np.float16)
    assert taken.ptr == 0x2000 and backend.waits == [(0x55, OURS)]
    assert taken.wait == 0x55 and taken.recheck.stream == 0x55


def test_a_probed_array_on_another_stream_repeats_with_a_wait_at_every_use(monkeypatch):
    """A PyTorch tensor written on PyTorch's current stream, used by calls on our own stream (the default
    AllToAll(stream="own")): every use waits for that stream on the device, and nothing else is asked but
    the probe. A wait is made once a call for a producer its arguments share."""
    current = [0x55]
    fake_torch(monkeypatch, current)
    b, backend = boundary()
    x, w = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4))
    for _ in range(4):
        taken_x = take_in_call(b, "x", x, (2, 4), np.float16)
        taken_w = b.take("w", w, (2, 4), np.float16, OURS)
        assert (taken_x.ptr, taken_w.ptr) == (0x1000, 0x1800)
    assert x.asked == [OURS] and w.asked == []  # x's export ordered the first call; w, described by its probe,
    assert backend.waits == [(0x55, OURS)] * 4  # waited for on the device; then one wait a call, shared by x and w
    assert taken_x.wait == 0x55 and taken_w.wait == 0x55 and taken_x.repeatable and taken_w.repeatable
    current[0] = OURS  # PyTorch now writes on the call's stream: nothing to wait for
    assert take_in_call(b, "x", x, (2, 4), np.float16).wait is None and len(backend.waits) == 4


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
        ptr, keep, *_ = take_in_call(b, "x", t, (2, 4), np.float16)
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
