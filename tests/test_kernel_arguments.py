"""The kernels divide by the call's fixed sizes (k, L, E, segments, route chunks, W) with a multiply and
a shift whose constants the host picks (pyhipa2a.kernels.divisor); and the host's ctypes argument
structures must lay out exactly the fields the kernels' structures declare."""
from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

from pyhipa2a import kernels
from pyhipa2a.kernels import divisor
from tests.mpi_harness import REPO
from tests.native_build import build_native

LIMIT = 2**31  # quot is exact below this (portability.h), and divisors lie below it too


@pytest.mark.parametrize("d", [0, -3, LIMIT, LIMIT + 5])
def test_divisors_out_of_range_are_refused(d):
    with pytest.raises(ValueError, match="out of range"):
        divisor(d)


def divisors_to_try() -> list[int]:
    ds = set(range(1, 2049))
    for s in range(1, 31):
        ds |= {2**s - 1, 2**s, 2**s + 1}
    ds |= {LIMIT - 1, LIMIT - 2, 3 * 2**29, 1_000_003, 7 * 2**20 + 1}
    rng = np.random.default_rng(7)
    ds |= set(int(d) for d in rng.integers(2, LIMIT, 200))
    return sorted(d for d in ds if d < LIMIT)


def numerators(d: int, rng) -> list[int]:
    top = LIMIT - 1
    ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, top, top - top % d, top - top % d - 1}
    ns |= set(int(n) for n in rng.integers(0, LIMIT, 6))
    ns |= set(int(q) * d + r for q, r in zip(rng.integers(0, top // d + 1, 4), (0, d - 1, d // 2, 1)))
    return sorted(n for n in ns if 0 <= n < LIMIT)


def test_the_kernels_quot_and_rem_are_exact(tmp_path):
    """portability.h's quot, rem and quot_rem, compiled for the host, against // and % on the host's divisors,
    at the edges (0, multiples of d and their neighbours, the largest n) and at random."""
    exe = build_native(tmp_path, "divisors")
    rng = np.random.default_rng(11)
    record = np.dtype([("mul", "<u8"), ("d", "<u4"), ("shift", "<u4"), ("n", "<u4"), ("unused", "<u4")])
    rows = []
    for d in divisors_to_try():
        v = divisor(d)
        assert (v.d, 2**v.shift >= d, v.shift == 0 or 2 ** (v.shift - 1) < d) == (d, True, True)
        rows += [(v.mul, v.d, v.shift, n, 0) for n in numerators(d, rng)]
    records = np.array(rows, dtype=record)
    out = np.frombuffer(subprocess.run([str(exe)], input=records.tobytes(), capture_output=True, check=True).stdout,
                        dtype="<u4").reshape(-1, 4)
    n, d = records["n"].astype(np.int64), records["d"].astype(np.int64)
    assert len(out) == len(records)
    wrong = np.flatnonzero((out[:, 0] != n // d) | (out[:, 1] != n % d) | (out[:, 2] != n // d) | (out[:, 3] != n % d))
    assert not len(wrong), [(int(d[i]), int(n[i]), tuple(out[i])) for i in wrong[:5]]


# C field types as the kernels' headers spell them, and their ctypes twins.
C_TYPES = {"u64": ctypes.c_uint64, "i32": ctypes.c_int32, "u32": ctypes.c_uint32, "float": ctypes.c_float,
           "HeapView": kernels.HeapView, "Divisor": kernels.Divisor}


def declared_fields(struct: str) -> list[tuple[str, str]]:
    """(type, name) of each member of `struct` in kernels_hip/, in order (pointers as u64)."""
    for header in sorted((REPO / "kernels_hip").glob("*.*")):
        found = re.search(rf"^struct {struct} {{\n(.*?)^}};", header.read_text(), re.M | re.S)
        if found:
            break
    else:
        raise AssertionError(f"struct {struct} not found in kernels_hip/")
    fields = []
    for line in found.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        kind, pointer, names = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*([\w\s,*]+);", code).groups()
        for name in names.split(","):
            name = name.strip()
            fields.append(("u64" if pointer or name.startswith("*") else kind, name.lstrip("*").strip()))
    return fields


@pytest.mark.parametrize("struct", ["A2AArgs", "DispatchCall", "CombineCall", "HeapView", "Divisor", "HeapCheckArgs",
                                    "HierArgs", "HierSumArgs"])
def test_argument_structures_agree_with_the_kernels(struct):
    host = getattr(kernels, struct)
    declared = declared_fields(struct)
    assert [name for _, name in declared] == [f[0] for f in host._fields_], struct
    for (kind, name), (_, host_type) in zip(declared, host._fields_):
        assert ctypes.sizeof(C_TYPES[kind]) == ctypes.sizeof(host_type), f"{struct}.{name}: {kind} vs {host_type}"
