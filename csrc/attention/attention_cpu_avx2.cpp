// AVX2 + FMA fp32 flash attention (8 lanes per vector, 16 ymm registers).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "attention/attention_cpu_impl.h"

namespace pyext::cpu {
namespace attn {
namespace {

struct VecAvx2 {
  using reg = __m256;
  static constexpr int64_t kW = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_max(reg x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  static float reduce_add(reg x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  // 2^x for x <= 0: builds 2^n in the exponent bits; below -126 (and -inf) the result is 0.
  // A NaN score (NaN in q or k) must stay NaN, as in softmax: the "below" compare is false
  // for NaN, and vmaxps returns its second operand when either is NaN, so x goes second
  // and the polynomial turns it into NaN.
  static reg exp2(reg x) {
    const reg below = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x);
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const reg p = _mm256_mul_ps(exp2_poly<VecAvx2>(_mm256_sub_ps(x, n)), _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(below, p);
  }
};

}  // namespace
}  // namespace attn

// 6 rows x 2 vectors = 12 accumulators of the 16 ymm registers, in both products: with fewer,
// the FMAs wait on their own latency (4 rows and one key stripe measured clearly slower on a Zen 3).
AttnKernel attention_kernel_avx2() { return attn::Fp32Attention<attn::VecAvx2, 6, 2, 2>::kernel(); }
}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_avx2() { return attention_kernel_scalar(); }
}  // namespace pyext::cpu
#endif
