"""Matrix multiplies queued on a stream: the vendor's BLAS (cuBLAS, hipBLAS) through ctypes, as the rest of the
runtime reaches the driver, and NumPy on the host backend. Row-major, as the library lays arrays out: a row-major
C = A @ B is the column-major C^T = B^T @ A^T, so the vendor's call gets the operands swapped. fp16 and bf16
operands accumulate in fp32 (GemmEx with a 32-bit compute type). C = A @ B + D goes to cuBLASLt where the
vendor has it (D apart from C: its matmul reads D while it writes C; GemmEx only adds onto C in place)."""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import RuntimeFailure


class Blas:
    def matmul(self, stream, a: int, b: int, c: int, m: int, n: int, k: int, *, lda: int, ldb: int, ldc: int,
               dtype: np.dtype, addend: int | None = None) -> None:
        """Queue C[m, n] = A[m, k] @ B[k, n] on `stream`, or C = A @ B + the matrix at `addend` (laid out as C;
        it may be C itself: the sum in fp32, rounded to C's type once; some of cuBLAS's kernels round the
        product to C's type first, seen on an H200 at 2048x4096x4096 but not at 256x256x4096); leading
        dimensions in elements; A, B and C of `dtype`."""
        raise NotImplementedError

    def prime(self, stream, gemms, c: int) -> None:
        """Queue on `stream`, into scratch at `c`, each GEMM of `gemms` ((a, b, m, n, k, lda, ldb, ldc, dtype,
        addend) each, the addend as the call will give it: cuBLASLt runs another kernel where it is c itself)
        whose kind was never launched here: a call queues these before its first wait on a peer. The driver
        loads a kernel at its first launch (CUDA's lazy loading), and that load waits for the streams of the
        context: a first launch queued behind a wait on a rank that never comes would hold the caller's thread
        in the driver, where no timeout of ours can reach it."""

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class VendorApi:
    """One vendor's GemmEx family: the library, the entry points' names, and the enum values they take."""
    libraries: tuple        # sonames tried in turn
    wheel_globs: tuple      # where pip wheels put them, under a sys.path entry
    create: str
    destroy: str
    set_stream: str
    set_workspace: str | None
    gemm: tuple             # GemmEx's names, newest first (ROCm 6 spells the hipDataType one hipblasGemmEx_v2)
    status_text: str
    # A symbol only libraries whose last name in `gemm` takes these enums have (hipBLAS >= 2.1: ROCm 5's
    # hipblasGemmEx took hipblasDatatype_t), or None
    enums_since: str | None
    op_n: int
    compute_32f: int
    algo_default: int
    lt: LtApi | None = None  # where C = A @ B + D goes (None: D is copied into C, and GemmEx adds onto it)


@dataclass(frozen=True)
class LtApi:
    """cuBLASLt: the library and the enum values its matmul takes (names as in cublasLt.h)."""
    libraries: tuple
    wheel_globs: tuple
    compute_32f: int        # CUBLAS_COMPUTE_32F
    scale_32f: int          # CUDA_R_32F
    pref_max_workspace: int  # CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES


class LtHeuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (cublasLtMatmulAlgo_t, 8 uint64) and what it needs."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


# NumPy dtype name -> cudaDataType / hipDataType (the same numbers): CUDA_R_16F, CUDA_R_16BF
DATA_TYPES = {"float16": 2, "bfloat16": 14}
CUBLASLT = LtApi(("libcublasLt.so", "libcublasLt.so.13", "libcublasLt.so.12"),
                 ("nvidia/cublas/lib/libcublasLt.so*", "nvidia/cu13/lib/libcublasLt.so*"), compute_32f=68,
                 scale_32f=0, pref_max_workspace=1)
CUBLAS = VendorApi(("libcublas.so", "libcublas.so.13", "libcublas.so.12"),
                   ("nvidia/cublas/lib/libcublas.so*", "nvidia/cu13/lib/libcublas.so*"),
                   "cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                   ("cublasGemmEx",), "cublasGetStatusString", None, op_n=0, compute_32f=68, algo_default=-1,
                   lt=CUBLASLT)
HIPBLAS = VendorApi(("libhipblas.so", "libhipblas.so.3", "libhipblas.so.2"), (),
                    "hipblasCreate", "hipblasDestroy", "hipblasSetStream", None,
                    ("hipblasGemmEx_v2", "hipblasGemmEx"), "hipblasStatusToString", "hipblasGetMathMode", op_n=111,
                    compute_32f=2, algo_default=160)
WORKSPACE_BYTES = 32 << 20  # cuBLAS's and cuBLASLt's each, given once: a capture must not allocate it


def load_library(api: VendorApi | LtApi) -> tuple[ctypes.CDLL, str]:
    """(the vendor's library, the name it was found by): by soname (the loader's path), else where a pip wheel
    (PyTorch's, CuPy's) put it."""
    tried = list(api.libraries)
    for root in filter(os.path.isdir, sys.path):
        for pattern in api.wheel_globs:
            tried.extend(sorted(glob.glob(os.path.join(root, pattern))))
    for name in tried:
        try:
            return ctypes.CDLL(name), name
        except OSError:
            continue
    raise RuntimeFailure(f"no {api.libraries[0]} found (tried {', '.join(tried)}): install the vendor's BLAS, or "
                         "pass gemm= your own")


def check_status(lib, status_text: str, name: str, status: int) -> None:
    """Raise where the library's call `name` returned a nonzero status, with the library's words for it."""
    if status:
        text = getattr(lib, status_text)
        text.restype = ctypes.c_char_p
        raise RuntimeFailure(f"{name} failed: {(text(status) or b'').decode()} (status {status})")


class LtMatmul:
    """C = A @ B + D through cuBLASLt (D apart from C, or C itself): for each shape, descriptors and the
    heuristic's first algorithm made once, kept for the handle's life."""

    def __init__(self, backend, api: LtApi):
        self.backend, self.api = backend, api
        self._lib, _ = load_library(api)
        self._plans: dict = {}  # (m, n, k, lda, ldb, ldc, data type) -> (matmul desc, layouts of A B C D, algo)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(1.0)
        handle = ctypes.c_void_p()
        self._call("cublasLtCreate", ctypes.byref(handle))
        self.handle, self.workspace = handle, None
        try:
            self.workspace = backend.malloc_ipc(WORKSPACE_BYTES)
        except BaseException:
            self.close()
            raise

    def _call(self, name: str, *args) -> None:
        check_status(self._lib, "cublasLtGetStatusString", name, getattr(self._lib, name)(*args))

    def _made(self, name: str, *args) -> ctypes.c_void_p:
        made = ctypes.c_void_p()
        self._call(name, ctypes.byref(made), *args)
        return made

    def _plan(self, m, n, k, lda, ldb, ldc, data_type) -> tuple:
        key = (m, n, k, lda, ldb, ldc, data_type)
        if key not in self._plans:
            api, u64, i64 = self.api, ctypes.c_uint64, ctypes.c_int64
            desc = self._made("cublasLtMatmulDescCreate", ctypes.c_int(api.compute_32f), ctypes.c_int(api.scale_32f))
            # Column-major, operands swapped (the module's note): A^T is B [n, k], B^T is A [k, m], C^T [n, m]
            layouts = tuple(self._made("cublasLtMatrixLayoutCreate", ctypes.c_int(data_type), u64(rows), u64(cols),
                                       i64(ld)) for rows, cols, ld in ((n, k, ldb), (k, m, lda), (n, m, ldc)))
            pref = self._made("cublasLtMatmulPreferenceCreate")
            try:
                size = ctypes.c_uint64(WORKSPACE_BYTES)
                self._call("cublasLtMatmulPreferenceSetAttribute", pref, ctypes.c_int(api.pref_max_workspace),
                           ctypes.byref(size), ctypes.c_size_t(ctypes.sizeof(size)))
                found, count = LtHeuristic(), ctypes.c_int(0)
                self._call("cublasLtMatmulAlgoGetHeuristic", self.handle, desc, layouts[0], layouts[1], layouts[2],
                           layouts[2], pref, ctypes.c_int(1), ctypes.byref(found), ctypes.byref(count))
            finally:
                self._call("cublasLtMatmulPreferenceDestroy", pref)
            if count.value < 1:
                raise RuntimeFailure(f"cuBLASLt has no algorithm for C [{m}, {n}] = A @ B + D (k = {k})")
            self._plans[key] = (desc, layouts, found)
        return self._plans[key]

    def matmul(self, stream_handle: int, a, b, c, addend, m, n, k, lda, ldb, ldc, data_type) -> None:
        desc, (lb, la, lc), found = self._plan(m, n, k, lda, ldb, ldc, data_type)
        self._call("cublasLtMatmul", self.handle, desc, ctypes.byref(self._alpha), ctypes.c_void_p(b), lb,
                   ctypes.c_void_p(a), la, ctypes.byref(self._beta), ctypes.c_void_p(addend), lc, ctypes.c_void_p(c),
                   lc, ctypes.byref(found.algo), ctypes.c_void_p(self.workspace), ctypes.c_size_t(WORKSPACE_BYTES),
                   ctypes.c_void_p(stream_handle))

    def close(self) -> None:
        for desc, layouts, _ in self._plans.values():
            for layout in layouts:
                self._call("cublasLtMatrixLayoutDestroy", layout)
            self._call("cublasLtMatmulDescDestroy", desc)
        self._plans = {}
        if self.handle is not None:
            self._call("cublasLtDestroy", self.handle)
            self.handle = None
        if self.workspace is not None:
            self.backend.free(self.workspace)
            self.workspace = None


def gemm_kind(m, n, k, lda, ldb, ldc, dtype, addend: int | None, c: int) -> tuple:
    """What decides the kernels a GEMM launches (one launch loads them); its addend none, C itself, or apart."""
    addend_kind = "none" if addend is None else "in place" if addend == c else "apart"
    return m, n, k, lda, ldb, ldc, np.dtype(dtype).name, addend_kind


class VendorBlas(Blas):
    """A handle of the vendor's BLAS on the current device, its workspace our memory."""

    def __init__(self, backend, api: VendorApi):
        self.backend, self.api = backend, api
        lib, found = load_library(api)
        self._lib = lib
        gemm_name = next((n for n in api.gemm if hasattr(lib, n)), None)
        if gemm_name is None:
            raise RuntimeFailure(f"{found} has none of {', '.join(api.gemm)}")
        if gemm_name == api.gemm[-1] and len(api.gemm) > 1 and api.enums_since and not hasattr(lib, api.enums_since):
            raise RuntimeFailure(f"{found} is too old: its {gemm_name} takes other type enums (ROCm >= 6 needed)")
        self._gemm = getattr(lib, gemm_name)  # (it returns a status: ctypes' default restype, int)
        # (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo)
        ptr, int_ = ctypes.c_void_p, ctypes.c_int
        self._gemm.argtypes = [ptr, int_, int_, int_, int_, int_, ptr, ptr, int_, int_, ptr, int_, int_, ptr, ptr, int_,
                               int_, int_, int_]
        self._gemm_name = gemm_name
        self._alpha, self._betas = ctypes.c_float(1.0), (ctypes.c_float(0.0), ctypes.c_float(1.0))
        self._stream = None
        self._launched: set = set()  # the gemm_kind of each GEMM launched: its kernels are loaded
        handle = ctypes.c_void_p()
        backend.activate()
        self._call(api.create, ctypes.byref(handle))
        self.handle, self.workspace = handle, None
        if api.set_workspace is not None:
            self.workspace = backend.malloc_ipc(WORKSPACE_BYTES)
            self._use_workspace()
        # C = A @ B + D's: made now, as the workspace is (a capture must not allocate it)
        try:
            self._lt = LtMatmul(backend, api.lt) if api.lt is not None else None
        except BaseException:
            self._lt = None
            self.close()
            raise

    def _status(self, name: str, status: int) -> None:
        check_status(self._lib, self.api.status_text, name, status)

    def _call(self, name: str, *args) -> None:
        self._status(name, getattr(self._lib, name)(*args))

    def _use_workspace(self) -> None:
        if self.workspace is not None:
            self._call(self.api.set_workspace, self.handle, ctypes.c_void_p(self.workspace),
                       ctypes.c_size_t(WORKSPACE_BYTES))

    def matmul(self, stream, a, b, c, m, n, k, *, lda, ldb, ldc, dtype, addend=None) -> None:
        handle, data_type = self.backend.stream_handle(stream), DATA_TYPES[np.dtype(dtype).name]
        if addend is not None and self._lt is not None:
            self._lt.matmul(handle, a, b, c, addend, m, n, k, lda, ldb, ldc, data_type)
        else:
            if handle != self._stream:
                self._call(self.api.set_stream, self.handle, ctypes.c_void_p(handle))
                self._use_workspace()  # (setting a stream puts back the library's own workspace)
                self._stream = handle
            if addend is not None and addend != c:  # (GemmEx adds onto C in place: D's rows first, C's padding kept)
                item = np.dtype(dtype).itemsize
                rows = [(0, m * n * item)] if ldc == n else [(i * ldc * item, n * item) for i in range(m)]
                for offset, nbytes in rows:
                    self.backend.copy_device(c + offset, addend + offset, nbytes, stream)
            op = self.api.op_n
            self._status(self._gemm_name, self._gemm(
                self.handle, op, op, n, m, k, ctypes.byref(self._alpha), b, data_type, ldb, a, data_type, lda,
                ctypes.byref(self._betas[addend is not None]), c, data_type, ldc, self.api.compute_32f,
                self.api.algo_default))
        self._launched.add(gemm_kind(m, n, k, lda, ldb, ldc, dtype, addend, c))

    def prime(self, stream, gemms, c) -> None:
        new = [g for g in gemms if gemm_kind(*g[2:], c) not in self._launched]
        if not new or self.backend.stream_capturing(stream):  # (a capture would replay them at every launch)
            return
        for a, b, m, n, k, lda, ldb, ldc, dtype, addend in new:
            self.matmul(stream, a, b, c, m, n, k, lda=lda, ldb=ldb, ldc=ldc, dtype=dtype, addend=addend)

    def close(self) -> None:
        if self._lt is not None:
            self.backend.activate()
            self._lt.close()
            self._lt = None
        if self.handle is not None:
            self.backend.activate()
            self._call(self.api.destroy, self.handle)
            self.handle = None
        if self.workspace is not None:
            self.backend.free(self.workspace)
            self.workspace = None


def host_matrix(ptr: int, rows: int, cols: int, ld: int, dtype: np.dtype) -> np.ndarray:
    """The row-major [rows, cols] matrix at `ptr` whose rows lie `ld` elements apart, as a NumPy view."""
    dtype = np.dtype(dtype)
    count = (rows - 1) * ld + cols if rows and cols else 0
    flat = np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype) if count else \
        np.empty(0, dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (ld * dtype.itemsize, dtype.itemsize))


class HostBlas(Blas):
    """NumPy's matmul in fp32, run as the host backend runs kernels: at once, or when a captured graph launches."""

    def __init__(self, backend):
        self.backend = backend

    def matmul(self, stream, a, b, c, m, n, k, *, lda, ldb, ldc, dtype, addend=None) -> None:
        def step() -> None:
            left = host_matrix(a, m, k, lda, dtype).astype(np.float32)
            product = left @ host_matrix(b, k, n, ldb, dtype).astype(np.float32)
            if addend is not None:
                product += host_matrix(addend, m, n, ldc, dtype).astype(np.float32)
            host_matrix(c, m, n, ldc, dtype)[...] = product
        self.backend.enqueue(stream, step)
