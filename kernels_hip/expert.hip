// The fake expert of gpu-mode's benchmark (expert_y = expert_x * scale), as
// a kernel of its own: scripts and tests stand it in for a grouped GEMM.
#include "exchange.h"
#include "formats.h"

// prefix[l] = sum of counts[0..l), for l in [0, L], for the whole block. The
// counts are loaded by all threads at once into shared memory; warp 0 then
// scans them a warp's width at a time with shuffles (a serial loop over
// global loads cost a memory latency per count).
A2A_DEVICE void exclusive_prefix(u32* prefix, const i32* counts, u32 L) {
  for (u32 l = a2a_thread(); l < L; l += a2a_block_dim()) prefix[l + 1] = (u32)counts[l];
  a2a_block_sync();
  if (a2a_thread() < A2A_WARP_SIZE) {
    const u32 lane = a2a_lane();
    u32 base = 0;
    for (u32 l0 = 0; l0 < L; l0 += A2A_WARP_SIZE) {
      u32 v = l0 + lane < L ? prefix[l0 + lane + 1] : 0u;
      for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) {  // inclusive scan across the warp
        const u32 up = (u32)a2a_shfl((int)v, (int)(lane >= d ? lane - d : lane));
        if (lane >= d) v += up;
      }
      if (l0 + lane < L) prefix[l0 + lane + 1] = base + v;
      base += (u32)a2a_shfl((int)v, A2A_WARP_SIZE - 1);
    }
    if (lane == 0) prefix[0] = 0u;
  }
  a2a_block_sync();
}

// Row index in the [L][capacity] expert-major buffer of the q-th received row.
A2A_DEVICE u64 received_row(const u32* prefix, u32 L, u32 capacity, u32 q) {
  u32 lo = 0, hi = L;  // largest l with prefix[l] <= q
  while (hi - lo > 1u) { const u32 mid = (lo + hi) / 2u; if (prefix[mid] <= q) lo = mid; else hi = mid; }
  return (u64)lo * capacity + (q - prefix[lo]);
}

// The stand-in for a grouped GEMM used by scripts and tests (gpu-mode's fake
// expert: expert_y = expert_x * scale), applied to received rows only: warps
// walk the filled rows through the prefix of the counts, 8 elements a lane.
template <typename Fmt>
A2A_DEVICE void scale_rows(const u16* x, u16* y, const i32* counts, u32 L, u32 capacity, u32 hidden,
                           float scale) {
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, counts, L);
  const WarpGrid g = warp_grid();
  for (u32 q = g.warp; q < prefix[L]; q += g.warps) {
    const u64 row = received_row(prefix, L, capacity, q) * hidden;
    copy_row_scaled<Fmt>(y + row, x + row, hidden, scale, g.lane);
  }
}

extern "C" __global__ void expert_scale_f16(u64 x, u64 y, u64 counts, u32 L, u32 capacity, u32 hidden,
                                            float scale) {
  scale_rows<F16>((const u16*)x, (u16*)y, (const i32*)counts, L, capacity, hidden, scale);
}
extern "C" __global__ void expert_scale_bf16(u64 x, u64 y, u64 counts, u32 L, u32 capacity, u32 hidden,
                                             float scale) {
  scale_rows<BF16>((const u16*)x, (u16*)y, (const i32*)counts, L, capacity, hidden, scale);
}
