"""Multi-rank case for profiling (run by tests/test_profile.py under mpiexec)."""
from __future__ import annotations

import os
import sys


def case_trace(comm, shape, out):
    """Runs scripts/trace.py in this job's ranks (it checks the profiling build against the oracle)."""
    import runpy
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "trace.py")
    sys.argv = [script, "--shape", shape, "--iters", "2", "--out", out]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def case_clock_sync(comm):
    """clock_offset_ns() twice: every rank's clock against rank 0's comes with a bound that holds. On the
    host backend all ranks read one clock, so the true offset is 0 and must lie within the bound; on a
    GPU the two syncs, a few milliseconds apart, agree within their bounds (plus 1 us for drift)."""
    from pyhipa2a import AllToAll
    world = comm.Get_size()
    with AllToAll(comm, num_experts=2 * world, experts_per_token=2, hidden_dim=64, max_num_tokens=4) as a2a:
        first = [a2a.clock_offset_ns(), a2a.clock_sync]
        second = [a2a.clock_offset_ns(), a2a.clock_sync]
        for offset, sync in (first, second):
            assert isinstance(offset, int) and sync.error_ns >= 0
            if a2a.rank == 0:
                assert sync.offset_ns == 0 and sync.error_ns == 0
        one, two = first[1], second[1]
        if a2a.backend.kind == "host":
            assert abs(one.offset_ns) <= one.error_ns and abs(two.offset_ns) <= two.error_ns, (one, two)
        else:
            # A link's round trip, not a launch's; where ranks share a GPU their contexts may take turns (a
            # time slice, milliseconds, between a word and its answer): then only that the bound is finite.
            shared = a2a.heap.ranks_on_device > 1
            bound = 50_000_000 if shared else 5000
            assert one.error_ns < bound and two.error_ns < bound, (one, two)
            assert abs(one.offset_ns - two.offset_ns) <= one.error_ns + two.error_ns + 1000, (one, two)
            # Host minus device, as this rank's own host reading has it (good to a launch's round trip:
            # a few us) where two GPUs' clocks stand tens of us apart: a sign slip would show. (Ranks that
            # share a GPU: within a time slice too, which either reading may wait for; rank 0's sync, the
            # reference, has no bound of its own.)
            from pyhipa2a.kernels import KernelLibrary
            from pyhipa2a.clock import clock_offset
            library = KernelLibrary(a2a.backend, a2a.heap.device.arch)
            own = clock_offset(a2a.backend, library, a2a.stream)
            library.close()
            assert abs(second[0] - own) < 20_000 + (bound if shared else 0), (second[0], own, two)
        print(f"rank {a2a.rank}: {one} {two}")


def case_clock_sync_missing_peer(comm, who):
    """One rank (`who`: the first or the last) never calls clock_offset_ns(): the ranks that trade
    words with it (rank 0 trades with everyone; the others only with rank 0) raise A2ATimeoutError
    naming it within the timeout, on the device's deadline (no host collective to hang in), and every
    rank still closes."""
    import time

    import pytest

    import pyhipa2a
    from pyhipa2a import A2ATimeoutError, AllToAll
    world = comm.Get_size()
    if world == 1:
        pytest.skip("needs a peer that skips")
    skipper = 0 if who == "first" else world - 1
    with AllToAll(comm, num_experts=2 * world, experts_per_token=2, hidden_dim=64, max_num_tokens=4,
                  timeout=1.5) as a2a:
        if a2a.rank != skipper:
            start = time.monotonic()
            if a2a.rank == 0 or skipper == 0:
                with pytest.raises(A2ATimeoutError, match=f"rank {skipper} never arrived") as info:
                    a2a.clock_offset_ns()
                assert info.value.ranks == (skipper,) and time.monotonic() - start < 1.5 + 2.0
                # Its syncs are out of step now (the skipper counted one fewer): later ones refuse.
                with pytest.raises(pyhipa2a.A2AError, match="unusable after an earlier failure"):
                    a2a.clock_offset_ns()
            else:  # trades with rank 0 only, which is here
                a2a.clock_offset_ns()
        comm.Barrier()
