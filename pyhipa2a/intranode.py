"""Dispatch and combine within one node over the ranks' symmetric heaps: a NodeExchange (heap, buffers,
kernels, the fake expert, clock syncs), and NodeAllToAll, the AllToAll over one.
"""
from __future__ import annotations

from .api import AllToAll
from .bootstrap import agreed, world_size
from .calls import PLACED_ARGS
from .buffers import Buffers, heap_bytes
from .clock import Clocks
from .config import Config
from .errors import A2ATimeoutError, Health
from .expert import FakeExpert
from .heap import SymmetricHeap
from .internode import asked_engine
from .kernels import KernelLibrary
from .legs import exchange_legs, load_kernels, settle_geometry


class NodeExchange:
    def __init__(self, comm, config: Config, *, backend=None, device: int | None = None):
        self.heap = SymmetricHeap(comm, heap_bytes(config), backend=backend, device=device, timeout=config.timeout)
        self.library = self.stream = self.buffers = self.expert = None
        try:
            self._open(config)
        except BaseException:
            self.close(broken=True)
            raise

    def _open(self, config: Config) -> None:
        heap = self.heap
        backend, device = heap.backend, heap.device

        def loaded():  # (what this device makes of the configuration: its code objects, its launch geometry)
            on_device = config.on_device(device.arch, device.warp_size)
            self.library = KernelLibrary(backend, device.arch, variant=".profile" if on_device.profile else "")
            kernels = load_kernels(self.library, on_device)
            ranks_here = on_device.ranks_on_device or heap.ranks_on_device
            return kernels, settle_geometry(on_device, backend, device, kernels, ranks_here)
        # (a rank whose device refuses the configuration tells the others, who raise too)
        kernels, config = agreed(heap.comm, "AllToAll: loading the kernels", loaded)
        config.check_agrees(heap.comm, backend.kind)
        self.config = config
        self.buffers = Buffers(heap, config)
        self.health = Health(self.buffers.status, heap.rank)  # outputs ask it before handing data out
        self.stream = backend.stream_create()
        self.dispatch, self.combine = exchange_legs(kernels, config, self.buffers.exchange_args)
        self.expert = FakeExpert(kernels.fake_expert, self.buffers, config.blocks, config.block_threads)
        self.expert.set_scale(float(1 + heap.rank))
        self.clocks = Clocks(self.library, self.buffers, self.stream)

    def close(self, broken: bool) -> None:
        """Waits (bounded) for peers before unmapping the heap; a peer that already timed out on us (the
        object is `broken`) may be gone, and its absence is no news then."""
        try:
            self.heap.close()
        except A2ATimeoutError:
            if not broken:
                raise
        finally:
            for part in (self.expert, self.buffers, self.library):
                if part is not None:
                    part.close()
            if self.stream is not None:
                self.heap.backend.stream_destroy(self.stream)


class NodeAllToAll(AllToAll, across_nodes=False):
    """AllToAll within one node."""

    def _open(self, comm, layout, backend, device, params: dict) -> tuple:
        asked_engine(params.pop("engine", None))  # (nothing crosses nodes here: a named engine goes unused)
        exchange = NodeExchange(comm, Config.of(world_size(comm), **params), backend=backend, device=device)
        # Where a plan's stand-ins write the caller's arrays: the node's kernel arguments
        self._places = {leg: {name: getattr(exchange, leg).repeater_places[name] for name in names}
                        for leg, names in PLACED_ARGS.items()}
        return exchange.config, exchange, exchange.health, exchange.heap.rank

    @property
    def buffers(self) -> Buffers:
        """The symmetric buffers by name (buffers["recv_x"]: a DeviceArray)."""
        return self._exchange.buffers

    def _make_views(self, stream):
        return self._exchange.buffers.views(stream, self._health)

    def _launch_dispatch(self, s, tokens, x, indices, x_scales, weights, groups, ticket) -> None:
        leg = self._exchange.dispatch
        call = leg.call  # (the epoch is the device's own: make_ctx in kernels_hip/exchange.h)
        call.x, call.indices, call.x_scales, call.weights, call.num_tokens = x, indices, x_scales, weights, tokens
        call.groups, call.ticket = groups, ticket
        leg.launch(s, tokens)

    def _launch_combine(self, s, tokens, expert_y, weights, out, scale, phase, groups) -> None:
        leg = self._exchange.combine
        c = leg.call
        c.expert_y, c.weights, c.out, c.num_tokens, c.expert_scale = expert_y, weights, out, tokens, scale
        c.phase, c.groups = phase, groups
        leg.launch(s, tokens)

    def launch_site(self, leg: str, tokens: int) -> tuple:
        """(kernel, blocks, threads a block, the address of the fixed arguments) of a `leg` call ("dispatch",
        "combine") of `tokens` tokens: what pyhipa2a.jax launches on XLA's stream with arguments of its own."""
        return getattr(self._exchange, leg).site(tokens)

    def _repeater(self, leg: str, tokens: int):
        return getattr(self._exchange, leg).repeater(tokens)

    def _close_parts(self, broken: bool) -> None:
        self._exchange.close(broken)
