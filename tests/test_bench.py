"""scripts/bench.py runs end to end and reports what it claims to (not how fast: timings are not tested)."""
from __future__ import annotations

import json
import os

import pytest

from pyhipa2a import repeat
from tests.mpi_harness import BACKENDS, REPO, env_backend, gpu_count, ranks_for, run_case, run_mpi

PHASES = ("dispatch", "gemm", "combine", "e2e")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lockstep_calls", [0, 3])
def test_bench_script(tmp_path, backend, lockstep_calls):
    """A shape (and without lockstep calls the sweep, whose points take a shape's steps), every call checked
    against the oracle by the bench itself (a failed check is a FAIL row, not ok: the lockstep graph's last
    call too, and the graph with events around the step alone that e2e is timed on); the e2e with events
    between the phases is kept beside it (each of its samples spans that call's dispatch and combine, so a
    span timed between the wrong events breaks the order of the medians); with lockstep calls, their phases
    are reported likewise; without, no ls figures and the columns say '-'; the host figures are taken again
    on CPUs of each rank's own where it has some."""
    ranks, out = ranks_for(backend), tmp_path / "bench.json"
    hidden = "128" if backend == "host" else "7168"
    sweep = ["--sweep", "--sweep-hidden", hidden] if not lockstep_calls else []
    run = run_mpi([str(REPO / "scripts" / "bench.py"), "--shape", f"{4 * ranks},2,256,8", *sweep,
                   "--iters", "2", "--warmup", "1", "--fused-expert",
                   "--lockstep-calls", str(lockstep_calls), "--full-speed-slack", "inf", "--json", str(out)],
                  ranks, env_backend(backend), timeout=900, what="bench.py")
    report = json.loads(out.read_text())
    # Starred figures: where every rank has CPUs of its own (one node, ranks not bound), taken on every
    # shape and point (--full-speed-slack inf: any CPU counts as at full speed), else on none
    pickable = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= ranks
    assert report["fast_cpus"] == pickable and report["full_speed_slack"] == float("inf"), report
    assert report["lockstep_calls"] == lockstep_calls
    # Which executor the repeated calls took, said beside the host figures it sets (the ranks' own import)
    assert report["plans_in_c"] == repeat.COMPILED
    assert ("repeated calls: the C helper" if repeat.COMPILED else "repeated calls: the Python executor") in run.stdout
    rows = report["shapes"] + report["sweep"]
    assert len(report["shapes"]) == 1
    assert [r["tokens"] for r in report["sweep"]] == ([1, 8, 32, 64, 128, 256] if sweep else [])
    for r in rows:
        assert r["ok"], r.get("error")
        assert all(r[p] > 0 for p in ("dispatch", "combine", "e2e", "empty", "empty_e2e", "eager_e2e"))
        assert r["e2e_phased"] >= max(r["dispatch"], r["combine"]), r
        # the host column, its floor, the CPU's state
        assert 0 < r["host_launches"] and 0 < r["host"] and 0 < r["yard"], r
        assert 0 < r["host_new"], r  # and with new arrays at every call
        fast = ([r["host_fast"], r["host_launches_fast"], r["fast_yard"]]
                + ([r["eager_over_graph_fast"]] if "wall" in r else []))
        assert all(v > 0 for v in fast) if pickable else all(v is None for v in fast), r
        if lockstep_calls:
            assert all(r["ls_" + p] >= 0 for p in PHASES) and r["ls_empty"] > 0, r
            assert r["ls_e2e"] >= max(r["ls_dispatch"], r["ls_combine"]), r
        else:
            assert not any(k.startswith("ls_") for k in r), r
    table = run.stdout.splitlines()
    shape = next(line for line in table if line.startswith("shape "))
    assert shape.split()[-4:] == ["ls", "e2e", "ls", "nop"], shape
    cols, r = next(line.split() for line in table if line.startswith("E=")), report["shapes"][0]
    assert (cols[-2:] == ["-", "-"]) == (lockstep_calls == 0), cols
    assert f"{r['host']:.1f} {r['host_launches']:.1f}" in " ".join(cols), cols  # the launches after host
    if not sweep:
        return
    header = next(line for line in table if line.lstrip().startswith("tok/rk"))
    assert header.split()[-6:] == ["ls", "disp", "ls", "comb", "ls", "nop"], header
    points = [line.split() for line in table[table.index(header) + 1:] if line.split()[:1] in (["1"], ["256"])]
    assert len(points) == 2
    for cols, r in zip(points, (report["sweep"][0], report["sweep"][-1])):
        assert cols[-3:] == ["-", "-", "-"], cols
        # (the launches and the yard after host)
        assert f"{r['host']:.1f} {r['host_launches']:.1f} {r['yard']:.1f}" in " ".join(cols), cols


@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_sets_a_call_between_nodes_beside_the_bare_exchange(tmp_path, backend):
    """Simulated nodes of one rank: the shape is checked and timed as anywhere, and its wall is reported
    beside the engine alone moving the same bytes, eager and replayed as a graph (MPI on the host, NCCL
    between two GPUs: both capturable), with the ratio over the graph's wall in the table."""
    ranks, out = ranks_for(backend), tmp_path / "bench.json"
    if ranks < 2:
        pytest.skip("one rank is one node")
    if backend == "gpu" and (gpu_count() < ranks or os.environ.get("PYHIPA2A_INTERNODE") == "mpi"):
        pytest.skip("the exchange between nodes is MPI's here (ranks sharing a GPU, or named): no graph of it")
    hidden = 128 if backend == "host" else 2048
    run = run_mpi([str(REPO / "scripts" / "bench.py"), "--shape", f"{4 * ranks},2,{hidden},8", "--iters", "2",
                   "--warmup", "1", "--fused-expert", "--json", str(out)],
                  ranks, env_backend(backend), timeout=600, env={"PYHIPA2A_RANKS_PER_NODE": "1"},
                  what="bench.py between nodes")
    (row,) = json.loads(out.read_text())["shapes"]
    assert row["ok"], row.get("error")
    assert row["wall"] > 0 and row["bare_exchange_wall"] > 0 and row["bare_exchange_eager_wall"] > 0, row
    table = run.stdout.splitlines()
    header = next(i for i, line in enumerate(table)
                  if line.split() == ["shape", "wall", "bare", "ratio", "bare", "eager"])
    cols = table[header + 1].split()
    assert cols[:4] == ["E=%d" % (4 * ranks), "k=2", f"H={hidden}", "M=8"], cols
    assert float(cols[-2]) == pytest.approx(row["wall"] / row["bare_exchange_wall"], abs=0.006), cols


@pytest.mark.parametrize("fail_at,release_raises,between_nodes,x_in_heap",
                         [(0, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0), (5, 0, 0, 0), (6, 0, 0, 0), (3, 1, 0, 0),
                          (6, 1, 0, 0), (0, 0, 1, 0), (3, 0, 1, 0), (0, 0, 0, 1), (5, 0, 0, 1)])
def test_bench_releases_what_it_made(fail_at, release_raises, between_nodes, x_in_heap):
    """Every input buffer, event and graph the bench makes for a shape is freed, also when a check fails
    (the whole step's graph's; the bare graph's; the eager calls' with new arrays; the lockstep graph's) and
    the shape is reported as a FAIL
    row: the bench goes on
    to the next shape. A release that raises (a faulted device) loses neither the FAIL row nor the other
    releases. Between nodes (a rank a node), the bare exchange's graph too, which the wall replays. With x in
    the heap (--x-in-heap), the object's x_buffer() is left to the object. The host backend, 2 ranks."""
    run_case("tests.cases.bench_cases:case_timing_releases_what_it_made", 2, "host",
             args=(fail_at, release_raises, between_nodes, x_in_heap))
