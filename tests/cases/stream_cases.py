"""Multi-rank cases of streams and graphs: calls across streams, inputs from other streams, captures (ours, another
library's, PyTorch's) (run under mpiexec by the tests).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2AError, AllToAll
from tests.cases import launches_checked
from tests.cases.calls_cases import DLPackOnly
from pyhipa2a.testing import (WEIGHTS_AT, draw_world, run_round,
                              weights_where)


def case_checks_between_back_to_back_replays(comm, H, M, rounds="3"):
    """Rounds of back-to-back graph launches (no host synchronisation between them), each round
    followed by a poisoned, checked launch, as a benchmark's timing loop and its checks alternate.
    Poisoning fills large buffers with no stream (expert_x alone is 940 MB at H=7168, M=256 on 2 ranks);
    such a fill still running when the next call's kernels start would corrupt that call. It did,
    before a fill with no stream waited for itself."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    H, M, world = int(H), int(M), comm.Get_size()
    E, k = 256 // world * world, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        a2a.expert_y_buffer()  # the fake expert's output, allocated before capturing
        for i in range(int(rounds)):
            T = (M // 8, M // 2, M)[i % 3]  # pushed and pulled calls, as the threshold decides
            inputs = draw_world(900 + i, world, E, k, H, M, token_counts=[T] * world)
            arrays = upload_inputs(a2a, inputs)
            outs = []
            to_dispatch, w = weights_where(arrays[2], WEIGHTS_AT[i % 2])
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(arrays[0], arrays[1], **to_dispatch), a2a.combine(a2a.fake_expert(d), w))))
            try:
                for j in range(3):
                    for _ in range(5):
                        graph.launch()
                    a2a.synchronize()
                    poison(a2a)
                    graph.launch()
                    a2a.synchronize()
                    err = check_call(a2a, inputs, *outs)
                    print(f"rank {a2a.rank} round {i} check {j}: T={T} max err {err:.3g}")
            finally:
                graph.close()
                free_inputs(a2a, arrays)


def case_calls_on_different_streams(comm, H, M, rounds="4"):
    """A caller may change streams between calls (dispatch on one, its expert and combine on
    another, the next call on a third): each call is queued behind the last one, so the results
    are right, and synchronize() without a stream waits for the last call. The hand-offs are
    counted: one event recorded and waited for per change of stream, none otherwise; a refused
    call does not become the last one; after synchronize() nothing is left to wait for; a graph
    launch after a call on another stream is queued behind it too."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    H, M, world = int(H), int(M), comm.Get_size()
    E, k = 256 // world * world, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        b, me = a2a.backend, a2a.rank
        streams = [b.stream_create() for _ in range(4)]
        handoffs, owned = [], []
        record, wait = b.event_record, b.stream_wait_event
        b.event_record = lambda ev, s, **kw: (handoffs.append(("record", b.stream_handle(s))), record(ev, s, **kw))[1]
        b.stream_wait_event = lambda s, ev: (handoffs.append(("wait", b.stream_handle(s))), wait(s, ev))[1]
        h, hA = [b.stream_handle(s) for s in streams], b.stream_handle(a2a.stream)

        def inputs_for(seed, T):  # arrays that name no stream (filled synchronously): no waits for them
            inputs = draw_world(seed, world, E, k, H, M, token_counts=[T] * world)
            owned.append(upload_inputs(a2a, inputs, stream=None))
            return inputs, owned[-1]

        try:
            a2a.expert_y_buffer()
            for i in range(int(rounds)):
                T = (M // 8, M)[i % 2]  # a pushed call, then a pulled one
                inputs, (x, idx, w) = inputs_for(700 + i, T)
                poison(a2a)  # synchronizes: nothing is left to wait for
                handoffs.clear()
                d = a2a.dispatch(x, idx, stream=streams[0])
                a2a.combine(a2a.fake_expert(d, stream=streams[1]), w, stream=streams[1])
                assert handoffs == [("record", h[0]), ("wait", h[1])], (i, handoffs)
                # a call refused after its wait was queued (x's dtype is checked then) does not
                # become the last call
                with pytest.raises(TypeError, match="x"):
                    a2a.dispatch(x.view((T, H), np.uint16), idx, stream=streams[3])
                handoffs.clear()
                d = a2a.dispatch(x, idx, stream=streams[2])
                ey = a2a.fake_expert(d, stream=streams[2])
                assert b.stream_handle(ey.stream) == h[2]  # its output names the stream that wrote it
                y = a2a.combine(ey, w, stream=streams[2])
                assert handoffs == [("record", h[1]), ("wait", h[2])], (i, handoffs)
                a2a.synchronize()  # the last call's stream, streams[2]
                err = check_call(a2a, inputs, d, y)
                print(f"rank {me} round {i}: T={T} max err {err:.3g}")
            # one of our own arrays, labelled with a stream (as if written there): used after it
            x3 = pyhipa2a.DeviceArray(b, x.ptr, x.shape, x.dtype, stream=streams[3])
            handoffs.clear()
            d = a2a.dispatch(x3, idx, stream=streams[0])
            a2a.combine(a2a.fake_expert(d, stream=streams[0]), w, stream=streams[0])
            assert handoffs == [("record", h[3]), ("wait", h[0])], handoffs
            a2a.synchronize()
            # a graph captured on the object's stream, launched right after an eager call on streams[2]
            # with other inputs: its results must be the graph's own
            inputs, (x, idx, w) = inputs_for(799, M)
            outs = []
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(x, idx), a2a.combine(a2a.fake_expert(d), w))))
            _, (x2, idx2, w2) = inputs_for(798, M)
            poison(a2a)
            handoffs.clear()
            d = a2a.dispatch(x2, idx2, stream=streams[2])
            a2a.combine(a2a.fake_expert(d, stream=streams[2]), w2, stream=streams[2])
            graph.launch()
            assert handoffs == [("record", h[2]), ("wait", hA)], handoffs
            a2a.synchronize()  # the graph's stream
            check_call(a2a, inputs, *outs)
            graph.close()
        finally:
            b.event_record, b.stream_wait_event = record, wait
            a2a.synchronize()
            for arrays in owned:
                free_inputs(a2a, arrays)
            for s in streams:
                b.stream_destroy(s)


def case_inputs_written_on_another_stream(comm, via="cai", rounds="3"):
    """x, indices, weights and out= made by CuPy on a stream of its own, queued there behind a few
    milliseconds of other work; dispatch and combine are called with no stream= while that stream
    is CuPy's current one. The library must wait for those writes: for __cuda_array_interface__
    arrays on the stream they name (the same arrays every round, so a cached description must not
    skip the wait), for DLPack ones by naming its stream to __dlpack__ at every use. Inputs read
    too early are zeros, and an out= filled late is NaN: either fails the check."""
    cp = pytest.importorskip("cupy")
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    wrap = DLPackOnly if via == "dlpack" else (lambda a: a)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        with cp.cuda.Device(a2a.heap.device.index), cp.cuda.Stream(non_blocking=True) as producer:
            busy = cp.zeros(1 << 27, cp.float32)  # 512 MiB, touched 16 times before the inputs are written
            T = M // 2
            x, idx, w, y = (cp.zeros((T, H), cp.float16), cp.zeros((T, k), cp.int32),
                            cp.zeros((T, k), cp.float32), cp.zeros((T, H), cp.float16))
            # wrapped once: the same objects every round, so a cached description is reused
            xw, iw, ww, yw = (wrap(a) for a in (x, idx, w, y))
            for i in range(int(rounds)):
                inputs = draw_world(300 + i, world, E, k, H, M, token_counts=[T] * world)
                sources = [cp.asarray(h) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me])]
                for arr in (x, idx, w):
                    arr.fill(0)
                producer.synchronize()
                poison(a2a)
                for _ in range(16):
                    busy += 1.0
                for arr, src in zip((x, idx, w), sources):
                    arr[...] = src                    # queued on the producer stream, behind the busy work
                y.fill(cp.nan)                        # so is this fill of out=: our writes must come after it
                d = a2a.dispatch(xw, iw)
                a2a.combine(a2a.fake_expert(d), ww, out=yw)
                a2a.synchronize()
                check_dispatch_against_oracle(a2a, inputs, d)
                err = combine_error_against_oracle(a2a, inputs, types.SimpleNamespace(numpy=lambda: cp.asnumpy(y)))
                print(f"rank {me} round {i} via {via}: max err {err:.3g}")
            # captured with the producer's stream current: the capture must not wait for work outside
            # it (CUDA refuses that), so ordering the launch is the caller's part
            outs = []
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(xw, iw), a2a.combine(a2a.fake_expert(d), ww, out=yw))))
            inputs = draw_world(399, world, E, k, H, M, token_counts=[T] * world)
            for arr, h in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                arr[...] = cp.asarray(h)
            y.fill(cp.nan)
            producer.synchronize()
            poison(a2a)
            graph.launch()
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, outs[0])
            combine_error_against_oracle(a2a, inputs, types.SimpleNamespace(numpy=lambda: cp.asnumpy(y)))
            graph.close()


def case_graph_replays(comm, launches="4"):
    """A captured dispatch -> fake expert -> combine replays as a new call each launch: with fresh inputs
    copied into the same device buffers, every launch matches the oracle, eager calls interleave with
    launches, and misuse of capture() is refused without breaking the object."""
    from pyhipa2a.testing import free_buffers, step_buffers
    world = comm.Get_size()
    E, k, H, M = 3 * world, 2, 264, 8
    counts = [(3 * r) % (M + 1) for r in range(world)]  # differ per rank; T=0 on rank 0
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        T = counts[me]
        buffers = x, idx, w, y = step_buffers(a2a, T)
        captured = {}
        with pytest.raises(A2AError, match="needs expert_y_buffer\\(\\) called before the capture"):
            a2a.capture(lambda: a2a.combine(a2a.fake_expert(a2a.dispatch(x, idx)), w, out=y))
        a2a.expert_y_buffer()

        def step():
            captured["d"] = d = a2a.dispatch(x, idx)
            a2a.combine(a2a.fake_expert(d), w, out=y)

        try:
            graph = a2a.capture(step)
            launches_checked(a2a, graph, buffers, captured, launches,  # (an eager call between: other token counts)
                             lambda i: draw_world(100 + i, world, E, k, H, M, token_counts=counts),
                             lambda: run_round(a2a, draw_world(200, world, E, k, H, M)))

            host_x = np.zeros((T, H), np.float16)
            with pytest.raises(TypeError, match="inside capture\\(\\), x must be a device array"):
                a2a.capture(lambda: a2a.dispatch(host_x, idx))
            with pytest.raises(A2AError, match="left a dispatch without its combine"):
                a2a.capture(lambda: a2a.dispatch(x, idx))
            with pytest.raises(A2AError, match="synchronize\\(\\) inside capture"):
                a2a.capture(a2a.synchronize)
            # A replay, or close(), would run now and record nothing: a graph that did nothing at its launches
            with pytest.raises(A2AError, match="Graph.launch\\(\\) inside capture\\(\\)"):
                a2a.capture(graph.launch)
            with pytest.raises(A2AError, match="close\\(\\) inside capture\\(\\)"):
                a2a.capture(a2a.close)
            with pytest.raises(TypeError, match="step must be a function of no arguments, not int"):
                a2a.capture(5)
            d = a2a.dispatch(x, idx)
            with pytest.raises(A2AError, match="dispatch\\(\\) called again before combine\\(\\)"):
                a2a.dispatch(x, idx)
            with pytest.raises(A2AError, match="graph cannot launch while a dispatch\\(\\) awaits its combine"):
                graph.launch()  # its dispatch would reuse the pending call's epoch
            a2a.combine(a2a.fake_expert(d), w)
            run_round(a2a, draw_world(300, world, E, k, H, M))  # still usable after every refusal
            graph.launch()                                      # and so is the graph
            a2a.synchronize()
            graph.close()
            with pytest.raises(A2AError, match="graph is closed"):
                graph.launch()
        finally:
            free_buffers(a2a, buffers)


def case_calls_in_callers_capture(comm, launches="3"):
    """Calls made while another library captures their stream (torch.cuda.graph does that; here the
    backend's own capture stands in for it, unknown to the AllToAll) are recorded into that capture:
    each replay of the caller's graph is a new call that matches the oracle with fresh inputs in the
    same buffers, eager calls interleave with replays, and a dispatch and its combine must be made on
    the same side of the capture."""
    from pyhipa2a.testing import check_call, free_buffers, poison, step_buffers
    world = comm.Get_size()
    E, k, H, M = 3 * world, 2, 264, 8
    counts = [(3 * r + 1) % (M + 1) for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me, b = a2a.rank, a2a.backend
        T = counts[me]
        s = b.stream_create()  # the caller's stream
        buffers = x, idx, w, y = step_buffers(a2a, T)
        a2a.expert_y_buffer()  # (the fake expert's output: memory cannot be allocated while capturing)

        def step(fused: bool):
            d = a2a.dispatch(x, idx, stream=s)
            if fused:
                a2a.combine(d.expert_x, w, out=y, stream=s, expert_scale=1 + me)
            else:
                a2a.combine(a2a.fake_expert(d, stream=s), w, out=y, stream=s)
            return d

        def load(inputs):
            b.stream_synchronize(s)
            for arr, host in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                arr.copy_from(host)
            poison(a2a)
            y.fill_bytes(0xFF)
            b.stream_synchronize(a2a.stream)

        try:
            for fused in (False, True):
                inputs = draw_world(60 + fused, world, E, k, H, M, token_counts=counts)
                load(inputs)
                d = step(fused)  # eager on the caller's stream first: the captured calls must not repeat it
                b.stream_synchronize(s)
                check_call(a2a, inputs, d, y, fused=fused)
                b.capture_begin(s)
                try:
                    d = step(fused)
                finally:
                    graph = b.capture_end(s)
                a2a.synchronize()  # (the capture left: synchronize() is refused inside one)
                for i in range(int(launches)):
                    inputs = draw_world(70 + 10 * fused + i, world, E, k, H, M, token_counts=counts)
                    load(inputs)
                    comm.Barrier()
                    b.graph_launch(graph, s)
                    b.stream_synchronize(s)
                    err = check_call(a2a, inputs, d, y, fused=fused)
                    print(f"rank {me} fused={fused} replay {i}: T={T} max err {err:.3g}")
                    if i == 0:  # an eager call between replays, on the object's own stream
                        run_round(a2a, draw_world(80 + fused, world, E, k, H, M))
                        a2a.synchronize()
                b.graph_destroy(graph)

            # A combine recorded into the capture of a dispatch made outside it: refused, nothing broken.
            d = a2a.dispatch(x, idx)
            b.capture_begin(s)
            with pytest.raises(A2AError, match="made outside it awaits its combine"):
                a2a.combine(d.expert_x, w, stream=s, expert_scale=1 + me)
            b.capture_end(s, keep=False)
            a2a.combine(d.expert_x, w, expert_scale=1 + me)
            run_round(a2a, draw_world(90, world, E, k, H, M))

            # A dispatch recorded alone: the object's next call outside the capture refuses, for good.
            b.capture_begin(s)
            a2a.dispatch(x, idx, stream=s)
            b.capture_end(s, keep=False)
            with pytest.raises(A2AError, match="recorded into another library's capture was followed by combine"):
                a2a.combine(d.expert_x, w, expert_scale=1 + me)
            with pytest.raises(A2AError, match="unusable after an earlier failure"):
                a2a.dispatch(x, idx)
        finally:
            b.stream_synchronize(s)
            free_buffers(a2a, buffers)
            b.stream_destroy(s)


def case_calls_in_torch_graph(comm, launches="3"):
    """torch.cuda.graph captures our calls with PyTorch's tensors on its capture stream
    (AllToAll(stream="current")), after eager calls on that same stream (a serving engine's warm-up),
    and a PyTorch consumer of the output in the same graph; each replay, with fresh inputs copied into
    the same tensors, matches the oracle, with eager calls between replays."""
    from pyhipa2a.testing import check_call, poison
    torch = pytest.importorskip("torch")
    if pyhipa2a.get_backend().kind != "cuda":
        pytest.skip("torch.cuda.graph needs the CUDA backend")
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    counts = [M // 2 - 3 * r for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream="current",
                  outputs="ours") as a2a:
        me = a2a.rank
        dev = torch.device("cuda", a2a.heap.device.index)
        torch.cuda.set_device(dev)
        T = counts[me]
        x = torch.zeros((T, H), dtype=torch.float16, device=dev)
        idx = torch.zeros((T, k), dtype=torch.int32, device=dev)
        w = torch.zeros((T, k), dtype=torch.float32, device=dev)
        capture_stream = torch.cuda.Stream(dev)

        def load(seed):
            inputs = draw_world(seed, world, E, k, H, M, token_counts=counts)
            torch.cuda.synchronize()
            for t, host in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                t.copy_(torch.from_numpy(host))
            torch.cuda.synchronize()
            poison(a2a)
            return inputs

        def step():
            d = a2a.dispatch(x, idx)
            y = a2a.combine(d.expert_x, w, expert_scale=1 + me)
            return d, y, torch.from_dlpack(y).float() * 2  # consumed by PyTorch on the same stream

        with torch.cuda.stream(capture_stream):
            for seed in (1, 2):  # eager, twice: the second repeats the first
                inputs = load(seed)
                d, y, z = step()
                torch.cuda.synchronize()
                check_call(a2a, inputs, d, y, fused=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream):
            d, y, z = step()
        a2a.synchronize()  # (the capture left: synchronize() is refused inside one)
        for i in range(int(launches)):
            inputs = load(10 + i)
            comm.Barrier()
            graph.replay()
            torch.cuda.synchronize()
            err = check_call(a2a, inputs, d, y, fused=True)
            np.testing.assert_array_equal(z.cpu().numpy(), y.numpy().astype(np.float32) * 2)
            print(f"rank {me} replay {i}: T={T} max err {err:.3g}")
            if i == 0:
                run_round(a2a, draw_world(20, world, E, k, H, M), fused=True)  # our own arrays, eager
                a2a.synchronize()




def case_graph_launch_follows_the_callers_stream(comm, launches="3"):
    """Graph.launch() is ordered with the caller's stream on the device: PyTorch tensors are written on a
    PyTorch stream behind milliseconds of other work, the graph is launched, and a PyTorch copy of out=
    is queued right after the launch, with no host wait between them. With AllToAll(stream="current") a
    launch with no stream= goes to PyTorch's current stream; an object on its own stream is given
    launch(stream=). A replay that read its inputs early (zeros), or a copy that read out= before the
    replay wrote it (NaN), fails the check."""
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, poison
    torch = pytest.importorskip("torch")
    if pyhipa2a.get_backend().kind != "cuda":
        pytest.skip("PyTorch's streams need the CUDA backend")
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    T = M // 2
    for calls_on in ("current", "own"):
        params = {"stream": "current"} if calls_on == "current" else {}
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, **params) as a2a:
            me = a2a.rank
            dev = torch.device("cuda", a2a.heap.device.index)
            torch.cuda.set_device(dev)
            x = torch.zeros((T, H), dtype=torch.float16, device=dev)
            idx = torch.zeros((T, k), dtype=torch.int32, device=dev)
            w = torch.zeros((T, k), dtype=torch.float32, device=dev)
            y = torch.zeros((T, H), dtype=torch.float16, device=dev)
            busy = torch.zeros(1 << 27, dtype=torch.float32, device=dev)  # 512 MiB, touched 16 times a launch
            side = torch.cuda.Stream(dev)
            a2a.expert_y_buffer()
            torch.cuda.synchronize()
            outs = []
            with torch.cuda.stream(side):
                graph = a2a.capture(lambda: outs.extend(
                    (d := a2a.dispatch(x, idx), a2a.combine(a2a.fake_expert(d), w, out=y))))
            for i in range(int(launches)):
                inputs = draw_world(500 + i, world, E, k, H, M, token_counts=[T] * world)
                sources = [torch.from_numpy(h).to(dev) for h in (inputs.xs[me], inputs.indices[me],
                                                                 inputs.weights[me])]
                torch.cuda.synchronize()
                poison(a2a)
                comm.Barrier()
                with torch.cuda.stream(side):
                    for t in (x, idx, w):
                        t.zero_()
                    y.fill_(float("nan"))
                    for _ in range(16):
                        busy += 1.0
                    for t, src in zip((x, idx, w), sources):
                        t.copy_(src)
                    graph.launch() if calls_on == "current" else graph.launch(stream=side)
                    seen = y.clone()
                torch.cuda.synchronize()
                check_dispatch_against_oracle(a2a, inputs, outs[0])
                err = combine_error_against_oracle(a2a, inputs, types.SimpleNamespace(numpy=lambda: seen.cpu().numpy()))
                print(f"rank {me} calls on {calls_on}, launch {i}: max err {err:.3g}")
            graph.close()
