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
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.a2a import LAYOUT_CHOICES  # noqa: E402
from pyhipa2a.profile import (TAGS, kernel_starts_and_ends, stage_durations, stage_windows, summarize,  # noqa: E402
                              to_trace_events, write_trace)
from pyhipa2a.testing import (dispatch_uploaded, draw_world, dtype_arguments, free_inputs,  # noqa: E402
                              inputs_as_given, run_round, upload_inputs)

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
                      stage_durations(by_rank), sorted(by_rank), 26, lambda c: f"{c[0]:>7.2f} / {c[1]:>7.2f} {c[2]:>8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
