// torch's brgemm behind the torch-free declarations of brgemm.h (the stand-in: brgemm_stand_in.cpp).
#include "common/brgemm.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

namespace pyext::cpu {

void brgemm_bf16_onednn(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                        const uint16_t* A, const uint16_t* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add_C, reinterpret_cast<const c10::BFloat16*>(A),
                              reinterpret_cast<const c10::BFloat16*>(B), C, true);
}

void brgemm_release_onednn() { at::native::cpublas::brgemm_release(true); }

bool brgemm_amx_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

}  // namespace pyext::cpu
