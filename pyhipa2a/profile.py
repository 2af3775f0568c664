"""In-kernel timelines (profile=True: the kernels built with -DA2A_PROFILE=1): each warp records (start,
end, tag, block, warp, detail) for every stage; `scripts/trace.py` lines the ranks up into one trace.
"""
from __future__ import annotations

import numpy as np

# tag -> (name, kind) as in kernels_hip/profile.h; kind: "wait" (for a peer), "move", "span" (a warp's kernel)
# or "sync" (grid-level bookkeeping).
TAGS = {
    1: ("dispatch.route", "move"),
    2: ("dispatch.stage", "move"),
    3: ("dispatch.wait_header", "wait"),
    4: ("dispatch.wait_token", "wait"),
    5: ("dispatch.fanout", "move"),
    6: ("dispatch.counts", "wait"),
    7: ("dispatch.warp", "span"),
    8: ("combine.weights", "move"),
    9: ("combine.wait_weights", "wait"),
    10: ("combine.contribute", "move"),
    11: ("combine.wait_contrib", "wait"),
    12: ("combine.reduce", "move"),
    13: ("combine.warp", "span"),
}
KERNEL_OF_SPAN = {7: "dispatch", 13: "combine"}

EVENT = np.dtype([("start", "<u8"), ("end", "<u8"), ("tag", "<u4"), ("block", "<u4"), ("warp", "<u4"),
                  ("detail", "<u4")])
HEADER_BYTES = 16  # warps, per_warp, dropped, pad (ProfHeader in kernels_hip/profile.h)


def events_offset(warps: int) -> int:
    """Where the events start: after the header and one u32 count per warp, padded to 32 bytes."""
    return HEADER_BYTES + (4 * warps + 31) // 32 * 32


class ProfileBuffer:
    """Device buffer of events, a ring per warp (the layout of kernels_hip/profile.h)."""

    def __init__(self, backend, warps: int, per_warp: int = 256):
        self.backend, self.warps, self.per_warp = backend, int(warps), int(per_warp)
        self.offset = events_offset(self.warps)
        self.nbytes = self.offset + self.warps * self.per_warp * EVENT.itemsize
        self.ptr = backend.malloc_ipc(self.nbytes)
        self.reset()

    def reset(self, stream=None) -> None:
        head = np.zeros(self.offset // 4, np.uint32)
        head[:2] = self.warps, self.per_warp
        self.backend.copy_to_device(self.ptr, head, stream)

    def read(self, stream=None) -> tuple[np.ndarray, int]:
        """(events, dropped): the events recorded since the last reset, warp by warp; dropped counts the
        events a warp's ring overwrote (and is at least 1 when a warp beyond the buffer's tried)."""
        head = np.empty(self.offset // 4, np.uint32)
        self.backend.copy_to_host(head, self.ptr, stream)
        counts = head[HEADER_BYTES // 4:HEADER_BYTES // 4 + self.warps].astype(np.int64)
        dropped = int(head[2]) + int(np.maximum(counts - self.per_warp, 0).sum())
        if not counts.any():
            return np.empty(0, EVENT), dropped
        used = int(np.flatnonzero(counts)[-1]) + 1  # copy only up to the last warp that recorded
        events = np.empty((used, self.per_warp), EVENT)
        self.backend.copy_to_host(events, self.ptr + self.offset, stream)
        keep = np.arange(self.per_warp)[None, :] < np.minimum(counts[:used], self.per_warp)[:, None]
        return events[keep], dropped

    def free(self) -> None:
        if self.ptr:
            self.backend.free(self.ptr)
            self.ptr = 0
