// The 16-bit formats the exchange and the fake expert compute in: element
// access, and the 8-wide loads, stores and sums of a lane's chunk.
#pragma once
#include "exchange.h"  // (A2A_CHUNKS, the loads a lane keeps in flight)

// Element access for the two 16-bit formats combine reduces.
struct F16 {
  static A2A_DEVICE float load(u16 v) { return a2a_half_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_half(f); }
};
struct BF16 {
  static A2A_DEVICE float load(u16 v) { return a2a_bf16_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_bf16(f); }
};


// The 8 16-bit values in v, each times `scale`, rounded back to the format.
template <typename Fmt>
A2A_DEVICE vec16 scale8(vec16 v, float scale) {
  u32* w = &v.x;
  for (int i = 0; i < 4; ++i)
    w[i] = (u32)Fmt::store(Fmt::load((u16)(w[i] & 0xffffu)) * scale) |
           ((u32)Fmt::store(Fmt::load((u16)(w[i] >> 16)) * scale) << 16);
  return v;
}

// acc[0..8) += w * the 8 16-bit values in v.
template <typename Fmt>
A2A_DEVICE void fma8v(float* acc, float w, const vec16& v) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] += w * Fmt::load((u16)(words[q] & 0xffffu));
    acc[2 * q + 1] += w * Fmt::load((u16)(words[q] >> 16));
  }
}

A2A_DEVICE void add8v(float* acc, const vec16& a, const vec16& b) {
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  for (int q = 0; q < 8; ++q) acc[q] += __builtin_bit_cast(float, w[q]);
}

A2A_DEVICE void store8f(float* p, const float* acc) {
  vec16* o = reinterpret_cast<vec16*>(p);
  o[0] = vec16{__builtin_bit_cast(u32, acc[0]), __builtin_bit_cast(u32, acc[1]), __builtin_bit_cast(u32, acc[2]),
               __builtin_bit_cast(u32, acc[3])};
  o[1] = vec16{__builtin_bit_cast(u32, acc[4]), __builtin_bit_cast(u32, acc[5]), __builtin_bit_cast(u32, acc[6]),
               __builtin_bit_cast(u32, acc[7])};
}


template <typename Fmt>
A2A_DEVICE void store8(u16* p, const float* acc) {
  vec16 o;
  u32* w = &o.x;
  for (int q = 0; q < 4; ++q) w[q] = (u32)Fmt::store(acc[2 * q]) | ((u32)Fmt::store(acc[2 * q + 1]) << 16);
  *reinterpret_cast<vec16*>(p) = o;
}

// One warp writes n 16-bit elements of src, each times `scale` and rounded
// back to the format, to dst: an expert's row through the fused epilogue,
// rounded as the expert's own output would be.
template <typename Fmt>
A2A_DEVICE void copy_row_scaled(u16* dst, const u16* src, u32 n, float scale, u32 lane) {
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  const u32 bulk = (((u64)dst | (u64)src) & 15u) == 0 ? n / 8u * 8u : 0u;
  for (u32 e0 = lane * 8u; e0 < bulk; e0 += U * STEP) {
    vec16 v[U];
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < bulk) v[u] = *reinterpret_cast<const vec16*>(src + e0 + u * STEP);
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < bulk) *reinterpret_cast<vec16*>(dst + e0 + u * STEP) = scale8<Fmt>(v[u], scale);
  }
  for (u32 e = bulk + lane; e < n; e += A2A_WARP_SIZE) dst[e] = Fmt::store(Fmt::load(src[e]) * scale);
}

// 8 consecutive 16-bit elements: one 16-byte load when `vec` (aligned), else
// eight 2-byte loads.
A2A_DEVICE vec16 load8(const u16* p, bool vec) {
  if (vec) return *reinterpret_cast<const vec16*>(p);
  vec16 v;
  u32* w = &v.x;
  for (u32 q = 0; q < 4; ++q) w[q] = (u32)p[2 * q] | (u32)p[2 * q + 1] << 16;
  return v;
}
