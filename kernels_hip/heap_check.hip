// Symmetric-heap self-test: every rank writes a pattern that names (writer,
// reader, word, epoch) into its own slot of every peer's array, then
// release-stores its flag on that peer. Every rank acquires all flags and
// verifies every slot. This exercises the peer bases table, remote stores,
// the last-block hand-off and release/acquire across devices.
#include "protocol.h"

struct HeapCheckArgs {
  HeapView heap;
  u64 off_slots;     // u32 [world][words]: slot w is written by rank w
  u64 off_flags;     // u32 [world]: flag w is stored by rank w
  u64 off_counter;   // u32: last-block counter (local use only)
  u64 off_status;    // u32 [4]: error report (local)
  u64 off_result;    // u32 [1]: mismatching words seen by this rank
  u32 words;
  u32 epoch;
  u64 timeout_ns;
};

A2A_DEVICE u32 heap_check_pattern(u32 writer, u32 reader, u32 word, u32 epoch) {
  // Distinct for every input that matters; a stale epoch or a wrong peer fails.
  return (writer * 0x9E3779B1u) ^ (reader * 0x85EBCA77u) ^ (word * 0xC2B2AE3Du) ^ epoch;
}

extern "C" __global__ void heap_check(HeapCheckArgs a) {
  const HeapView& h = a.heap;
  const u64 deadline = a2a_clock_ns() + a.timeout_ns;
  u32* status = sym<u32>(h, h.rank, a.off_status);
  const u32 threads = a2a_grid_dim() * a2a_block_dim();
  const u32 tid = a2a_block() * a2a_block_dim() + a2a_thread();

  for (int peer = 0; peer < h.world; ++peer) {
    u32* slot = sym<u32>(h, peer, a.off_slots) + (u64)h.rank * a.words;
    for (u32 i = tid; i < a.words; i += threads)
      slot[i] = heap_check_pattern((u32)h.rank, (u32)peer, i, a.epoch);
  }
  if (!a2a_last_block(sym<u32>(h, h.rank, a.off_counter))) return;

  // Last block: publish to every peer, then wait for every peer and verify.
  for (int peer = a2a_thread(); peer < h.world; peer += a2a_block_dim())
    a2a_store_release_sys(sym<u32>(h, peer, a.off_flags) + h.rank, a.epoch);

  __shared__ u32 mismatches;
  if (a2a_thread() == 0) mismatches = 0;
  a2a_block_sync();
  const u32* flags = sym<u32>(h, h.rank, a.off_flags);
  for (int writer = 0; writer < h.world; ++writer) {
    if (a2a_thread() == 0 && !a2a_wait_flag(&flags[writer], a.epoch, deadline, status))
      a2a_report(status, nullptr, A2A_ERR_TIMEOUT, (u32)writer, A2A_WAIT_HEAP_CHECK, (u32)writer);
    a2a_block_sync();
    if (a2a_load_relaxed_sys(&status[0]) != A2A_OK) return;
    const u32* slot = sym<u32>(h, h.rank, a.off_slots) + (u64)writer * a.words;
    u32 bad = 0;
    for (u32 i = a2a_thread(); i < a.words; i += a2a_block_dim())
      bad += slot[i] != heap_check_pattern((u32)writer, (u32)h.rank, i, a.epoch);
    if (bad) a2a_add_shared(&mismatches, bad);
  }
  a2a_block_sync();
  if (a2a_thread() == 0) {
    *sym<u32>(h, h.rank, a.off_result) = mismatches;
    if (mismatches) a2a_report(status, nullptr, A2A_ERR_MISMATCH, (u32)h.rank, 0u, mismatches);
  }
}
