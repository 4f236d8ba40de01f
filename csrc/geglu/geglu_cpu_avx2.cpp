// AVX2 + FMA build of the GEGLU kernel: 8 lanes, each erf coefficient fetched per lane's segment by
// vpermps; the row's tail one element at a time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "common/half_rounding.h"
#include "geglu/geglu_cpu.h"
#include "geglu/geglu_erf.h"

namespace pyext::cpu {
namespace {

template <PyextDtype D>
inline __m256 load8(const void* p) {
  if constexpr (D == PYEXT_F32) return _mm256_loadu_ps(static_cast<const float*>(p));
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  if constexpr (D == PYEXT_F16) return _mm256_cvtph_ps(h);  // exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// To nearest even with NaN made quiet: the bits of float_to_bf16 (half_rounding.h).
inline __m128i bf16_round_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));  // both sides below 2^31: signed works
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each <= 0xffff: exact
}

template <PyextDtype D>
inline void store8(void* p, __m256 v) {
  if constexpr (D == PYEXT_F32) {
    _mm256_storeu_ps(static_cast<float*>(p), v);
  } else if constexpr (D == PYEXT_F16) {  // to nearest even, NaN quiet: as float_to_fp16
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), bf16_round_avx2(v));
  }
}

// geglu_f32 (geglu_erf.h) on 8 lanes; coef[j] holds kErfPoly[j].
inline __m256 geglu8(__m256 a, __m256 g, const __m256* coef) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 s = _mm256_min_ps(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, g), _mm256_set1_ps(kSqrt2)),
                                 _mm256_set1_ps(kErfClamp));  // NaN: the clamp (min's second operand)
  const __m256i k = _mm256_cvttps_epi32(s);
  const __m256 v = _mm256_sub_ps(s, _mm256_cvtepi32_ps(k));
  __m256 p = _mm256_permutevar8x32_ps(coef[kErfDegree], k);
  for (int j = kErfDegree - 1; j >= 0; --j) p = _mm256_fmadd_ps(p, v, _mm256_permutevar8x32_ps(coef[j], k));
  p = _mm256_min_ps(p, _mm256_set1_ps(1.0f));
  const __m256 e = _mm256_or_ps(_mm256_andnot_ps(sign_bit, p), _mm256_and_ps(sign_bit, g));  // copysign(p, g)
  const __m256 h = _mm256_mul_ps(g, _mm256_set1_ps(0.5f));
  return _mm256_mul_ps(a, _mm256_fmadd_ps(h, e, h));
}

template <PyextDtype D>
void span(const GegluArgs& a, int64_t row, int64_t begin, int64_t end) {
  using Io = DtypeIo<D>;
  const auto* x = static_cast<const typename Io::T*>(a.x) + row * a.x_stride;
  const auto* gate = x + a.D;
  auto* y = static_cast<typename Io::T*>(a.y) + row * a.D;
  __m256 coef[kErfDegree + 1];
  for (int j = 0; j <= kErfDegree; ++j) coef[j] = _mm256_loadu_ps(kErfPoly[j]);
  int64_t j = begin;
  for (; j + 8 <= end; j += 8) store8<D>(y + j, geglu8(load8<D>(x + j), load8<D>(gate + j), coef));
  for (; j < end; ++j) y[j] = Io::store(geglu_f32(Io::load(x[j]), Io::load(gate[j])));
}

}  // namespace

GegluSpan geglu_span_avx2(PyextDtype dtype) {
  switch (dtype) {
    case PYEXT_F16: return span<PYEXT_F16>;
    case PYEXT_BF16: return span<PYEXT_BF16>;
    default: return span<PYEXT_F32>;
  }
}

}  // namespace pyext::cpu
#else
#include "geglu/geglu_cpu.h"
namespace pyext::cpu {
GegluSpan geglu_span_avx2(PyextDtype dtype) { return geglu_span_scalar(dtype); }
}  // namespace pyext::cpu
#endif
