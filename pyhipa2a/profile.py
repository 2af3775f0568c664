"""In-kernel timelines: collection, clock alignment, summaries, Perfetto traces.

`AllToAll(..., profile=True)` loads the profiling build of the kernels
(`*.profile.*` code objects, built with -DA2A_PROFILE=1), whose warps record
(start, end, tag, block, warp, detail) for every stage into a device buffer.
The normal build compiles the recording away. Each device's clock is compared
with rank 0's on the device (a clock sync: kernels_hip/clock.hip), and rank
0's with the host's monotonic clock through one reading, so the timelines of
all ranks line up in one trace to a fraction of a microsecond.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np


# tag -> (name, kind); kept in sync with kernels_hip/profile.h. kind: what the
# time was spent on: "wait" (for a peer), "move" (copying / computing), "span"
# (a warp's whole kernel), "sync" (grid-level bookkeeping).
TAGS = {
    1: ("dispatch.route", "move"),
    2: ("dispatch.stage", "move"),
    3: ("dispatch.wait_header", "wait"),
    4: ("dispatch.wait_token", "wait"),
    5: ("dispatch.fanout", "move"),
    6: ("dispatch.counts", "wait"),
    7: ("dispatch.warp", "span"),
    8: ("combine.weights", "move"),
    9: ("combine.wait_weights", "wait"),
    10: ("combine.contribute", "move"),
    11: ("combine.wait_contrib", "wait"),
    12: ("combine.reduce", "move"),
    13: ("combine.warp", "span"),
}
KERNEL_OF_SPAN = {7: "dispatch", 13: "combine"}

EVENT = np.dtype([("start", "<u8"), ("end", "<u8"), ("tag", "<u4"), ("block", "<u4"), ("warp", "<u4"),
                  ("detail", "<u4")])
HEADER_BYTES = 16  # warps, per_warp, dropped, pad (ProfHeader in kernels_hip/profile.h)


def events_offset(warps: int) -> int:
    """Where the events start: after the header and one u32 count per warp, padded to 32 bytes."""
    return HEADER_BYTES + (4 * warps + 31) // 32 * 32


class ProfileBuffer:
    """Device buffer of events, a ring per warp (the layout of kernels_hip/profile.h)."""

    def __init__(self, backend, warps: int, per_warp: int = 256):
        self.backend, self.warps, self.per_warp = backend, int(warps), int(per_warp)
        self.offset = events_offset(self.warps)
        self.nbytes = self.offset + self.warps * self.per_warp * EVENT.itemsize
        self.ptr = backend.malloc_ipc(self.nbytes)
        self.reset()

    def reset(self, stream=None) -> None:
        head = np.zeros(self.offset // 4, np.uint32)
        head[:2] = self.warps, self.per_warp
        self.backend.copy_to_device(self.ptr, head, stream)

    def read(self, stream=None) -> tuple[np.ndarray, int]:
        """(events, dropped): the events recorded since the last reset, warp by warp; dropped counts the
        events a warp's ring overwrote (and is at least 1 when a warp beyond the buffer's tried)."""
        head = np.empty(self.offset // 4, np.uint32)
        self.backend.copy_to_host(head, self.ptr, stream)
        counts = head[HEADER_BYTES // 4:HEADER_BYTES // 4 + self.warps].astype(np.int64)
        dropped = int(head[2]) + int(np.maximum(counts - self.per_warp, 0).sum())
        if not counts.any():
            return np.empty(0, EVENT), dropped
        used = int(np.flatnonzero(counts)[-1]) + 1  # copy only up to the last warp that recorded
        events = np.empty((used, self.per_warp), EVENT)
        self.backend.copy_to_host(events, self.ptr + self.offset, stream)
        keep = np.arange(self.per_warp)[None, :] < np.minimum(counts[:used], self.per_warp)[:, None]
        return events[keep], dropped

    def free(self) -> None:
        if self.ptr:
            self.backend.free(self.ptr)
            self.ptr = 0


def clock_offset(backend, library, stream, tries: int = 5) -> int:
    """host monotonic ns minus device clock ns, from the tightest of `tries` probes."""
    kernel = library.kernel("clock_probe")
    pack = kernel.pack()
    out = backend.malloc_ipc(8)
    try:
        best = None
        for _ in range(tries):
            pack.set_scalars(out)
            before = time.monotonic_ns()
            kernel.launch(pack, 1, 1, stream)
            backend.stream_synchronize(stream)
            after = time.monotonic_ns()
            device = np.empty(1, np.uint64)
            backend.copy_to_host(device, out, stream)
            if best is None or after - before < best[0]:
                best = (after - before, (before + after) // 2 - int(device[0]))
        return best[1]
    finally:
        backend.free(out)


CLOCK_ROUNDS = 32  # words each peer trades with rank 0 in a clock sync (kernels_hip/clock.hip)


@dataclass(frozen=True)
class ClockSync:
    """This rank's clock against rank 0's, from a clock sync's stamps (ns)."""
    offset_ns: int     # this rank's clock minus rank 0's
    error_ns: int      # the offset is within this of the truth: half the longest round trip used
    one_way_ns: float  # a word's trip between the two ranks (median of the rounds used)


def clock_sync_from_stamps(rank0: np.ndarray, peer: np.ndarray) -> ClockSync:
    """A peer's ClockSync from rank 0's stamps with it and its own with rank 0, each [round] = (sent,
    seen) by that rank's clock. NTP's arithmetic: in round i rank 0 sends at s0 and sees the answer at
    r0, the peer sees the word at r1 and answers at s1; whatever each trip takes, the peer's offset
    lies within half the round trip (r0 - s0) - (s1 - r1) of ((r1 - s0) + (s1 - r0)) / 2. The quarter
    of the rounds with the shortest round trips give the median offset."""
    s0, r0 = rank0[:, 0].astype(np.int64), rank0[:, 1].astype(np.int64)
    s1, r1 = peer[:, 0].astype(np.int64), peer[:, 1].astype(np.int64)
    round_trip = (r0 - s0) - (s1 - r1)
    best = np.argsort(round_trip, kind="stable")[:max(1, len(round_trip) // 4)]
    offsets = ((r1 - s0) + (s1 - r0))[best] / 2
    return ClockSync(int(np.median(offsets)), int(round_trip[best].max() + 1) // 2,
                     float(np.median(round_trip[best])) / 2)


def to_trace_events(events: np.ndarray, rank: int, offset_ns: int) -> list[dict]:
    """Chrome/Perfetto 'complete' events: process = rank, thread = block, times in us."""
    out = []
    for e in events:
        name, kind = TAGS.get(int(e["tag"]), (f"tag{int(e['tag'])}", "other"))
        detail = int(e["detail"])
        out.append({"name": name, "cat": kind, "ph": "X", "pid": rank, "tid": int(e["block"]),
                    "ts": (int(e["start"]) + offset_ns) / 1e3,
                    "dur": max(int(e["end"]) - int(e["start"]), 0) / 1e3,
                    "args": {"warp": int(e["warp"]), "peer": detail & 0xFF, "token": detail >> 8}})
    return out


def summarize(events_by_rank: dict[int, np.ndarray]) -> dict:
    """Per kernel and rank: time waiting vs moving data (summed over warps), slowest block, most-waited-for peer."""
    summary = {}
    for rank, events in events_by_rank.items():
        for span_tag, kernel in KERNEL_OF_SPAN.items():
            mine = [e for e in events if TAGS.get(int(e["tag"]), ("", ""))[0].startswith(kernel + ".")]
            if not mine:
                continue
            totals = defaultdict(float)
            per_block = defaultdict(float)
            waited_on = defaultdict(float)
            for e in mine:
                dur = (int(e["end"]) - int(e["start"])) / 1e3
                name, kind = TAGS[int(e["tag"])]
                totals[kind] += dur
                if int(e["tag"]) == span_tag:
                    per_block[int(e["block"])] = max(per_block[int(e["block"])], dur)
                if kind == "wait":
                    waited_on[int(e["detail"]) & 0xFF] += dur
            slowest = max(per_block.items(), key=lambda kv: kv[1]) if per_block else (None, 0.0)
            peer = max(waited_on.items(), key=lambda kv: kv[1]) if waited_on else (None, 0.0)
            summary[(kernel, rank)] = {
                "wait_us": totals["wait"], "move_us": totals["move"], "sync_us": totals["sync"],
                "warp_span_us": totals["span"], "slowest_block": slowest[0], "slowest_block_us": slowest[1],
                "most_waited_peer": peer[0], "most_waited_us": peer[1], "events": len(mine)}
    return summary


def _call_windows(calls_by_rank: dict[int, list[np.ndarray]], offsets: dict[int, int]) -> list[dict]:
    """For each call every rank recorded: {(rank, tag): (first start, last end)} in ns on the clocks
    aligned by `offsets` (empty for a call with no events)."""
    ncalls = min(len(c) for c in calls_by_rank.values())
    out = []
    for i in range(ncalls):
        windows = {}
        for r, calls in calls_by_rank.items():
            ev = calls[i]
            for tag in np.unique(ev["tag"]):
                pick = ev["tag"] == tag
                first, last = int(ev["start"][pick].min()), int(ev["end"][pick].max())
                windows[(r, int(tag))] = (first + offsets[r], last + offsets[r])
        out.append(windows)
    return out


def _kernel_spans(windows: dict, ranks) -> dict:
    """Of one call's windows: per kernel that every rank ran, each rank's (start, end) of its span."""
    spans = {kernel: [windows.get((r, tag)) for r in ranks] for tag, kernel in KERNEL_OF_SPAN.items()}
    return {kernel: s for kernel, s in spans.items() if None not in s}


KERNEL_OF_TAG = {tag: name.split(".")[0] for tag, (name, _) in TAGS.items()}  # "dispatch" or "combine"


def stage_windows(calls_by_rank: dict[int, list[np.ndarray]], offsets: dict[int, int],
                  from_kernel_start: bool = False) -> dict:
    """When each stage ran, for reading the critical path: per (rank, tag), the median over the calls
    that ran it of the first start and the last end of that stage (us), measured from the call's
    earliest event on any rank (clocks aligned by `offsets`), or, with `from_kernel_start`, from the
    latest rank's start of the stage's own kernel in that call: each kernel's stages then read without
    the ranks' start skew and the gap before the kernel (calls where a rank did not run it are left
    out). A median, since a call whose ranks started far apart (the first after a capture, above all:
    tens of microseconds) would pull a mean. Every rank must have recorded the same number of calls."""
    per_stage = defaultdict(list)
    for windows in _call_windows(calls_by_rank, offsets):
        if not windows:
            continue
        origin = {None: min(first for first, _ in windows.values())}
        origin.update({kernel: max(start for start, _ in spans)
                       for kernel, spans in _kernel_spans(windows, calls_by_rank).items()})
        for (r, tag), (first, last) in windows.items():
            kernel = KERNEL_OF_TAG.get(tag) if from_kernel_start else None
            if kernel in origin:
                per_stage[(r, tag)].append(((first - origin[kernel]) / 1e3, (last - origin[kernel]) / 1e3))
    return {key: tuple(float(x) for x in np.median(np.array(v), axis=0)) for key, v in per_stage.items()}


def stage_durations(events_by_rank: dict[int, np.ndarray]) -> dict:
    """Per (rank, tag): the median and 90th percentile (us) of one event's duration, and how many events
    there were. A stage's window (stage_windows) says when its warps were at it; this says how long one
    item of it took a warp (a segment's copy, a token's reduce), which a stage whose items all start at
    once and end at once (a latency, not a queue) shows best."""
    out = {}
    for r, events in events_by_rank.items():
        if not len(events):
            continue
        durations = (events["end"].astype(np.int64) - events["start"].astype(np.int64)) / 1e3
        for tag in np.unique(events["tag"]):
            d = durations[events["tag"] == tag]
            out[(r, int(tag))] = (float(np.median(d)), float(np.percentile(d, 90)), len(d))
    return out


def kernel_starts_and_ends(calls_by_rank: dict[int, list[np.ndarray]], offsets: dict[int, int]) -> dict:
    """Per kernel, the median over calls (us, clocks aligned by `offsets`) of how far apart the ranks'
    kernels started (first warp's start, earliest rank to latest) and how long the kernel ran from the
    latest rank's start to the latest rank's end: the kernel's time once every rank has started, without
    the ranks' start skew that each rank's own timing of a call holds. Only calls that every rank ran."""
    per_kernel = defaultdict(list)
    for windows in _call_windows(calls_by_rank, offsets):
        for kernel, spans in _kernel_spans(windows, calls_by_rank).items():
            starts, ends = [s for s, _ in spans], [e for _, e in spans]
            per_kernel[kernel].append(((max(starts) - min(starts)) / 1e3, (max(ends) - max(starts)) / 1e3))
    return {kernel: {"start_skew_us": float(np.median([v[0] for v in values])),
                     "from_last_start_us": float(np.median([v[1] for v in values])), "calls": len(values)}
            for kernel, values in per_kernel.items()}


def write_trace(path: str, trace_events: list[dict], metadata: dict) -> None:
    """One JSON file for all ranks, created owner-writable only (no world-writable bits)."""
    names = sorted({e["pid"] for e in trace_events})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in names]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"traceEvents": meta + trace_events, "displayTimeUnit": "ns", "metadata": metadata}, f)
