// One name for each device facility our kernels use, on AMD (clang -x hip,
// no HIP headers: -nogpuinc) and on NVIDIA (nvcc -x cu). Kernel sources
// include only this header, so they compile unchanged for gfx942, gfx90a and
// sm_90.
#pragma once

typedef __UINT8_TYPE__ u8;
typedef __UINT16_TYPE__ u16;
typedef __UINT32_TYPE__ u32;
typedef __UINT64_TYPE__ u64;
typedef __INT32_TYPE__ i32;
typedef __INT64_TYPE__ i64;

// A 16-byte vector: the widest load/store both vendors issue per lane.
struct __attribute__((aligned(16))) vec16 { u32 x, y, z, w; };

#if defined(__AMDGCN__) || (defined(__HIP__) && !defined(__CUDACC__))
// ---------------------------------------------------------------- AMD ----
#define A2A_AMD 1
#ifndef __global__
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#endif
#define A2A_DEVICE __device__ __attribute__((always_inline)) inline
#define A2A_DEVICE_CALLED __device__ __attribute__((noinline))  // one copy of its code, however many callers
#define A2A_WARP_SIZE 64
// Kernels are never launched with more than this many threads per block, so
// the compiler may budget registers for it (two 256-thread blocks per CU/SM).
#define A2A_MAX_THREADS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))

A2A_DEVICE u32 a2a_thread() { return __builtin_amdgcn_workitem_id_x(); }
A2A_DEVICE u32 a2a_block() { return __builtin_amdgcn_workgroup_id_x(); }
A2A_DEVICE u32 a2a_block_dim() { return __builtin_amdgcn_workgroup_size_x(); }
A2A_DEVICE u32 a2a_grid_dim() {
  return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x();
}
A2A_DEVICE u32 a2a_lane() {
  return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
}
// Workgroup barrier that also orders memory within the workgroup.
A2A_DEVICE void a2a_block_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
// Lanes of a wavefront execute in lock step; this keeps the compiler from
// moving memory operations across the point and orders them for the wave.
A2A_DEVICE void a2a_wave_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
// Publish: data written before is visible system-wide before the flag.
A2A_DEVICE void a2a_store_release_sys(u32* p, u32 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
A2A_DEVICE u32 a2a_load_acquire_sys(const u32* p) {
  return __hip_atomic_load(const_cast<u32*>(p), __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Publish data left in OUR memory to a peer polling `p` (see the NVIDIA twin). A peer on another
// GPU reads our memory (the heap is fine-grained) without going through our L2, so AMD keeps the
// system-scope release: `gpu_fence` is not honoured here.
A2A_DEVICE void a2a_publish_own_sys(u32* p, u32 v, u32 gpu_fence) {
  (void)gpu_fence;
  a2a_store_release_sys(p, v);
}
// Within this device only (a kernel's blocks handing over to each other).
A2A_DEVICE void a2a_store_release_dev(u32* p, u32 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
A2A_DEVICE u32 a2a_load_acquire_dev(const u32* p) {
  return __hip_atomic_load(const_cast<u32*>(p), __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
A2A_DEVICE u32 a2a_exchange_dev(u32* p, u32 v) {
  return __hip_atomic_exchange(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Each thread's writes released device-wide before a barrier after which one thread releases a
// flag for the whole block. The PTX model makes the barrier and that one release cumulative; on
// AMD we do not rely on the barrier's workgroup-scope fences carrying other waves' writes to an
// agent-scope release (LLVM has had that transitivity wrong on some targets), so every thread
// fences at agent scope, as the kernels' tails always did.
A2A_DEVICE void a2a_release_before_barrier_dev() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
A2A_DEVICE u32 a2a_load_relaxed_sys(const u32* p) {
  return __hip_atomic_load(const_cast<u32*>(p), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Single-copy-atomic 8-byte words, no ordering: a reader sees all of a word or none of it.
A2A_DEVICE void a2a_store_relaxed_sys_u64(u64* p, u64 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
A2A_DEVICE u64 a2a_load_relaxed_sys_u64(const u64* p) {
  return __hip_atomic_load(const_cast<u64*>(p), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
A2A_DEVICE u32 a2a_add_shared(u32* p, u32 v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
// Device-scope acq_rel counter for "last block done" detection.
A2A_DEVICE u32 a2a_fetch_add_acq_rel_dev(u32* p, u32 v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
A2A_DEVICE u32 a2a_cas_sys(u32* p, u32 expected, u32 desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
}
// Device-scope relaxed 64-bit add and compare-and-swap (exchange.h: a counter that hands out work).
A2A_DEVICE u64 a2a_fetch_add_relaxed_dev_u64(u64* p, u64 v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
A2A_DEVICE u64 a2a_cas_relaxed_dev_u64(u64* p, u64 expected, u64 desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_AGENT);
  return expected;
}
A2A_DEVICE void a2a_fence_sys() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }
// s_memrealtime runs at a constant 100 MHz on gfx90a/gfx942.
A2A_DEVICE u64 a2a_clock_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
A2A_DEVICE void a2a_pause() { __builtin_amdgcn_s_sleep(1); }
// Abort the kernel: the queue is torn down and later device operations fail.
A2A_DEVICE void a2a_trap() { __builtin_trap(); }
A2A_DEVICE int a2a_shfl(int v, int src_lane) {
  return __builtin_amdgcn_ds_bpermute(src_lane << 2, v);
}
// Bit l set for each lane l of the wave whose p holds (a compare into a scalar register).
A2A_DEVICE u64 a2a_ballot(bool p) { return __builtin_amdgcn_ballot_w64(p); }
A2A_DEVICE u32 a2a_ctz(u32 v) { return (u32)__builtin_ctz(v); }
A2A_DEVICE float a2a_half_to_float(u16 h) { return (float)__builtin_bit_cast(_Float16, h); }
A2A_DEVICE u16 a2a_float_to_half(float f) { return __builtin_bit_cast(u16, (_Float16)f); }
A2A_DEVICE float a2a_rint(float f) { return __builtin_rintf(f); }  // to nearest, ties to even

#elif defined(__CUDACC__)
// ------------------------------------------------------------- NVIDIA ----
#define A2A_NVIDIA 1
#define A2A_DEVICE __device__ __forceinline__
#define A2A_DEVICE_CALLED __device__ __noinline__  // one copy of its code, however many callers
#define A2A_WARP_SIZE 32
// (min. one block: ptxas would otherwise budget a 256-thread kernel for two
// resident blocks, 128 registers.)
#define A2A_MAX_THREADS(n) __launch_bounds__(n, 1)

A2A_DEVICE u32 a2a_thread() { return threadIdx.x; }
A2A_DEVICE u32 a2a_block() { return blockIdx.x; }
A2A_DEVICE u32 a2a_block_dim() { return blockDim.x; }
A2A_DEVICE u32 a2a_grid_dim() { return gridDim.x; }
A2A_DEVICE u32 a2a_lane() { u32 l; asm volatile("mov.u32 %0, %%laneid;" : "=r"(l)); return l; }
A2A_DEVICE void a2a_block_sync() { __syncthreads(); }
A2A_DEVICE void a2a_wave_sync() { __syncwarp(); }
A2A_DEVICE void a2a_store_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
A2A_DEVICE u32 a2a_load_acquire_sys(const u32* p) {
  u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// Publish data that this thread wrote into OUR OWN memory to a peer that polls `p` and then reads
// that data over the link. With `gpu_fence` (the host sets it for sm_90: A2AArgs.gpu_fence_publish)
// the data is ordered before the flag by a GPU-scope fence, not a system-scope release: a peer
// reads our memory through our own L2, which a GPU-scope fence has already made hold the data,
// and the flag store leaves only after that fence. This is outside PTX's formal model (a release
// must be at system scope to synchronize with another GPU's acquire), in the way NCCL's LL128
// relies on NVLink behaviour for the architectures it enables it on; it saves a MEMBAR.SYS:
// 1.1 us of the 2.9 us a published 14 KiB segment took to be seen on two H100s (probe vis2,
// measured at commit 4fc61e2). Data written into a PEER's memory still needs
// a2a_store_release_sys.
A2A_DEVICE void a2a_publish_own_sys(u32* p, u32 v, u32 gpu_fence) {
  if (gpu_fence)
    asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    a2a_store_release_sys(p, v);
}
A2A_DEVICE void a2a_store_release_dev(u32* p, u32 v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
A2A_DEVICE u32 a2a_load_acquire_dev(const u32* p) {
  u32 v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
A2A_DEVICE u32 a2a_exchange_dev(u32* p, u32 v) {
  u32 old; asm volatile("atom.relaxed.gpu.global.exch.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// Nothing here: a barrier, then one thread's st.release.gpu, orders the whole block's writes before
// that release (PTX memory model: the barrier synchronizes, release is cumulative).
A2A_DEVICE void a2a_release_before_barrier_dev() {}
A2A_DEVICE u32 a2a_load_relaxed_sys(const u32* p) {
  u32 v; asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
A2A_DEVICE void a2a_store_relaxed_sys_u64(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
A2A_DEVICE u64 a2a_load_relaxed_sys_u64(const u64* p) {
  u64 v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
A2A_DEVICE u32 a2a_add_shared(u32* p, u32 v) { return atomicAdd(p, v); }
A2A_DEVICE u32 a2a_fetch_add_acq_rel_dev(u32* p, u32 v) {
  u32 old; asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
A2A_DEVICE u32 a2a_cas_sys(u32* p, u32 expected, u32 desired) {
  return atomicCAS_system(p, expected, desired);
}
A2A_DEVICE u64 a2a_fetch_add_relaxed_dev_u64(u64* p, u64 v) {
  u64 old; asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
A2A_DEVICE u64 a2a_cas_relaxed_dev_u64(u64* p, u64 expected, u64 desired) {
  u64 old;
  asm volatile("atom.relaxed.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
}
A2A_DEVICE void a2a_fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
A2A_DEVICE u64 a2a_clock_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
A2A_DEVICE void a2a_pause() { __nanosleep(32); }
// Abort the kernel: the context is left with a sticky error, later device operations fail.
A2A_DEVICE void a2a_trap() { asm volatile("trap;"); }
A2A_DEVICE int a2a_shfl(int v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
// Bit l set for each lane l of the warp whose p holds (one vote instruction).
A2A_DEVICE u64 a2a_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
A2A_DEVICE u32 a2a_ctz(u32 v) { return (u32)(__ffs((int)v) - 1); }
A2A_DEVICE float a2a_half_to_float(u16 h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
A2A_DEVICE u16 a2a_float_to_half(float f) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
A2A_DEVICE float a2a_rint(float f) { return rintf(f); }  // to nearest, ties to even
// sm_89 and newer convert to and from fp8 e4m3fn in hardware, two values at a time: to nearest
// even, saturating finite values (a2a_float2_to_fp8 below); low byte: lo.
#define A2A_HAS_E4M3FN_CVT 1
A2A_DEVICE u32 a2a_cvt_e4m3fn_x2(float lo, float hi) {
  u16 r; asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo)); return r;
}
A2A_DEVICE void a2a_cvt_e4m3fn_x2_to_float(u32 codes, float& lo, float& hi) {
  u32 h2; asm("{.reg .b16 c; cvt.u16.u32 c, %1; cvt.rn.f16x2.e4m3x2 %0, c;}" : "=r"(h2) : "r"(codes));
  lo = a2a_half_to_float((u16)(h2 & 0xffffu)); hi = a2a_half_to_float((u16)(h2 >> 16));
}
#elif defined(A2A_HOST_EMULATION)
// ------------------------------------------------------- host C++ ----
// Only the shared part below, compiled by a host compiler so that tests can
// hold its text to ml_dtypes (tests/test_fp8.py) and to Python's integer
// division (tests/test_kernel_arguments.py).
#define A2A_DEVICE inline
#define A2A_DEVICE_CALLED inline
A2A_DEVICE float a2a_rint(float f) { return __builtin_rintf(f); }
#else
#error "portability.h: compile with clang -x hip (AMD) or nvcc -x cu (NVIDIA)"
#endif

// ------------------------------------------------------------ shared ----
A2A_DEVICE float a2a_bf16_to_float(u16 b) { return __builtin_bit_cast(float, (u32)b << 16); }
// Round to nearest even, as numpy/ml_dtypes do; NaN stays a quiet NaN.
A2A_DEVICE u16 a2a_float_to_bf16(float f) {
  u32 u = __builtin_bit_cast(u32, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

// n / d and n % d for a divisor fixed when an object is built (k, L, E, a row's
// segments, the route chunk, W). A divide by a run-time value is 15-20
// instructions around a reciprocal on the special-function unit, and a
// one-token call's path ran a dozen of them in series; this is a multiply and
// a shift. The host picks mul = ceil(2^(32 + s) / d) with 2^s >= d, which is
// exact for every n < 2^31 (pyhipa2a/kernels.py: divisor;
// tests/native/divisors.cpp holds this text to Python's //).
struct Divisor {
  u64 mul;
  u32 d, shift;
};
A2A_DEVICE u32 quot(const Divisor& v, u32 n) { return (u32)(((u64)n * v.mul) >> 32) >> v.shift; }
A2A_DEVICE u32 rem(const Divisor& v, u32 n) { return n - quot(v, n) * v.d; }
// Both: the quotient, and the remainder in r.
A2A_DEVICE u32 quot_rem(const Divisor& v, u32 n, u32& r) {
  const u32 q = quot(v, n);
  r = n - q * v.d;
  return q;
}

// The larger of each unsigned 16-bit half of a and b: two halves an instruction on NVIDIA (__vmaxu2).
A2A_DEVICE u32 a2a_max_halves(u32 a, u32 b) {
#ifdef A2A_NVIDIA
  return __vmaxu2(a, b);
#else
  const u32 lo = (a & 0xffffu) > (b & 0xffffu) ? a & 0xffffu : b & 0xffffu;
  const u32 hi = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  return lo | hi << 16;
#endif
}
// The largest magnitude among the 16 halves of w (16-bit floats: fp16 or bf16) as its 16-bit
// pattern, sign cleared. A 16-bit float's magnitude bits order like its magnitude, infinity above
// every finite value and NaN above infinity, as a float32's bits do, so this is the largest |x|
// (tests/native/fp8_amax.cpp holds it to NumPy on every fp16 and bf16 value).
A2A_DEVICE u32 a2a_amax16(const u32 (&w)[8]) {
  u32 m[4];
  for (u32 q = 0; q < 4; ++q) m[q] = a2a_max_halves(w[q] & 0x7fff7fffu, w[q + 4] & 0x7fff7fffu);
  const u32 both = a2a_max_halves(a2a_max_halves(m[0], m[1]), a2a_max_halves(m[2], m[3]));
  return (both & 0xffffu) > (both >> 16) ? both & 0xffffu : both >> 16;
}

// fp8 e4m3 (4 exponent bits, 3 mantissa bits) in the two encodings MoE
// kernels use: OCP float8_e4m3fn (NVIDIA sm_90; bias 7, largest 448, 0x7f
// and 0xff are NaN, -0 is 0x80) and float8_e4m3fnuz (MI300X; bias 8,
// largest 240, 0x80 is the only NaN, no -0). Written out in integer and
// exact power-of-two arithmetic, so both vendors (and the host) round
// alike: to nearest, ties to even, saturating at the largest finite value,
// as ml_dtypes does after a clip to that value.
struct Fp8Format {
  bool fnuz;
  A2A_DEVICE float largest() const { return fnuz ? 240.0f : 448.0f; }
  A2A_DEVICE int min_exponent() const { return fnuz ? -7 : -6; }  // of the smallest normal
  A2A_DEVICE u32 nan() const { return fnuz ? 0x80u : 0x7fu; }
};

// 2^n as a float, for n in [-126, 127].
A2A_DEVICE float a2a_pow2(int n) { return __builtin_bit_cast(float, (u32)(n + 127) << 23); }

A2A_DEVICE u32 a2a_float_to_fp8(float v, Fp8Format f) {
  const u32 bits = __builtin_bit_cast(u32, v), sign = (bits >> 24) & 0x80u;
  const float a = __builtin_bit_cast(float, bits & 0x7fffffffu);
  if (a != a) return f.nan();
  u32 code = f.fnuz ? 0x7fu : 0x7eu;  // the largest finite value (inf saturates too)
  if (a < f.largest()) {
    // Quanta of 2^(e - 3) for a value of exponent e, never finer than the
    // subnormals'; m quanta past the exponent's first value, carrying into
    // the next exponent when m rounds up to 16 (or up to 8 from below the
    // normals), which the code's layout does by itself.
    int e = (int)((bits >> 23) & 0xffu) - 127;
    e = e < f.min_exponent() ? f.min_exponent() : e;
    const u32 m = (u32)a2a_rint(a * a2a_pow2(3 - e));
    const u32 rounded = ((u32)(e - f.min_exponent()) << 3) + m;
    code = rounded < code ? rounded : code;
  }
  if (f.fnuz && code == 0u) return 0u;  // no -0
  return code | sign;
}

A2A_DEVICE float a2a_fp8_to_float(u32 code, Fp8Format f) {
  const u32 e = (code >> 3) & 0xfu, m = code & 7u;
  if (f.fnuz ? code == 0x80u : (code & 0x7fu) == 0x7fu) return __builtin_bit_cast(float, 0x7fc00000u);
  const float v = (float)(e ? 8u + m : m) * a2a_pow2((int)(e ? e : 1u) - 1 + f.min_exponent() - 3);
  return code & 0x80u ? -v : v;
}

// Two at a time (low byte: lo), in hardware where the device has it. A device with the
// hardware conversion (NVIDIA) only ever quantizes to e4m3fn: the host refuses fnuz there
// (pyhipa2a.dtypes.fp8_for_arch), so no branch on the format stands in the quantizer's chain
// (a runtime choice with an out-of-line fnuz path cost 1.5-2 us of dispatch on an H100).
#ifdef A2A_HAS_E4M3FN_CVT
A2A_DEVICE u32 a2a_float2_to_fp8(float lo, float hi, Fp8Format) { return a2a_cvt_e4m3fn_x2(lo, hi); }
#else
A2A_DEVICE u32 a2a_float2_to_fp8(float lo, float hi, Fp8Format f) {
  return a2a_float_to_fp8(lo, f) | a2a_float_to_fp8(hi, f) << 8;
}
#endif
A2A_DEVICE void a2a_fp8x2_to_float(u32 codes, Fp8Format f, float& lo, float& hi) {
#ifdef A2A_HAS_E4M3FN_CVT
  a2a_cvt_e4m3fn_x2_to_float(codes, lo, hi);  // e4m3fn only, as above
#else
  lo = a2a_fp8_to_float(codes & 0xffu, f);
  hi = a2a_fp8_to_float((codes >> 8) & 0xffu, f);
#endif
}
