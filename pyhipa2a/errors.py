"""Exceptions raised by pyhipa2a, and the device status codes they decode (in sync with kernels_hip/protocol.h)."""
from __future__ import annotations

__all__ = ["Health", "A2AError", "A2ATimeoutError", "A2ADeviceError", "ConfigMismatchError", "AllocationMismatchError",
           "CodeObjectNotFound", "RuntimeFailure"]


class RuntimeFailure(RuntimeError):
    """A HIP/CUDA/host runtime call failed; the message holds the runtime's own error text."""


STATUS_OK, STATUS_TIMEOUT, STATUS_BAD_INDEX, STATUS_CAPACITY, STATUS_MISMATCH, STATUS_PEER, STATUS_UNPAIRED = range(7)
WAIT_WHAT = {1: "dispatch flag", 2: "combine contribution flag", 4: "heap self-test flag", 5: "combine weights",
             6: "tokens between nodes (dispatch)", 7: "sums between nodes (combine)",
             8: "routing and weights between nodes (combine)",
             10: "combine part's verdict from its first block"}  # what a timed-out wait awaited (3 is retired)
WAIT_GROUP_DONE = 9  # a grouped combine's wait for the caller's group_done, given up on by the host (groups.py)
WAIT_DISPATCH = 1  # (A2A_WAIT_DISPATCH) with STATUS_PEER: a source whose x this rank read in the heap failed


class A2AError(RuntimeError):
    """Base class of pyhipa2a's own errors."""


class A2ATimeoutError(A2AError):
    """A device-side (or host-side) wait for a peer ran past the timeout."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class A2ADeviceError(A2AError):
    """A kernel reported a contract violation (bad index, capacity, mismatch)."""


class ConfigMismatchError(A2AError):
    """Ranks disagree on something every rank must agree on, or a peer refused its own arguments to a setup."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class AllocationMismatchError(ConfigMismatchError):
    """Ranks made different symmetric-heap allocations."""


class CodeObjectNotFound(A2AError):
    """No ahead-of-time code object matches the device's architecture."""


def status_error(status, rank: int, context: str) -> A2AError | None:
    """Turn the four device status words into an exception (None when OK)."""
    code, peer, what, detail = (int(v) for v in status)
    if code == STATUS_OK:
        return None
    if code == STATUS_TIMEOUT and what == WAIT_GROUP_DONE:
        return A2ATimeoutError(f"{context}: rank {rank}: combine's wait for group_done({detail}) did not pass within "
                               f"the timeout (the stream that queued group_done({detail}) never got there, or "
                               f"combine's own stream never reached the wait); the call's y is poison, and the "
                               f"peers time out waiting for this rank's contributions", ranks=(rank,))
    if code == STATUS_TIMEOUT:
        return A2ATimeoutError(f"{context}: rank {rank} timed out waiting for the {WAIT_WHAT.get(what, what)} "
                               f"of rank {peer} (detail {detail}); rank {peer} never arrived, is stuck, or refuses "
                               f"calls after an error of its own (its error says which)",
                               ranks=(peer,))
    if code == STATUS_BAD_INDEX:
        return A2ADeviceError(
            f"{context}: rank {rank}: expert index {detail if detail < 2**31 else detail - 2**32} at flat "
            f"position {what} is outside [0, num_experts) or repeated in its row; it was not sent")
    if code == STATUS_CAPACITY:
        return A2ADeviceError(f"{context}: rank {rank}: local expert {what} of rank {peer} overflowed its rows "
                              f"(up to row {detail}; an expert has W * max_num_tokens rows, and contiguous rows "
                              f"have max_recv_rows in all); the call's outputs are poison")
    if code == STATUS_PEER and what == WAIT_DISPATCH:
        return A2ADeviceError(f"{context}: rank {rank}: rank {peer} failed (its status {detail}) while this rank "
                              f"read its tokens where they lie (x in the heap), so they may be its next call's; "
                              f"the call's outputs are poison, and that rank's own error says why")
    if code == STATUS_PEER:
        return A2ADeviceError(f"{context}: rank {rank}: rank {peer}, on another node, failed its part of this call, "
                              f"so its sums of our tokens are poison; that rank's own error says why")
    if code == STATUS_UNPAIRED:
        return A2ADeviceError(f"{context}: rank {rank}: a dispatch followed a dispatch that was never combined "
                              f"(epoch {detail}), so it was refused (a JAX program drops a combine whose result it "
                              "never uses: use every combine's y)")
    if code == STATUS_MISMATCH:
        return A2ADeviceError(f"{context}: rank {rank}: {detail} words did not match the expected pattern")
    return A2ADeviceError(f"{context}: rank {rank}: unknown device status {code} ({peer}, {what}, {detail})")


class Health:
    """One AllToAll's status words in pinned host memory, read without a wait before launches and output reads."""

    watches_streams = False  # whether settle() also bounds a stream held by no bound's wait (NodesHealth: NCCL)
    context = "AllToAll"  # what its errors name

    def __init__(self, host_status, rank: int):
        self.host_status, self.rank = host_status, rank
        self._bounds: list = []  # (see bound_waits)

    def error(self) -> A2AError | None:
        """The reported failure as an exception (a fresh one each time), or None."""
        return status_error(self.host_status.copy(), self.rank, self.context) if self.host_status[0] else None

    def bound_waits(self, settle) -> None:
        """`settle()` runs before every host wait on the object's streams: it returns once they may be waited
        for, or raises (a grouped combine's waits, pyhipa2a.groups, have no bound on the device)."""
        self._bounds.append(settle)

    def settle(self, stream) -> None:
        """Before a host read waits for `stream`: the bounds of waits that have none on the device (kernels bound
        their own); multi-node health also watches NCCL."""
        for settle in self._bounds:
            settle()

    def check(self, cause: BaseException | None = None) -> None:
        """Raise the reported failure, if any (chained to `cause`, what it made fail)."""
        error = self.error()
        if error is not None:
            raise error from cause
