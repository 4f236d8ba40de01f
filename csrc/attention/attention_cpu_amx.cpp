// AMX flash attention for bf16 inputs: attention_cpu_brgemm_impl.h on torch's oneDNN brgemm, its
// softmax and conversions compiled for AVX-512 (every AMX CPU has it).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "attention/attention_cpu_brgemm_impl.h"
#include "attention/attention_cpu_vec_avx512.h"

namespace pyext::cpu {
namespace attn {
namespace {

// The AVX-512 traits with the probabilities rounded to bf16 by AVX512_BF16's one instruction (every
// AMX CPU has it): round to nearest even, NaN quiet, as the portable rounding (exp2 gives no fp32
// denormal for it to flush).
struct VecAmx : VecAvx512 {
  // 2^x with a degree-4 minimax polynomial on [-0.5, 0.5] (relative error 2.7e-6, against bf16's
  // 3.9e-3 rounding of each p): three multiply-adds fewer than the fp32 kernels' series.
  static reg exp2(reg x) {
    return exp2_scaled(x, [](reg f) {
      reg p = _mm512_set1_ps(9.570101276e-03f);
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591785908e-02f));
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-01f));
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-01f));
      return _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-01f));
    });
  }
  static void store_bf16(uint16_t* p, reg x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x)); }
};

}  // namespace
}  // namespace attn

AttnKernel attention_kernel_amx() {
  return AttnKernel{attn::brgemm_packed_bytes, attn::brgemm_pack<attn::VecAmx>,
                    attn::brgemm_forward<attn::VecAmx, brgemm_bf16_onednn, brgemm_release_onednn>, attn::kBrgemmRows};
}

}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_amx() { return attention_kernel_brgemm_stand_in(); }
}  // namespace pyext::cpu
#endif
