// What one NVLink pair moves, as the exchange kernels would move it: peer loads (the receiver pulls, as
// prefill-sized calls do today) against peer stores (the sender pushes), one direction and both at once,
// by grid size and by item size (a 2 KB segment, a 14 KB row of 7168 16-bit values), what a release flag
// costs per item or per chunk of items when pushing, and what pulls give while each item is also stored to
// several places in memory, as dispatch's rows are; last, what a posting combine's senders get, their work's
// factors added one at a time (senders, below). One process drives GPUs 0 and 1.
//   nvcc -O3 -arch=native -o link_probe scripts/link_probe.cu && ./link_probe   (scripts/gpu_all.sh runs it)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

// Each warp copies whole items (item_vec 16-byte vectors), UNROLL loads in flight per lane before its
// stores, each item to `copies` places a whole buffer apart (dispatch stores a row for each of the rank's
// experts a token chose); after every `flag_every` items (0: never), and after its last, the warp's lane 0
// releases a flag at system scope.
template <int UNROLL>
__global__ void copy_items(const int4* __restrict__ src, int4* __restrict__ dst, size_t items, int item_vec,
                           int copies, int flag_every, unsigned* flags) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
  const size_t warps = (gridDim.x * (size_t)blockDim.x) >> 5;
  int since = 0;
  for (size_t it = warp; it < items; it += warps) {
    const int4* s = src + it * item_vec;
    int4* d = dst + it * item_vec;
    for (int base = lane; base < item_vec; base += 32 * UNROLL) {
      int4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) if (base + u * 32 < item_vec) v[u] = s[base + u * 32];
      for (int c = 0; c < copies; c++) {
        int4* place = d + c * items * item_vec;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) if (base + u * 32 < item_vec) place[base + u * 32] = v[u];
      }
    }
    if (flag_every && (++since == flag_every || it + warps >= items)) {  // (a warp's last chunk too)
      since = 0;
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        *(volatile unsigned*)(flags + warp) = (unsigned)it;
      }
    }
  }
}

struct Side { int dev; cudaStream_t stream; cudaEvent_t start, stop; int4 *local, *staging; unsigned* flags; };

constexpr size_t kBytes = 256ull << 20;  // per direction (less the tail that fills no whole item)
constexpr int kMaxCopies = 4;

static void launch(const Side& on, const int4* src, int4* dst, int item_bytes, int blocks, int unroll,
                   int copies, int flag_every, unsigned* flags) {
  CHECK(cudaSetDevice(on.dev));
  int item_vec = item_bytes / 16;
  size_t items = kBytes / item_bytes;
  if (unroll == 4)
    copy_items<4><<<blocks, 256, 0, on.stream>>>(src, dst, items, item_vec, copies, flag_every, flags);
  else
    copy_items<8><<<blocks, 256, 0, on.stream>>>(src, dst, items, item_vec, copies, flag_every, flags);
  CHECK(cudaGetLastError());
}

// mode 0: pull (the kernel runs on the receiver, loads from the peer); 1: push (runs on the sender, stores
// to the peer); 2: local (both pointers on the kernel's own GPU: the receiver's move at HBM speed).
// both: each GPU sends to the other at once. Returns GB/s per direction (the slower side).
static double run(Side* side, int mode, bool both, int item_bytes, int blocks, int unroll, int flag_every,
                  int copies = 1) {
  const int reps = 5;
  float best = 1e30f;
  for (int r = 0; r < reps + 1; r++) {
    for (int s = 0; s < (both ? 2 : 1); s++) {
      Side& sender = side[s];
      Side& receiver = side[1 - s];
      Side& runner = mode == 0 ? receiver : sender;
      const int4* src = sender.local;
      int4* dst = mode == 2 ? sender.staging : receiver.staging;
      CHECK(cudaSetDevice(runner.dev));
      CHECK(cudaEventRecord(runner.start, runner.stream));
      launch(runner, src, dst, item_bytes, blocks, unroll, copies, flag_every,
             mode == 1 ? receiver.flags : runner.flags);
      CHECK(cudaEventRecord(runner.stop, runner.stream));
    }
    float worst = 0;
    for (int s = 0; s < (both ? 2 : 1); s++) {
      Side& runner = mode == 0 ? side[1 - s] : side[s];
      CHECK(cudaSetDevice(runner.dev));
      CHECK(cudaEventSynchronize(runner.stop));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, runner.start, runner.stop));
      if (ms > worst) worst = ms;
    }
    if (r > 0 && worst < best) best = worst;  // (the first is a warm-up)
  }
  return kBytes / item_bytes * item_bytes / (best * 1e-3) / 1e9;
}

// A posting combine's senders (kernels_hip/combine.hip), as combine at 1001 tokens moves its bytes (E = 256,
// k = 8, H = 7168, two ranks: 7007 items of 4 KB of fp32 sums a direction, 28.7 MB), `send_warps` of every
// block's 8 warps sending, the factors of their work added one at a time: `sum` loads 4 rows of 2 KB bf16 from
// scattered places here and sums them in fp32 first; `stride` stores as combine's store8f does (a lane's 8
// fp32 as two 16-byte stores, lanes 32 B apart; else each instruction a contiguous 512 B); `release` releases a
// flag at system scope after each item; `hog`: the block's other warps read 100 MB here meanwhile (the reduce's
// traffic). Its buffers: a Side's local (the rows), its peer's staging (the inbox; the hog reads its own
// staging past it) and flags.
constexpr int kItems = 7007, kItemFloats = 1024, kRowElems = 1024, kRows = 1 << 17;  // rows: kBytes of bf16
constexpr size_t kHogBytes = 100ull << 20;

struct Opts { int sum, stride, release, hog, send_warps; };

__global__ void senders(const __nv_bfloat16* __restrict__ rows, float* __restrict__ dst, unsigned* flags,
                        const int4* __restrict__ hogbuf, float* sink, Opts o) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  if (wib >= o.send_warps) {
    if (!o.hog) return;
    const int hw = (blockDim.x >> 5) - o.send_warps;
    const size_t hogger = (size_t)blockIdx.x * hw + (wib - o.send_warps), hoggers = (size_t)gridDim.x * hw;
    const size_t vecs = kHogBytes / 16;
    int acc = 0;
    for (size_t i = hogger * 32 + lane; i < vecs; i += hoggers * 32 * 4) {
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; u++) if (i + u * hoggers * 32 < vecs) v[u] = hogbuf[i + u * hoggers * 32];
#pragma unroll
      for (int u = 0; u < 4; u++) if (i + u * hoggers * 32 < vecs) acc ^= v[u].x ^ v[u].w;
    }
    if (acc == 0x12345678) sink[0] = 1.f;
    return;
  }
  const size_t s = (size_t)blockIdx.x * o.send_warps + wib, ns = (size_t)gridDim.x * o.send_warps;
  for (size_t it = s; it < kItems; it += ns) {
    float acc[4][8];
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
      for (int i = 0; i < 8; i++) acc[c][i] = (float)(it + c + i);
    if (o.sum) {
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const __nv_bfloat16* row = rows + ((it * 4 + r) * 2654435761ull % kRows) * kRowElems;
        int4 v[4];
#pragma unroll
        for (int c = 0; c < 4; c++) v[c] = *reinterpret_cast<const int4*>(row + c * 256 + lane * 8);
#pragma unroll
        for (int c = 0; c < 4; c++) {
          const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[c]);
#pragma unroll
          for (int i = 0; i < 8; i++) acc[c][i] += 0.5f * __bfloat162float(h[i]);
        }
      }
    }
    float* out = dst + it * kItemFloats;
#pragma unroll
    for (int c = 0; c < 4; c++) {
      float4 a = make_float4(acc[c][0], acc[c][1], acc[c][2], acc[c][3]);
      float4 b = make_float4(acc[c][4], acc[c][5], acc[c][6], acc[c][7]);
      if (o.stride) {  // combine's store8f: lane l's 8 floats at c*256 + 8l
        reinterpret_cast<float4*>(out + c * 256 + lane * 8)[0] = a;
        reinterpret_cast<float4*>(out + c * 256 + lane * 8)[1] = b;
      } else {  // each instruction a contiguous 512 B
        reinterpret_cast<float4*>(out + c * 256)[lane] = a;
        reinterpret_cast<float4*>(out + c * 256 + 128)[lane] = b;
      }
    }
    if (o.release) {
      __syncwarp();
      if (lane == 0) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags + it), "r"((unsigned)it + 1u) : "memory");
    }
  }
}

constexpr size_t kHogAt = (512ull << 20) / 16;  // (int4s into staging: past the inbox)

static double run_senders(Side* side, Opts o, int blocks) {
  float best = 1e30f;
  for (int r = 0; r < 6; r++) {
    for (int d = 0; d < 2; d++) {
      Side& me = side[d];
      Side& peer = side[1 - d];
      CHECK(cudaSetDevice(me.dev));
      CHECK(cudaEventRecord(me.start, me.stream));
      senders<<<blocks, 256, 0, me.stream>>>(reinterpret_cast<const __nv_bfloat16*>(me.local),
                                             reinterpret_cast<float*>(peer.staging), peer.flags, me.staging + kHogAt,
                                             reinterpret_cast<float*>(me.flags) + (1 << 17), o);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(me.stop, me.stream));
    }
    float worst = 0;
    for (int d = 0; d < 2; d++) {
      CHECK(cudaSetDevice(side[d].dev));
      CHECK(cudaEventSynchronize(side[d].stop));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, side[d].start, side[d].stop));
      if (ms > worst) worst = ms;
    }
    if (r > 0 && worst < best) best = worst;
  }
  return (double)kItems * kItemFloats * 4 / (best * 1e-3) / 1e9;
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) { fprintf(stderr, "link_probe needs two GPUs, found %d\n", n); return 1; }
  Side side[2];
  for (int d = 0; d < 2; d++) {
    Side& s = side[d];
    s.dev = d;
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&s.start));
    CHECK(cudaEventCreate(&s.stop));
    CHECK(cudaMalloc(&s.local, kBytes));
    CHECK(cudaMalloc(&s.staging, kMaxCopies * kBytes));
    CHECK(cudaMalloc(&s.flags, 1 << 20));
    CHECK(cudaMemset(s.local, d + 1, kBytes));
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("link_probe: %s x2, %d SMs, %zu MB a direction, 256 threads a block; GB/s a direction (best of 5)\n",
         prop.name, prop.multiProcessorCount, kBytes >> 20);
  const char* modes[] = {"pull", "push", "local"};
  const int grids[] = {16, 33, 66, 132, 264};
  const int sizes[] = {2048, 14336};
  printf("%-6s %-5s %7s %6s", "mode", "dirs", "item B", "unroll");
  for (int g : grids) printf(" %6d bl", g);
  printf("\n");
  for (int mode = 0; mode < 3; mode++)
    for (int both = 0; both < 2; both++)
      for (int size : sizes)
        for (int unroll : {4, 8}) {
          if (mode == 2 && both) continue;
          printf("%-6s %-5s %7d %6d", modes[mode], both ? "both" : "one", size, unroll);
          for (int g : grids) printf(" %9.1f", run(side, mode, both, size, g, unroll, 0));
          printf("\n");
        }
  // Push with a release flag after every `k` items of 14 KB (a chunk of k rows), both directions at once.
  printf("push, both directions, 14336 B items, unroll 4, a system-scope release flag every k items:\n");
  printf("%-8s", "k");
  for (int g : grids) printf(" %6d bl", g);
  printf("\n");
  for (int k : {0, 1, 4, 16}) {
    printf("%-8d", k);
    for (int g : grids) printf(" %9.1f", run(side, 1, true, 14336, g, 4, k));
    printf("\n");
  }
  // Pull, each item stored to c places here, as dispatch's fan-out does (c = 4 at 2 ranks and k = 8): the
  // link and the memory at once. GB/s a direction through the link.
  printf("pull, both directions, 14336 B items, unroll 4, each item stored to c places (link GB/s):\n");
  printf("%-8s", "c");
  for (int g : grids) printf(" %6d bl", g);
  printf("\n");
  for (int c = 1; c <= kMaxCopies; c *= 2) {
    printf("%-8d", c);
    for (int g : grids) printf(" %9.1f", run(side, 0, true, 14336, g, 4, 0, c));
    printf("\n");
  }
  // A posting combine's senders, their work's factors added one at a time (senders, above).
  printf("combine's senders, both directions, 7007 items of 4 KB, factors added in turn (link GB/s):\n");
  printf("%-34s %9s %9s %9s\n", "senders' work", "264x2 w", "264x8 w", "132x2 w");
  const char* factors[] = {"store 4 KB from registers", "+ sum 4 bf16 rows read here", "+ combine's strided stores",
                           "+ a release an item", "+ 6 warps a block reading 100 MB"};
  for (int f = 0; f < 5; f++) {
    Opts o{f >= 1, f >= 2, f >= 3, f >= 4, 2};
    Opts all = o;
    all.send_warps = 8;
    all.hog = 0;
    printf("%-34s %9.1f %9.1f %9.1f\n", factors[f], run_senders(side, o, 264), run_senders(side, all, 264),
           run_senders(side, o, 132));
  }
  return 0;
}
