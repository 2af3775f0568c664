"""Per-block timelines of dispatch and combine on every rank, in one Perfetto trace.

    mpirun -n N python scripts/trace.py [--shape E,k,H,M] [--tokens T] [--iters 3] --out trace.json

Runs the profiling build of the kernels (checked against the oracle first:
profiling must not change results), records every warp's stages (send, wait,
copy, ...) for a few calls, maps each rank's device clock onto the host's
monotonic clock, and writes one Chrome/Perfetto trace (process = rank,
thread = block). Prints per kernel and rank: time waiting vs moving data
(summed over warps), the slowest block and the most-waited-for peer.
Open the file at ui.perfetto.dev or chrome://tracing. Recording touches no
global counter (kernels_hip/profile.h), but it still costs time (`bench.py
--profile` measures how much): use the timelines for order and overlap, and
bench.py for durations.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.config import LAYOUT_CHOICES  # noqa: E402
from pyhipa2a.profile import KERNEL_OF_SPAN, TAGS  # noqa: E402
from pyhipa2a.testing import (dispatch_uploaded, draw_world, dtype_arguments, free_inputs,  # noqa: E402
                              inputs_as_given, run_round, upload_inputs)

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


LARGEST_GPU_MODE_SHAPE = (256, 8, 7168, 256)


def print_stage_table(title: str, table: dict, ranks, width: int, cell) -> None:
    """A row per stage that some rank ran, a column per rank: cell(table[(rank, tag)]), '-' where none."""
    print(title)
    print(f"{'stage':<22} " + " ".join(f"{'rank ' + str(r):>{width}}" for r in ranks))
    for tag, (name, _) in sorted(TAGS.items()):
        cells = [table.get((r, tag)) for r in ranks]
        if any(cells):
            print(f"{name:<22} " + " ".join(cell(c) if c else f"{'-':>{width}}" for c in cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=",".join(map(str, LARGEST_GPU_MODE_SHAPE)), help="E,k,H,M")
    p.add_argument("--iters", type=int, default=3, help="calls recorded (after one checked, unrecorded call)")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--tokens", type=int, help="tokens per rank (default: drawn in [1, M) as gpu-mode does)")
    p.add_argument("--out", default="trace.json")
    p.add_argument("--graph", action="store_true", help="record calls launched as one captured graph each "
                   "(device inputs), as bench.py times them")
    p.add_argument("--dispatch-dtype", choices=("float8_e4m3",), help="dispatch in fp8 (combine stays fp16)")
    p.add_argument("--fp8-input", choices=("quantize", "given"), default="quantize",
                   help="fp8 dispatch: fp16 x quantized by the dispatch kernel, or x given in fp8 with x_scales")
    p.add_argument("--row-layout", choices=LAYOUT_CHOICES, default="packed",
                   help="AllToAll(row_layout=): each expert's rows packed, or by source")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    E, k, H, M = (int(v) for v in args.shape.split(","))
    E = E // world * world or world  # keep the expert count divisible by the ranks running

    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, profile=True,
                  **dtype_arguments("float16", args.dispatch_dtype, args.fp8_input),
                  row_layout=args.row_layout) as a2a:
        inputs = inputs_as_given(a2a, draw_world(args.seed, world, E, k, H, M, token_counts=None if args.tokens
                                                 is None else [args.tokens] * world), args.fp8_input)
        err = run_round(a2a, inputs)  # the profiling build against the oracle
        a2a.profile_events()           # drop the checked call's events
        before = a2a.clock_offset_ns()  # (the calls below take milliseconds: clocks drift ~ppm apart)
        sync_before = a2a.clock_sync
        recorded, dropped = [], 0
        graph = None
        if args.graph:  # the call captured once, with this rank's inputs in device buffers of its own
            arrays = upload_inputs(a2a, inputs)
            a2a.expert_y_buffer()
            graph = a2a.capture(lambda: a2a.combine(a2a.fake_expert(dispatch_uploaded(a2a, arrays)), arrays[2]))
        for i in range(args.iters):
            comm.Barrier()
            if graph is not None:
                graph.launch()
                a2a.synchronize()
            else:
                run_round(a2a, inputs, check=False)
            events, lost = a2a.profile_events()
            recorded.append(events)
            dropped += lost
        device = f"{a2a.backend.kind} {a2a.heap.device.name}"
        offset = (before + a2a.clock_offset_ns()) // 2  # collective: after every rank's calls
        sync = a2a.clock_sync
        if graph is not None:
            graph.close()
            free_inputs(a2a, arrays)

    drift = sync.offset_ns - sync_before.offset_ns  # this clock against rank 0's, over the calls
    everything = comm.gather((rank, offset, recorded, dropped, err, sync, drift), root=0)
    if rank == 0:
        calls_by_rank, offsets = {r: calls for r, _, calls, *_ in everything}, {r: o for r, o, *_ in everything}
        windows = stage_windows(calls_by_rank, offsets)
        kernel_windows = stage_windows(calls_by_rank, offsets, from_kernel_start=True)
    if rank != 0:
        return 0
    trace, by_rank = [], {}
    for r, off, per_call, *_ in everything:
        for i, events in enumerate(per_call):
            for e in to_trace_events(events, r, off):
                e["args"]["call"] = i
                trace.append(e)
        by_rank[r] = np.concatenate(per_call) if per_call else np.empty(0)
    write_trace(args.out, trace, {"shape": [E, k, H, M], "ranks": world, "device": device, "calls": args.iters,
                                  "dropped_events": sum(x[3] for x in everything)})
    print(f"pyhipa2a trace: {device}, {world} ranks, E={E} k={k} H={H} M={M}, {args.iters} calls, "
          f"oracle max err {max(x[4] for x in everything):.3g}; {len(trace)} events -> {args.out}")
    print("clocks against rank 0's (a device ping-pong, kernels_hip/clock.hip): "
          + "; ".join(f"rank {r} {s.offset_ns / 1e3:+.2f} us +- {s.error_ns / 1e3:.2f} "
                      f"(one way {s.one_way_ns / 1e3:.2f}, "
                      f"moved {drift / 1e3:+.2f} over the calls)" for r, *_, s, drift in everything[1:]))
    for kernel, k in kernel_starts_and_ends(calls_by_rank, offsets).items():
        print(f"{kernel}: the ranks' kernels started {k['start_skew_us']:.1f} us apart; from the last rank's start "
              f"to the last rank's end {k['from_last_start_us']:.1f} us (medians over {k['calls']} calls)")
    print("per kernel and rank, summed over warps and calls (us):")
    print(f"{'kernel':<9} {'rank':>4} {'waiting':>10} {'moving':>10} {'sync':>8} {'slowest block':>14} "
          f"{'its span':>9} {'most-waited peer':>17} {'for':>9}")
    for (kernel, r), s in sorted(summarize(by_rank).items()):
        print(f"{kernel:<9} {r:>4} {s['wait_us']:>10.1f} {s['move_us']:>10.1f} {s['sync_us']:>8.1f} "
              f"{str(s['slowest_block']):>14} {s['slowest_block_us']:>9.1f} {str(s['most_waited_peer']):>17} "
              f"{s['most_waited_us']:>9.1f}")
    print("per stage, summed over warps and calls (us):")
    print(f"{'stage':<22} {'kind':<5} " + " ".join(f"{'rank ' + str(r):>10}" for r in sorted(by_rank)))
    for tag, (name, kind) in sorted(TAGS.items()):
        sums = [float(((e["end"] - e["start"]) * (e["tag"] == tag)).sum()) / 1e3 if len(e) else 0.0
                for e in (by_rank[r] for r in sorted(by_rank))]
        if any(sums):
            print(f"{name:<22} {kind:<5} " + " ".join(f"{v:>10.1f}" for v in sums))
    for title, table in (("us from the call's first event on any rank", windows),
                         ("us from the last rank's start of the stage's kernel", kernel_windows)):
        print_stage_table(f"when each stage ran: first start .. last end, {title} (median over calls)", table,
                          sorted(by_rank), 17, lambda c: f"{c[0]:>7.1f} .. {c[1]:>6.1f}")
    print_stage_table("one event of each stage: median / 90th percentile (us), events over all calls",
                      stage_durations(by_rank), sorted(by_rank), 26,
                      lambda c: f"{c[0]:>7.2f} / {c[1]:>7.2f} {c[2]:>8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
