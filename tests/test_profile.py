"""Profiling: the trace of every rank (scripts/trace.py) is valid Perfetto JSON and its summary adds up; the
clock syncs' arithmetic (pyhipa2a.clock)."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from pyhipa2a.clock import clock_sync_from_stamps
from pyhipa2a.profile import EVENT, TAGS
from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case
from tests.script_modules import load_script

trace_script = load_script("trace")
kernel_starts_and_ends, stage_durations, stage_windows, summarize = (
    trace_script.kernel_starts_and_ends, trace_script.stage_durations, trace_script.stage_windows,
    trace_script.summarize)

KERNEL_SPAN = {"dispatch": "dispatch.warp", "combine": "combine.warp"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_trace_script(tmp_path, backend):
    ranks = ranks_for(backend)
    out = tmp_path / "trace.json"
    shape = "16,4,512,16" if backend == "host" else "256,8,7168,256"
    run = run_case("tests.cases.profile_cases:case_trace", ranks, env_backend(backend), args=(shape, str(out)))
    trace = json.loads(out.read_text())                      # loads in a JSON parser
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(ranks))   # every rank present
    names = {name for name, _ in TAGS.values()}
    assert {e["name"] for e in events} <= names               # names from the fixed table
    assert trace["metadata"]["dropped_events"] == 0
    # every event lies inside its kernel's span on its rank, for each call
    spans = defaultdict(lambda: [float("inf"), float("-inf")])
    for e in events:
        kernel = e["name"].split(".")[0]
        if e["name"] == KERNEL_SPAN[kernel]:
            s = spans[(e["pid"], e["args"]["call"], kernel)]
            s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
    for e in events:
        kernel = e["name"].split(".")[0]
        lo, hi = spans[(e["pid"], e["args"]["call"], kernel)]
        assert lo - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= hi + 1e-3, e
        assert e["dur"] >= 0
    assert "oracle max err" in run.stdout and "waiting" in run.stdout
    assert "from the last rank's start of the stage's kernel" in run.stdout
    assert "one event of each stage: median / 90th percentile" in run.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_clock_sync(backend):
    run_case("tests.cases.profile_cases:case_clock_sync", ranks_for(backend), env_backend(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("who", ["first", "last"])
def test_clock_sync_missing_peer(who, backend):
    run_case("tests.cases.profile_cases:case_clock_sync_missing_peer", ranks_for(backend), env_backend(backend),
             args=(who,))


def test_clock_sync_arithmetic():
    """NTP's estimate from synthetic stamps: the peer's clock runs 50 us ahead of rank 0's; words take
    600 ns out and 800 back (the estimate is off by half the difference, within the bound), the peer
    answers 300 ns after seeing a word (its own stamps leave that out), and in half the rounds the word
    out is held up 5 us: those rounds' round trips are long and their offsets 2.5 us off, and only the
    quarter with the shortest round trips counts."""
    offset, out, back, reply = 50_000, 600, 800, 300
    rank0, peer = np.zeros((8, 2), np.uint64), np.zeros((8, 2), np.uint64)
    for i in range(8):
        s0 = 1_000_000 + 10_000 * i
        r1 = s0 + out + (5_000 if i % 2 else 0) + offset
        s1 = r1 + reply
        rank0[i] = s0, s1 - offset + back
        peer[i] = s1, r1
    sync = clock_sync_from_stamps(rank0, peer)
    assert sync.offset_ns == offset + (out - back) // 2
    assert sync.error_ns == (out + back) // 2 and abs(sync.offset_ns - offset) <= sync.error_ns
    assert sync.one_way_ns == (out + back) / 2


def test_stage_windows_take_the_median_call():
    """Per (rank, stage): the median over calls of first start .. last end, from each call's earliest
    event on any rank, on clocks shifted by the offsets: one call whose ranks started 80 us apart does
    not move it."""
    def call(start0, start1):  # rank r's dispatch.warp (tag 7) from start_r for 5 us, in its own clock
        out = {}
        for r, start in ((0, start0), (1, start1 - 1000)):  # rank 1's clock runs 1000 ns behind
            ev = np.zeros(1, EVENT)
            ev[0] = (start, start + 5000, 7, 0, 0, 0)
            out[r] = ev
        return out
    calls = [call(10_000, 12_000), call(10_000, 90_000), call(10_000, 13_000)]
    windows = stage_windows({r: [c[r] for c in calls] for r in (0, 1)}, {0: 0, 1: 1000})
    assert windows[(0, 7)] == pytest.approx((0.0, 5.0))
    assert windows[(1, 7)] == pytest.approx((3.0, 8.0))


def test_stage_windows_from_the_kernels_last_start():
    """from_kernel_start: each stage from the latest rank's start of its own kernel in that call (rank 1's
    clock runs 1000 ns behind; rank 1 starts each kernel later), so a combine stage reads the same
    whatever the gap after dispatch and the ranks' skew; a call where rank 1 ran no combine is left out."""
    def call(start1, gap, combine_on_1=True):
        out = {}
        for r, start in ((0, 0), (1, start1)):
            rows = [(start, start + 6_000, 7), (start + 1_000, start + 2_000, 3),  # dispatch.warp, .stage
                    (start + 6_000 + gap, start + 10_000 + gap, 13),               # combine.warp
                    (start + 7_000 + gap, start + 9_000 + gap, 10)]                # combine.contribute
            rows = [row for row in rows if r == 0 or combine_on_1 or row[2] in (7, 3)]
            ev = np.zeros(len(rows), EVENT)
            for i, (a, b, tag) in enumerate(rows):
                ev[i] = (a - 1000 * r, b - 1000 * r, tag, 0, 0, 0)
            out[r] = ev
        return out
    calls = [call(2_000, 5_000), call(3_000, 20_000), call(2_500, 9_000), call(40_000, 1_000, combine_on_1=False)]
    w = stage_windows({r: [c[r] for c in calls] for r in (0, 1)}, {0: 0, 1: 1000}, from_kernel_start=True)
    assert w[(1, 3)] == pytest.approx((1.0, 2.0))
    assert w[(0, 3)] == pytest.approx((1.0 - 2.75, 2.0 - 2.75))  # rank 1 started 2, 3, 2.5, 40 us later: median 2.75
    assert w[(1, 10)] == pytest.approx((1.0, 3.0)) and w[(0, 10)] == pytest.approx((1.0 - 2.5, 3.0 - 2.5))
    assert w[(1, 13)] == pytest.approx((0.0, 4.0))  # only the three calls with rank 1's combine


def test_stage_durations_per_event():
    """Per (rank, stage): median and 90th percentile of one event's duration (us), and the count."""
    ev = np.zeros(11, EVENT)
    for i in range(10):
        ev[i] = (1000 * i, 1000 * i + 100 * (i + 1), 3, 0, i, 0)  # stage events of 0.1 .. 1.0 us
    ev[10] = (0, 20_000, 7, 0, 0, 0)
    d = stage_durations({0: ev, 1: np.zeros(0, EVENT)})
    assert d[(0, 3)] == pytest.approx((0.55, 0.91, 10)) and d[(0, 7)] == pytest.approx((20.0, 20.0, 1))
    assert not any(r == 1 for r, _ in d)


def test_kernel_time_from_the_last_start():
    """Per kernel, medians over calls of the ranks' start skew and of the time from the last rank's start
    to the last rank's end, on clocks shifted by the offsets (rank 1's runs 1000 ns behind)."""
    def call(start0, end0, start1, end1):
        out = {}
        for r, (start, end) in ((0, (start0, end0)), (1, (start1 - 1000, end1 - 1000))):
            ev = np.zeros(2, EVENT)
            ev[0] = (start, end, 7, 0, 0, 0)           # dispatch.warp
            ev[1] = (end + 100, end + 900, 13, 0, 0, 0)  # combine.warp
            out[r] = ev
        return out
    # rank 1 starts 2 / 3 / 50 us after rank 0; dispatch then ends 6 / 6 / 7 us after rank 1's start
    calls = [call(0, 7_000, 2_000, 8_000), call(0, 8_500, 3_000, 9_000), call(0, 56_000, 50_000, 57_000)]
    k = kernel_starts_and_ends({r: [c[r] for c in calls] for r in (0, 1)}, {0: 0, 1: 1000})
    assert k["dispatch"]["start_skew_us"] == pytest.approx(3.0)
    assert k["dispatch"]["from_last_start_us"] == pytest.approx(6.0)
    assert k["combine"]["from_last_start_us"] == pytest.approx(0.8) and k["dispatch"]["calls"] == 3


def test_summary_adds_up():
    events = np.zeros(6, EVENT)
    #            start  end  tag block warp detail(peer)
    rows = [(0, 100, 7, 0, 0, 0), (10, 30, 3, 0, 0, 1), (30, 80, 5, 0, 0, 0),
            (0, 150, 7, 1, 0, 0), (5, 45, 4, 1, 0, 2), (45, 140, 2, 1, 0, 2)]
    for i, r in enumerate(rows):
        events[i] = r
    s = summarize({0: events})[("dispatch", 0)]
    assert s["wait_us"] == pytest.approx((20 + 40) / 1e3)
    assert s["move_us"] == pytest.approx((50 + 95) / 1e3)
    assert s["warp_span_us"] == pytest.approx((100 + 150) / 1e3)
    assert s["slowest_block"] == 1 and s["slowest_block_us"] == pytest.approx(0.15)
    assert s["most_waited_peer"] == 2 and s["most_waited_us"] == pytest.approx(0.04)
    assert s["events"] == 6


def test_a_warps_ring_keeps_its_latest_events_and_counts_the_rest():
    """Each warp records into a ring of per_warp events (no global counter): past per_warp, the
    oldest are overwritten and read() says how many were lost. The host twin of kernels_hip/profile.h
    writes the same layout."""
    from pyhipa2a import get_backend
    from pyhipa2a.host_kernels import Recorder
    from pyhipa2a.profile import ProfileBuffer
    backend = get_backend("host")
    buffer = ProfileBuffer(backend, warps=3, per_warp=4)
    try:
        recorder = Recorder(buffer.ptr)
        for tag in range(1, 7):
            recorder.record(tag, start_ns=tag * 10, detail=tag)
        events, dropped = buffer.read()
        assert sorted(events["tag"].tolist()) == [3, 4, 5, 6] and dropped == 2
        assert all(e["end"] >= e["start"] for e in events)
        buffer.reset()
        assert len(buffer.read()[0]) == 0 and buffer.read()[1] == 0
    finally:
        buffer.free()
