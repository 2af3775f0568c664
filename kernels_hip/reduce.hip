// The last step of matmul_reduce_scatter (pyhipa2a.collective): out = the sum
// of `n` slots of `count` 16-bit elements lying `stride` elements apart (each
// rank's partial sums of our rows), added in fp32 and rounded once. 8 elements
// a lane where the slots allow 16-byte loads, else one: the pass is bound by
// the bytes it reads.
#include "formats.h"

template <typename Fmt>
A2A_DEVICE void sum_slots(u64 slots, u64 out, u64 count, u64 stride, u32 n) {
  const u64 threads = (u64)a2a_grid_dim() * a2a_block_dim();
  const u64 tid = (u64)a2a_block() * a2a_block_dim() + a2a_thread();
  const u16* s = reinterpret_cast<const u16*>(slots);
  u16* o = reinterpret_cast<u16*>(out);
  const bool wide = count % 8u == 0 && stride % 8u == 0 && ((slots | out) & 15u) == 0;
  const u64 bulk = wide ? count / 8u : 0u;
  for (u64 v = tid; v < bulk; v += threads) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (u32 j = 0; j < n; ++j) fma8v<Fmt>(acc, 1.0f, reinterpret_cast<const vec16*>(s + j * stride)[v]);
    store8<Fmt>(o + v * 8u, acc);
  }
  for (u64 i = bulk * 8u + tid; i < count; i += threads) {
    float acc = 0.f;
    for (u32 j = 0; j < n; ++j) acc += Fmt::load(s[j * stride + i]);
    o[i] = Fmt::store(acc);
  }
}

extern "C" __global__ void sum_slots_f16(u64 slots, u64 out, u64 count, u64 stride, u32 n) {
  sum_slots<F16>(slots, out, count, stride, n);
}

extern "C" __global__ void sum_slots_bf16(u64 slots, u64 out, u64 count, u64 stride, u32 n) {
  sum_slots<BF16>(slots, out, count, stride, n);
}
