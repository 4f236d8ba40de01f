// AVX-512 fp32 vector traits for attention_cpu_impl.h. Include only from a unit
// compiled with `#pragma GCC target("avx512f,...")`.
#pragma once
// GCC 12 flags its own AVX-512 intrinsics' deliberately undefined pass-through operands.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "attention/attention_cpu_impl.h"
#include "common/bf16_avx512.h"
#include "common/pairs_avx512.h"

namespace pyext::cpu::attn {
namespace {

struct VecAvx512 {
  using reg = __m512;
  static constexpr int64_t kW = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
  // 2^x for x <= 0 (including -inf), as exp2_scaled's p(x - n) * 2^n with exp2_poly as p.
  static reg exp2(reg x) { return exp2_scaled(x, [](reg f) { return exp2_poly<VecAvx512>(f); }); }
  // Below x = -125 the result is 0, not a float below 2^-126: Intel CPUs take a microcode assist
  // for every denormal vscalefps writes, and every -inf padding lane of a row's last vector would
  // make one. A NaN score
  // (NaN in q or k) must stay NaN, as in softmax: the ordered compare leaves NaN lanes computed,
  // and vmaxps returns its second operand when either is NaN, so x goes second.
  template <class Poly>
  static reg exp2_scaled(reg x, Poly poly) {
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-125.0f), x);
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(kept, poly(_mm512_sub_ps(x, n)), n);
  }
  // 16 bf16, rounded to nearest even as float_to_bf16 (NaN quiet): AVX512F only, bit-identical to
  // the portable units' rounding.
  static void store_bf16(uint16_t* p, reg x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_round_avx512(x)); }
  // brgemm_pack's layouts (attention_cpu_brgemm_impl.h)
  static void transpose_pairs(const uint16_t* src, int64_t rows, int64_t pairs, int64_t ld_src, uint32_t* dst,
                              int64_t ld_dst) {
    transpose_pairs_avx512(src, rows, pairs, ld_src, dst, ld_dst);
  }
  static void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
    interleave_rows_avx512(a, b, n, dst);
  }
};

}  // namespace
}  // namespace pyext::cpu::attn
