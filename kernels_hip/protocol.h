// Protocol pieces shared by every kernel: reaching a peer's copy of a
// symmetric object, bounded flag waits, error reporting, and the "last block
// of the grid" hand-off.
#pragma once
#include "portability.h"

// Error codes written into the status words (kept in sync with pyhipa2a/errors.py).
#define A2A_OK 0u
#define A2A_ERR_TIMEOUT 1u        // detail: which flag; peer: who never arrived
#define A2A_ERR_BAD_INDEX 2u      // detail: the offending expert index
#define A2A_ERR_CAPACITY 3u       // detail: the local expert that overflowed
#define A2A_ERR_MISMATCH 4u       // heap self-test: detail = mismatching words
#define A2A_ERR_PEER 5u           // peer: a rank between nodes whose part of the call failed (its sums are poison)
#define A2A_ERR_UNPAIRED 6u       // a dispatch after one that was never combined; detail: that one's epoch

// What a flag wait was for (status word 2 on timeout).
#define A2A_WAIT_DISPATCH 1u
#define A2A_WAIT_COMBINE_ROW 2u
// 3 was v0's combine done barrier; the number stays retired.
#define A2A_WAIT_HEAP_CHECK 4u
#define A2A_WAIT_WEIGHTS 5u
// 6-8: kernels_hip/hier.hip. 9, a grouped combine's wait for the caller's group_done, is written by the
// host when it gives up on that wait (pyhipa2a/groups.py); detail: the group.
#define A2A_WAIT_PART_VERDICT 10u  // a combine part's block 0, which reads the host's mirror for every block

// The symmetric heap as kernels see it: a device table of every rank's base
// address (peers' bases are IPC mappings) and this rank's index. Any
// symmetric object is an offset from the base, identical on every rank.
struct HeapView {
  const u64* bases;
  i32 rank;
  i32 world;
};

template <typename T>
A2A_DEVICE T* sym(const HeapView& h, int peer, u64 offset) {
  return reinterpret_cast<T*>(h.bases[peer] + offset);
}

// status[0] code, [1] peer, [2] what, [3] detail. The first error wins so the
// report names the root cause, not its consequences. The winner also copies
// the report into `mirror` (pinned host memory, may be null) with plain
// stores, so the host reads it without a device copy; the race for "first"
// stays in device memory, where atomics are reliable. True for the winner.
// A mirror that holds an error already keeps it: the host writes there alone
// when it gives up on a grouped combine (pyhipa2a/groups.py), and what then
// fails on the device (a peer's sums that never came, say) is its consequence.
A2A_DEVICE bool a2a_report(u32* status, u32* mirror, u32 code, u32 peer, u32 what, u32 detail) {
  if (a2a_cas_sys(&status[0], A2A_OK, code) == A2A_OK) {
    status[1] = peer;
    status[2] = what;
    status[3] = detail;
    if (mirror && a2a_load_relaxed_sys(&mirror[0]) == A2A_OK) {
      mirror[1] = peer;
      mirror[2] = what;
      mirror[3] = detail;
      a2a_fence_sys();
      mirror[0] = code;
    }
    a2a_fence_sys();
    return true;
  }
  return false;
}

// Waits call this after each try that found nothing: a short sleep, and
// every 64th time a look at the clock and at this rank's status. False: give
// up, the deadline passed or this rank already failed (so one timeout does
// not cost one timeout per waiting block). (A lambda-taking poll loop cost
// the AMD build 18-36 more VGPRs per exchange kernel: this stays a plain
// function the loops call.)
A2A_DEVICE bool a2a_try_again(u32& tries, u64 deadline_ns, u32* status) {
  if ((++tries & 63u) == 0) {
    if (a2a_clock_ns() > deadline_ns) return false;
    if (a2a_load_relaxed_sys(&status[0]) != A2A_OK) return false;
  }
  a2a_pause();
  return true;
}

// True once *flag == want (acquire); false when a2a_try_again gives up. A
// flag already set costs one acquiring load, not a relaxed one and then an
// acquiring one in series (the later rank of a small call finds its peers'
// flags set: one round trip less on its path); one still unset is polled
// with relaxed loads, which take no fence each time round.
A2A_DEVICE bool a2a_wait_flag(const u32* flag, u32 want, u64 deadline_ns, u32* status) {
  if (a2a_load_acquire_sys(flag) == want) return true;
  for (u32 tries = 0; a2a_load_relaxed_sys(flag) != want;)
    if (!a2a_try_again(tries, deadline_ns, status)) return false;
  return a2a_load_acquire_sys(flag) == want;
}

// Small messages (routing rows, token counts, weights) travel as tagged
// words: the value in the low half of an 8-byte word, the call's epoch in the
// high half, stored and loaded as single atomic words. A reader that sees the
// epoch sees the value, so these need no fence and no separate flag: a
// release would wait for every bulk store this thread has in flight, which
// under load took tens of microseconds.
A2A_DEVICE u64 a2a_tag(u32 value, u32 epoch) { return (u64)epoch << 32 | value; }

// True once *word carries `epoch` (its value goes to `value`, untouched
// otherwise); false when a2a_try_again gives up.
A2A_DEVICE bool a2a_wait_tagged(const u64* word, u32 epoch, u64 deadline_ns, u32* status, u32& value) {
  for (u32 tries = 0;;) {
    const u64 w = a2a_load_relaxed_sys_u64(word);
    if ((u32)(w >> 32) == epoch) {
      value = (u32)w;
      return true;
    }
    if (!a2a_try_again(tries, deadline_ns, status)) return false;
  }
}

// Every block calls this once its writes are issued (the heap self-test).
// Exactly one block (the last to arrive) gets true, and by then it observes
// all other blocks' writes, and may publish them to peers with a
// system-scope release (each thread's remote writes are fenced system-wide
// first). The counter is reset for the next launch by that block. (The
// exchange kernels end without such a round trip: finish in exchange.h.)
A2A_DEVICE bool a2a_last_block(u32* counter) {
  __shared__ u32 is_last;
  a2a_fence_sys();
  a2a_block_sync();
  if (a2a_thread() == 0) {
    u32 arrived = a2a_fetch_add_acq_rel_dev(counter, 1u);
    is_last = (arrived == a2a_grid_dim() - 1u);
    if (is_last) *counter = 0u;  // nobody else touches it until the next launch
  }
  a2a_block_sync();
  return is_last != 0u;
}

// All threads of a block set `bytes` bytes at `p` to `value`: 16-byte stores
// for the aligned middle, single bytes for the ends. Out of line: only a
// failed call runs it, and healthy calls should not fetch past its code.
A2A_DEVICE_CALLED void a2a_fill_bytes(u8* p, u64 bytes, u8 value) {
  const u64 head = ((16u - ((u64)p & 15u)) & 15u) < bytes ? (16u - ((u64)p & 15u)) & 15u : bytes;
  const u64 body = (bytes - head) / 16u;
  const u32 v4 = value * 0x01010101u;
  const vec16 v{v4, v4, v4, v4};
  for (u64 i = a2a_thread(); i < head; i += a2a_block_dim()) p[i] = value;
  vec16* q = reinterpret_cast<vec16*>(p + head);
  for (u64 i = a2a_thread(); i < body; i += a2a_block_dim()) q[i] = v;
  for (u64 i = head + body * 16u + a2a_thread(); i < bytes; i += a2a_block_dim()) p[i] = value;
}

// All threads of a block set `words` 4-byte words at `p` (aligned) to `value` (out of line, as above).
A2A_DEVICE_CALLED void a2a_fill_words(u32* p, u64 words, u32 value) {
  for (u64 i = a2a_thread(); i < words; i += a2a_block_dim()) p[i] = value;
}
