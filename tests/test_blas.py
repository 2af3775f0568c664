"""pyhipa2a.runtime.blas without a GPU: the host's GEMM against NumPy, and the vendor's call as the driver gets it
(row-major operands swapped for the column-major library, leading dimensions, types, checked status)."""
from __future__ import annotations

import ctypes
import dataclasses
import types

import numpy as np
import pytest

from pyhipa2a.dtypes import resolve
from pyhipa2a.runtime import blas
from pyhipa2a.errors import RuntimeFailure
from pyhipa2a.runtime.host import HostBackend


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("addend", [None, "c", "apart"])
def test_host_matmul_reads_and_writes_with_leading_dimensions(dtype, addend):
    d = resolve(dtype)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 9)).astype(d)    # A = a[:, :7] (lda 9)
    b = rng.standard_normal((7, 6)).astype(d)    # B = b (ldb 6)
    c = np.full((5, 8), np.nan, d)               # C = c[:, :4]... of B[:, :4] (ldc 8)
    before = rng.standard_normal((5, 4)).astype(d)
    c[:, :4] = before
    other = np.full((5, 8), np.nan, d)           # D = other[:, :4], laid out as C
    other[:, :4] = rng.standard_normal((5, 4)).astype(d)
    at = {None: None, "c": c.ctypes.data, "apart": other.ctypes.data}[addend]
    backend = HostBackend()
    blas.HostBlas(backend).matmul(None, a.ctypes.data, b.ctypes.data, c.ctypes.data, 5, 4, 7, lda=9, ldb=6, ldc=8,
                                  dtype=d, addend=at)
    product = a[:, :7].astype(np.float32) @ b[:, :4].astype(np.float32)
    if addend is not None:  # (added in fp32, rounded once)
        product = product + (before if addend == "c" else other[:, :4]).astype(np.float32)
    want = product.astype(d)
    np.testing.assert_array_equal(c[:, :4], want)
    assert np.isnan(c[:, 4:].astype(np.float32)).all()  # nothing beyond the rows' n columns


class FakeLibrary:
    """Records the vendor's calls; `status` is what GemmEx returns."""

    def __init__(self, api: blas.VendorApi, status: int = 0, old: bool = False):
        self.calls = []
        if api.enums_since and not old:
            setattr(self, api.enums_since, lambda *args: 0)
        for name in (api.create, api.destroy, api.set_stream) + ((api.set_workspace,) if api.set_workspace else ()):
            setattr(self, name, self._recorder(name, 0))
        setattr(self, api.gemm[-1], self._recorder("gemm", status))
        setattr(self, api.status_text, lambda status: b"CUBLAS_STATUS_NOT_SUPPORTED")

    def _recorder(self, name, status):
        def call(*args):
            self.calls.append((name, args))
            return status
        return call


class FakeLt:
    """cuBLASLt's entry points as LtMatmul calls them: made objects numbered, the heuristic finding `found`
    algorithms, the matmul returning `status`."""

    def __init__(self, found: int = 1, status: int = 0):
        self.calls, self.made, self.found, self.status = [], 0, found, status

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name.endswith("Create"):
                self.made += 1
                args[0]._obj.value = 0x1000 + self.made
            if name == "cublasLtMatmulAlgoGetHeuristic":
                args[-1]._obj.value = self.found
            return self.status if name == "cublasLtMatmul" else 0
        if name == "cublasLtGetStatusString":
            return lambda status: b"CUBLAS_STATUS_EXECUTION_FAILED"
        return call


def vendor(api, status=0, monkeypatch=None, old=False, lt=None):
    lib, lt = FakeLibrary(api, status, old), lt or FakeLt()
    monkeypatch.setattr(blas, "load_library", lambda which: (lt, "fake") if isinstance(which, blas.LtApi) else
                        (lib, "fake"))
    backend = types.SimpleNamespace(activate=lambda: None, stream_handle=lambda s: 0xABC,
                                    malloc_ipc=lambda n: 0x5000, free=lambda p: None,
                                    stream_capturing=lambda s: s == "capturing")
    return blas.VendorBlas(backend, api), lib


WITHOUT_LT = dataclasses.replace(blas.CUBLAS, lt=None)  # (adds go to GemmEx: cuBLASLt's have tests of their own)


@pytest.mark.parametrize("api", [WITHOUT_LT, blas.HIPBLAS], ids=["cublas", "hipblas"])
def test_vendor_gets_the_column_major_call_of_a_row_major_product(api, monkeypatch):
    v, lib = vendor(api, monkeypatch=monkeypatch)
    v._gemm = getattr(lib, api.gemm[-1])  # (the fake has no ctypes argtypes to check)
    v.matmul("stream", 0x100, 0x200, 0x300, 5, 4, 7, lda=9, ldb=6, ldc=8, dtype=resolve("bfloat16"))
    (name, args), = [c for c in lib.calls if c[0] == "gemm"]
    op, compute = api.op_n, api.compute_32f
    assert args[1:6] == (op, op, 4, 5, 7)                   # C^T [n, m] = B^T [n, k] A^T [k, m]
    assert (args[7], args[8], args[9]) == (0x200, 14, 6)    # B first, bf16, ldb
    assert (args[10], args[11], args[12]) == (0x100, 14, 9)  # then A, lda
    assert (args[14], args[15], args[16], args[17], args[18]) == (0x300, 14, 8, compute, api.algo_default)
    assert [c[0] for c in lib.calls].count(api.set_stream) == 1
    assert (args[6]._obj.value, args[13]._obj.value) == (1.0, 0.0)  # alpha, beta: C = A @ B
    v.matmul("stream", 0x100, 0x200, 0x300, 5, 4, 7, lda=9, ldb=6, ldc=8, dtype=resolve("float16"), addend=0x300)
    assert [c[0] for c in lib.calls].count(api.set_stream) == 1  # (set once while the stream stays)
    assert lib.calls[-1][1][13]._obj.value == 1.0  # beta: C += A @ B
    v.close()
    assert lib.calls[-1][0] == api.destroy


def test_vendor_failure_names_the_call_and_the_status(monkeypatch):
    v, lib = vendor(blas.CUBLAS, status=15, monkeypatch=monkeypatch)
    v._gemm = getattr(lib, "cublasGemmEx")
    with pytest.raises(RuntimeFailure, match=r"cublasGemmEx failed: CUBLAS_STATUS_NOT_SUPPORTED \(status 15\)"):
        v.matmul(None, 1, 2, 3, 1, 1, 1, lda=1, ldb=1, ldc=1, dtype=resolve("float16"))


def test_a_missing_library_says_where_it_looked(monkeypatch):
    api = blas.VendorApi(("libnot-a-blas.so",), ("nowhere/lib*.so",), "c", "d", "s", None, ("g",), "t", None, op_n=0,
                         compute_32f=0, algo_default=0)
    with pytest.raises(RuntimeFailure, match="no libnot-a-blas.so found .*pass gemm= your own"):
        blas.load_library(api)


def test_a_hipblas_whose_gemmex_takes_the_old_enums_is_refused(monkeypatch):
    with pytest.raises(RuntimeFailure, match=r"too old: its hipblasGemmEx takes other type enums \(ROCm >= 6"):
        vendor(blas.HIPBLAS, monkeypatch=monkeypatch, old=True)


def test_prime_launches_each_kind_of_gemm_once_and_never_into_a_capture(monkeypatch):
    # (a call primes the GEMMs it queues behind waits on peers: their kernels must be loaded before such a wait)
    v, lib = vendor(WITHOUT_LT, monkeypatch=monkeypatch)
    v._gemm = getattr(lib, "cublasGemmEx")
    bf16 = resolve("bfloat16")
    kinds = [(0x100, 0x200, 4, 8, 16, 16, 8, 8, bf16, None), (0x100, 0x200, 4, 8, 16, 16, 8, 8, bf16, 0x900)]

    def gemms():
        return [args for name, args in lib.calls if name == "gemm"]
    v.prime("capturing", kinds, 0x900)
    assert gemms() == []
    v.prime("stream", kinds, 0x900)
    assert [(g[14], g[13]._obj.value) for g in gemms()] == [(0x900, 0.0), (0x900, 1.0)]  # into the scratch
    v.matmul("stream", 0x100, 0x200, 0x300, 2, 8, 16, lda=16, ldb=8, ldc=8, dtype=bf16)
    v.prime("stream", kinds + [(0x100, 0x200, 2, 8, 16, 16, 8, 8, bf16, None)], 0x900)
    assert len(gemms()) == 3  # (every kind launched already)


def test_an_addend_apart_from_c_is_copied_into_c_first_where_the_vendor_has_no_lt(monkeypatch):
    v, lib = vendor(blas.HIPBLAS, monkeypatch=monkeypatch)
    v._gemm = getattr(lib, blas.HIPBLAS.gemm[-1])
    copies = []
    v.backend.copy_device = lambda dst, src, nbytes, stream: copies.append((dst, src, nbytes, stream))
    v.matmul("stream", 0x100, 0x200, 0x300, 5, 4, 7, lda=9, ldb=6, ldc=8, dtype=resolve("bfloat16"), addend=0x700)
    # D's rows into C's, each n columns: C's padding (ldc 8 > n 4) is left as it is
    assert copies == [(0x300 + i * 16, 0x700 + i * 16, 8, "stream") for i in range(5)]
    assert lib.calls[-1][0] == "gemm" and lib.calls[-1][1][13]._obj.value == 1.0


def test_an_addend_apart_goes_to_cublaslt_with_the_operands_swapped_and_one_plan_a_shape(monkeypatch):
    lt = FakeLt()
    v, lib = vendor(blas.CUBLAS, monkeypatch=monkeypatch, lt=lt)
    bf16 = resolve("bfloat16")
    for _ in range(2):
        v.matmul("stream", 0x100, 0x200, 0x300, 5, 4, 7, lda=9, ldb=6, ldc=8, dtype=bf16, addend=0x700)
    names = [name for name, _ in lt.calls]
    assert names.count("cublasLtMatmulAlgoGetHeuristic") == 1 and names.count("cublasLtMatmul") == 2
    layouts = [tuple(x.value for x in args[1:]) for name, args in lt.calls if name == "cublasLtMatrixLayoutCreate"]
    assert layouts == [(14, 4, 7, 6), (14, 7, 5, 9), (14, 4, 5, 8)]  # B^T [n, k], A^T [k, m], C^T and D^T [n, m]
    desc = [args for name, args in lt.calls if name == "cublasLtMatmulDescCreate"][0]
    assert (desc[1].value, desc[2].value) == (68, 0)  # fp32 compute and scale
    args = [args for name, args in lt.calls if name == "cublasLtMatmul"][-1]
    b_layout, a_layout, c_layout = 0x1003, 0x1004, 0x1005  # (0x1001 the handle, 0x1002 the descriptor)
    assert (args[3].value, args[4].value, args[5].value, args[6].value) == (0x200, b_layout, 0x100, a_layout)
    assert (args[8].value, args[9].value, args[10].value, args[11].value) == (0x700, c_layout, 0x300, c_layout)
    assert (args[2]._obj.value, args[7]._obj.value, args[15].value) == (1.0, 1.0, 0xABC)  # alpha, beta; stream
    assert (args[13].value, args[14].value) == (0x5000, blas.WORKSPACE_BYTES)  # its own workspace, all of it
    heuristic = [args for name, args in lt.calls if name == "cublasLtMatmulAlgoGetHeuristic"][0]
    chosen = ctypes.addressof(heuristic[8]._obj) + blas.LtHeuristic.algo.offset
    assert ctypes.addressof(args[12]._obj) == chosen and heuristic[7].value == 1  # the algorithm it chose
    pref = [args for name, args in lt.calls if name == "cublasLtMatmulPreferenceSetAttribute"][0]
    assert (pref[1].value, pref[2]._obj.value, pref[3].value) == (1, blas.WORKSPACE_BYTES, 8)  # max workspace
    assert not [c for c in lib.calls if c[0] == "gemm"]  # (GemmEx took none of it)
    v._gemm = getattr(lib, "cublasGemmEx")
    v.matmul("stream", 0x100, 0x200, 0x300, 5, 4, 7, lda=9, ldb=6, ldc=8, dtype=bf16)  # (no addend: GemmEx's)
    assert [c[0] for c in lib.calls].count("gemm") == 1 and len([n for n, _ in lt.calls if n == "cublasLtMatmul"]) == 2
    # Primed as the call gives it: an addend apart is a kind of its own (cuBLASLt runs another kernel in place)
    primed = [(0x100, 0x200, 5, 4, 7, 9, 6, 8, bf16, 0x780), (0x100, 0x200, 5, 4, 7, 9, 6, 8, bf16, 0x900)]
    v.prime("stream", primed, 0x900)
    matmuls = [args for name, args in lt.calls if name == "cublasLtMatmul"]
    assert len(matmuls) == 3 and (matmuls[-1][8].value, matmuls[-1][10].value) == (0x900, 0x900)  # (in place)
    v.close()
    names = [name for name, _ in lt.calls]
    assert names.count("cublasLtMatrixLayoutDestroy") == 3 and names[-1] == "cublasLtDestroy"


def test_cublaslt_without_an_algorithm_or_failing_says_so(monkeypatch):
    v, _ = vendor(blas.CUBLAS, monkeypatch=monkeypatch, lt=FakeLt(found=0))
    with pytest.raises(RuntimeFailure, match=r"cuBLASLt has no algorithm for C \[5, 4\] = A @ B \+ D"):
        v.matmul("stream", 1, 2, 3, 5, 4, 7, lda=7, ldb=4, ldc=4, dtype=resolve("float16"), addend=9)
    v, _ = vendor(blas.CUBLAS, monkeypatch=monkeypatch, lt=FakeLt(status=13))
    with pytest.raises(RuntimeFailure, match=r"cublasLtMatmul failed: CUBLAS_STATUS_EXECUTION_FAILED \(status 13\)"):
        v.matmul("stream", 1, 2, 3, 5, 4, 7, lda=7, ldb=4, ldc=4, dtype=resolve("float16"), addend=9)
