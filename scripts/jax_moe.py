"""A JAX MoE layer in one jax.jit, checked against the same layer computed densely on one device:
`mpirun -n N python scripts/jax_moe.py [--tokens T] [--json FILE]`, or one process driving N devices as
ranks, the layer inside shard_map: `python scripts/jax_moe.py --devices N` (on JAX's CPU platform
XLA_FLAGS=--xla_force_host_platform_device_count=N gives it N devices).

The layer: router logits, top-k with softmax weights, pyhipa2a.jax's dispatch, a SwiGLU MLP for each local
expert in jnp (one batched matmul over the experts), combine. Every rank draws every expert's weights from
one seed (its own experts are the ones it runs), and its tokens from a seed of its own; the dense oracle
runs each of its tokens through the top-k experts' MLPs on its own device in float32. Prints PASS or FAIL
per rank and the time of one call of the jitted layer (block_until_ready around it, a barrier before).

`--bench`: on gpu-mode's shapes, the jitted dispatch + combine step (expert_scale fused, as bench.py's
--fused-expert) beside AllToAll's own graph of the same step in the same run: host wall of one call,
synchronized and after a barrier, median over --iters, max over ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (our heap shares the GPU with JAX's pool)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from mpi4py import MPI  # noqa: E402

import pyhipa2a  # noqa: E402
from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.jax import JaxAllToAll  # noqa: E402
from pyhipa2a.testing import draw_world, fused_step_graph, script_verdict  # noqa: E402

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpumode_all2all.json")


def device_of(a2a):
    if pyhipa2a.get_backend().kind == "host":
        return jax.devices("cpu")[0]
    return [d for d in jax.devices() if d.platform == "gpu"][a2a.device_index]


def expert_weights(E: int, H: int, inter: int, seed: int):
    """Every expert's SwiGLU weights (gate, up [E, H, I], down [E, I, H]), alike on every rank."""
    rng = np.random.default_rng(seed)
    scale_in, scale_out = 1 / np.sqrt(H), 1 / np.sqrt(inter)
    return ((rng.standard_normal((E, H, inter)) * scale_in).astype(np.float32),
            (rng.standard_normal((E, H, inter)) * scale_in).astype(np.float32),
            (rng.standard_normal((E, inter, H)) * scale_out).astype(np.float32),
            (rng.standard_normal((H, E)) * scale_in).astype(np.float32))


def swiglu(h, gate, up, down):
    return (jax.nn.silu(h @ gate) * (h @ up)) @ down


def route(x, router, k: int):
    logits = (x @ router).astype(jnp.float32)
    top, indices = jax.lax.top_k(logits, k)
    return indices.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def moe_of_rank(a2a, k: int):
    """One rank's layer: its tokens x [T, H], the router, its local experts' weights [L, ...] -> y [T, H]."""
    def moe(x, router, gate, up, down):
        indices, weights = route(x, router, k)
        d = a2a.dispatch(x, indices)
        h = d.expert_x.astype(jnp.float32)
        y_rows = jax.vmap(swiglu)(h, gate.astype(jnp.float32), up.astype(jnp.float32), down.astype(jnp.float32))
        return a2a.combine(y_rows.astype(jnp.bfloat16), weights)
    return moe


def dense_of(k: int):
    """The oracle: every token through its top-k experts' MLPs, on one device, in float32."""
    @jax.jit
    def dense(x, router, gate, up, down):
        indices, weights = route(x, router, k)
        h = x.astype(jnp.float32)
        outs = jax.vmap(lambda g, u, dn: swiglu(h, g, u, dn))(gate, up, down)  # [E, T, H]
        picked = jnp.take_along_axis(outs.transpose(1, 0, 2), indices[:, :, None], axis=1)  # [T, k, H]
        return (picked * weights[:, :, None]).sum(axis=1)
    return dense


def compared(y, want) -> tuple[bool, float]:
    got, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
    return bool(np.allclose(got, want, rtol=3e-2, atol=3e-2)), float(np.abs(got - want).max())


def tokens_of(args, rank: int) -> np.ndarray:
    """Rank `rank`'s tokens [T, H], from a seed of its own."""
    return np.random.default_rng(args.seed + 1 + rank).standard_normal((args.tokens, args.hidden))


def median_us(call, iters: int, before=lambda: None) -> float:
    """The median wall time of `call()` (its results ready), `before()` ahead of each, in microseconds."""
    times = []
    for _ in range(iters):
        before()
        t0 = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def layer_check(comm, args) -> dict:
    world = comm.Get_size()
    E, k, H, inter, T = args.experts_per_rank * world, args.top_k, args.hidden, args.intermediate, args.tokens
    with JaxAllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=T,
                     in_dtype="bfloat16") as a2a:
        me, L, dev = a2a.rank, E // world, device_of(a2a)
        gate, up, down, router = expert_weights(E, H, inter, args.seed)
        mine = slice(me * L, (me + 1) * L)
        put = lambda a: jax.device_put(a, dev)  # noqa: E731
        local = [put(jnp.asarray(w[mine], jnp.bfloat16)) for w in (gate, up, down)]
        router_d = put(jnp.asarray(router, jnp.bfloat16))
        x = put(jnp.asarray(tokens_of(args, me), jnp.bfloat16))
        moe = jax.jit(moe_of_rank(a2a, k))
        y = moe(x, router_d, *local)
        ok, err = compared(y, dense_of(k)(x, router_d, *(put(jnp.asarray(w, jnp.bfloat16)) for w in (gate, up, down))))
        us = comm.allreduce(median_us(lambda: moe(x, router_d, *local), args.iters, comm.Barrier), op=MPI.MAX)
        a2a.check()
        print(f"rank {me}: {'PASS' if ok else 'FAIL'} (max |y - dense| {err:.3g}; T={T}, E={E}, k={k}, H={H}, "
              f"I={inter}, bf16; one jitted layer {us:.1f} us)", flush=True)
        return {"rank": me, "ok": ok, "max_error": err, "layer_us": us}


def layer_on_devices(args) -> dict:
    """--devices N: one process, its first N devices the ranks, the layer in jax.jit(jax.shard_map(...))."""
    from jax.sharding import PartitionSpec as P
    W = args.devices
    host = pyhipa2a.get_backend().kind == "host"
    devices = (jax.devices("cpu") if host else [d for d in jax.devices() if d.platform == "gpu"])[:W]
    if len(devices) < W:
        raise SystemExit(f"jax_moe: --devices {W} but JAX sees {len(devices)} such devices")
    E, k, H, inter, T = args.experts_per_rank * W, args.top_k, args.hidden, args.intermediate, args.tokens
    with JaxAllToAll(devices=devices, axis_name="ep", num_experts=E, experts_per_token=k, hidden_dim=H,
                     max_num_tokens=T, in_dtype="bfloat16") as a2a:
        gate, up, down, router = (jnp.asarray(w, jnp.bfloat16) for w in expert_weights(E, H, inter, args.seed))
        x = jnp.asarray(np.concatenate([tokens_of(args, r) for r in range(W)]), jnp.bfloat16)
        # (each rank its T tokens and its experts' weights; the router whole)
        moe = jax.jit(jax.shard_map(moe_of_rank(a2a, k), mesh=a2a.mesh, in_specs=(P("ep"), P()) + (P("ep"),) * 3,
                                    out_specs=P("ep")))
        y = moe(x, router, gate, up, down)
        ok, err = compared(y, dense_of(k)(x, router, gate, up, down))
        us = median_us(lambda: moe(x, router, gate, up, down), args.iters)
        a2a.check()
        print(f"{W} ranks that are devices: {'PASS' if ok else 'FAIL'} (max |y - dense| {err:.3g}; T={T} a rank, "
              f"E={E}, k={k}, H={H}, I={inter}, bf16; one jitted layer {us:.1f} us)", flush=True)
        return {"ranks": W, "ok": ok, "max_error": err, "layer_us": us}


def bench(comm, args) -> list:
    """The jitted fused step beside AllToAll's own graph of it, per gpu-mode shape."""
    world, rows = comm.Get_size(), []
    shapes = json.load(open(SHAPES))["benchmarks"]
    for shape in shapes:
        E, k, H, M = (shape[n] for n in ("num_experts", "experts_per_token", "hidden_dim", "max_num_tokens"))
        params = dict(num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
        inputs = draw_world(shape.get("seed", 1), world, E, k, H, M)
        with JaxAllToAll(comm, **params) as ja, AllToAll(comm, **params) as a2a:
            me, dev = ja.rank, device_of(ja)
            x, idx, w = (jax.device_put(h, dev) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me]))
            step = jax.jit(lambda x, i, w: ja.combine(ja.dispatch(x, i).expert_x, w, expert_scale=1.0 + me))
            step(x, idx, w).block_until_ready()

            def jitted():
                step(x, idx, w).block_until_ready()

            def eager():  # (JAX's op-by-op dispatch of the same two calls, outside jit)
                ja.combine(ja.dispatch(x, idx).expert_x, w, expert_scale=1.0 + me).block_until_ready()
            row = {"shape": [E, k, H, M]}
            with fused_step_graph(a2a, inputs) as graph:
                def replayed():
                    graph.launch()
                    a2a.synchronize()
                for name, once in (("jit", jitted), ("eager", eager), ("graph", replayed)):
                    times = []
                    for i in range(args.iters + 10):
                        comm.Barrier()
                        t0 = time.perf_counter()
                        once()
                        if i >= 10:
                            times.append(time.perf_counter() - t0)
                    row[name] = comm.allreduce(statistics.median(times) * 1e6, op=MPI.MAX)
            ja.check()
            rows.append(row)
            if me == 0:
                print(f"E={E:>3} k={k} H={H:>4} M={M:>3}: jit {row['jit']:7.1f} us  eager {row['eager']:7.1f} us  "
                      f"graph {row['graph']:7.1f} us  jit/graph {row['jit'] / row['graph']:.2f}", flush=True)
    if comm.Get_rank() == 0:
        gm = {n: float(np.exp(np.mean([np.log(r[n]) for r in rows]))) for n in ("jit", "eager", "graph")}
        print(f"geomean over {len(rows)} shapes: jit {gm['jit']:.1f} us, eager {gm['eager']:.1f} us, graph "
              f"{gm['graph']:.1f} us; jit/graph {gm['jit'] / gm['graph']:.2f}, eager/graph "
              f"{gm['eager'] / gm['graph']:.2f}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--bench", action="store_true", help="gpu-mode's shapes: the jitted step beside our graph")
    p.add_argument("--devices", type=int, help="one process driving this many devices as ranks (no mpirun)")
    p.add_argument("--json", help="write the results to this file (rank 0)")
    args = p.parse_args()
    if args.devices:
        result = layer_on_devices(args)
        return script_verdict(MPI.COMM_SELF, "jax_moe", result["ok"], result, args.json)
    comm = MPI.COMM_WORLD
    result = {"layer": layer_check(comm, args)}
    if args.bench:
        result["bench"] = bench(comm, args)
    return script_verdict(comm, "jax_moe", result["layer"]["ok"], result, args.json)


if __name__ == "__main__":
    sys.exit(main())
