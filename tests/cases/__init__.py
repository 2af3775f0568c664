"""Multi-rank cases, run under mpiexec by the test modules (tests/run_case.py)."""
from __future__ import annotations

import contextlib


def routed_to(inputs, expert: int):
    """`inputs` with every rank's first token routed to `expert` among its picks, so that every rank's call needs
    the rank that holds it: with many ranks and few tokens, random routing leaves some rank none (its call then
    rightly succeeds, and a case about that rank's failure would test nothing there)."""
    for indices in inputs.indices:
        if expert not in indices[0]:
            indices[0, 0] = expert
    return inputs


def launches_checked(a2a, graph, buffers, captured: dict, launches, draw, between) -> None:
    """Launch a captured step `launches` times, each a new call on new inputs (`draw(i)`) in the step's
    `buffers`, checked against the oracle (pyhipa2a.testing.replay_checked, with the DispatchResult the capture
    kept in captured["d"]); `between()`, an eager call, runs after the second launch."""
    from pyhipa2a.testing import replay_checked
    for i in range(int(launches)):
        err = replay_checked(a2a, graph, draw(i), buffers, captured["d"])
        print(f"rank {a2a.rank} launch {i}: max err {err:.3g}")
        if i == 1:
            between()


@contextlib.contextmanager
def launch_sites_watched(backend):
    """(prepared, launched, names): sets of the launch sites (kernel, grid, block, pack) that `backend`'s
    prepare_launch made and that its launches and launchers used while the block runs, and the name of
    each kernel (by id) that the backend looked up meanwhile."""
    prepared, launched, names = set(), set(), {}

    def site(function, grid, block, pack):
        return id(function), grid, block, id(pack)

    def prepare(function, grid, block, pack):
        prepared.add(site(function, grid, block, pack))
        real_prepare(function, grid, block, pack)

    def launch(function, grid, block, stream, pack):
        launched.add(site(function, grid, block, pack))
        real_launch(function, grid, block, stream, pack)

    def launcher(function, grid, block, pack):
        launched.add(site(function, grid, block, pack))
        return real_launcher(function, grid, block, pack)

    def module_function(module, name):
        function = real_function(module, name)
        names[id(function)] = name
        return function
    real_prepare, real_launch, real_launcher = backend.prepare_launch, backend.launch, backend.launcher
    real_function = backend.module_function
    backend.prepare_launch, backend.launch, backend.launcher = prepare, launch, launcher
    backend.module_function = module_function
    try:
        yield prepared, launched, names
    finally:
        backend.prepare_launch, backend.launch, backend.launcher = real_prepare, real_launch, real_launcher
        backend.module_function = real_function


class Watched:
    """What calls did while calls_watched() ran: `plans`, for each call a plan was there for, whether it
    took the call (False: it missed, and the full path took it; None: it raised); `forms`, the plan's (activate, launch)
    forms ("driver": by the driver's entries from C; "python": by a Python function); `described`, for
    each device array a full path took, the protocol of its description (pyhipa2a.inputs: "own", "cai",
    "dlpack", or "probed": by its probe's view alone)."""

    def __init__(self):
        self.plans, self.forms, self.described = [], [], []

    def clear(self) -> None:
        self.plans.clear()
        self.forms.clear()
        self.described.clear()


@contextlib.contextmanager
def calls_watched():
    from pyhipa2a import calls, inputs
    watched, real_run, real_describe = Watched(), calls.run, inputs.Boundary.describe

    def run(plan, *args):
        try:
            result = real_run(plan, *args)
        except BaseException:
            watched.plans.append(None)
            raise
        watched.plans.append(result is not calls.MISSED)
        activate, launch = plan[4], plan[6]
        watched.forms.append(("driver" if activate is not None and len(activate) == 3 else "python",
                              "driver" if len(launch) == 4 else "python"))
        return result

    def describe(self, name, obj, *args):
        d, producer = real_describe(self, name, obj, *args)
        watched.described.append(d.protocol)
        return d, producer
    calls.run, inputs.Boundary.describe = run, describe
    try:
        yield watched
    finally:
        calls.run, inputs.Boundary.describe = real_run, real_describe
