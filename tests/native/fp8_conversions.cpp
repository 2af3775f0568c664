// The fp8 conversions of kernels_hip/portability.h, compiled for the host
// (A2A_HOST_EMULATION) so that tests/test_fp8.py can hold them to ml_dtypes
// on every input it likes: the same source text the kernels compile.
//   stdin:  n float32 values (raw)
//   stdout: n fn codes, n fnuz codes (bytes), then 256 + 256 float32 values:
//           every fn code, then every fnuz code, decoded.
#include <cstdio>
#include <vector>
#include "portability.h"

int main() {
  std::vector<float> in;
  float v;
  while (std::fread(&v, sizeof v, 1, stdin) == 1) in.push_back(v);
  for (int fnuz = 0; fnuz < 2; ++fnuz)
    for (float f : in) std::fputc((int)a2a_float_to_fp8(f, Fp8Format{fnuz != 0}), stdout);
  for (int fnuz = 0; fnuz < 2; ++fnuz)
    for (u32 code = 0; code < 256; ++code) {
      const float d = a2a_fp8_to_float(code, Fp8Format{fnuz != 0});
      std::fwrite(&d, sizeof d, 1, stdout);
    }
  return 0;
}
