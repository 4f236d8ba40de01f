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
// AMX CPU has it): round to nearest even, NaN quiet, as the portable rounding; fp32 denormals (p
// below 2^-126) become 0.
struct VecAmx : VecAvx512 {
  // 2^x with a degree-4 minimax polynomial on [-0.5, 0.5] (relative error 2.7e-6, against bf16's
  // 3.9e-3 rounding of each p): three multiply-adds fewer than the fp32 kernels' series.
  static reg exp2(reg x) {
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm512_sub_ps(x, n);
    reg p = _mm512_set1_ps(9.570101276e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591785908e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-01f));
    return _mm512_scalef_ps(p, n);
  }
  static void store_bf16(uint16_t* p, reg x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x)); }
};

}  // namespace
}  // namespace attn

AttnKernel attention_kernel_amx() {
  return AttnKernel{attn::brgemm_packed_bytes, attn::brgemm_pack,
                    attn::brgemm_forward<attn::VecAmx, brgemm_bf16_onednn, brgemm_release_onednn>, attn::kBrgemmRows};
}

}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_amx() { return attention_kernel_brgemm_stand_in(); }
}  // namespace pyext::cpu
#endif
