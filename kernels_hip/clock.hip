// Device clocks, for lining up the ranks' profiles (pyhipa2a/profile.py).
//
// Two GPUs' clocks differ by tens of microseconds and drift apart by a few
// per second (two H100s: 62 and 77 us, seconds apart), and a host reading of
// a device clock is only as good as half a launch's round trip (several
// microseconds). So ranks compare clocks with each other on the device, as
// NTP does: rank 0 and each peer in turn trade tagged words through the
// symmetric heap, each side stamping when it sends and when it sees the
// other's word; the peer's offset is the mean of the two trips' stamp
// differences, wrong only by half the difference of the two trips' times
// (a relaxed store crosses NVLink in 0.5-0.9 us either way).
#include "protocol.h"

// The device clock (ns) now: rank 0's profile meets the host's monotonic
// clock through this reading.
extern "C" __global__ void clock_probe(u64 out) {
  if (a2a_block() == 0 && a2a_thread() == 0) *reinterpret_cast<u64*>(out) = a2a_clock_ns();
}

struct ClockSyncArgs {
  HeapView heap;
  u64 off_box;     // u64 [world]: box r, in every rank's memory, is written by rank r
  u64 off_stamps;  // u64 [world][rounds][2] (local): with rank r, round i: (sent, seen) by this rank's clock
  u64 off_from0;   // u64 [rounds][2] + 1, written by rank 0: its stamps with this rank, then host_offset
  u64 off_done;    // u32, written by rank 0 (release): epoch once off_from0 holds this sync's values
  u64 off_verdict; // u32 (local): epoch once this rank's part succeeded (the host reads nothing else first)
  u64 host_offset; // rank 0's host clock minus its device clock (ns, two's complement), handed to every peer
  u32 rounds;
  u32 epoch;       // tags this sync's words: never 0, new each sync
  u64 timeout_ns;
};

// One thread of one block. Rank 0 trades `rounds` words with each peer in
// turn, then hands it its stamps and host_offset, so that every rank works
// out its own offset with no host collective (a rank that never comes makes
// its peers time out on the device, not in MPI). A peer trades with rank 0
// only, answering each word it sees. A stamp of a round that never completed
// stays 0, and off_verdict is written only when this rank's part succeeded.
extern "C" __global__ void clock_sync(ClockSyncArgs a) {
  if (a2a_block() != 0 || a2a_thread() != 0) return;
  const HeapView& h = a.heap;
  const u64 deadline = a2a_clock_ns() + a.timeout_ns;
  u64* stamps = sym<u64>(h, h.rank, a.off_stamps);
  const u64* box = sym<u64>(h, h.rank, a.off_box);
  for (int peer = 1; peer < h.world; ++peer) {
    if (h.rank != 0 && h.rank != peer) continue;
    const int other = h.rank == 0 ? peer : 0;
    u64* theirs = sym<u64>(h, other, a.off_box) + h.rank;
    u64* mine = stamps + (u64)other * a.rounds * 2u;
    for (u32 i = 0; i < a.rounds; ++i) {
      const u64 word = (u64)a.epoch << 32 | i;
      if (h.rank == 0) {  // send, then see the answer
        mine[2 * i] = a2a_clock_ns();
        a2a_store_relaxed_sys_u64(theirs, word);
        while (a2a_load_relaxed_sys_u64(&box[other]) != word)
          if (a2a_clock_ns() > deadline) return;
        mine[2 * i + 1] = a2a_clock_ns();
      } else {  // see the word, then answer
        while (a2a_load_relaxed_sys_u64(&box[other]) != word)
          if (a2a_clock_ns() > deadline) return;
        mine[2 * i + 1] = a2a_clock_ns();
        mine[2 * i] = a2a_clock_ns();
        a2a_store_relaxed_sys_u64(theirs, word);
      }
    }
    if (h.rank == 0) {  // the peer's copy of our stamps and host offset, then its flag
      u64* from0 = sym<u64>(h, peer, a.off_from0);
      for (u32 i = 0; i < 2u * a.rounds; ++i) from0[i] = mine[i];
      from0[2u * a.rounds] = a.host_offset;
      a2a_store_release_sys(sym<u32>(h, peer, a.off_done), a.epoch);
    } else {  // wait until they are here (the host reads them after the kernel)
      const u32* done = sym<u32>(h, h.rank, a.off_done);
      while (a2a_load_acquire_sys(done) != a.epoch)
        if (a2a_clock_ns() > deadline) return;
    }
  }
  // (A flag that lands after the deadline is not success: the host trusts only this.)
  *sym<u32>(h, h.rank, a.off_verdict) = a.epoch;
}
