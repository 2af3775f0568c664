"""gpu-mode's stand-in for the grouped GEMM, as a kernel: expert_y = expert_x * (1 + rank) over the received
rows (fp8 rows times their block scales first), into the object's own buffer (expert_y_buffer) or the caller's."""
from __future__ import annotations

import math
import weakref

from .array import DeviceArray, FreedMemory


class FakeExpert:
    def __init__(self, kernel, buffers, blocks: int, threads: int):
        self.kernel, self.buffers, self.blocks, self.threads = kernel, buffers, blocks, threads
        self.pack = kernel.pack()
        kernel.prepare(self.pack, blocks, threads)
        self.out_arg = self.pack[2 if buffers.config.scale_cols else 1]
        self.buffer = None  # expert_y_buffer(), made on first use
        self._views: dict = {}  # the buffer naming other streams, by handle
        self._free = None

    def set_scale(self, scale: float) -> None:
        """Every argument but the output: our expert_x (and its scales), counts, and the factor."""
        c, b = self.buffers.config, self.buffers
        fixed = (b["num_tokens"].ptr, b["layout"].ptr if c.by_source else 0, b["offsets"].ptr if c.contiguous else 0,
                 c.world if c.by_source else 0, c.recv_rows, c.local_experts, c.capacity, c.hidden, scale)
        if c.scale_cols:
            self.pack.set_scalars(b["recv_x"].ptr, b["recv_scales"].ptr, 0, *fixed,
                                  int(c.dispatch_dtype.name == "float8_e4m3fnuz"))
        else:
            self.pack.set_scalars(b["recv_x"].ptr, 0, *fixed)

    def launch(self, out_ptr: int, stream) -> None:
        self.out_arg.value = out_ptr
        self.kernel.launch(self.pack, self.blocks, self.threads, stream)

    def expert_y_buffer(self, stream) -> DeviceArray:
        """A device buffer shaped like expert_y [L, W*M, H] ([R, H] contiguous; out_dtype), made once, freed by
        close()."""
        if self.buffer is None:
            c, backend = self.buffers.config, self.buffers.heap.backend
            backend.activate()  # memory is allocated on the current device
            shape = (*c.rows_shape, c.hidden)
            ptr = backend.malloc_ipc(math.prod(shape) * c.out_dtype.itemsize)
            self._free = weakref.finalize(self, backend.free, ptr)  # also at exit
            self.buffer = DeviceArray(backend, ptr, shape, c.out_dtype, owner=self, stream=stream)
        return self.buffer

    def expert_y_on(self, stream, health) -> DeviceArray:
        """expert_y_buffer() as a view naming `stream`, where the fake expert writes it, carrying `health`."""
        base = self.buffer
        handle = base.backend.stream_handle(stream)
        view = self._views.get(handle)
        if view is None:
            view = self._views[handle] = DeviceArray(base.backend, base.ptr, base.shape, base.dtype, owner=base.owner,
                                                     stream=stream, health=health)
        return view

    @property
    def closed(self) -> bool:
        """Whether expert_y_buffer()'s memory was freed (its arrays' owner: they keep this object alive till then)."""
        return self._free is not None and not self._free.alive

    def close(self) -> None:
        if self._free is not None and self._free.alive:
            self._free()
            FreedMemory.freed()
            self.buffer = None
