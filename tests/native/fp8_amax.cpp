// a2a_amax16 of kernels_hip/portability.h (the amax of a quantized block's chunk, on 16-bit
// magnitudes), compiled for the host (A2A_HOST_EMULATION: the generic code AMD GPUs run; NVIDIA
// takes __vmaxu2 for the pairwise max) so that tests/test_fp8.py can hold it to NumPy.
//   stdin:  groups of 8 u32 words (16 halves of fp16 or bf16 values)
//   stdout: one u16 per group, its largest magnitude's bits
#include <cstdio>
#include "portability.h"

int main() {
  u32 w[8];
  while (std::fread(w, sizeof w, 1, stdin) == 1) {
    const u16 m = (u16)a2a_amax16(w);
    std::fwrite(&m, sizeof m, 1, stdout);
  }
  return 0;
}
