"""The MoE layer at prefill sizes, with PyTorch: `mpirun -n N python scripts/moe_layer.py [--tokens T] [--json F]`.

One layer: a router (top-k of its logits, softmax weights), dispatch of x written into AllToAll.x_buffer()
(pulled by the peers where it lies) into the contiguous layout, a SwiGLU MLP
(--intermediate, bf16) for each local expert by PyTorch's grouped GEMM over the rows as they lie
(torch._grouped_mm, each expert's segment ending at its expert_offsets entry: nothing to pack, no host sync),
combine. Two ways, in one run:
  sequence    dispatch, the grouped GEMMs of every expert, combine, each after the other on one stream;
  overlapped  dispatch(groups=G); for each group the host learns its rows (group_rows), a stream of the
              experts' own waits for them on the device (wait_group), runs the group's grouped GEMMs and says
              so (group_done); combine sends each group's tokens as the groups are done.
Parts are timed beside them, unchecked, for the bound they set: the grouped GEMMs alone (on the rows the
last dispatch laid out), the same GEMMs a group after the other (the overlapped way's pieces) and the
exchange alone (dispatch, then combine of expert_y as it is). Overlap hides at most the shorter of the
GEMMs and the exchange, so overlapped >= max(gemms, exchange), and overlapped / sequence can go no lower
than that over the sequence.
Every rank draws every expert's weights from one seed (each expert from its own), its tokens from a seed of its
own. Each way's y is checked against the layer computed densely on this rank's device in float32: each token
through its top-k experts' MLPs. Prints PASS or FAIL per rank and, for each way, the wall time of one layer
(synchronized, a barrier before; the ways take turns), median over --iters, max over ranks; --json writes
them (rank 0).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.testing import script_verdict  # noqa: E402


def expert_weights(e: int, H: int, inter: int, seed: int, device) -> tuple:
    """Expert e's SwiGLU weights (gate, up [H, I], down [I, H]) in bf16, alike on every rank."""
    g = torch.Generator(device=device).manual_seed(seed * 100_003 + e)
    gate, up = (torch.randn(H, inter, generator=g, device=device) / H ** 0.5 for _ in range(2))
    down = torch.randn(inter, H, generator=g, device=device) / inter ** 0.5
    return gate.bfloat16(), up.bfloat16(), down.bfloat16()


def swiglu_grouped(x, ends, gate, up, down):
    """Each expert's MLP on its rows of x (expert i: rows ends[i - 1] .. ends[i] - 1, from 0), bf16 in and out."""
    h = torch.nn.functional.silu(torch._grouped_mm(x, gate, offs=ends)) * torch._grouped_mm(x, up, offs=ends)
    return torch._grouped_mm(h.bfloat16(), down, offs=ends)


class Layer:
    """This rank's part of the layer: the AllToAll, its experts' weights, the router, its tokens."""

    def __init__(self, comm, args):
        world, rank = comm.Get_size(), comm.Get_rank()
        E, k, H, T = args.experts_per_rank * world, args.top_k, args.hidden, args.tokens
        self.args, self.rank, self.E, self.k, self.H = args, rank, E, k, H
        self.a2a = AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=T,
                            in_dtype="bfloat16", row_layout="contiguous", row_align=args.row_align,
                            timeout=args.timeout)
        gpu = self.a2a.backend.kind != "host"
        device = self.device = torch.device("cuda", self.a2a.heap.device.index) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        L = self.L = E // world
        local = [expert_weights(rank * L + i, H, args.intermediate, args.seed, device) for i in range(L)]
        self.gate, self.up, self.down = (torch.stack([w[i] for w in local]) for i in range(3))
        g = torch.Generator(device=device).manual_seed(args.seed)
        self.router = (torch.randn(H, E, generator=g, device=device) / H ** 0.5).bfloat16()
        g = torch.Generator(device=device).manual_seed(args.seed + 1 + rank)
        # x where the peers read it (AllToAll.x_buffer()), as the layer before would write it: no staging copy
        self.x = torch.from_dlpack(self.a2a.x_buffer())[:T]
        self.x.copy_(torch.randn(T, H, generator=g, device=device).bfloat16())
        logits = self.x.float() @ self.router.float()
        top, indices = torch.topk(logits, k, dim=1)
        self.indices, self.weights = indices.int().contiguous(), torch.softmax(top, dim=1).contiguous()
        # Our buffers as PyTorch tensors, made once before any call (making one may order streams)
        self.expert_x = torch.from_dlpack(self.a2a.buffers["recv_x"])
        self.offsets = torch.from_dlpack(self.a2a.buffers["offsets"])
        self.expert_y = torch.empty_like(self.expert_x)
        self.experts_stream = torch.cuda.Stream(device) if gpu else None

    def sequence(self):
        """Dispatch, every expert's GEMMs, combine: each waits for the one before."""
        a2a = self.a2a
        d = a2a.dispatch(self.x, self.indices, weights=self.weights)  # (PyTorch's stream then waits for it)
        self.expert_y.copy_(swiglu_grouped(d.expert_x, d.expert_offsets[1:], self.gate, self.up, self.down))
        return a2a.combine(self.expert_y)

    def overlapped(self):
        """dispatch(groups=G); each group's GEMMs on the experts' stream as its rows land; combine sends each
        group's tokens once it is done."""
        a2a, G, s = self.a2a, self.args.groups, self.experts_stream
        a2a.dispatch(self.x, self.indices, weights=self.weights, groups=G)
        self.pieces = []
        for g in range(G):
            rows, experts = a2a.group_rows(g), a2a.group_experts(g)
            a2a.wait_group(g, s)
            self._group_gemms(rows, experts)
            a2a.group_done(g, s)
            self.pieces.append((rows, experts))
        return a2a.combine(self.expert_y)

    def _group_gemms(self, rows, experts):
        """One group's grouped GEMMs, on the experts' stream, over its rows as they lie."""
        with torch.cuda.stream(self.experts_stream) if self.experts_stream is not None else contextlib.nullcontext():
            ends = self.offsets[experts.start + 1:experts.stop + 1] - rows.start
            part = slice(experts.start, experts.stop)
            self.expert_y[rows.start:rows.stop] = swiglu_grouped(
                self.expert_x[rows.start:rows.stop], ends, self.gate[part], self.up[part], self.down[part])

    def gemms(self):
        """The grouped GEMMs alone, on the rows the last dispatch laid out."""
        self.expert_y.copy_(swiglu_grouped(self.expert_x, self.offsets[1:], self.gate, self.up, self.down))

    def gemms_in_groups(self):
        """The GEMMs of the last overlapped layer's groups, one group after the other, alone."""
        for rows, experts in self.pieces:
            self._group_gemms(rows, experts)

    def exchange(self):
        """Dispatch, then combine of expert_y as it is: the layer without its GEMMs."""
        self.a2a.dispatch(self.x, self.indices, weights=self.weights)
        return self.a2a.combine(self.expert_y)

    def dense(self):
        """The same layer on this rank's tokens alone, in float32: each token through its top-k experts."""
        args, x = self.args, self.x.float()
        y = torch.zeros_like(x)
        for e in torch.unique(self.indices).tolist():
            tokens, slot = torch.nonzero(self.indices == e, as_tuple=True)
            gate, up, down = (w.float() for w in expert_weights(e, self.H, args.intermediate, args.seed, self.device))
            h = x[tokens]
            y[tokens] += self.weights[tokens, slot][:, None] * ((torch.nn.functional.silu(h @ gate) * (h @ up)) @ down)
        return y

    def timed(self, comm, ways) -> list[float]:
        """Each way's wall time of one layer: median over --iters, max over ranks. The ways take turns, so
        that a drift of the clocks over the run (a warming GPU) weighs on each alike."""
        times = [[] for _ in ways]
        for i in range(self.args.iters + 2):
            for way, kept in zip(ways, times):
                comm.Barrier()
                t0 = time.perf_counter()
                way()
                self.synchronize()
                if i >= 2:
                    kept.append(time.perf_counter() - t0)
        return [comm.allreduce(statistics.median(kept) * 1e6, op=MPI.MAX) for kept in times]

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.a2a.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--groups", type=int, default=4, help="dispatch(groups=) of the overlapped way")
    p.add_argument("--row-align", type=int, default=128,
                   help="AllToAll(row_align=): each expert's rows rounded up to this, rows the GEMMs compute too")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--json", help="write the results to this file (rank 0)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    layer = None
    try:
        layer = Layer(comm, args)
        want = layer.dense()
        result = {"rank": layer.rank, "tokens": args.tokens, "experts": layer.E, "top_k": layer.k,
                  "hidden": layer.H, "intermediate": args.intermediate, "groups": args.groups,
                  "row_align": args.row_align}
        ok, ways = True, {"sequence": layer.sequence, "overlapped": layer.overlapped}
        for name, way in ways.items():
            y = way()
            layer.synchronize()
            got = torch.as_tensor(y).float()
            err = float((got - want).abs().max()) if got.numel() else 0.0
            close = bool(torch.allclose(got, want, rtol=3e-2, atol=3e-2))
            ok = ok and close
            result[name] = {"ok": close, "max_error": err}
        parts = {"gemms": layer.gemms, "gemms_in_groups": layer.gemms_in_groups, "exchange": layer.exchange}
        timed = layer.timed(comm, list(ways.values()) + list(parts.values()))
        for name, us in zip(list(ways) + list(parts), timed):
            result.setdefault(name, {})["layer_us"] = us
        print(f"rank {layer.rank}: {'PASS' if ok else 'FAIL'} (max |y - dense| sequence "
              f"{result['sequence']['max_error']:.3g}, overlapped {result['overlapped']['max_error']:.3g})", flush=True)
    finally:
        if layer is not None:
            layer.a2a.close()
    seq, ovl = result["sequence"]["layer_us"], result["overlapped"]["layer_us"]
    gemms, exchange = result["gemms"]["layer_us"], result["exchange"]["layer_us"]
    in_groups = result["gemms_in_groups"]["layer_us"]
    return script_verdict(comm, "moe_layer", ok, result, args.json, lambda: print(
        f"moe_layer: {comm.Get_size()} ranks, T={args.tokens} a rank, E={layer.E}, k={layer.k}, H={layer.H}, "
        f"I={args.intermediate}, row_align={args.row_align}, bf16: sequence {seq:.1f} us, "
        f"overlapped (groups={args.groups}) {ovl:.1f} us, "
        f"overlapped / sequence {ovl / seq:.2f}; gemms alone {gemms:.1f} us (in groups {in_groups:.1f}), "
        f"exchange alone {exchange:.1f} us, "
        f"bound max(gemms, exchange) / sequence {max(gemms, exchange) / seq:.2f}", flush=True))


if __name__ == "__main__":
    sys.exit(main())
