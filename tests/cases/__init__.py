"""Multi-rank cases, run under mpiexec by the test modules (tests/run_case.py)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def launch_sites_watched(backend):
    """(prepared, launched): sets of the launch sites (kernel, grid, block, pack) that `backend`'s
    prepare_launch made and that its launches and launchers used while the block runs."""
    prepared, launched = set(), set()

    def site(function, grid, block, pack):
        return id(function), grid, block, id(pack)

    def prepare(function, grid, block, pack):
        prepared.add(site(function, grid, block, pack))
        real_prepare(function, grid, block, pack)

    def launch(function, grid, block, stream, pack):
        launched.add(site(function, grid, block, pack))
        real_launch(function, grid, block, stream, pack)

    def launcher(function, grid, block, pack, rewritten=False):
        launched.add(site(function, grid, block, pack))
        return real_launcher(function, grid, block, pack, rewritten)
    real_prepare, real_launch, real_launcher = backend.prepare_launch, backend.launch, backend.launcher
    backend.prepare_launch, backend.launch, backend.launcher = prepare, launch, launcher
    try:
        yield prepared, launched
    finally:
        backend.prepare_launch, backend.launch, backend.launcher = real_prepare, real_launch, real_launcher
