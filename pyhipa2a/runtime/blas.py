"""Matrix multiplies queued on a stream: the vendor's BLAS (cuBLAS, hipBLAS) through ctypes, as the rest of the
runtime reaches the driver, and NumPy on the host backend. Row-major, as the library lays arrays out: a row-major
C = A @ B is the column-major C^T = B^T @ A^T, so the vendor's call gets the operands swapped. fp16 and bf16
operands accumulate in fp32 (GemmEx with a 32-bit compute type)."""
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
               dtype: np.dtype, out_dtype: np.dtype | None = None, accumulate: bool = False) -> None:
        """Queue C[m, n] = A[m, k] @ B[k, n] on `stream`, or C += A @ B where `accumulate` (beta = 1: the sum in
        fp32, rounded to C's type once; some of cuBLAS's kernels round the product to C's type first, seen on
        an H200 at 2048x4096x4096 but not at 256x256x4096); leading dimensions in elements; A and B of
        `dtype`, C of `out_dtype` (default `dtype`)."""
        raise NotImplementedError

    def prime(self, stream, gemms, c: int) -> None:
        """Queue on `stream`, into scratch at `c`, each GEMM of `gemms` ((a, b, m, n, k, lda, ldb, ldc, dtype,
        accumulate) each) whose kind was never launched here: a call queues these before its first wait on a
        peer. The driver loads a kernel at its first launch (CUDA's lazy loading), and that load waits for
        the streams of the context: a first launch queued behind a wait on a rank that never comes would hold
        the caller's thread in the driver, where no timeout of ours can reach it."""

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
    types: dict             # NumPy dtype name -> cudaDataType / hipDataType (the same numbers)


_DATA_TYPES = {"float16": 2, "bfloat16": 14, "float32": 0}  # CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F (HIP_R_* alike)
CUBLAS = VendorApi(("libcublas.so", "libcublas.so.13", "libcublas.so.12"),
                   ("nvidia/cublas/lib/libcublas.so*", "nvidia/cu13/lib/libcublas.so*"),
                   "cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                   ("cublasGemmEx",), "cublasGetStatusString", None, op_n=0, compute_32f=68, algo_default=-1,
                   types=_DATA_TYPES)
HIPBLAS = VendorApi(("libhipblas.so", "libhipblas.so.3", "libhipblas.so.2"), (),
                    "hipblasCreate", "hipblasDestroy", "hipblasSetStream", None,
                    ("hipblasGemmEx_v2", "hipblasGemmEx"), "hipblasStatusToString", "hipblasGetMathMode", op_n=111,
                    compute_32f=2, algo_default=160, types=_DATA_TYPES)
WORKSPACE_BYTES = 32 << 20  # cuBLAS's own, given once: a capture must not allocate it


def load_library(api: VendorApi) -> tuple[ctypes.CDLL, str]:
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
        self._gemm = getattr(lib, gemm_name)
        self._gemm.restype = ctypes.c_int
        self._gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._gemm_name = gemm_name
        self._alpha, self._betas = ctypes.c_float(1.0), (ctypes.c_float(0.0), ctypes.c_float(1.0))
        self._stream = None
        self._launched: set = set()  # the (m, n, k, lda, ldb, ldc, dtype, accumulate) launched: kernels loaded
        handle = ctypes.c_void_p()
        backend.activate()
        self._call(api.create, ctypes.byref(handle))
        self.handle, self.workspace = handle, None
        if api.set_workspace is not None:
            self.workspace = backend.malloc_ipc(WORKSPACE_BYTES)
            self._call(api.set_workspace, handle, ctypes.c_void_p(self.workspace), ctypes.c_size_t(WORKSPACE_BYTES))

    def _status(self, name: str, status: int) -> None:
        if status:
            text = getattr(self._lib, self.api.status_text)
            text.restype = ctypes.c_char_p
            raise RuntimeFailure(f"{name} failed: {(text(status) or b'').decode()} (status {status})")

    def _call(self, name: str, *args) -> None:
        self._status(name, getattr(self._lib, name)(*args))

    def matmul(self, stream, a, b, c, m, n, k, *, lda, ldb, ldc, dtype, out_dtype=None, accumulate=False) -> None:
        handle = self.backend.stream_handle(stream)
        if handle != self._stream:
            self._call(self.api.set_stream, self.handle, ctypes.c_void_p(handle))
            if self.workspace is not None:  # (setting a stream puts back the library's own workspace)
                self._call(self.api.set_workspace, self.handle, ctypes.c_void_p(self.workspace),
                           ctypes.c_size_t(WORKSPACE_BYTES))
            self._stream = handle
        types = self.api.types
        ab, cd = types[np.dtype(dtype).name], types[np.dtype(out_dtype or dtype).name]
        op = self.api.op_n
        self._status(self._gemm_name, self._gemm(
            self.handle, op, op, n, m, k, ctypes.byref(self._alpha), b, ab, ldb, a, ab, lda,
            ctypes.byref(self._betas[bool(accumulate)]), c, cd, ldc, self.api.compute_32f, self.api.algo_default))
        self._launched.add((m, n, k, lda, ldb, ldc, ab, cd, bool(accumulate)))

    def prime(self, stream, gemms, c) -> None:
        types = self.api.types
        new = [g for g in gemms if (*g[2:8], types[np.dtype(g[8]).name], types[np.dtype(g[8]).name], bool(g[9]))
               not in self._launched]
        if not new or self.backend.stream_capturing(stream):  # (a capture would replay them at every launch)
            return
        for a, b, m, n, k, lda, ldb, ldc, dtype, accumulate in new:
            self.matmul(stream, a, b, c, m, n, k, lda=lda, ldb=ldb, ldc=ldc, dtype=dtype, accumulate=accumulate)

    def close(self) -> None:
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

    def matmul(self, stream, a, b, c, m, n, k, *, lda, ldb, ldc, dtype, out_dtype=None, accumulate=False) -> None:
        def step() -> None:
            left = host_matrix(a, m, k, lda, dtype).astype(np.float32)
            right = host_matrix(b, k, n, ldb, dtype).astype(np.float32)
            out = host_matrix(c, m, n, ldc, out_dtype or dtype)
            out[...] = left @ right + out.astype(np.float32) if accumulate else left @ right
        self.backend.enqueue(stream, step)
