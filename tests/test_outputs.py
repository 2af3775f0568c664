"""Outputs in the caller's library (pyhipa2a.outputs), on a fake CUDA runtime and a fake PyTorch: which calls
hand out the library's arrays, that each is made once and handed out again, that the library's stream is
ordered after the call's, and which handed-out views a later call takes as our own arrays."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pyhipa2a.array import DeviceArray
from pyhipa2a.buffers import OutputViews
from pyhipa2a.outputs import Outputs
from pyhipa2a.streams import LAST, Streams
from tests.fakes import OURS, STRIDED, FakeCuda, Tensor, fake_producer_module


def outputs_on_fake_torch(monkeypatch, choice="inputs"):
    current, imports = [0x55], []

    def from_dlpack(a):  # the fake PyTorch's import of one of our arrays: a tensor over its memory
        imports.append(a)
        t = Tensor(a.ptr, a.shape)
        t.ours = a
        return t
    monkeypatch.setattr(Tensor, "__getitem__", lambda t, rows: from_dlpack(t.ours.rows(rows.stop)), raising=False)
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED, from_dlpack=from_dlpack,
                         _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda device: current[0]))
    backend = FakeCuda()
    streams = Streams(backend, OURS, True, 0)

    def views(stream):
        def ours(ptr, shape, dtype):
            return DeviceArray(backend, ptr, shape, dtype, stream=stream)
        return OutputViews(ours(0x1000, (2,), np.int32), ours(0x2000, (2, 8, 4), np.float16),
                           ours(0x3000, (2, 8, 3), np.int32), None, ours(0x4000, (4, 4), np.float16))
    return Outputs(choice, streams, views), streams, backend, current, imports


def test_a_call_on_library_arrays_hands_out_its_views_made_once(monkeypatch):
    outputs, streams, backend, current, imports = outputs_on_fake_torch(monkeypatch)
    t = Tensor(0x9000, (3, 4))
    probe = outputs.library_of((np.zeros(2), t))
    assert probe is not None and outputs.library_of((np.zeros(2), DeviceArray(backend, 0x1, (1,), np.int8))) is None
    views = outputs.views(OURS, probe)
    d = views.dispatch_result(3)
    assert all(isinstance(a, Tensor) for a in (d.expert_num_tokens, d.expert_x, d.expert_meta)) and d.num_tokens == 3
    y = views.y(3)
    assert isinstance(y, Tensor) and y.shape == (3, 4)
    made = len(imports)
    assert outputs.views(OURS, probe) is views and views.dispatch_result(3) is d and views.y(3) is y
    assert views.dispatch_result(2).expert_x is d.expert_x and len(imports) == made  # nothing imported again
    assert Outputs("ours", streams, lambda s: None).library_of((t,)) is None


def test_the_librarys_stream_is_ordered_after_the_call(monkeypatch):
    outputs, streams, backend, current, _ = outputs_on_fake_torch(monkeypatch)
    probe = outputs.library_of((Tensor(0x9000, (3, 4)),))
    order = outputs.orderer(0x77, probe)
    order()
    assert backend.waits == [(0x77, 0x55)]  # (producer, waiter): PyTorch's current stream waits for the call's
    current[0] = 0x66
    order()
    assert backend.waits[-1] == (0x77, 0x66)  # the current stream when the call is made
    assert outputs.orderer(0x77, None) is None  # our own arrays name their stream
    streams.capturing = 0x77
    assert outputs.orderer(0x77, probe) is None  # a capture orders its replays itself


def test_a_handed_out_view_comes_back_as_ours_on_its_librarys_stream(monkeypatch):
    outputs, streams, backend, current, _ = outputs_on_fake_torch(monkeypatch)
    probe = outputs.library_of((Tensor(0x9000, (3, 4)),))
    views = outputs.views(0x55, probe)
    d, y = views.dispatch_result(3), views.y(3)
    lead = (probe, 0, 0x55)  # the call's stream: PyTorch's current one
    assert outputs.ours_behind(d.expert_x, lead) is outputs.ours(0x55).arrays[1]
    assert outputs.ours_behind(y, lead) is outputs.ours(0x55).y(3)
    assert outputs.ours_behind(d.expert_x, LAST) is d.expert_x  # on another stream: asked as any tensor
    lookalike = Tensor(d.expert_x.ptr, d.expert_x.shape)
    assert outputs.ours_behind(lookalike, lead) is lookalike


def test_a_capture_on_the_objects_own_stream_hands_out_ours(monkeypatch):
    """Replays of a step capture() recorded on the object's own stream run there: only our arrays tell their
    readers so. Where calls follow the library's stream (their replays go there too) its views stand."""
    outputs, streams, backend, current, _ = outputs_on_fake_torch(monkeypatch)
    t = Tensor(0x9000, (3, 4))
    streams.capturing = OURS
    assert outputs.library_of((t,)) is not None  # (outputs_on_fake_torch's objects follow the library)
    own = Streams(backend, OURS, False, 0)
    own.capturing = OURS
    assert Outputs("inputs", own, lambda s: None).library_of((t,)) is None
