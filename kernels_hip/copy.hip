// A plain SM copy, used by scripts/bench.py to measure the bandwidth of
// stores into a peer's memory (the speed of light the all-to-all is held to).
#include "portability.h"

extern "C" __global__ void copy_bytes(u64 dst, u64 src, u64 nbytes) {
  const u64 threads = (u64)a2a_grid_dim() * a2a_block_dim();
  const u64 tid = (u64)a2a_block() * a2a_block_dim() + a2a_thread();
  vec16* d = reinterpret_cast<vec16*>(dst);
  const vec16* s = reinterpret_cast<const vec16*>(src);
  for (u64 i = tid; i < nbytes / 16u; i += threads) d[i] = s[i];
  u8* db = reinterpret_cast<u8*>(dst);
  const u8* sb = reinterpret_cast<const u8*>(src);
  for (u64 i = nbytes / 16u * 16u + tid; i < nbytes; i += threads) db[i] = sb[i];
}

// Does nothing: scripts/bench.py times a graph of these, launched like the
// exchange kernels, beside each call (what the call costs over bare launches).
extern "C" __global__ void nothing() {}
