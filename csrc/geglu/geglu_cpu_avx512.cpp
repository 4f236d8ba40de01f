// AVX-512 build of the GEGLU kernel: 16 lanes, each erf coefficient fetched per lane's segment by
// vpermps, the row's tail through masked loads and stores.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>

#include "common/bf16_avx512.h"
#include "common/half_rounding.h"
#include "geglu/geglu_cpu.h"
#include "geglu/geglu_erf.h"

namespace pyext::cpu {
namespace {

template <PyextDtype D>
inline __m512 load16(const void* p, __mmask16 m) {
  if constexpr (D == PYEXT_F32) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if constexpr (D == PYEXT_F16) return _mm512_cvtph_ps(h);  // exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <PyextDtype D>
inline void store16(void* p, __mmask16 m, __m512 v) {
  if constexpr (D == PYEXT_F32) {
    _mm512_mask_storeu_ps(p, m, v);
  } else if constexpr (D == PYEXT_F16) {  // to nearest even, NaN quiet: as float_to_fp16
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm256_mask_storeu_epi16(p, m, bf16_round_avx512(v));
  }
}

// geglu_f32 (geglu_erf.h) on 16 lanes; coef[j] holds kErfPoly[j] in lanes 0..7.
inline __m512 geglu16(__m512 a, __m512 g, const __m512* coef) {
  const __m512 s = _mm512_min_ps(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(kSqrt2)),
                                 _mm512_set1_ps(kErfClamp));  // NaN: the clamp (min's second operand)
  const __m512i k = _mm512_cvttps_epi32(s);
  const __m512 v = _mm512_sub_ps(s, _mm512_cvtepi32_ps(k));
  __m512 p = _mm512_permutexvar_ps(k, coef[kErfDegree]);
  for (int j = kErfDegree - 1; j >= 0; --j) p = _mm512_fmadd_ps(p, v, _mm512_permutexvar_ps(k, coef[j]));
  p = _mm512_min_ps(p, _mm512_set1_ps(1.0f));
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));  // e = copysign(p, g)
  const __m512 e = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(sign_bit, _mm512_castps_si512(g),
                                                                 _mm512_castps_si512(p), 0xca));  // sign_bit ? g : p
  const __m512 h = _mm512_mul_ps(g, _mm512_set1_ps(0.5f));
  return _mm512_mul_ps(a, _mm512_fmadd_ps(h, e, h));
}

template <PyextDtype D>
void span(const GegluArgs& a, int64_t row, int64_t begin, int64_t end) {
  constexpr int64_t kSize = PYEXT_DTYPE_SIZE(D);
  const char* x = static_cast<const char*>(a.x) + row * a.x_stride * kSize;
  const char* gate = x + a.D * kSize;
  char* y = static_cast<char*>(a.y) + row * a.D * kSize;
  __m512 coef[kErfDegree + 1];
  for (int j = 0; j <= kErfDegree; ++j) {
    float lanes[16] = {};
    for (int k = 0; k < kErfSegments; ++k) lanes[k] = kErfPoly[j][k];
    coef[j] = _mm512_loadu_ps(lanes);
  }
  for (int64_t j = begin; j < end; j += 16) {
    const __mmask16 m = end - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (end - j)) - 1);
    const int64_t o = j * kSize;
    store16<D>(y + o, m, geglu16(load16<D>(x + o, m), load16<D>(gate + o, m), coef));
  }
}

}  // namespace

GegluSpan geglu_span_avx512(PyextDtype dtype) {
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
GegluSpan geglu_span_avx512(PyextDtype dtype) { return geglu_span_scalar(dtype); }
}  // namespace pyext::cpu
#endif
