// In-kernel timelines (the profiling build, -DA2A_PROFILE=1): lane 0 of a
// warp records (start, end, tag, block, warp, detail) for each stage into the
// warp's own region of a buffer the host reads after the call. Regions per
// warp keep recording off any shared counter: one atomic counter for
// thousands of warps stretched the stages it timed by microseconds. In the normal build the macros are
// empty, so profiling costs nothing when off. Tags are named in
// pyhipa2a/profile.py (keep the two in sync). Each event still costs lane 0
// one atomic on its warp's count (the counts sit side by side in one array),
// and an event's end is stamped after it: read the timelines for order and
// overlap, and take durations from scripts/bench.py.
#pragma once
#include "portability.h"

#define A2A_TAG_DISPATCH_HEADERS 1u
#define A2A_TAG_DISPATCH_STAGE 2u
#define A2A_TAG_DISPATCH_WAIT_HEADER 3u
#define A2A_TAG_DISPATCH_WAIT_TOKEN 4u
#define A2A_TAG_DISPATCH_FANOUT 5u
#define A2A_TAG_DISPATCH_COUNTS 6u
#define A2A_TAG_DISPATCH_WARP 7u
#define A2A_TAG_COMBINE_WEIGHTS 8u
#define A2A_TAG_COMBINE_WAIT_WEIGHTS 9u
#define A2A_TAG_COMBINE_CONTRIBUTE 10u
#define A2A_TAG_COMBINE_WAIT_CONTRIB 11u
#define A2A_TAG_COMBINE_REDUCE 12u
#define A2A_TAG_COMBINE_WARP 13u
#define A2A_TAG_DISPATCH_WAIT_SLOT 14u

struct ProfEvent {
  u64 start, end;  // device clock, ns
  u32 tag, block, warp;
  u32 detail;      // waits: peer | token << 8
};

// Layout: this header, u32 counts[warps] (padded to 32 bytes), then
// ProfEvent events[warps][per_warp]. A warp's count may exceed per_warp: the
// rest were dropped. Warps beyond `warps` only count into `dropped`.
struct ProfHeader {
  u32 warps, per_warp, dropped, pad;
};

#ifdef A2A_PROFILE
A2A_DEVICE void a2a_prof_record(u64 buffer, u32 tag, u64 start, u32 detail) {
  if (!buffer) return;
  ProfHeader* h = reinterpret_cast<ProfHeader*>(buffer);
  const u32 w = a2a_block() * (a2a_block_dim() / A2A_WARP_SIZE) + a2a_thread() / A2A_WARP_SIZE;
  if (w >= h->warps) {
    a2a_fetch_add_dev(&h->dropped, 1u);
    return;
  }
  // Lanes of one warp may record at once (waits per peer): an atomic, but on the warp's own word.
  const u32 i = a2a_fetch_add_dev(reinterpret_cast<u32*>(buffer + sizeof(ProfHeader)) + w, 1u);
  if (i >= h->per_warp) return;
  const u64 events = sizeof(ProfHeader) + ((4ull * h->warps + 31ull) & ~31ull);
  ProfEvent& e = reinterpret_cast<ProfEvent*>(buffer + events)[(u64)w * h->per_warp + i];
  e.start = start;
  e.end = a2a_clock_ns();
  e.tag = tag;
  e.block = a2a_block();
  e.warp = a2a_thread() / A2A_WARP_SIZE;
  e.detail = detail;
}
#define A2A_PROF_START(var) const u64 var = a2a_clock_ns()
#define A2A_PROF(buffer, lane, tag, start, detail) \
  do {                                              \
    if ((lane) == 0) a2a_prof_record(buffer, tag, start, detail); \
  } while (0)
#else
#define A2A_PROF_START(var) \
  do {                      \
  } while (0)
#define A2A_PROF(buffer, lane, tag, start, detail) \
  do {                                              \
  } while (0)
#endif
