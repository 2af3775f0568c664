"""Streams and graphs: a call's stream as the object chooses it (pyhipa2a.streams, with fake producers); under
MPI, calls across streams, inputs written on other streams, captures of our own and of other libraries
(PyTorch's graphs among them)."""
from __future__ import annotations

import numpy as np
import pytest

from pyhipa2a import producers
from pyhipa2a.array import DeviceArray
from pyhipa2a.streams import ANY, LAST, Streams
from tests.fakes import OURS, FakeCuda, Tensor, fake_torch
from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case

CASE = "tests.cases.stream_cases:"


def test_calls_on_the_current_stream_take_the_first_input_that_names_one(monkeypatch):
    """AllToAll(stream="current"): a call given no stream= runs on the current stream of its first input
    whose library names one, and says how it chose (its library's probe, the input, the handle; ANY where
    an earlier input's library named none); where none does, on the last call's (our own before any)."""
    current = [0x55]
    fake_torch(monkeypatch, current)
    streams = Streams(FakeCuda(), OURS, True, 0)
    mine = DeviceArray(FakeCuda(), 0x6000, (2, 4), np.float16, stream=0x99)
    t = Tensor(0x1000, (2, 4))
    probe = producers.stream_source(t)
    assert streams.current((np.zeros(2), mine, t)) == (0x55, (probe, 2, 0x55))
    current[0] = 0
    assert streams.current((t,)) == (1, (probe, 0, 1))  # PyTorch's default stream: the legacy one, CUDA's 1
    hip = FakeCuda()
    hip.kind = "hip"  # HIP's null stream is 0: the call runs there, while the probe still answers 1
    assert Streams(hip, OURS, True, 0).current((t,)) == (0, (probe, 0, 1))
    assert streams.current((np.zeros(2), mine, None)) == (OURS, LAST)  # none names one, no call yet: our own
    elsewhere = Tensor(0x1000, (2, 4))
    elsewhere.get_device = lambda: 1
    assert streams.current((elsewhere,)) == (OURS, ANY)  # on another device: not its stream (the checks refuse it)
    assert streams.current((elsewhere, t)) == (1, ANY)  # (a later input's library chose: asked again each time)
    streams.queued(0x77)
    assert streams.current((mine,)) == (0x77, LAST)  # the last call's, so that calls on our own arrays keep order
    streams.synchronized(0x77)
    assert streams.latest() == OURS


def test_a_replay_goes_to_the_stream_an_eager_call_would_take(monkeypatch):
    """Graph.launch() with no stream=: on the current stream of the library whose arrays the captured step
    took (asked at each launch), where calls follow it; on the capture's stream otherwise. Then the replay
    is ordered with the caller's work before and after it on that stream, as an eager call is."""
    current = [0x55]
    fake_torch(monkeypatch, current)
    backend = FakeCuda()
    backend.capture_begin = lambda stream: None
    t = Tensor(0x1000, (2, 4))
    follows = Streams(backend, OURS, True, 0)
    follows.begin(OURS)
    assert follows.enter(None, (np.zeros(2), None, t)) == (OURS, None)  # recorded on the capture's stream
    follows.enter(None, (DeviceArray(FakeCuda(), 0x6000, (2, 4), np.float16, stream=0x99),))
    target = follows.replay_target(OURS)
    assert target() == 0x55
    current[0] = 0x66
    assert target() == 0x66  # the current stream at the launch, not at the capture
    follows.begin(OURS)
    follows.enter(None, (DeviceArray(FakeCuda(), 0x6000, (2, 4), np.float16, stream=0x99),))
    assert follows.replay_target(OURS)() == OURS  # a step on our own arrays only: the capture's stream
    own = Streams(backend, OURS, False, 0)
    own.begin(OURS)
    own.enter(None, (t,))
    assert own.replay_target(OURS)() == OURS  # calls on the object's own stream: replays too


@pytest.mark.parametrize("backend", BACKENDS)
def test_checks_between_back_to_back_replays(backend):
    # On the GPU at the sweep's size, where the buffers are large enough for a fill to outlast a
    # kernel launch; on the host twin small (its fills are synchronous anyway).
    H, M = (7168, 256) if backend == "gpu" else (64, 16)
    run_case(CASE + "case_checks_between_back_to_back_replays", ranks_for(backend), env_backend(backend),
             args=(H, M), timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("via", ["cai", "dlpack"])
def test_inputs_written_on_another_stream(via):
    run_case(CASE + "case_inputs_written_on_another_stream", ranks_for("gpu"), env_backend("gpu"), args=(via,))


@pytest.mark.gpu
def test_graph_launch_follows_the_callers_stream():
    run_case(CASE + "case_graph_launch_follows_the_callers_stream", ranks_for("gpu"), env_backend("gpu"), timeout=300)


@pytest.mark.gpu
def test_calls_in_torch_graph():
    run_case(CASE + "case_calls_in_torch_graph", ranks_for("gpu"), env_backend("gpu"), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_on_different_streams(backend):
    H, M = (7168, 256) if backend == "gpu" else (64, 16)  # on the GPU, calls long enough to overlap
    run_case(CASE + "case_calls_on_different_streams", ranks_for(backend), env_backend(backend), args=(H, M),
             timeout=600)




@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_graph_replays", "case_calls_in_callers_capture"])
def test_graphs(case, backend):
    run_case(CASE + case, ranks_for(backend), env_backend(backend))
