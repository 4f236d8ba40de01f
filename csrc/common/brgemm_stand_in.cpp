// The stand-in micro-kernel of brgemm.h: plain C++, no torch (the sanitizer harness links it).
#include "common/brgemm.h"

#include "common/half_rounding.h"

namespace pyext::cpu {

void brgemm_bf16_stand_in(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                          const uint16_t* A, const uint16_t* B, float* C) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;  // products in fp32, summed in order
      for (int64_t k = 0; k < K; ++k)
        acc += bf16_to_float(A[m * ld_a + k]) * bf16_to_float(B[((k / 2) * ld_b + n) * 2 + k % 2]);
      C[m * ld_c + n] = add_C ? C[m * ld_c + n] + acc : acc;
    }
}

void brgemm_release_stand_in() {}

}  // namespace pyext::cpu
