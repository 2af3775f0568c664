"""Dispatch and combine over ranks on several nodes: within a node the symmetric heap, between nodes
NCCL/RCCL (MPI on the host backend); the protocol is in docs/DESIGN.md ("Across nodes").

`AllToAll(comm, ...)` is a HierarchicalAllToAll when `comm` spans nodes, or when `ranks_per_node` (or
PYHIPA2A_RANKS_PER_NODE) splits one machine into simulated nodes. Ranks lie node by node (rank = node *
G + place), so node n holds experts [n * E/N, (n+1) * E/N). Each rank's tokens cross once to its
counterpart (the rank in its place) on every other node as one region of max_num_tokens rows; each
node runs its own exchange over all regions (kernels_hip/hier.hip), and combine sends each region's
sums home, where hier_sum adds them. Regions move whole: no host round trip, and a step can be a graph.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import numpy as np

from .api import AllToAll
from .array import DeviceArray
from .bootstrap import NodeLayout, agreed, machine_comm, mpi
from .calls import PLACED_ARGS
from .config import Config
from .errors import A2AError, Health, STATUS_CAPACITY, STATUS_TIMEOUT, status_error
from .heap import TABLE_ALIGN, align_up
from .internode import Transfer, asked_engine, make_engine
from .intranode import NodeExchange
from .kernels import REDUCE_ONLY, WHOLE_COMBINE, X_FP8, field_addresses
from .runtime import Launcher, get_backend, select_device

NODE_WAITS = (6, 7, 8)  # status `what` of waits between nodes: their peer is already a world rank


class NodesHealth(Health):
    """The node part's status words, read with world ranks, and a watch on the exchange between nodes
    before any host read waits for the stream (NCCL's waits have no bound of their own)."""

    def __init__(self, host_status, rank: int, layout: NodeLayout, engine):
        super().__init__(host_status, rank)
        self.layout, self.engine = layout, engine
        self.watches_streams = engine.watches_streams

    def error(self):
        if not self.host_status[0]:
            return None
        words = self.host_status.copy()
        node_part_peer = words[0] == STATUS_CAPACITY or (words[0] == STATUS_TIMEOUT and words[2] not in NODE_WAITS)
        if node_part_peer:  # the node part names a rank of our node by its place; the others are world ranks
            words[1] += self.layout.node * self.layout.ranks_per_node
        return status_error(words, self.rank, self.context)

    def settle(self, stream) -> None:
        try:
            super().settle(stream)
        except A2AError:
            # The call failed with its work still queued (the host gave up on a grouped combine): NCCL's part of
            # it, queued behind the stuck wait, must not then wait for peers that gave up too.
            self.engine.abort()
            raise
        self.engine.settle(stream)


class HierarchicalAllToAll(AllToAll, across_nodes=True):
    """AllToAll for a communicator that spans nodes (see the module's doc)."""

    JOINS_CAPTURES = False  # (its exchange between nodes is watched from the host)

    def _open(self, comm, layout: NodeLayout, backend, device, params: dict) -> tuple:
        comm = mpi().COMM_WORLD if comm is None else comm
        rank = comm.Get_rank()
        engine = asked_engine(params.pop("engine", None))
        config = Config.of(comm.Get_size(), **params)

        def chosen():  # (the device by the rank's place on its machine, not in its (maybe simulated) node)
            made = get_backend(backend)
            return made, select_device(made, layout.local_rank, device)
        backend, device = agreed(comm, "AllToAll: choosing the device", chosen)
        config.check_agrees(comm, backend.kind)  # (each node checks its own part, not the nodes against each other)
        # Ranks of other (simulated) nodes may drive the same GPU: the grid is shared among all of them.
        machine = machine_comm(comm)
        devices = machine.allgather(device)
        # (which GPU, for the engine's default: the machine, named by its first rank, and the device index)
        placement = (machine.bcast(rank, root=0), device)
        machine.Free()
        self.comm = comm  # (pyhipa2a.testing's poison barriers span every node)
        self._comms = (comm.Split(color=layout.node, key=rank), comm.Split(color=layout.place, key=layout.node))
        self._engine = self._free = None
        def node_exchange():
            part = config.node_part(layout.nodes, layout.ranks_per_node, devices.count(device))
            return NodeExchange(self._comms[0], part, backend=backend, device=device)
        try:  # (a node whose part fails, its ranks told within it, tells the other nodes too)
            exchange = agreed(comm, "AllToAll: the node's exchange", node_exchange,
                              undo=lambda made: made.close(broken=True))
        except BaseException:
            self._free_comms()
            raise
        try:
            settled = config.settled_like(exchange.config)
            exchange.expert.set_scale(float(1 + rank))  # gpu-mode's factor is 1 + the world rank
            column = self._comms[1]  # its rank is the node's number
            self._engine = make_engine(engine, backend, column, config.timeout, column.allgather(placement))
            health = NodesHealth(exchange.buffers.status, rank, layout, self._engine)
            self._make_regions(settled, layout, exchange)
        except BaseException:
            self._close_parts(True, exchange)
            raise
        return settled, exchange, health, rank

    def _make_regions(self, c: Config, layout: NodeLayout, exchange: NodeExchange) -> None:
        """Our own allocation (the regions are not symmetric: only the engine reads them), the steps' packs,
        and the exchanges between nodes."""
        N, M, k, H, backend = layout.nodes, c.max_tokens, c.top_k, c.hidden, exchange.heap.backend
        row_bytes, out_row = H * c.in_dtype.itemsize, H * c.out_dtype.itemsize
        scale_bytes = 4 * c.scale_cols if c.x_format == X_FP8 else 0
        record_bytes = align_up(8 * M * k + 8, 16)
        parts = [("sequence", 16), ("seals", 16 * N), ("records", N * record_bytes),
                 ("regions_x", N * M * row_bytes), ("regions_scales", N * M * scale_bytes),
                 ("local_indices", 4 * N * M * k), ("local_weights", 4 * N * M * k),
                 ("sums", N * M * out_row), ("partials", N * M * out_row), ("y", M * out_row)]
        base = backend.malloc_ipc(sum(align_up(n, TABLE_ALIGN) for _, n in parts))  # zeroed: no sequence yet
        self._free = weakref.finalize(self, backend.free, base)
        ptr, at = {}, base
        for name, n in parts:
            ptr[name], at = at, at + align_up(n, TABLE_ALIGN)

        def own(name, shape, dtype):
            return DeviceArray(backend, ptr[name], shape, dtype, owner=self, stream=exchange.stream)
        self._y = own("y", (M, H), c.out_dtype)
        # What the exchange between nodes fills (tests poison it; the sequence number is the protocol's own).
        self.exchange_buffers = [own(name, (n,), np.uint8) for name, n in parts if n and name not in ("sequence", "y")]
        # The node part's dispatch always takes every region whole, without weights: fixed arguments.
        call = exchange.dispatch.call
        call.x, call.indices, call.weights, call.num_tokens = ptr["regions_x"], ptr["local_indices"], 0, N * M
        call.x_scales = ptr["regions_scales"] if scale_bytes else 0
        # Its combine takes every region too, with the regions' weights, into the sums that go home.
        call = exchange.combine.call
        call.weights, call.out, call.num_tokens = ptr["local_weights"], ptr["sums"], N * M
        self._node_tokens = N * M

        library = exchange.library
        self._stage, self._localize = library.kernel("hier_stage"), library.kernel("hier_localize")
        self._seal = library.kernel("hier_seal")
        self._sum = library.kernel("hier_sum_bf16" if c.out_dtype.name == "bfloat16" else "hier_sum_f16")
        status, mirror = exchange.buffers["status"].ptr, exchange.buffers.status_device
        self._steps = {}  # leg -> (its pack, the pack a plan launches from)
        for leg, whole in (("dispatch", 1), ("combine", 0)):
            packs = self._steps[leg] = (self._stage.pack(), self._stage.pack())
            a = packs[0][0]
            a.regions_x, a.records, a.sequence = ptr["regions_x"], ptr["records"], ptr["sequence"]
            a.regions_scales = ptr["regions_scales"] if scale_bytes else 0
            a.local_indices, a.local_weights = ptr["local_indices"], ptr["local_weights"]
            a.status, a.mirror = status, mirror
            a.node, a.nodes, a.ranks_per_node, a.place = layout.node, N, layout.ranks_per_node, layout.place
            a.max_tokens, a.top_k, a.num_experts, a.node_experts = M, k, c.num_experts, c.num_experts // N
            a.x_row_bytes, a.scale_bytes, a.record_bytes, a.whole = row_bytes, scale_bytes, record_bytes, whole
        # Where a plan's stand-ins write the caller's arrays (PLACED_ARGS): the stage's arguments (dispatch: the
        # tokens and their routing; combine: the weights that cross with the records), but expert_y, which the
        # node's combine takes.
        self._places = {"dispatch": field_addresses(self._steps["dispatch"][1][0], PLACED_ARGS["dispatch"]),
                        "combine": {**field_addresses(self._steps["combine"][1][0], ("weights",)),
                                    "expert_y": exchange.combine.repeater_places["expert_y"]}}
        self._sums = (self._sum.pack(), self._sum.pack())
        b = self._sums[0][0]
        b.own = ptr["sums"] + layout.node * M * out_row  # our own region's sums stay here
        b.partials, b.seals, b.sequence = ptr["partials"], ptr["seals"], ptr["sequence"]
        b.status, b.mirror = status, mirror
        b.node, b.nodes, b.ranks_per_node, b.place = layout.node, N, layout.ranks_per_node, layout.place
        b.max_tokens, b.hidden = M, H
        # One geometry for every call (the kernels loop over their items): the sites made now serve any call.
        # The seal is one thread's store: a block of a wave's width.
        self._geometry, self._seal_geometry = (c.blocks, c.block_threads), (1, 64)
        for leg, packs in self._steps.items():
            for pack in packs:
                for kernel in (self._stage, self._localize):
                    kernel.prepare(pack, *self._geometry)
                if leg == "combine":
                    self._seal.prepare(pack, *self._seal_geometry)
        for pack in self._sums:
            self._sum.prepare(pack, *self._geometry)

        # What crosses between nodes: to and from each other node's rank in our place.
        me, others = layout.node, [n for n in range(N) if n != layout.node]

        def region(name, nbytes):  # our part of buffer `name` out, theirs in, `nbytes` a part
            return [Transfer(m, ptr[name] + me * nbytes, ptr[name] + m * nbytes, nbytes) for m in others]
        records = region("records", record_bytes)
        tokens = region("regions_x", M * row_bytes) + records + (region("regions_scales", M * scale_bytes)
                                                                  if scale_bytes else [])
        sums = [Transfer(m, ptr["sums"] + m * M * out_row, ptr["partials"] + m * M * out_row, M * out_row)
                for m in others] + [Transfer(m, ptr["sequence"], ptr["seals"] + 16 * m, 16) for m in others]
        self._moves = {"dispatch": tokens, "combine": records, "sums": sums}  # (a leg's regions, then the sums)

    # -- AllToAll's parts ---------------------------------------------------------
    @property
    def buffers(self) -> dict:
        """The node part's buffers by name, with our y (scripts and tests poison them by name)."""
        return {**self._exchange.buffers.arrays, "y": self._y}

    def _make_views(self, stream):
        y = DeviceArray(self.backend, self._y.ptr, self._y.shape, self._y.dtype, owner=self, stream=stream,
                        health=self._health)
        return self._exchange.buffers.views(stream, self._health, y)

    def _check_capturable(self) -> None:
        if not self._engine.capturable:
            raise A2AError("capture() between nodes needs the NCCL engine: the MPI engine stages regions "
                           "through the host, which a graph cannot record")

    def _cross(self, leg: str, s) -> None:
        """`leg`'s regions on `s`: staged from its arguments, swapped with our counterparts on the other nodes,
        placed for the node's call."""
        pack = self._steps[leg][0]
        self._stage.launch(pack, *self._geometry, s)
        self._engine.exchange(self._moves[leg], s)
        self._localize.launch(pack, *self._geometry, s)

    def _launch_dispatch(self, s, tokens, x, indices, x_scales, weights, groups, ticket) -> None:
        a = self._steps["dispatch"][0][0]
        a.x, a.indices, a.x_scales, a.weights, a.tokens = x, indices, x_scales, weights, tokens
        self._cross("dispatch", s)
        leg = self._exchange.dispatch
        leg.call.groups, leg.call.ticket = groups, ticket  # (the node's groups are ours: the same experts)
        leg.launch(s, self._node_tokens)

    def _before_combine(self, s, tokens, weights) -> None:
        """The regions' records (the weights given to combine) to the experts' nodes, before the node's combine
        (in parts, before the first part's wait: the MPI engine's host waits for the stream, which that wait
        may hold)."""
        a = self._steps["combine"][0][0]
        a.weights, a.tokens = weights, tokens
        self._cross("combine", s)

    def _launch_combine(self, s, tokens, expert_y, weights, out, scale, phase, groups) -> None:
        # After the records (_before_combine). In groups the node's combine comes in parts (phase g + 1 sends
        # group g's tokens, then the reduce); the sums go home after the reduce.
        leg = self._exchange.combine
        leg.call.expert_y, leg.call.expert_scale = expert_y, scale
        leg.call.phase, leg.call.groups = phase, groups
        leg.launch(s, self._node_tokens)
        if phase in (WHOLE_COMBINE, REDUCE_ONLY):
            self._seal.launch(self._steps["combine"][0], *self._seal_geometry, s)
            self._engine.exchange(self._moves["sums"], s)
            b = self._sums[0][0]
            b.out, b.tokens = out, tokens
            self._sum.launch(self._sums[0], *self._geometry, s)

    def _repeater(self, leg: str, tokens: int):
        pack, frozen = self._steps[leg]
        exchange, node_leg = self._engine.exchange, getattr(self._exchange, leg)
        steps = [self._stage.repeater(pack, frozen, *self._geometry),
                 Launcher(functools.partial(exchange, self._moves[leg])),
                 self._localize.repeater(pack, frozen, *self._geometry), node_leg.repeater(self._node_tokens)]
        if leg == "combine":  # the seal, and the sums home
            steps += [self._seal.repeater(pack, frozen, *self._seal_geometry),
                      Launcher(functools.partial(exchange, self._moves["sums"])),
                      self._sum.repeater(*self._sums, *self._geometry)]
        # (a plan that wrote a pointer into a pack: each kernel's site takes it anew; an exchange, or a launcher
        # that reads its pack at each launch, as HIP's does, has nothing to re-hand)
        queues, rehands = [step.queue for step in steps], [step.rehand for step in steps if step.rehand is not None]

        def launch(s) -> None:
            for queue in queues:
                queue(s)

        def rehand() -> None:
            for again in rehands:
                again()
        # Every plan of a leg launches the same kernels (the node's call takes every region whole) and exchanges,
        # from the same frozen packs: the engine keeps them as one graph a leg, handed this plan's arguments now
        # (but a dispatch in groups: the node's grouped kernel, not in the leg's one graph).
        graph = None if node_leg.call.groups else self._engine.graph_for(leg, launch)
        if graph is None:
            return Launcher(launch, rehand=rehand)
        return Launcher(graph.launch, graph, graph.rehand)  # (a plan launches its graph from C: no Python a call)

    def _plan_conditions(self) -> tuple:
        return self._engine.plan_conditions

    def exchange_between_nodes(self, stream=None) -> None:
        """A call's bytes between nodes moved alone by the same engine, no kernel of ours (the bare exchange
        benchmarks set a call beside). Collective and ordered as a call; only between calls."""
        self._usable()
        if self._state.pending is not None:
            raise A2AError("exchange_between_nodes() between a dispatch and its combine would overwrite "
                           "the call's regions")
        streams = self._streams
        s = streams.given(stream)
        streams.follow(s)
        for moves in self._moves.values():
            self._engine.exchange(moves, s)
        streams.queued(s)

    @property
    def engine(self):
        return self._engine

    def _free_comms(self) -> None:
        for c in self._comms:
            c.Free()

    def _close_parts(self, broken: bool, exchange=None) -> None:
        """Ours, then the node's exchange (`exchange` while _open makes it), then the communicators: each
        whatever the one before raised."""
        with contextlib.ExitStack() as then:  # (its callbacks run in reverse order)
            then.callback(self._free_comms)
            then.callback((self._exchange if exchange is None else exchange).close, broken)
            if self._free is not None:
                then.callback(self._free)
            if self._engine is not None:
                self._engine.close(broken)
