"""Multi-rank cases of dispatch(groups=G) (pyhipa2a.groups), run under mpiexec by tests/test_groups.py.

The caller's expert runs group by group on a stream of its own: wait_group(g), the group's rows of expert_y,
group_done(g); combine then sends each group's tokens as the groups are done. On GPUs the expert is PyTorch's on
a stream of its own while the dispatch is held back behind a long kernel on ours, so an expert that ran before
its group's rows were in would read poison; on the host backend streams run at once and the expert is the same
PyTorch code on the CPU. Every result is checked against pyhipa2a.reference.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

import numpy as np
import pytest

from pyhipa2a import A2AError, AllToAll
from pyhipa2a import reference
from pyhipa2a.hierarchy import HierarchicalAllToAll
from pyhipa2a.testing import (check_dispatch_against_oracle, combine_error_against_oracle, draw_world,
                              free_buffers, free_inputs, layout_arguments, poison, step_buffers,
                              upload_inputs)
from tests.cases import calls_watched, launches_checked, routed_to


def _order(order: str, G: int, seed: int) -> list[int]:
    if order == "forward":
        return list(range(G))
    if order == "reverse":
        return list(range(G))[::-1]
    return [int(g) for g in np.random.default_rng(seed).permutation(G)]


class TorchExpert:
    """gpu-mode's fake expert (expert_y = expert_x * (1 + rank)), one group's rows at a time, in PyTorch on a
    stream of its own (GPU) or on the CPU (host backend), writing into the object's expert_y buffer."""

    def __init__(self, a2a, torch):
        self.torch, self.a2a = torch, a2a
        self.gpu = a2a.backend.kind != "host"
        # Views made once, before any call: a view's making may order PyTorch's stream after ours.
        self.x = torch.from_dlpack(a2a.buffers["recv_x"])
        self.y = torch.from_dlpack(a2a.expert_y_buffer())
        self.contiguous = a2a.config.contiguous
        self.stream = torch.cuda.Stream() if self.gpu else None
        self.ours = torch.cuda.ExternalStream(a2a.backend.stream_handle(a2a.stream)) if self.gpu else None
        self.factor = float(1 + a2a.rank)

    def hold_back_ours(self) -> None:
        """Our stream (where dispatch runs) busy for a while first: an expert that did not wait reads poison."""
        if self.gpu:
            with self.torch.cuda.stream(self.ours):
                self.torch.cuda._sleep(20_000_000)

    def run(self, group: int) -> None:
        a2a, torch = self.a2a, self.torch
        # [L, W*M, H]: the group's experts' slabs whole (rows past a count too); [R, H]: the group's rows, which
        # the host learns before they land (group_rows)
        rows = a2a.group_rows(group) if self.contiguous else a2a.group_experts(group)
        part = slice(rows.start, rows.stop)
        handle = self.stream.cuda_stream if self.gpu else None
        a2a.wait_group(group, handle)
        with torch.cuda.stream(self.stream) if self.gpu else contextlib.nullcontext():
            self.y[part] = (self.x[part].float() * self.factor).to(self.y.dtype)
        a2a.group_done(group, handle)
        return a2a.group_experts(group), rows


def case_groups(comm, order="forward", row_layout="packed", G="4", rounds="3", ranks_per_node="0", H="256",
                grid_blocks="0"):
    """dispatch(groups=G), the expert group by group in `order` (forward, reverse, shuffled), combine: every
    result against the oracle, with the outputs poisoned before each round and token counts changing; with
    `ranks_per_node` (not 0) across simulated nodes of that many ranks; `grid_blocks` (not 0) a grid of that
    many blocks (with 1, rows of several segments land a whole token at a time: count_landed)."""
    torch = pytest.importorskip("torch")
    world, G, H = comm.Get_size(), int(G), int(H)
    E, k, M = 8 * world, 3, 24
    options = {"ranks_per_node": int(ranks_per_node)} if int(ranks_per_node) else {}
    if int(grid_blocks):
        options["grid_blocks"] = int(grid_blocks)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=30.0,
                  **layout_arguments(row_layout), **options) as a2a:
        assert bool(int(ranks_per_node)) == isinstance(a2a, HierarchicalAllToAll)
        me = a2a.rank
        expert = TorchExpert(a2a, torch)
        for i in range(int(rounds)):
            inputs = draw_world(60 + i, world, E, k, H, M, token_counts=[(M, 7, 0, M)[(i + r) % 4]
                                                                        for r in range(world)])
            poison(a2a)
            expert.hold_back_ours()
            d = a2a.dispatch(inputs.xs[me], inputs.indices[me], weights=inputs.weights[me], groups=G)
            assert [list(a2a.group_experts(g)) for g in range(G)] == \
                [[e for e in range(E // world) if e * G // (E // world) == g] for g in range(G)]
            told = {g: expert.run(g) for g in _order(order, G, 90 + i)}  # (experts, rows) of each group
            y = a2a.combine(a2a.expert_y_buffer())
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            if a2a.config.contiguous:  # what the host was told, against what the device wrote
                offsets = d.expert_offsets.numpy()
                for g, (experts, rows) in told.items():
                    assert rows == range(offsets[experts.start], offsets[experts.stop]), (g, rows, offsets)
            err = combine_error_against_oracle(a2a, inputs, y, expert=reference.fake_expert)
            # The next call of the same object without groups: nothing of the grouped one is left over.
            poison(a2a)
            d = a2a.dispatch(inputs.xs[me], inputs.indices[me])
            y = a2a.combine(a2a.fake_expert(d), inputs.weights[me])
            a2a.synchronize()
            combine_error_against_oracle(a2a, inputs, y, expert=reference.fake_expert)
            print(f"rank {me} round {i}: T={len(inputs.xs[me])} groups {G} in {order} order, max err {err:.3g}")


def case_groups_repeated(comm, row_layout="contiguous/8", G="3", ranks_per_node="0", arrays_at="same"):
    """A layer's loop: dispatch(groups=G) and its combine on device arrays with new values at every step, the
    same arrays refilled (`arrays_at` "same") or new ones ("new": a layer's activations, standing in for the
    last). The third call alike and every one after is its plan (a new ticket for the rows the host is told,
    the parts and their bound queued anew), a call of another token count the full path, each checked against
    the oracle on poisoned outputs, the rows the host was told against the offsets the device wrote."""
    torch = pytest.importorskip("torch")
    from pyhipa2a.testing import free_inputs, upload_inputs
    world, G = comm.Get_size(), int(G)
    E, k, H, M = 8 * world, 3, 128, 16
    options = {"ranks_per_node": int(ranks_per_node)} if int(ranks_per_node) else {}
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=30.0,
                  **layout_arguments(row_layout), **options) as a2a, calls_watched() as watched:
        me = a2a.rank
        expert, expert_y = TorchExpert(a2a, torch), a2a.expert_y_buffer()
        arrays, kept, counts_before = None, [], []
        for i, T in enumerate((9, 9, 9, 9, 4, 4, 4, 9)):
            inputs = draw_world(120 + i, world, E, k, H, M, token_counts=[T] * world)
            if arrays_at == "new" or arrays is None or T != arrays[0].shape[0]:
                arrays = upload_inputs(a2a, inputs)
                kept.append(arrays)  # (the device may still read the last ones)
            else:  # the same arrays, new values
                for arr, fresh in zip(arrays, (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                    arr.copy_from(fresh)
            x, indices, weights = arrays[:3]
            poison(a2a)
            watched.clear()
            expert.hold_back_ours()
            d = a2a.dispatch(x, indices, weights=weights, groups=G)
            told = {g: expert.run(g) for g in _order("reverse", G, 0)}
            y = a2a.combine(expert_y)
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            if a2a.config.contiguous:
                offsets = d.expert_offsets.numpy()
                for g, (experts, rows) in told.items():
                    assert rows == range(offsets[experts.start], offsets[experts.stop]), (i, g, rows, offsets)
            combine_error_against_oracle(a2a, inputs, y, expert=reference.fake_expert)
            # (the second of two calls alike makes the plans; a call of another token count misses them)
            planned = len(counts_before) >= 2 and counts_before[-1] == counts_before[-2]
            want = [] if not planned else [True, True] if T == counts_before[-1] else [False, False]
            assert watched.plans == want, (i, counts_before, T, watched.plans)
            counts_before.append(T)
        for arrays in kept:
            free_inputs(a2a, arrays)
    print(f"rank {me} grouped calls repeated ({row_layout}, G={G}, ranks_per_node {ranks_per_node}, {arrays_at} "
          "arrays): right")


def case_groups_refusals(comm):
    """What groups= refuses, each before any kernel runs, leaving the object usable."""
    world = comm.Get_size()
    E, k, H, M = 4 * world, 2, 64, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        inputs = draw_world(5, world, E, k, H, M, token_counts=[4] * world)
        x, idx, w = inputs.xs[me], inputs.indices[me], inputs.weights[me]
        with pytest.raises(A2AError, match=r"wait_group\(\) needs a pending dispatch\(groups=...\)"):
            a2a.wait_group(0)
        with pytest.raises(TypeError, match=r"dispatch\(groups=\) needs the gate's weights here"):
            a2a.dispatch(x, idx, groups=2)
        with pytest.raises(ValueError, match=r"groups must be in \[1, 4\] .*; got 5"):
            a2a.dispatch(x, idx, weights=w, groups=5)
        with pytest.raises(TypeError, match="groups must be an int, not float"):
            a2a.dispatch(x, idx, weights=w, groups=2.0)
        with pytest.raises(TypeError, match="groups must be an int, not bool"):
            a2a.dispatch(x, idx, weights=w, groups=True)
        with pytest.raises(ValueError, match=r"groups must be in \[1, 4\] .*; got 0"):
            a2a.dispatch(x, idx, weights=w, groups=0)
        a2a.expert_y_buffer()  # (before a capture)
        theirs = a2a.backend.stream_create()  # (another library's capture: none of our hooks runs at its launches)
        a2a.backend.capture_begin(theirs)
        try:
            with pytest.raises(A2AError, match=r"dispatch\(groups=\) cannot be recorded into another library's"):
                a2a.dispatch(x, idx, weights=w, groups=2, stream=theirs)
        finally:
            a2a.backend.capture_end(theirs, keep=False)
        elsewhere = a2a.backend.stream_create()  # (in capture(), a stream the capture does not record)
        on_device = upload_inputs(a2a, inputs)

        def grouped_step(then):
            d = a2a.dispatch(*on_device[:2], weights=on_device[2], groups=2)
            then()
            a2a.group_done(0)
            a2a.group_done(1)
            a2a.combine(d.expert_x)
        try:
            with pytest.raises(A2AError, match=r"group_rows\(\) inside capture\(\)"):
                a2a.capture(lambda: grouped_step(lambda: a2a.group_rows(0)))
            with pytest.raises(A2AError, match=r"wait_group\(\): inside capture\(\), the stream must be the "
                                               r"capture's"):
                a2a.capture(lambda: grouped_step(lambda: a2a.wait_group(0, elsewhere)))
        finally:
            free_inputs(a2a, on_device)
            for stream in (theirs, elsewhere):
                a2a.backend.stream_destroy(stream)
        # A runtime that cannot wait on the heap's words (ROCm with GPU_STREAMOPS_CP_WAIT set: runtime/hip.py)
        a2a.backend.stream_waits_refused = lambda: "no waits on heap words here"
        try:
            with pytest.raises(A2AError, match=r"dispatch\(groups=\): no waits on heap words here"):
                a2a.dispatch(x, idx, weights=w, groups=2)
        finally:
            del a2a.backend.stream_waits_refused
        d = a2a.dispatch(x, idx, weights=w, groups=2)
        with pytest.raises(A2AError, match=r"group_rows\(\) is for row_layout='contiguous'"):
            a2a.group_rows(0)
        with pytest.raises(ValueError, match=r"group_done\(\): the group must be an int in \[0, 2\); got 2"):
            a2a.group_done(2)
        a2a.wait_group(1)
        a2a.group_done(1)
        with pytest.raises(A2AError, match="group 1 is done already"):
            a2a.group_done(1)
        with pytest.raises(A2AError, match="group 1 is done already"):
            a2a.wait_group(1)
        with pytest.raises(A2AError, match=r"needs group_done\(\) of every group first; groups \[0\] are not done"):
            a2a.combine(d.expert_x)
        a2a.group_done(0)  # (never waited for: done() waits for it itself)
        y = a2a.combine(d.expert_x, expert_scale=1.0 + me)
        a2a.synchronize()
        expert = reference.fused_expert([1.0 + r for r in range(world)])
        combine_error_against_oracle(a2a, inputs, y, expert=expert)
        with pytest.raises(A2AError, match=r"group_done\(\) needs a pending dispatch\(groups=...\)"):
            a2a.group_done(0)


def case_groups_captured(comm, row_layout="packed", G="3", order="reverse", ranks_per_node="0", launches="3"):
    """dispatch(groups=G), every group's wait, the expert, each group's group_done in `order` and combine, recorded
    by capture(): each launch is a new call (new inputs in the same arrays, outputs poisoned, checked against the
    oracle), with an eager grouped call between two launches; with `ranks_per_node` (not 0) across simulated
    nodes of that many ranks."""
    world, G = comm.Get_size(), int(G)
    E, k, H, M = 4 * world, 3, 256, 12
    counts = [(5 * r + 3) % (M + 1) for r in range(world)]
    nodes = {"ranks_per_node": int(ranks_per_node)} if int(ranks_per_node) else {}
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=30.0,
                  **layout_arguments(row_layout), **nodes) as a2a:
        if nodes and not a2a.engine.capturable:
            pytest.skip("the MPI engine on a GPU stages through the host: no graph capture")
        me = a2a.rank
        buffers = x, idx, w, y = step_buffers(a2a, counts[me])
        expert_y = a2a.expert_y_buffer()
        captured = {}

        def grouped(d, order_seed: int) -> None:  # the caller's part: waits, the expert, each group done
            for g in range(G):
                a2a.wait_group(g)
            a2a.fake_expert(d, out=expert_y)
            for g in _order(order, G, order_seed):
                a2a.group_done(g)

        def step():
            captured["d"] = d = a2a.dispatch(x, idx, weights=w, groups=G)
            grouped(d, 7)
            a2a.combine(expert_y, out=y)
        def eager_grouped_call():
            eager = draw_world(90, world, E, k, H, M)
            poison(a2a)
            d = a2a.dispatch(eager.xs[me], eager.indices[me], weights=eager.weights[me], groups=G)
            grouped(d, 8)
            out = a2a.combine(expert_y)
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, eager, d)
            combine_error_against_oracle(a2a, eager, out, expert=reference.fake_expert)
        try:
            launches_checked(a2a, a2a.capture(step), buffers, captured, launches,
                             lambda i: draw_world(80 + i, world, E, k, H, M, token_counts=counts), eager_grouped_call)
        finally:
            free_buffers(a2a, buffers)


def case_group_done_never_comes(comm, ranks_per_node="0"):
    """GPUs: the last rank's expert stream never reaches group_done(1), so its combine's stream would wait
    forever. The host gives up on it after the timeout: that rank's call fails naming the group, with y poison,
    and its parts send nothing, so every other rank's call fails naming it. Nothing hangs, also where every
    stream of a process shares one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), so that combine's stream
    never even reaches its waits until the expert's stream moves. Across (simulated) nodes of `ranks_per_node`
    ranks, the victim's counterparts on other nodes are told by the seal that comes with its poisoned sums."""
    from pyhipa2a import A2ATimeoutError
    torch = pytest.importorskip("torch")
    world = comm.Get_size()
    E, k, H, M, G, T = 4 * world, 2, 256, 16, 2, 12
    victim = world - 1
    nodes = {"ranks_per_node": int(ranks_per_node)} if int(ranks_per_node) else {}
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=3.0,
                  **nodes) as a2a:
        me = a2a.rank
        if a2a.backend.kind == "host":
            pytest.skip("host streams run their waits as they are queued: the caller's wait would raise first")
        expert = TorchExpert(a2a, torch)
        # (expert E - 1: the victim's last, in its group G - 1, the one whose group_done never comes)
        inputs = routed_to(draw_world(70, world, E, k, H, M, token_counts=[T] * world), E - 1)
        d = a2a.dispatch(inputs.xs[me], inputs.indices[me], weights=inputs.weights[me], groups=G)
        # A word in pinned host memory, raised by the host only once the calls failed: no stream lifts it, as
        # work on any stream may sit behind the stuck wait (streams may share a hardware queue: MPS shares them)
        gate, gate_device = a2a.backend.malloc_host_mapped(4)
        expert.run(0)
        handle = expert.stream.cuda_stream
        if me == victim:  # (the expert's stream stuck before group 1's group_done)
            a2a.backend.stream_wait_word(handle, gate_device, 1, a2a.config.timeout, None)
        expert.run(1)
        a2a.combine(d.expert_x)
        try:
            with pytest.raises(A2ATimeoutError if me == victim or not nodes else A2AError) as failure:
                a2a.synchronize()
            # On another node than the victim's, the rank in our place there is named: its sums came sealed with its
            # failure (the victim's, or a node peer's that timed out waiting for it), or came too late.
            size = int(ranks_per_node) or world
            named = victim if me // size == victim // size else victim // size * size + me % size
            # With one hardware queue a process, the victim's combine stream waits behind its stuck expert stream,
            # the records it crosses to its counterparts on the other nodes included; a counterpart's own node part
            # is queued behind that crossing, so its node peers, waiting on it for as long as it waits on the
            # victim, may time out on it first and name it.
            counterpart = me // size * size + victim % size
            held = nodes and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and counterpart not in (me, named)
            names = {named, counterpart} if held else {named}
            if isinstance(failure.value, A2ATimeoutError):
                assert len(failure.value.ranks) == 1 and failure.value.ranks[0] in names, failure.value
            else:
                assert any(f"rank {r}, on another node, failed its part" in str(failure.value) for r in names), \
                    failure.value
            if me == victim:
                assert "combine's wait for group_done(1) did not pass within the timeout" in str(failure.value)
        finally:
            # The expert's stream drains (its late group_done finds the object broken), and with it whatever
            # the driver queued behind it: only then is y read. (Raised also where a check above failed: a
            # stream stuck on the gate would hold up closing the object, and hide that failure behind a hang.)
            ctypes.c_uint32.from_address(gate).value = 1
            torch.cuda.synchronize()
        a2a.backend.free_host_mapped(gate)
        if me == victim:
            assert (a2a.buffers["y"].numpy()[:T].view(np.uint16) == 0xFFFF).all()  # (y: poison)
        comm.Barrier()


def case_failed_rank_sends_no_grouped_parts(comm):
    """A rank whose grouped dispatch failed (an expert index out of range, in a device array the host does not
    check) takes no part in the combine's parts: it sends nothing, so every other rank's call fails naming it,
    instead of summing contributions of rows its dispatch never received. Its own error is the index. (On the
    host backend the failure is seen before combine() and refuses it; on GPUs the dispatch is held back, so
    the parts are queued first and must see the failure themselves.)"""
    from pyhipa2a import A2ADeviceError, A2ATimeoutError
    world = comm.Get_size()
    if world < 2:
        pytest.skip("needs a peer")
    E, k, H, M, G, T = 4 * world, 2, 64, 8, 2, 4
    bad = world - 1
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=2.0) as a2a:
        me = a2a.rank
        inputs = routed_to(draw_world(71, world, E, k, H, M, token_counts=[T] * world), E - 1)  # (the bad rank's)
        # Device arrays of their own: x outside the heap, so that no peer reads it where it lies (a peer that did
        # would fail its dispatch on seeing the bad rank's status, before any grouped part), and indices the host
        # does not check.
        arrays = upload_inputs(a2a, inputs)
        x, indices = arrays[0], arrays[1]
        if me == bad:
            wrong = inputs.indices[me].copy()
            wrong[1, 0] = E + 5
            indices.copy_from(wrong)
        if a2a.backend.kind != "host":  # (the dispatch held back: its report comes after combine() was queued)
            TorchExpert(a2a, pytest.importorskip("torch")).hold_back_ours()
        d = a2a.dispatch(x, indices, weights=inputs.weights[me], groups=G)
        if me == bad:  # (the host sees the report before combine(), or only at synchronize())
            with pytest.raises(A2ADeviceError, match=f"expert index {E + 5}"):
                for g in range(G):
                    a2a.group_done(g)
                a2a.combine(d.expert_x)
                a2a.synchronize()
        else:
            for g in range(G):
                a2a.group_done(g)
            a2a.combine(d.expert_x)
            with pytest.raises(A2ATimeoutError, match=f"rank {bad}") as failure:
                a2a.synchronize()
            assert failure.value.ranks == (bad,), failure.value
        comm.Barrier()
        free_inputs(a2a, arrays)
