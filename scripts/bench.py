"""Timing on the gpu-mode shapes: `mpirun -n N python scripts/bench.py`.

Per shape (default: the five gpu-mode benchmark shapes, fp16 in and out,
num_tokens drawn per rank in [1, M)): one correctness check with run_round,
then the call dispatch -> fake expert ("GEMM") -> combine captured as one
graph (AllToAll.capture) and checked again; device time of each phase from
events between the phases, of the whole step (e2e) from a graph with events
around it alone (an event node between two kernels delays the second: a step
read 6.7-7.4 us longer with the events between its phases on two H100s, and no
user's step has them), and host wall time of one call the way gpu-mode's harness takes it
(cache flushed, synchronize + barrier around the call, rank 0's clock),
printed beside the floor (the same with an empty call). The same figures for
eager calls (three launches) stand beside them. Link bytes and the speed of light come
from the routing and a measured peer-store bandwidth (peer reads are measured too). `--sweep` times tokens
per rank 1..256 at E=256 k=8 H=7168 M=256 instead of the default shapes
(add --shape to get both). Device times: median per rank, max over ranks.
`--narrow-partials` runs AllToAll(narrow_partials=True): partial sums cross
in fp16 instead of fp32 (half of combine's partial-sum bytes, one more rounding).
`--fused-expert` fuses the fake expert into combine (combine(d.expert_x, w,
expert_scale=1 + rank)), as gpu-mode's fastest entries did: two kernels a call
instead of three, and no pass over expert_x; the GEMM column is then empty.
`--weights-at dispatch` gives the weights to dispatch (dispatch(x, idx,
weights=w)), which sends them with the routing, instead of to combine.
`--inputs own|numpy|cupy|torch|jax` hands the eager calls x, indices and
weights as that library's arrays (default: our own device arrays; a graph
replays the pointers it captured, so the graph columns always use ours), with
`--producer-order` passed to AllToAll. `--profile` times the profiling build
(AllToAll(profile=True)): beside a run without it, what recording costs.
`--x-in-heap` writes x into AllToAll.x_buffer() once and calls with its rows
(graphs and eager calls on our arrays): the peers pull the tokens from there,
with no staging copy.
`--dispatch-dtype float8_e4m3` dispatches in fp8 (e4m3 with one scale per 128
elements): quantized by the dispatch kernel from fp16 x (`--fp8-input
quantize`, the default), or given in fp8 with its scales (`--fp8-input given`);
combine stays fp16. Shapes whose hidden size is not a multiple of 128 are skipped. The host column is the median host
time of one eager dispatch() + combine() (until both returned; the fake expert's
launch between them is not counted), `launch` the host time of two empty kernels'
launches timed the same way (a step's two launches with no library code around
them: a lower bound of the host column within a node), and eag/gr the eager wall over the graph's.
`yard` is a fixed piece of Python's time right after the host column was taken
(the device machines' vCPUs run Python at full speed part of the time, about
half speed otherwise: scripts/cpu_speed.py), and the starred columns the same
figures taken with each rank on a CPU found at full speed, the best of three takes.
`ls ...` columns (lockstep): `--lockstep-calls` calls (default 8) back to back
in one graph after one more call, each between events of its own. Each
rank's first call absorbs the ranks' launch skew (two processes' graph launches
after a barrier start microseconds apart, and the earlier rank's call
waits for the later one); the later calls follow the exchange's own pace,
as consecutive layers of a model do. Their median per phase, beside empty
kernels timed the same way (ls nop); ls e2e is theirs too, so it counts the
event nodes between the phases that the e2e column leaves out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll, SymmetricHeap, get_backend  # noqa: E402
from pyhipa2a.config import LAYOUT_CHOICES, STREAM_CHOICES  # noqa: E402
from pyhipa2a.dtypes import FP8_BLOCK  # noqa: E402
from pyhipa2a.kernels import KernelLibrary, route_chunks  # noqa: E402
from pyhipa2a.repeat import COMPILED as PLANS_IN_C  # noqa: E402
from pyhipa2a.traffic import link_bytes  # noqa: E402
from pyhipa2a.testing import (GPU_MODE_TOLERANCE, check_call, dispatch_uploaded, draw_world,  # noqa: E402
                              dtype_arguments, failure_line, free_inputs, fused_combine, in_x_buffer, inputs_as_given,
                              poison, run_round, upload_inputs, weights_where)
from cpu_speed import SLACK, FastCpu, yardstick_us  # noqa: E402  (scripts/, this file's directory)

SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpumode_all2all.json")
MiB = 1 << 20
FLUSH_BYTES = 256 * MiB   # larger than any L2/MALL, like gpu-mode's cache clear
COPY_BYTES = 256 * MiB    # per bandwidth repetition
COPY_REPS = 20
SWEEP_TOKENS = (1, 8, 32, 64, 128, 256)
NEW_ARRAYS = 4  # the `new` column's calls take these many sets of the eager inputs in turn: new objects at every call
PHASES = ("dispatch", "gemm", "combine", "e2e")
# A timed call's spans, by the indices of the events that bound them (call(): before dispatch, after it,
# before combine, after it).
SPANS = {"dispatch": (0, 1), "gemm": (1, 2), "combine": (2, 3), "e2e": (0, 3)}
WHOLE = {"e2e": (0, 3)}  # the spans of a call with events around it alone
INPUT_KINDS = ("own", "numpy", "cupy", "torch", "jax")


def parse_shape(text: str) -> dict:
    try:
        E, k, H, M = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants E,k,H,M (four integers), got {text!r}") from None
    return {"num_experts": E, "experts_per_token": k, "hidden_dim": H, "max_num_tokens": M}


def shape_name(s: dict) -> str:
    return f"E={s['num_experts']} k={s['experts_per_token']} H={s['hidden_dim']} M={s['max_num_tokens']}"


# -- speed of light -------------------------------------------------------------
def peer_bandwidth(comm, backend) -> dict:
    """GB/s of copy_bytes between neighbours, every rank at once (min over ranks): stores
    into rank r+1's memory (the speed of light's bandwidth), and reads from it (what a
    pulling kernel can get at best).

    All ranks copy simultaneously so the figure is what one rank gets while
    every link is busy, as during an all-to-all. One rank, or the host backend
    (where a "peer" is the same RAM), measures a local copy instead.
    """
    world, rank = comm.Get_size(), comm.Get_rank()
    local = world == 1 or backend.kind == "host"
    peer = rank if local else (rank + 1) % world
    with SymmetricHeap(comm, 2 * COPY_BYTES, backend=backend) as heap:
        src, dst = heap.alloc(COPY_BYTES, np.uint8), heap.alloc(COPY_BYTES, np.uint8)
        lib = KernelLibrary(backend, heap.device.arch)
        kernel = lib.kernel("copy_bytes")
        stream, start, end = backend.stream_create(), backend.event_create(), backend.event_create()
        medians = {}
        for direction, (to, frm) in {"store": (heap.translate(dst.ptr, peer), src.ptr),
                                     "read": (dst.ptr, heap.translate(src.ptr, peer))}.items():
            pack = kernel.pack()
            pack.set_scalars(to, frm, COPY_BYTES)
            times = []
            for i in range(COPY_REPS + 1):  # the first launch is a warm-up
                backend.stream_synchronize(stream)
                comm.Barrier()
                backend.event_record(start, stream)
                kernel.launch(pack, 4 * heap.device.multiprocessors, 256, stream)
                backend.event_record(end, stream)
                backend.event_synchronize(end)
                if i:
                    times.append(backend.event_elapsed_ms(start, end))
            medians[direction] = statistics.median(times)
        for ev in (start, end):
            backend.event_destroy(ev)
        backend.stream_destroy(stream)
        lib.close()
        device = heap.device.name
    gbps = {d: comm.allreduce(COPY_BYTES / (ms * 1e-3) / 1e9, op=MPI.MIN) for d, ms in medians.items()}
    what = (f"local copy ({'host backend' if backend.kind == 'host' else 'one rank'})" if local
            else "peer stores rank r -> r+1, all ranks at once")
    return {"gbps": gbps["store"], "read_gbps": gbps["read"], "what": what, "device": device}


# -- one call, and its timings ------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """How the bench makes a call: the fake expert fused into combine (its scale applied there; no
    expert kernel, a GEMM phase of 0) or a kernel of its own, and the call that takes the weights."""
    fused: bool = False
    weights_at: str = "combine"


def call(a2a, arrays, step: Step, events=None, between=lambda: None):
    """dispatch -> fake expert -> combine, with an event before, between and after when given.
    `arrays`: x, indices, weights (and x's scales when x is fp8). `between()` runs after dispatch()
    returned and again before combine() is called (the host-time column leaves out what lies between)."""
    s = a2a.stream_for(*arrays) if events else None  # (with --calls-on current, the arrays' library's)
    mark = lambda i: events and events[i] is not None and a2a.backend.event_record(events[i], s)  # noqa: E731
    to_dispatch, w = weights_where(arrays[2], step.weights_at)
    mark(0)
    d = dispatch_uploaded(a2a, arrays, **to_dispatch)
    between()
    mark(1)
    ey = None if step.fused else a2a.fake_expert(d)
    mark(2)
    between()
    y = fused_combine(a2a, d, w) if step.fused else a2a.combine(ey, w)
    mark(3)
    return d, y


def capture(a2a, arrays, step: Step, made: contextlib.ExitStack, event_sets=(None,)):
    """The call as one graph, once for each set of four events (recorded inside it at every launch; None:
    no events), back to back: (graph, the last call's (d, y)); the graph is closed when `made` closes."""
    out = []
    graph = a2a.capture(lambda: out.extend(call(a2a, arrays, step, events) for events in event_sets))
    made.callback(graph.close)
    return graph, out[-1]


def capture_empty(a2a, event_sets, step: Step, made: contextlib.ExitStack):
    """A graph of empty kernels in place of the calls' (launched with the exchange kernels' geometry,
    between the same event nodes): what the calls cost over bare launches. One call's kernels for each
    set of four events, in order; destroyed when `made` closes. Returns what launches it."""
    b, s = a2a.backend, a2a.stream
    kernel = empty_kernel(a2a, made)
    pack = kernel.pack()
    launch = lambda: kernel.launch(pack, a2a.config.blocks, a2a.config.block_threads, s)  # noqa: E731
    a2a.synchronize()
    b.capture_begin(s)
    try:
        for events in event_sets:
            for i, phase in enumerate(PHASES[:3]):
                if events[i] is not None:
                    b.event_record(events[i], s)
                if phase != "gemm" or not step.fused:
                    launch()
            b.event_record(events[3], s)
    finally:
        graph = b.capture_end(s)
        made.callback(b.graph_destroy, graph)
    return lambda: b.graph_launch(graph, s)


def collective_check(comm, check, what: str = "") -> str:
    """Run `check()` on every rank; '' when every rank passed, else the ranks' messages."""
    msg = ""
    try:
        check()
    except Exception as e:  # a failing rank makes its peers time out rather than hang
        msg = failure_line(comm.Get_rank(), e, what)
    return "; ".join(m for m in comm.allgather(msg) if m)


def check_run(comm, a2a, inputs, run, step: Step, what: str) -> str:
    """One call (`run()` makes it and returns its (dispatch result, y)) on poisoned outputs against the
    oracle."""
    def check():
        poison(a2a)
        outputs = run()
        a2a.synchronize()
        check_call(a2a, inputs, *outputs, tolerance=GPU_MODE_TOLERANCE, fused=step.fused)
    return collective_check(comm, check, what)


def with_x_in_heap(a2a, arrays: list, inputs) -> list:
    """`arrays` with x replaced by the rows of a2a.x_buffer() that hold it (--x-in-heap)."""
    return [in_x_buffer(a2a, inputs.xs[a2a.rank]), *arrays[1:]]


def framework_arrays(kind: str, a2a, inputs) -> list:
    """This rank's x, indices and weights as `kind`'s arrays on a2a's device, written and finished
    (numpy: host arrays, copied at each call; ours come from upload_inputs)."""
    hosts = [inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]]
    hosts += [] if inputs.x_scales is None else [inputs.x_scales[a2a.rank]]
    dev = a2a.heap.device.index
    if kind == "numpy":
        return hosts
    if kind == "cupy":
        import cupy
        if hosts[0].dtype.itemsize == 1:
            raise SystemExit("--inputs cupy: CuPy has no fp8 arrays")
        with cupy.cuda.Device(dev):
            arrays = [cupy.asarray(h) for h in hosts]
            cupy.cuda.Device(dev).synchronize()
        return arrays
    if kind == "torch":
        import torch

        def to_torch(h):  # torch reads no ml_dtypes array: fp8 goes over as bytes
            if h.dtype.name.startswith("float8"):
                return torch.from_numpy(h.view(np.uint8)).to(f"cuda:{dev}").view(getattr(torch, h.dtype.name))
            return torch.from_numpy(h).to(f"cuda:{dev}")
        arrays = [to_torch(h) for h in hosts]
        torch.cuda.synchronize(dev)
        return arrays
    import jax  # kind == "jax"
    device = [d for d in jax.devices() if d.platform == "gpu"][dev]
    arrays = [jax.device_put(h, device) for h in hosts]
    for a in arrays:
        a.block_until_ready()
    return arrays


def eager_arrays(kind: str, a2a, inputs, made: contextlib.ExitStack) -> list:
    """A new set of this rank's eager inputs (x, indices, weights), `kind`'s arrays as framework_arrays
    makes them, or ours (freed when `made` closes)."""
    if kind != "own":
        return framework_arrays(kind, a2a, inputs)
    arrays = upload_inputs(a2a, inputs)
    made.callback(free_inputs, a2a, arrays)
    return arrays


def median_host_us(comm, a2a, timed, iters: int, stream=None) -> float:
    """Median over `iters` samples (after 10 more) of the seconds `timed()` returns, each taken after a
    synchronize (of `stream`, else the last call's) and a barrier, in us, max over ranks."""
    times = []
    for i in range(iters + 10):
        a2a.synchronize(stream)
        comm.Barrier()
        sample = timed()
        if i >= 10:
            times.append(sample)
    a2a.synchronize(stream)
    return comm.allreduce(statistics.median(times) * 1e6, op=MPI.MAX)


def host_time(comm, a2a, arrays, step: Step, iters: int, turns=None) -> float:
    """Median host time of one eager dispatch() + combine() (us), max over ranks; the fake expert's launch
    between them (when not fused) is not counted. `turns`: sets of arrays that the calls take in turn
    instead of `arrays` (a layer's activations and a router's outputs are new arrays at every step)."""
    taken = [0]

    def timed():
        stamps = [time.perf_counter()]
        given = arrays if turns is None else turns[taken[0] % len(turns)]
        taken[0] += 1
        call(a2a, given, step, between=lambda: stamps.append(time.perf_counter()))
        stamps.append(time.perf_counter())
        return (stamps[1] - stamps[0]) + (stamps[3] - stamps[2])
    return median_host_us(comm, a2a, timed, iters)


def empty_kernel(a2a, made: contextlib.ExitStack):
    """The empty kernel, from a library of its own on a2a's device (closed when `made` closes)."""
    library = KernelLibrary(a2a.backend, a2a.heap.device.arch)
    made.callback(library.close)
    return library.kernel("nothing")


def launch_host_time(comm, a2a, arrays, iters: int, made: contextlib.ExitStack) -> float:
    """Median host time (us, max over ranks) of launching two empty kernels with the exchange kernels'
    geometry on the stream a step on `arrays` takes, timed as host_time times the step: what its two
    launches cost with no library code around them (on the host backend, the empty kernel's host twin)."""
    kernel, s = empty_kernel(a2a, made), a2a.stream_for(*arrays)
    pack = kernel.pack()

    def timed():
        t0 = time.perf_counter()
        kernel.launch(pack, a2a.config.blocks, a2a.config.block_threads, s)
        kernel.launch(pack, a2a.config.blocks, a2a.config.block_threads, s)
        return time.perf_counter() - t0
    return median_host_us(comm, a2a, timed, iters, s)


def device_times(comm, a2a, run, event_sets, warmup: int, iters: int, spans=SPANS) -> dict:
    """Median per rank of each span (us), then the max over ranks: the slowest rank sets the pace.
    `run()` makes calls that record events before, between and after their phases: each of `event_sets`
    (lists of four events, None where a call records none) is one call's, whose spans are samples."""
    b = a2a.backend
    samples = []
    for i in range(warmup + iters):
        a2a.synchronize()
        comm.Barrier()  # all ranks launch together, so dispatch does not time a late peer's arrival
        run()
        a2a.synchronize()
        if i >= warmup:
            for ev in event_sets:
                samples.append([b.event_elapsed_ms(ev[first], ev[last]) for first, last in spans.values()])
    medians = np.median(np.array(samples), axis=0) * 1e3
    return {p: comm.allreduce(float(m), op=MPI.MAX) for p, m in zip(spans, medians)}


def walls_of_one_take(comm, a2a, graph, arrays, step: Step, flush_ptr: int, iters: int) -> tuple[float, float]:
    """(graph wall, eager wall) of the step, one after the other (eag/gr compares them)."""
    return (wall_time(comm, a2a, graph.launch, flush_ptr, iters),
            wall_time(comm, a2a, lambda: call(a2a, arrays, step), flush_ptr, iters))


def wall_time(comm, a2a, body, flush_ptr: int, iters: int) -> float:
    """gpu-mode's clock: flush, synchronize + barrier, rank 0 times body + synchronize + barrier (us)."""
    times = []
    for i in range(iters):
        a2a.backend.memset(flush_ptr, i & 0xFF, FLUSH_BYTES, a2a.stream)
        a2a.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        body()
        a2a.synchronize()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6  # only rank 0's figure is reported


def bare_exchange_walls(comm, a2a, flush_ptr: int, iters: int, made: contextlib.ExitStack) -> dict:
    """Across nodes: the wall of the engine alone moving the call's bytes between nodes, eagerly and (where
    the engine is capturable) replayed as a graph, as the call's own wall is: the call is set beside the
    graph, since an eager exchange pays the engine's host-side launch (a group launch of NCCL's) that a
    replay does not."""
    walls = {"bare_exchange_eager_wall": wall_time(comm, a2a, a2a.exchange_between_nodes, flush_ptr, iters)}
    if a2a.engine.capturable:
        graph = a2a.capture(a2a.exchange_between_nodes)
        made.callback(graph.close)
        walls["bare_exchange_wall"] = wall_time(comm, a2a, graph.launch, flush_ptr, iters)
    return walls


def check_once(comm, a2a, inputs, step: Step) -> str:
    """One eager call on poisoned outputs against the oracle."""
    return collective_check(comm, lambda: run_round(a2a, inputs, tolerance=GPU_MODE_TOLERANCE, fused=step.fused,
                                                    weights_at=step.weights_at))


def call_events(b, made: contextlib.ExitStack) -> list:
    """The four events a timed call records (before, between and after its phases), destroyed when
    `made` closes."""
    events = [b.event_create() for _ in range(4)]
    for ev in events:
        made.callback(b.event_destroy, ev)
    return events


def failed(made: contextlib.ExitStack, error: str, timed: dict | None = None) -> dict:
    """A FAIL row (with what was timed before the failure), after releasing what `made` holds. A release
    that raises (after a device fault every later call does) is printed, not raised: the row says why
    the shape failed."""
    try:
        made.close()
    except Exception as e:
        print(f"bench: releasing after a failed check: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return {**(timed or {}), "ok": False, "error": error}


def lockstep(comm, a2a, arrays, inputs, step: Step, args) -> dict:
    """ls_<phase>: each phase of args.lockstep_calls calls back to back (after one more, which takes the
    launch skew), the last call checked like the single one; ls_empty: empty kernels timed the same way."""
    b = a2a.backend
    with contextlib.ExitStack() as made:  # every graph and event goes, whichever way this returns
        event_sets = [call_events(b, made) for _ in range(args.lockstep_calls + 1)]
        graph, last = capture(a2a, arrays, step, made, event_sets)  # the first call takes the launch skew
        launch_empty = capture_empty(a2a, event_sets, step, made)
        error = check_run(comm, a2a, inputs, lambda: (graph.launch(), last)[1], step, " (lockstep graph)")
        if error:
            return failed(made, error)
        timed = device_times(comm, a2a, graph.launch, event_sets[1:], args.warmup, args.iters)
        empty = device_times(comm, a2a, launch_empty, event_sets[1:], args.warmup, args.iters)
    return {**{"ls_" + p: v for p, v in timed.items()}, "ls_empty": empty["dispatch"]}


def time_shape(comm, a2a, inputs, args, step: Step, flush_ptr: int | None, fast: FastCpu) -> dict:
    """measure()'s timings of one checked shape: {"ok": False, "error": ...} when a timed graph or an eager
    call is wrong. Host figures (and, with flush_ptr, the walls) are taken again on CPUs at full speed
    (`fast`). Every buffer, graph and event it makes goes before it returns, whichever way it does
    (every rank in the same order: the timings end synchronized)."""
    with contextlib.ExitStack() as made:
        arrays = upload_inputs(a2a, inputs)  # a failure from here on aborts the job (see the end of the file)
        made.callback(free_inputs, a2a, arrays)  # (last: callbacks run in reverse order)
        if args.x_in_heap:
            arrays = with_x_in_heap(a2a, arrays, inputs)
        given = arrays if args.inputs == "own" else framework_arrays(args.inputs, a2a, inputs)  # the eager calls'
        turns = [given] + [eager_arrays(args.inputs, a2a, inputs, made) for _ in range(NEW_ARRAYS - 1)]
        b = a2a.backend
        events = call_events(b, made)
        around = [events[0], None, None, events[3]]  # e2e's: nothing recorded between the phases
        timed, timed_out = capture(a2a, arrays, step, made, [events])
        whole, whole_out = capture(a2a, arrays, step, made, [around])
        bare, bare_out = capture(a2a, arrays, step, made)
        error = (check_run(comm, a2a, inputs, lambda: (timed.launch(), timed_out)[1], step, " (graph)")
                 or check_run(comm, a2a, inputs, lambda: (whole.launch(), whole_out)[1], step, " (graph)")
                 or check_run(comm, a2a, inputs, lambda: (bare.launch(), bare_out)[1], step, " (graph)")
                 or check_run(comm, a2a, inputs, lambda: call(a2a, given, step), step,
                              f" (eager, {args.inputs} inputs)")
                 or check_run(comm, a2a, inputs, lambda: call(a2a, turns[-1], step), step,
                              f" (eager, new {args.inputs} inputs)"))
        if error:
            return failed(made, error)
        def whole_e2e(run) -> float:  # a step that records `around`'s events, timed as e2e
            return device_times(comm, a2a, run, [around], args.warmup, args.iters, WHOLE)["e2e"]
        r = device_times(comm, a2a, timed.launch, [events], args.warmup, args.iters)
        r["e2e_phased"] = r["e2e"]  # (with events between the phases: JSON only)
        r["e2e"] = whole_e2e(whole.launch)
        launch_empty = capture_empty(a2a, [events], step, made)
        r["empty"] = device_times(comm, a2a, launch_empty, [events], args.warmup, args.iters)["dispatch"]
        r["empty_e2e"] = whole_e2e(capture_empty(a2a, [around], step, made))  # the step's kernels, empty: e2e's floor
        if args.lockstep_calls:
            ls = lockstep(comm, a2a, arrays, inputs, step, args)
            if not ls.get("ok", True):
                return failed(made, ls["error"], r)
            r.update(ls)
        eager = device_times(comm, a2a, lambda: call(a2a, given, step, events), [events], args.warmup, args.iters)
        eager["e2e"] = whole_e2e(lambda: call(a2a, given, step, around))
        r.update({"eager_" + p: v for p, v in eager.items()})
        r["host"] = host_time(comm, a2a, given, step, args.iters)
        yard = yardstick_us()  # how fast Python ran right after (the CPU may have changed since)
        fast.saw(yard)
        r["yard"] = comm.allreduce(yard, op=MPI.MAX)
        r["host_new"] = host_time(comm, a2a, given, step, args.iters, turns)
        r["host_launches"] = launch_host_time(comm, a2a, given, args.iters, made)
        # The same on CPUs found at full speed (scripts/cpu_speed.py: the best of a few takes; None where none was)
        r["host_fast"], host_yard = fast.measure(lambda: host_time(comm, a2a, given, step, args.iters))
        r["host_launches_fast"], launch_yard = fast.measure(
            lambda: launch_host_time(comm, a2a, given, args.iters, made))
        yards = [host_yard, launch_yard]
        if flush_ptr is not None:
            def take_walls():
                return walls_of_one_take(comm, a2a, bare, given, step, flush_ptr, args.iters)
            r["wall"], r["eager_wall"] = take_walls()
            fast_walls, wall_yard = fast.measure(take_walls, key=lambda walls: walls[1])
            # (the graph wall of the take whose eager wall was best: eag/gr* compares the two of one take)
            r["wall_fast"], r["eager_wall_fast"] = fast_walls or (None, None)
            r["eager_over_graph_fast"] = fast_walls and fast_walls[1] / fast_walls[0]
            yards.append(wall_yard)
            r["floor"] = wall_time(comm, a2a, lambda: None, flush_ptr, args.iters)
            r["empty_wall"] = wall_time(comm, a2a, launch_empty, flush_ptr, args.iters)
            r["eager_over_graph"] = r["eager_wall"] / r["wall"]
            if hasattr(a2a, "exchange_between_nodes"):
                r.update(bare_exchange_walls(comm, a2a, flush_ptr, args.iters, made))
        r["fast_yard"] = max(yards) if None not in yards else None  # the slowest pick's yardstick of them all
        return r


def measure(comm, a2a, inputs, args, bw: dict, flush_ptr: int | None, fast: FastCpu) -> dict:
    """Check, then time one shape, as one graph per call and as eager calls (wall times too when
    flush_ptr is given). The main columns are the graph's; eager_* are the same call, three launches."""
    r = {"tokens_per_rank": float(np.mean([len(x) for x in inputs.xs])),
         "launch": {"block_threads": a2a.config.block_threads, "blocks": a2a.config.blocks,
                    "small_combine_tokens": getattr(a2a, "small_combine_tokens", -1)},
         "pushed_ranks": sum(len(x) <= a2a.config.push_max_tokens for x in inputs.xs)}
    step = Step(args.fused_expert, args.weights_at)
    inputs = inputs_as_given(a2a, inputs, args.fp8_input)
    error = check_once(comm, a2a, inputs, step)
    if error:
        return {**r, "ok": False, "error": error}
    timed_phases = time_shape(comm, a2a, inputs, args, step, flush_ptr, fast)
    if not timed_phases.get("ok", True):
        return {**r, **timed_phases}
    r.update(timed_phases)
    # x_bytes: per element, its scale's share too
    x_bytes = a2a.config.dispatch_dtype.itemsize + 4 * a2a.config.scale_cols / a2a.config.hidden
    sizes = (inputs.indices, a2a.config.num_experts, a2a.config.hidden, x_bytes, a2a.config.out_dtype.itemsize)
    chunks = route_chunks(a2a.config.top_k, a2a.config.max_tokens)
    dispatch, combine = link_bytes(*sizes, push_max_tokens=a2a.config.push_max_tokens,
                                   push_tokens=a2a.config.push_tokens, narrow_partials=a2a.config.narrow_partials,
                                   count_chunks=chunks, weights_at=args.weights_at)
    total = float(dispatch.sum() + combine.sum())
    # The speed of light moves the data alone: a pushed call's tags are our overhead, not its floor.
    data = sum(link_bytes(*sizes, push_max_tokens=0, narrow_partials=a2a.config.narrow_partials, count_chunks=chunks,
                          weights_at=args.weights_at))
    sol = float(data.max()) / (bw["gbps"] * 1e9) * 1e6
    r.update(ok=True, link_bytes=total, gbps=total / (r["e2e"] * 1e-6) / 1e9,
             sol=sol, ratio=r["e2e"] / sol if sol > 0 else None)
    return r


# -- the two runs -----------------------------------------------------------------------
def make_a2a(comm, backend, s: dict, args) -> AllToAll:
    keys = ("num_experts", "experts_per_token", "hidden_dim", "max_num_tokens")
    dtypes = dtype_arguments("float16", args.dispatch_dtype, args.fp8_input)
    return AllToAll(comm, **{k: s[k] for k in keys}, **dtypes, timeout=10.0, backend=backend,
                    narrow_partials=args.narrow_partials, producer_order=args.producer_order,
                    stream=args.calls_on, profile=args.profile, row_layout=args.row_layout)


def run_shapes(comm, backend, shapes, args, bw, flush_ptr, fast) -> list[dict]:
    world, rows = comm.Get_size(), []
    for s in shapes:
        row = {"shape": shape_name(s), **s}
        if s["num_experts"] % world:
            rows.append({**row, "ok": False, "error": f"SKIP: experts do not divide over {world} ranks"})
            continue
        if args.dispatch_dtype != "float16" and s["hidden_dim"] % FP8_BLOCK:
            rows.append({**row, "ok": False, "error": f"SKIP: fp8 dispatch needs H to be a multiple of {FP8_BLOCK}"})
            continue
        inputs = draw_world(s["seed"], world, s["num_experts"], s["experts_per_token"], s["hidden_dim"],
                            s["max_num_tokens"])
        result = None
        try:
            with make_a2a(comm, backend, s, args) as a2a:
                result = measure(comm, a2a, inputs, args, bw, flush_ptr, fast)
        except Exception:
            if result is None or result["ok"]:
                raise
            # closing after a failed check may time out on a peer; the FAIL row says enough
        rows.append({**row, **result})
    return rows


def run_sweep(comm, backend, args, bw, fast) -> list[dict]:
    world = comm.Get_size()
    s = {"num_experts": 256 // world * world, "experts_per_token": 8, "hidden_dim": args.sweep_hidden,
         "max_num_tokens": max(SWEEP_TOKENS), "seed": args.seed if args.seed is not None else 1234}
    rows = []
    try:
        with make_a2a(comm, backend, s, args) as a2a:
            for T in SWEEP_TOKENS:
                inputs = draw_world(s["seed"] + T, world, s["num_experts"], 8, s["hidden_dim"],
                                    s["max_num_tokens"], token_counts=[T] * world)
                rows.append({"shape": shape_name(s), **s, "tokens": T,
                             **measure(comm, a2a, inputs, args, bw, None, fast)})
                if not rows[-1]["ok"]:
                    break  # the AllToAll is unusable after a failure; later points would only time out
    except Exception:
        if not rows or rows[-1]["ok"]:
            raise  # as in run_shapes: only a close after a failed check may fail quietly
    return rows


# -- output (rank 0) ------------------------------------------------------------------
def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def all_taken(values) -> list | None:
    """`values` as a list, or None where one of them is None (a figure not taken) or there are none."""
    values = list(values)
    return None if not values or None in values else values


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def print_shapes(rows) -> None:
    print("graph: one graph launch per call (the main figures); eager: dispatch, fake expert and combine "
          "launched one by one; host: eager dispatch() + combine() host time; launch: two empty kernels' launches "
          "timed so (a lower bound of host); eag/gr: eager wall / graph wall; yard: a fixed piece of Python's time "
          "right after host (max over ranks; the device machines' vCPUs read about 2 at full speed, up to twice that "
          f"otherwise); new: host with new arrays at every call ({NEW_ARRAYS} sets of the inputs in turn); *: the same "
          "taken with each rank on a CPU found at full speed just before, the best of three takes "
          "(scripts/cpu_speed.py; '-': none found), yard* the slowest of those CPUs' yards at their pick; "
          "nop: one empty kernel between the same event nodes; +nop: wall over a graph of as many empty kernels; "
          "ls: calls back to back in one graph after one that takes the ranks' launch skew (--lockstep-calls), "
          "median per call; ls nop: an empty kernel timed so")
    print(f"{'shape':<30} {'tok/rk':>7} {'disp':>9} {'gemm':>9} {'comb':>9} {'e2e':>9} {'nop':>5} {'wall':>9} "
          f"{'+nop':>6} "
          f"{'eag e2e':>9} {'eag wall':>9} {'host':>7} {'launch':>6} {'eag/gr':>6} {'yard':>5} {'new':>7} {'host*':>7} "
          f"{'launch*':>7} {'eag/gr*':>7} {'yard*':>5} {'floor':>9} {'push':>5} {'link MB':>8} "
          f"{'GB/s':>7} {'SOL':>8} {'ratio':>6} {'ls e2e':>7} {'ls nop':>6}")
    for r in rows:
        if not r["ok"]:
            verdict = "SKIP" if r["error"].startswith("SKIP") else "FAIL"
            print(f"{r['shape']:<30} {verdict}  {r['error'].removeprefix('SKIP: ')}")
            continue
        print(f"{r['shape']:<30} {r['tokens_per_rank']:>7.1f} " + " ".join(f"{r[p]:>9.1f}" for p in PHASES)
              + f" {r['empty']:>5.1f} {r['wall']:>9.1f} {r['wall'] - r['empty_wall']:>6.1f} {r['eager_e2e']:>9.1f} "
              f"{r['eager_wall']:>9.1f} {r['host']:>7.1f} "
              f"{r['host_launches']:>6.1f} {r['eager_over_graph']:>6.2f} {r['yard']:>5.1f} {r['host_new']:>7.1f} "
              f"{fmt(r['host_fast']):>7} {fmt(r['host_launches_fast']):>7} {fmt(r['eager_over_graph_fast'], '.2f'):>7} "
              f"{fmt(r['fast_yard']):>5} "
              f"{r['floor']:>9.1f} "
              f"{r['pushed_ranks']:>5} {r['link_bytes'] / 1e6:>8.2f} {r['gbps']:>7.1f} {r['sol']:>8.2f} "
              f"{fmt(r['ratio'], '.2f'):>6}"
              f" {fmt(r.get('ls_e2e')):>7} {fmt(r.get('ls_empty')):>6}")
    ok = [r for r in rows if r["ok"]]
    print(f"geomean over {len(ok)} shapes: e2e device {fmt(geomean(r['e2e'] for r in ok))} us "
          f"(empty kernels {fmt(geomean(r['empty_e2e'] for r in ok))}), "
          f"wall {fmt(geomean(r['wall'] for r in ok))} us (empty kernels' graph "
          f"{fmt(geomean(r['empty_wall'] for r in ok))}; eager: e2e {fmt(geomean(r['eager_e2e'] for r in ok))}, "
          f"wall {fmt(geomean(r['eager_wall'] for r in ok))}, host {fmt(geomean(r['host'] for r in ok))} "
          f"(two empty launches {fmt(geomean(r['host_launches'] for r in ok))}; new arrays at every call "
          f"{fmt(geomean(r['host_new'] for r in ok))}), "
          f"eager/graph wall max {fmt(max((r['eager_over_graph'] for r in ok), default=None), '.2f')}; "
          f"on CPUs at full speed: host {fmt(geomean(all_taken(r['host_fast'] for r in ok) or []))}, "
          f"eager/graph wall max {fmt(max(all_taken(r['eager_over_graph_fast'] for r in ok) or [None]), '.2f')}; "
          f"floor {fmt(geomean(r['floor'] for r in ok))} us), "
          f"ratio to SOL {fmt(geomean(r['ratio'] for r in ok), '.2f')}")


def print_between_nodes(rows) -> None:
    """Across nodes: each call's wall beside a bare exchange of the same bytes by the same engine."""
    rows = [r for r in rows if r["ok"] and "bare_exchange_eager_wall" in r]
    if not rows:
        return
    print("between nodes: wall of the call (graph) beside a bare exchange of the same bytes between nodes "
          "(the engine alone: dispatch's regions and combine's records and sums), replayed as a graph and eager; "
          "ratio: the call over the bare graph; link MB, GB/s and SOL above count one node's model, not the "
          "traffic between nodes")
    print(f"{'shape':<30} {'wall':>9} {'bare':>9} {'ratio':>6} {'bare eager':>10}")
    for r in rows:
        bare = r.get("bare_exchange_wall")
        print(f"{r['shape']:<30} {r['wall']:>9.1f} {fmt(bare):>9} "
              f"{fmt(r['wall'] / bare if bare else None, '.2f'):>6} {r['bare_exchange_eager_wall']:>10.1f}")


def print_sweep(rows) -> None:
    print(f"sweep {rows[0]['shape']}, same columns")
    print(f"{'tok/rk':>7} {'disp':>9} {'gemm':>9} {'comb':>9} {'e2e':>9} {'nop':>5} {'eag disp':>9} {'eag comb':>9} "
          f"{'eag e2e':>9} {'host':>7} {'launch':>6} {'yard':>5} {'host*':>7} {'launch*':>7} {'yard*':>5} {'push':>5} "
          f"{'link MB':>8} "
          f"{'GB/s':>7} {'SOL':>8} {'ratio':>6} "
          f"{'ls disp':>7} {'ls comb':>7} {'ls nop':>6}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['tokens']:>7} FAIL  {r['error']}")
            continue
        print(f"{r['tokens']:>7} " + " ".join(f"{r[p]:>9.1f}" for p in PHASES) + f" {r['empty']:>5.1f}"
              + " " + " ".join(f"{r['eager_' + p]:>9.1f}" for p in ("dispatch", "combine", "e2e"))
              + f" {r['host']:>7.1f} {r['host_launches']:>6.1f} {r['yard']:>5.1f} {fmt(r['host_fast']):>7} "
              f"{fmt(r['host_launches_fast']):>7} {fmt(r['fast_yard']):>5} {r['pushed_ranks']:>5} "
              f"{r['link_bytes'] / 1e6:>8.2f} {r['gbps']:>7.1f} {r['sol']:>8.2f} {fmt(r['ratio'], '.2f'):>6}"
              + f" {fmt(r.get('ls_dispatch')):>7} {fmt(r.get('ls_combine')):>7} {fmt(r.get('ls_empty')):>6}")


def plot(path: str, shapes, sweep) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; no plot written to {path}")
        return
    ok, good = [r for r in shapes if r["ok"]], [r for r in sweep if r["ok"]]
    panels = int(bool(ok)) + int(bool(good))
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    if ok:
        ax, pos = axes.pop(0), np.arange(len(ok))
        ax.bar(pos - 0.2, [r["e2e"] for r in ok], 0.4, label="e2e device")
        ax.bar(pos + 0.2, [r["wall"] for r in ok], 0.4, label="wall (rank 0)")
        ax.set_xticks(pos, [r["shape"].replace(" ", "\n") for r in ok], fontsize=7)
        ax.set(ylabel="us")
        ax.legend()
    if good:
        ax = axes.pop(0)
        for p in ("dispatch", "combine", "e2e"):
            ax.plot([r["tokens"] for r in good], [r[p] for r in good], marker="o", label=p)
        ax.set(xscale="log", xlabel="tokens per rank", ylabel="us")
        ax.set_title(good[0]["shape"], fontsize=8)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def report(args, backend, bw: dict, rows, sweep, fast_cpus: bool) -> None:
    world = MPI.COMM_WORLD.Get_size()
    command = shlex.join(["python", *sys.argv])
    partials = "fp16 (--narrow-partials)" if args.narrow_partials else "fp32"
    expert = ("fused into combine (--fused-expert: no expert kernel)" if args.fused_expert
              else "a kernel of its own")
    dtypes = ("fp16" if args.dispatch_dtype == "float16"
              else f"dispatch {args.dispatch_dtype} ({args.fp8_input} fp8 x), combine fp16")
    print(f"pyhipa2a bench: {backend.kind} backend, {bw['device']}, {world} ranks, {dtypes}, "
          f"{args.iters} iters ({args.warmup} warm-up), partial sums {partials}, fake expert {expert}, "
          f"weights to {args.weights_at}, eager inputs {args.inputs} (producer_order={args.producer_order}, "
          f"calls on {args.calls_on} stream), rows {args.row_layout}" + (", x in the heap" if args.x_in_heap else ""))
    per_node = os.environ.get("PYHIPA2A_RANKS_PER_NODE")
    nodes = f", simulated nodes of {per_node} ranks (PYHIPA2A_RANKS_PER_NODE)" if per_node else ""
    print(f"command ({world} ranks{nodes}): {command}")
    # (host figures of repeated calls depend on it: a run whose code objects were copied in over a build may
    # have lost the helper, and its calls then take the Python executor unseen)
    print("repeated calls: " + ("the C helper" if PLANS_IN_C else "the Python executor (no C helper: "
                                "python -m pyhipa2a.build --only host), which makes host figures larger"))
    print(f"store bandwidth: {bw['gbps']:.1f} GB/s, {bw['what']} (SOL = max over ranks of its data's link bytes / "
          "this; link MB also counts pushed calls' tags); "
          f"reads{' (local copy)' if 'local' in bw['what'] else ' from rank r+1'}: {bw['read_gbps']:.1f} GB/s")
    print("times in us; device: median per rank, max over ranks; wall and floor: rank 0's clock, median; "
          "push: ranks whose call was pushed (PYHIPA2A_PUSH_MAX_TOKENS: its contributions pushed back, its tokens "
          "too where AllToAll.push_tokens), the others staged them")
    print("starred host figures: " + (f"each rank on a CPU of its own share that runs within {args.full_speed_slack}x "
                                      "of the node's fastest yardstick (--full-speed-slack)" if fast_cpus
                                      else "not taken (some rank has no CPU of its own to move to)"))
    launch = next((r["launch"] for r in rows + sweep if "launch" in r), None)
    if launch:
        small = launch.get("small_combine_tokens", -1)
        print(f"grid: {launch['blocks']} blocks of {launch['block_threads']} threads "
              "(PYHIPA2A_GRID_BLOCKS, PYHIPA2A_BLOCK_THREADS); combine's small kernel "
              + (f"for calls of up to {small} tokens (the first shape's)" if small >= 0 else "not used")
              + f" (PYHIPA2A_COMBINE_KERNEL={os.environ.get('PYHIPA2A_COMBINE_KERNEL', 'auto')})")
    if rows:
        print_shapes(rows)
        print_between_nodes(rows)
    if sweep:
        print_sweep(sweep)
    if args.json:
        machine = {"backend": backend.kind, "device": bw["device"], "world_size": world}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "command": command, "iters": args.iters, "warmup": args.warmup,
                       "narrow_partials": args.narrow_partials, "fused_expert": args.fused_expert,
                       "weights_at": args.weights_at, "lockstep_calls": args.lockstep_calls,
                       "inputs": args.inputs, "producer_order": args.producer_order, "calls_on": args.calls_on,
                       "dispatch_dtype": args.dispatch_dtype, "fp8_input": args.fp8_input,
                       "row_layout": args.row_layout, "x_in_heap": args.x_in_heap, "fast_cpus": fast_cpus,
                       "full_speed_slack": args.full_speed_slack, "plans_in_c": PLANS_IN_C,
                       "bandwidth": bw, "units": "us, bytes, GB/s", "shapes": rows, "sweep": sweep}, f, indent=1)
        print(f"json written to {args.json}")
    if args.plot:
        plot(args.plot, rows, sweep)


def load_shapes(args) -> list[dict]:
    """--shape entries, else (unless --sweep alone) gpu-mode's benchmark shapes; --seed overrides seeds."""
    if args.shape:
        return [{**s, "seed": args.seed if args.seed is not None else 1234} for s in args.shape]
    if args.sweep:
        return []
    with open(SHAPES_FILE) as f:
        keys = ("num_experts", "experts_per_token", "hidden_dim", "max_num_tokens", "seed")
        shapes = [{k: s[k] for k in keys} for s in json.load(f)["benchmarks"]]
    return [{**s, "seed": args.seed} for s in shapes] if args.seed is not None else shapes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=parse_shape, action="append", help="E,k,H,M (repeatable); default: gpu-mode's")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="overrides the shapes' seeds (default: gpu-mode's, or 1234)")
    p.add_argument("--sweep", action="store_true", help="tokens per rank 1..256 instead of the default shapes")
    p.add_argument("--sweep-hidden", type=int, default=7168, help="H of the sweep (smaller for slow backends)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--plot", help="write a PNG (needs matplotlib)")
    p.add_argument("--narrow-partials", action="store_true",
                   help="AllToAll(narrow_partials=True): partial sums cross in fp16, not fp32")
    p.add_argument("--fused-expert", action="store_true",
                   help="the fake expert fused into combine (combine(d.expert_x, w, expert_scale=1 + rank)): "
                        "no expert kernel")
    p.add_argument("--weights-at", choices=("combine", "dispatch"), default="combine",
                   help="the call that takes the gate's weights: combine(expert_y, w), or dispatch(x, idx, "
                        "weights=w), which sends them with the routing")
    p.add_argument("--inputs", choices=INPUT_KINDS, default="own",
                   help="the eager calls' x, indices and weights: our device arrays, NumPy (copied), CuPy, PyTorch "
                        "or JAX arrays")
    p.add_argument("--x-in-heap", action="store_true",
                   help="x written once into AllToAll.x_buffer(), the calls on its rows (our own arrays)")
    p.add_argument("--profile", action="store_true",
                   help="run the profiling build (every warp records its timeline): what profiling costs")
    p.add_argument("--producer-order", choices=("protocol", "stream"), default="protocol",
                   help="AllToAll(producer_order=): how device inputs are ordered after their producers")
    p.add_argument("--calls-on", choices=STREAM_CHOICES, default="own",
                   help="AllToAll(stream=): eager calls on the object's own stream, or on the current stream of "
                        "their inputs' library (--inputs torch|cupy)")
    p.add_argument("--dispatch-dtype", choices=("float16", "float8_e4m3"), default="float16",
                   help="expert_x's dtype: fp16 as x, or fp8 e4m3 with one float32 scale per 128 elements")
    p.add_argument("--fp8-input", choices=("quantize", "given"), default="quantize",
                   help="fp8 dispatch: fp16 x quantized by the dispatch kernel, or x given in fp8 with x_scales")
    p.add_argument("--row-layout", choices=LAYOUT_CHOICES, default="packed",
                   help="AllToAll(row_layout=): each expert's rows packed, or by source (expert_layout)")
    p.add_argument("--full-speed-slack", type=float, default=SLACK,
                   help="the starred columns' CPUs run at full speed where a yardstick reads within this factor of "
                        "the node's fastest reading (scripts/cpu_speed.py; inf: any CPU)")
    p.add_argument("--lockstep-calls", type=int, default=8,
                   help="calls timed back to back in one graph after one that takes the launch skew (the ls "
                        "columns); 0: none")
    args = p.parse_args()
    if args.lockstep_calls < 0:
        p.error("--lockstep-calls must be 0 or more")
    if args.dispatch_dtype != "float16" and args.fused_expert:
        p.error("--fused-expert reads expert_x as expert_y, which is 16-bit: not with fp8 dispatch")
    if args.inputs == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the device's memory to the heap
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    comm = MPI.COMM_WORLD
    shapes = load_shapes(args)

    backend = get_backend()  # one backend for every heap and buffer of this run
    bw = peer_bandwidth(comm, backend)
    flush_ptr = backend.malloc_ipc(FLUSH_BYTES)
    fast = FastCpu(comm, args.full_speed_slack)
    rows = run_shapes(comm, backend, shapes, args, bw, flush_ptr, fast)
    sweep = run_sweep(comm, backend, args, bw, fast) if args.sweep else []
    fast.close()
    backend.free(flush_ptr)
    if comm.Get_rank() == 0:
        report(args, backend, bw, rows, sweep, fast.usable)
    return 0 if all(r["ok"] or r["error"].startswith("SKIP") for r in rows + sweep) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # one rank failing mid-timing would leave the others in a barrier forever
        traceback.print_exc()
        MPI.COMM_WORLD.Abort(1)
