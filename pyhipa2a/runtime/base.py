"""The interface every runtime backend implements. Pointers are ints (on the host backend, this process's addresses);
streams, events, modules and functions are the backend's handles; a failed call raises RuntimeFailure."""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import RuntimeFailure


# The kinds of a stream_word_ops operation: (WAIT, ptr, value) waits until the word holds value, (WRITE, ptr, value)
# writes it (after the stream's earlier writes are visible).
WAIT, WRITE = "wait", "write"


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str              # "gfx942", "gfx90a", "sm_90", "host"
    index: int             # device ordinal used by this process
    count: int             # devices visible to this process
    multiprocessors: int   # CUs (AMD) / SMs (NVIDIA) / 1 on host
    warp_size: int


class Launcher:
    """A launch made once for the calls that repeat it (pyhipa2a.repeat's plans): calling it with a stream queues
    it (`queue(stream)`). `graph`: None, or the executable graph (its `exec`) that a plan launches from C
    instead (CUDA). `rehand`: None, or f() that hands the launch its packs' arguments again, after a plan wrote
    a new pointer into one (CUDA's graph nodes took them when they were made)."""
    __slots__ = ("queue", "graph", "rehand")

    def __init__(self, queue, graph=None, rehand=None):
        self.queue, self.graph, self.rehand = queue, graph, rehand

    def __call__(self, stream) -> None:
        self.queue(stream)


class Backend:
    """Device selection, streams, events, IPC-capable memory, copies, modules, launches. `kind`: "hip",
    "cuda" or "host"; `code_suffix`: the built code objects' (".hsaco", ".fatbin"; None on the host)."""

    kind: str = "abstract"
    code_suffix: str | None = None
    dlpack_device_type: int = 1  # DLPack kDLCPU (host arrays hand straight to NumPy); GPU backends override
    current_device: int = 0      # set by open_device: arrays made without an owner live there

    # -- device -------------------------------------------------------------
    def device_count(self) -> int:
        raise NotImplementedError

    def open_device(self, index: int) -> DeviceInfo:
        """Make device `index` current for this process and describe it."""
        raise NotImplementedError

    def activate(self) -> None:
        """Make the opened device current again on this thread, where another library (JAX) or thread left its own:
        every AllToAll call, and every backend call that makes something bound to a device, does this first."""

    # -- memory -------------------------------------------------------------
    def malloc_ipc(self, nbytes: int) -> int:
        """Allocate memory peers can map (fine-grained on AMD), zero-filled."""
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        raise NotImplementedError

    def ipc_export(self, ptr: int) -> bytes:
        """A handle (bytes) another process on this node can open."""
        raise NotImplementedError

    def ipc_open(self, handle: bytes) -> int:
        """Map a peer's allocation; returns its base address in this process."""
        raise NotImplementedError

    def reach_in_process(self, ptr: int, device: int) -> int | None:
        """A rank of this process allocated `ptr` on `device` (pyhipa2a.local): the address at which this rank
        reaches it, or None where its IPC handle is to be opened, as another process's is."""
        return None

    def ipc_close(self, ptr: int) -> None:
        raise NotImplementedError

    def ipc_exchanged(self, ptr: int) -> None:
        """Every peer has opened `ptr`'s handle: nothing here (the host backend drops its shared memory's name)."""

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        """Zeroed pinned host memory the device can write (kernels report errors there): (host, device)."""
        raise NotImplementedError

    def free_host_mapped(self, host_ptr: int) -> None:
        raise NotImplementedError

    def memory_in_use(self) -> int:
        """Bytes of device memory in use (device-wide on GPUs; this process's mappings on host)."""
        raise NotImplementedError

    def pointer_device(self, ptr: int) -> int | None:
        """Device ordinal that owns `ptr`, or None when the runtime does not know it."""
        raise NotImplementedError

    # -- copies (synchronous with respect to `stream` when stream is given) --
    def copy_to_device(self, dst: int, src: np.ndarray, stream=None) -> None:
        raise NotImplementedError

    def copy_to_host(self, dst: np.ndarray, src: int, stream=None) -> None:
        raise NotImplementedError

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        raise NotImplementedError

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        raise NotImplementedError

    # -- streams and events ---------------------------------------------------
    def stream_create(self):
        raise NotImplementedError

    def stream_destroy(self, stream) -> None:
        raise NotImplementedError

    stream_type: type | tuple = ()  # this backend's stream objects (stream= may be one; else it carries a handle)

    def stream_handle(self, stream) -> int:
        """Integer value of a stream handle (for __cuda_array_interface__ / DLPack)."""
        raise NotImplementedError

    def stream_from_handle(self, handle: int):
        """Wrap a foreign stream handle (an int) given by the user."""
        raise NotImplementedError

    def stream_synchronize(self, stream) -> None:
        raise NotImplementedError

    def stream_done(self, stream) -> bool:
        """Whether everything queued on `stream` has finished, without waiting."""
        raise NotImplementedError

    def event_create(self):
        raise NotImplementedError

    def event_destroy(self, event) -> None:
        raise NotImplementedError

    def event_record(self, event, stream, *, within_capture: bool = False) -> None:
        """Record `event` on `stream`. On a stream we capture (or joined), the record is one each replay makes
        (external), unless `within_capture`: then it is a dependency inside the graph (a fork or a join)."""
        raise NotImplementedError

    def event_synchronize(self, event) -> None:
        raise NotImplementedError

    def event_done(self, event) -> bool:
        """Whether the work before `event`'s last record has finished, without waiting."""
        raise NotImplementedError

    def stream_wait_event(self, stream, event) -> None:
        """Work queued on `stream` from now on waits for what `event` last recorded."""
        raise NotImplementedError

    def event_elapsed_ms(self, start, end) -> float:
        raise NotImplementedError

    def stream_wait_stream(self, waiter, producer, *, within_capture: bool = False) -> None:
        """Work queued on `waiter` from now on waits, on the device, for what `producer` holds now (via an event);
        `within_capture`: both are (or become) one capture's streams, so the wait is a graph's edge."""
        if self.stream_handle(waiter) == self.stream_handle(producer):
            return
        local = self.__dict__.get("_handoff") or self.__dict__.setdefault("_handoff", threading.local())
        event = getattr(local, "event", None)
        if event is None:
            event = local.event = self.event_create()
        self.event_record(event, producer, within_capture=within_capture)
        self.stream_wait_event(waiter, event)

    # -- words on the device: one stream signals another, on this GPU or a peer's, with no kernel --------
    def stream_write_word(self, stream, ptr: int, value: int) -> None:
        """After the work queued on `stream`, and after its writes are visible, write the 32-bit `value` at
        `ptr` (ours or a peer's mapping)."""
        raise NotImplementedError

    def stream_wait_word(self, stream, ptr: int, value: int, timeout: float, timed_out) -> None:
        """Work queued on `stream` from now on waits until the 32-bit word at `ptr` equals `value`. GPUs wait on
        the device, holding no multiprocessor and without a bound (the host bounds them); the host backend
        waits at most `timeout` seconds and then raises `timed_out()`."""
        raise NotImplementedError

    def stream_word_ops(self, stream, ops: tuple, timeout: float, timed_out) -> None:
        """Queue `ops` (a tuple of at most 255 (WAIT or WRITE, ptr, value)) on `stream` in order, as
        stream_wait_word and stream_write_word do. A runtime that takes them as one batch pays its cost per
        operation once, on the host and on the device (in a captured graph, one node). Here: one call each."""
        for kind, ptr, value in ops:
            if kind == WAIT:
                self.stream_wait_word(stream, ptr, value, timeout, timed_out)
            else:
                self.stream_write_word(stream, ptr, value)

    def stream_waits_refused(self) -> str | None:
        """Why stream_wait_word cannot wait on words of the symmetric heap in this process, or None."""
        return None

    def open_blas(self):
        """This backend's matrix multiply (pyhipa2a.runtime.blas.Blas), for the current device."""
        raise NotImplementedError

    # -- graphs: launches and event records on a capturing stream are recorded, replayed by one launch --
    def capture_begin(self, stream) -> None:
        raise NotImplementedError

    def capture_end(self, stream, keep: bool = True):
        """Stop capturing on `stream`; an executable graph when `keep`, else the capture is discarded (None)."""
        raise NotImplementedError

    def graph_launch(self, graph, stream) -> None:
        raise NotImplementedError

    def record_steps(self, stream, queue):
        """A graph of what `queue(stream)` launches on `stream`, whose kernels can take the arguments their packs
        hold again (its `rehand()`; `launch(stream)`, `close()`), made once and kept where calls change only
        arguments (a graph made per call grows device memory); None where this backend cannot (the caller
        then queues step by step)."""
        return None

    def stream_capturing(self, stream) -> bool:
        """Whether `stream` is being captured, by capture_begin or by another library (torch.cuda.graph)."""
        raise NotImplementedError

    def capturable(self, stream) -> bool:
        """Whether `stream` can be captured at all (False: stream_capturing need not be asked)."""
        return True

    def capture_join(self, stream) -> None:
        """Another library captures `stream`: our launches on it join that capture, until capture_leave."""

    def capture_leave(self, stream) -> None:
        """The end of capture_join."""

    def graph_destroy(self, graph) -> None:
        raise NotImplementedError

    # -- code ---------------------------------------------------------------
    def module_load(self, image: bytes):
        raise NotImplementedError

    def module_owner(self):
        """What loaded modules belong to (they are shared by owner): a process-long context; None on the host."""
        return None

    def module_unload(self, module) -> None:
        raise NotImplementedError

    def module_function(self, module, name: str):
        raise NotImplementedError

    def resident_blocks(self, function, block_threads: int) -> int:
        """How many blocks of `block_threads` threads of `function` one multiprocessor holds at once."""
        raise NotImplementedError

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        """Launch `function` on `grid` blocks of `block` threads with the arguments `pack` (kernels.ArgPack) holds
        now: its void* array on GPUs (CUDA via a one-node graph kept in `pack.sites`), its ctypes values on host."""
        raise NotImplementedError

    def prepare_launch(self, function, grid: int, block: int, pack) -> None:
        """Make what launch() makes at first use and keeps (CUDA: a graph): an object takes its memory when made."""

    def launcher(self, function, grid: int, block: int, pack) -> Launcher:
        """launch() from `pack` (unwritten while this lives) as a Launcher: CUDA passes arguments once."""
        return Launcher(functools.partial(self.launch, function, grid, block, pack=pack))

    # -- launches from outside Python (pyhipa2a.jax: XLA's handler) ----------------------------------
    def launch_entry(self) -> int | None:
        """The address of the driver's kernel launch (cuLaunchKernel's arguments), or None where there is none."""
        return None

    def function_address(self, function) -> int:
        """A loaded kernel as the driver's launch takes it."""
        raise NotImplementedError

    # -- a repeated call's plan (pyhipa2a.repeat) --------------------------------
    def plan_activate(self):
        """How a plan makes our device current: (f,) calls f(); CUDA gives the driver's entries instead."""
        return (self.activate,)

    def plan_launch(self, launch: Launcher, stream) -> tuple:
        """How a plan launches `launch` on `stream`, and the collections that must be empty for that to be what
        `launch` does: ((launch.queue, stream), ()) calls it; CUDA gives its graph's cuGraphLaunch."""
        return (launch.queue, stream), ()

    def raise_driver_error(self, what: str, code: int) -> None:
        """Raise what the backend raises where the driver call `what` returned `code` (in a plan's C)."""
        raise RuntimeFailure(f"{what} failed with code {code}")

    def trap(self, reason: str) -> None:
        """A kernel aborted the device (on_timeout="trap"): the host backend has to be told, GPUs know."""

    def close(self) -> None:
        """Release per-process runtime state (streams the backend created)."""
