"""The one small interface every runtime backend implements.

Pointers are plain Python ints (device virtual addresses; on the host backend,
addresses in this process). Streams, events, modules and functions are opaque
handles owned by the backend. Every method raises `RuntimeFailure` carrying the
runtime's own error string when the underlying call fails.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np


class RuntimeFailure(RuntimeError):
    """A HIP/CUDA/host runtime call failed; the message holds the runtime's own error text."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str              # "gfx942", "gfx90a", "sm_90", "host"
    index: int             # device ordinal used by this process
    count: int             # devices visible to this process
    multiprocessors: int   # CUs (AMD) / SMs (NVIDIA) / 1 on host
    warp_size: int


class Backend:
    """Device selection, streams, events, IPC-capable memory, copies, modules, launches.

    `kind` names the backend ("hip", "cuda", "host"); `code_suffix` is the file
    suffix of the ahead-of-time code objects this backend loads (".hsaco",
    ".fatbin"; None on host, whose kernels are Python functions).
    """

    kind: str = "abstract"
    code_suffix: str | None = None
    dlpack_device_type: int = 1  # DLPack kDLCPU; GPU backends override
    current_device: int = 0      # set by open_device: arrays made without an owner live there

    # -- device -------------------------------------------------------------
    def device_count(self) -> int:
        raise NotImplementedError

    def open_device(self, index: int) -> DeviceInfo:
        """Make device `index` current for this process and describe it."""
        raise NotImplementedError

    def activate(self) -> None:
        """Make the opened device current again on the calling thread, where another library (JAX,
        PyTorch on another device) or another thread left a different one: on a GPU whose process sees
        several, launches and events on our streams then fail, and allocations would land on that
        device. Every public entry of AllToAll calls this first, and so does each call of a backend that
        makes something bound to a device (memory, streams, events, modules); the host backend has nothing
        to switch."""

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

    def ipc_close(self, ptr: int) -> None:
        raise NotImplementedError

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        """Zeroed pinned host memory the device can write: (host address, device address).

        Kernels report errors here, so the host reads them without a copy or a sync."""
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

    # The type of this backend's own stream objects (stream_create's, stream_from_handle's), which a call's
    # stream= may be; anything else must carry a handle (pyhipa2a.producers.foreign_stream_handle).
    stream_type: type | tuple = ()

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

    def event_record(self, event, stream) -> None:
        raise NotImplementedError

    def event_synchronize(self, event) -> None:
        raise NotImplementedError

    def stream_wait_event(self, stream, event) -> None:
        """Work queued on `stream` from now on waits for what `event` last recorded."""
        raise NotImplementedError

    def event_elapsed_ms(self, start, end) -> float:
        raise NotImplementedError

    def stream_wait_stream(self, waiter, producer) -> None:
        """Work queued on `waiter` from now on waits, on the device, for what is queued on `producer`
        now: an event recorded there and waited for here (nothing when they are one stream). Each
        thread records its own event, so a wait never takes another thread's record."""
        if self.stream_handle(waiter) == self.stream_handle(producer):
            return
        local = self.__dict__.get("_handoff") or self.__dict__.setdefault("_handoff", threading.local())
        event = getattr(local, "event", None)
        if event is None:
            event = local.event = self.event_create()
        self.event_record(event, producer)
        self.stream_wait_event(waiter, event)

    # -- graphs -------------------------------------------------------------
    # Stream capture: launches and event records on a capturing stream are
    # recorded, not run, and replay together with one launch call.
    def capture_begin(self, stream) -> None:
        raise NotImplementedError

    def capture_end(self, stream, keep: bool = True):
        """Stop capturing on `stream`; an executable graph when `keep`, else the capture is discarded (None)."""
        raise NotImplementedError

    def graph_launch(self, graph, stream) -> None:
        raise NotImplementedError

    def stream_capturing(self, stream) -> bool:
        """Whether `stream` is being captured, by capture_begin or by another library (torch.cuda.graph)."""
        raise NotImplementedError

    def capturable(self, stream) -> bool:
        """Whether `stream` can be captured at all (False: stream_capturing need not be asked)."""
        return True

    def capture_join(self, stream) -> None:
        """Another library captures `stream`: our launches on it join that capture as they would ours
        (GPU backends launch plainly into a capture), until capture_leave."""

    def capture_leave(self, stream) -> None:
        """The end of capture_join."""

    def graph_destroy(self, graph) -> None:
        raise NotImplementedError

    # -- code ---------------------------------------------------------------
    def module_load(self, image: bytes):
        raise NotImplementedError

    def module_owner(self):
        """What a loaded module belongs to, for sharing it among libraries: a device context that
        lives as long as the process (the runtimes retain the primary context and never release it),
        or None where each library loads and unloads its own (the host backend)."""
        return None

    def module_unload(self, module) -> None:
        raise NotImplementedError

    def module_function(self, module, name: str):
        raise NotImplementedError

    def resident_blocks(self, function, block_threads: int) -> int:
        """How many blocks of `block_threads` threads of `function` one multiprocessor holds at once."""
        raise NotImplementedError

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        """Launch `function` on a 1-D grid of `grid` blocks of `block` threads.

        `pack` is a `kernels.ArgPack`: GPU backends pass `pack.kernel_params`
        (a ctypes array of void*, one per argument, built once per launch
        site), the CUDA backend to a one-node graph it keeps in `pack.sites`;
        the host backend calls its Python kernel with `pack.arguments` (the
        ctypes argument objects themselves). Each launch takes the arguments
        as the pack holds them at that moment.
        """
        raise NotImplementedError

    def prepare_launch(self, function, grid: int, block: int, pack) -> None:
        """Make now what launch() of `function` on this geometry from `pack` makes at its first use and
        keeps (CUDA: the site's one-node graph, which takes device memory), so that an object can take
        all its memory when it is made rather than in the middle of a run. Nothing to make by default."""

    def launcher(self, function, grid: int, block: int, pack):
        """launch() of `function` from `pack`, a pack not written while the launcher is used (a plan's,
        pyhipa2a.repeat), as a function of the stream alone: a backend may hand the arguments it holds
        now to the device once, here, and launch them as they were (CUDA)."""
        return functools.partial(self.launch, function, grid, block, pack=pack)

    # -- a repeated call's plan (pyhipa2a.repeat) ----------------------
    def plan_activate(self):
        """How a plan makes our device current: (f,) calls f() (activate() by default); a backend that
        can be asked in C gives the driver's entries instead (CUDA)."""
        return (self.activate,)

    def plan_launch(self, launch, stream) -> tuple:
        """How a plan launches `launch` (a launcher's function of the stream) on `stream`, and the
        collections that must be empty for that to be what `launch` would do: ((launch, stream), ())
        calls it; a backend whose launcher is one driver call may give that call's entry and handles
        instead (CUDA)."""
        return (launch, stream), ()

    def raise_driver_error(self, what: str, code: int) -> None:
        """Raise what the backend raises where the driver call `what` returned `code` (in a plan's C)."""
        raise RuntimeFailure(f"{what} failed with code {code}")

    def trap(self, reason: str) -> None:
        """A kernel aborted the device (AllToAll(..., on_timeout="trap")). GPU runtimes are left
        unusable by the abort itself; the host backend has to be told (HostBackend.trap)."""

    def close(self) -> None:
        """Release per-process runtime state (streams the backend created)."""
