// In-kernel timelines (the profiling build, -DA2A_PROFILE=1): a lane records
// (start, end, tag, block, warp, detail) for each stage into its warp's own
// ring of events in a buffer the host reads after the call. Recording touches
// no global counter: the warp's next slot is a word of shared memory (lanes
// of one warp may record at once: waits per peer), the end is stamped before
// that bookkeeping, and the event is four plain stores. An earlier design kept
// every warp's count in one global array and stamped the end after a global
// atomic on it; the atomics of thousands of warps on neighbouring words
// stretched the stages they timed. In the normal build the macros are empty,
// so profiling costs nothing when off; what it costs when on is measured by
// `scripts/bench.py --profile` (docs/PERFORMANCE.md). Tags are named in
// pyhipa2a/profile.py (keep the two in sync).
#pragma once
#include "portability.h"

#define A2A_TAG_DISPATCH_HEADERS 1u  // route: places, routing rows and counts out
#define A2A_TAG_DISPATCH_STAGE 2u
#define A2A_TAG_DISPATCH_WAIT_HEADER 3u  // token counts; then a token's routing row and counts before it
#define A2A_TAG_DISPATCH_WAIT_TOKEN 4u
#define A2A_TAG_DISPATCH_FANOUT 5u
#define A2A_TAG_DISPATCH_COUNTS 6u  // expert_num_tokens of a warp's experts (detail: the first)
#define A2A_TAG_DISPATCH_WARP 7u
#define A2A_TAG_COMBINE_WEIGHTS 8u
#define A2A_TAG_COMBINE_WAIT_WEIGHTS 9u
#define A2A_TAG_COMBINE_CONTRIBUTE 10u
#define A2A_TAG_COMBINE_WAIT_CONTRIB 11u
#define A2A_TAG_COMBINE_REDUCE 12u
#define A2A_TAG_COMBINE_WARP 13u
// 14 was the fan-out's wait for its reserved slots; the number stays retired.

struct ProfEvent {
  u64 start, end;  // device clock, ns
  u32 tag, block, warp;
  u32 detail;      // waits: peer | token << 8
};

// Layout: this header, u32 next[warps] (padded to 32 bytes), then ProfEvent
// events[warps][per_warp]. next[w] counts the events warp w ever recorded;
// its slots are a ring (event i goes to slot i % per_warp), so a warp that
// recorded more than per_warp kept only its latest. A warp reads its count
// into shared memory when a kernel starts and writes it back when the kernel
// ends; in between every event is shared-memory bookkeeping and plain stores.
struct ProfHeader {
  u32 warps, per_warp, beyond, pad;  // beyond: warps past `warps` tried to record
};

#ifdef A2A_PROFILE
A2A_DEVICE u32* a2a_prof_next() {  // this block's warps' counts, then the buffer's warps and per_warp
  __shared__ u32 next[32 + 2];
  return next;
}
A2A_DEVICE u32* a2a_prof_counts(u64 buffer) { return reinterpret_cast<u32*>(buffer + sizeof(ProfHeader)); }
A2A_DEVICE u32 a2a_prof_warp(u32 in_block) { return a2a_block() * (a2a_block_dim() / A2A_WARP_SIZE) + in_block; }
A2A_DEVICE void a2a_prof_begin(u64 buffer) {
  const u32 t = a2a_thread();
  if (buffer && t < a2a_block_dim() / A2A_WARP_SIZE) {
    const ProfHeader* h = reinterpret_cast<const ProfHeader*>(buffer);
    const u32 w = a2a_prof_warp(t);
    a2a_prof_next()[t] = w < h->warps ? a2a_prof_counts(buffer)[w] : 0u;
    if (t == 0) {
      a2a_prof_next()[32] = h->warps;
      a2a_prof_next()[33] = h->per_warp;
    }
  }
  a2a_block_sync();
}
A2A_DEVICE void a2a_prof_end(u64 buffer) {
  a2a_block_sync();
  const u32 t = a2a_thread();
  if (buffer && t < a2a_block_dim() / A2A_WARP_SIZE) {
    const ProfHeader* h = reinterpret_cast<const ProfHeader*>(buffer);
    const u32 w = a2a_prof_warp(t);
    if (w < h->warps) a2a_prof_counts(buffer)[w] = a2a_prof_next()[t];
  }
}
A2A_DEVICE void a2a_prof_record(u64 buffer, u32 tag, u64 start, u32 detail) {
  const u64 end = a2a_clock_ns();
  if (!buffer) return;
  // The sizes come from shared memory: a load of the header was a global round trip per event.
  const u32 warps = a2a_prof_next()[32], per_warp = a2a_prof_next()[33];
  const u32 in_block = a2a_thread() / A2A_WARP_SIZE, w = a2a_prof_warp(in_block);
  if (w >= warps) {
    reinterpret_cast<ProfHeader*>(buffer)->beyond = 1u;
    return;
  }
  const u32 i = a2a_add_shared(&a2a_prof_next()[in_block], 1u) % per_warp;
  const u64 events = sizeof(ProfHeader) + ((4ull * warps + 31ull) & ~31ull);
  ProfEvent& e = reinterpret_cast<ProfEvent*>(buffer + events)[(u64)w * per_warp + i];
  e.start = start;
  e.end = end;
  e.tag = tag;
  e.block = a2a_block();
  e.warp = in_block;
  e.detail = detail;
}
#define A2A_PROF_BEGIN(buffer) a2a_prof_begin(buffer)
#define A2A_PROF_END(buffer) a2a_prof_end(buffer)
#define A2A_PROF_START(var) const u64 var = a2a_clock_ns()
#define A2A_PROF(buffer, lane, tag, start, detail) \
  do {                                              \
    if ((lane) == 0) a2a_prof_record(buffer, tag, start, detail); \
  } while (0)
#else
#define A2A_PROF_BEGIN(buffer) \
  do {                         \
  } while (0)
#define A2A_PROF_END(buffer) \
  do {                       \
  } while (0)
#define A2A_PROF_START(var) \
  do {                      \
  } while (0)
#define A2A_PROF(buffer, lane, tag, start, detail) \
  do {                                              \
  } while (0)
#endif
