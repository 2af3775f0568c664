// quot, rem and quot_rem of kernels_hip/portability.h, compiled for the host
// (A2A_HOST_EMULATION) so that tests/test_kernel_arguments.py can hold them to
// Python's // and % on the divisors the host picks: the same source text the
// kernels compile.
//   stdin:  records of (u64 mul, u32 d, u32 shift, u32 n, u32 unused)
//   stdout: for each, u32 quot, u32 rem, and quot_rem's quotient and remainder
#include <cstdio>
#include "portability.h"

int main() {
  struct {
    u64 mul;
    u32 d, shift, n, unused;
  } r;
  while (std::fread(&r, sizeof r, 1, stdin) == 1) {
    const Divisor v{r.mul, r.d, r.shift};
    u32 r2;
    const u32 q2 = quot_rem(v, r.n, r2);
    const u32 out[4] = {quot(v, r.n), rem(v, r.n), q2, r2};
    std::fwrite(out, sizeof out, 1, stdout);
  }
  return 0;
}
