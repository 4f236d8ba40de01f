// The channels-last passes in AVX-512 intrinsics, for the AVX-512 unit (group_norm_cpu_avx512.cpp
// defines PYEXT_GN_AVX512 before it includes the kernel body). Both passes are compute-bound, so each
// of a row's 16-channel vectors is converted in registers, with no fp32 copy of the rows between
// the conversions and the arithmetic. The statistics' column sums add the rows in
// add_columns' order. The apply pass is normalize<SILU>'s arithmetic (v + shift - mean_hi, times
// scale, plus offset); its SiLU for fp32 is exp_f32's (Cephes' polynomial on the same reduction; 2^n
// by vscalefps, which rounds subnormal results once, where exp_f32 multiplies two powers of two) and
// a reciprocal refined once, and for fp16 and bf16 results, whose rounding is 2^-11 or coarser, a
// degree-4 exponential and the reciprocal's 2^-14 estimate; the conversions are bit-exact with
// half_rounding.h's.
#pragma once
#pragma GCC diagnostic push
// GCC 12 reads the _mm512_undefined_ps() inside its own intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>

#include "common/bf16_avx512.h"
#include "common/half_rounding.h"

namespace pyext::cpu {
namespace {

template <PyextDtype D> using RowElem = typename DtypeIo<D>::T;

// e^x as exp_f32: inf above ln(FLT_MAX) (x is clamped to 89, where 2^n already overflows), 0 below
// ln of half the least subnormal (clamped to -110, where it underflows), NaN kept (max/min return
// their second operand, x, when it is NaN).
inline __m512 exp_avx512(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x / (1 + e^-x), as silu(), the quotient as x times a reciprocal: vdivps is slow enough, 16 lanes
// at a time, to bound this pass. The reciprocal is rcp14's estimate and one Newton step: within an
// ulp or two, where 1 + e^-x is small enough that its reciprocal is normal (up to about 2^-22
// relative just below, x in [-88.7, -87.3]); where e^-x overflows, 0 (the step would make inf * 0
// a NaN), so that the result is -0 there and NaN at -inf, as silu()'s.
inline __m512 silu_avx512(__m512 v) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 d = _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), v)));
  const __m512 y0 = _mm512_rcp14_ps(d);
  __m512 y = _mm512_fmadd_ps(y0, _mm512_fnmadd_ps(d, y0, one), y0);
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
  return _mm512_mul_ps(v, y);
}

// e^x to about 3e-6 relative, for SiLUs rounded to fp16 or bf16: 2^(x log2e) as 2^n times a
// degree-4 minimax polynomial of the fraction on [-0.5, 0.5]; the same clamps as exp_avx512.
inline __m512 exp_half_avx512(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
  const __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.570101276e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591785908e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-01f));
  return _mm512_scalef_ps(p, n);
}

// silu_avx512 for results rounded to fp16 or bf16: rcp14's estimate is within 2^-14, and is 0 where
// e^-x overflows, so the result is -0 there and NaN at -inf without a fix-up.
inline __m512 silu_half_avx512(__m512 v) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_half_avx512(_mm512_sub_ps(_mm512_setzero_ps(), v)));
  return _mm512_mul_ps(v, _mm512_rcp14_ps(d));
}

// `lanes` (mask) elements of a row in dtype D, as fp32, and back.
template <PyextDtype D>
inline __m512 load16(const RowElem<D>* p, __mmask16 lanes) {
  if constexpr (D == PYEXT_F32) return _mm512_maskz_loadu_ps(lanes, p);
  const __m256i h = _mm256_maskz_loadu_epi16(lanes, p);
  if constexpr (D == PYEXT_F16) return _mm512_cvtph_ps(h);  // exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <PyextDtype D>
inline void store16(RowElem<D>* p, __m512 v, __mmask16 lanes) {
  if constexpr (D == PYEXT_F32) {
    _mm512_mask_storeu_ps(p, lanes, v);
  } else if constexpr (D == PYEXT_F16) {  // rounds to nearest even and quiets NaN, as float_to_fp16
    _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm256_mask_storeu_epi16(p, lanes, bf16_round_avx512(v));
  }
}

// The lanes of a row's channels c.. c + 15 that exist.
inline __mmask16 channel_lanes(int64_t C, int64_t c) {
  return C - c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (C - c)) - 1);
}

// `rows` channels-last rows of C channels: y = normalize<SILU>(x) with channel c's constants.
template <PyextDtype D, bool SILU>
void normalize_rows_avx512(const RowElem<D>* x, RowElem<D>* y, int64_t rows, int64_t C, const float* sh, const float* m,
                           const float* s, const float* o) {
  for (int64_t r = 0; r < rows; ++r, x += C, y += C)
    for (int64_t c = 0; c < C; c += 16) {
      const __mmask16 lanes = channel_lanes(C, c);
      const __m512 t = _mm512_sub_ps(_mm512_add_ps(load16<D>(x + c, lanes), _mm512_maskz_loadu_ps(lanes, sh + c)),
                                     _mm512_maskz_loadu_ps(lanes, m + c));
      __m512 v = _mm512_fmadd_ps(t, _mm512_maskz_loadu_ps(lanes, s + c), _mm512_maskz_loadu_ps(lanes, o + c));
      if constexpr (SILU) v = D == PYEXT_F32 ? silu_avx512(v) : silu_half_avx512(v);
      store16<D>(y + c, v, lanes);
    }
}

// add_columns on the rows as they lie: acc[c] += x[r * C + c] over `rows` rows, four at a time.
template <PyextDtype D>
void add_columns_avx512(float* acc, const RowElem<D>* x, int64_t C, int64_t rows) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const RowElem<D>*x0 = x + r * C, *x1 = x0 + C, *x2 = x1 + C, *x3 = x2 + C;
    for (int64_t c = 0; c < C; c += 16) {
      const __mmask16 lanes = channel_lanes(C, c);
      const __m512 v = _mm512_add_ps(_mm512_add_ps(load16<D>(x0 + c, lanes), load16<D>(x1 + c, lanes)),
                                     _mm512_add_ps(load16<D>(x2 + c, lanes), load16<D>(x3 + c, lanes)));
      _mm512_mask_storeu_ps(acc + c, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, acc + c), v));
    }
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < C; c += 16) {
      const __mmask16 lanes = channel_lanes(C, c);
      _mm512_mask_storeu_ps(acc + c, lanes,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, acc + c), load16<D>(x + r * C + c, lanes)));
    }
}

// add_column_deviations on the rows as they lie: s1[c] += d, s2[c] += d * d with
// d = (x[r * C + c] + add[c]) - m[c], four rows at a time.
template <PyextDtype D>
inline __m512 deviation16(const RowElem<D>* p, __mmask16 lanes, __m512 add, __m512 m) {
  return _mm512_sub_ps(_mm512_add_ps(load16<D>(p, lanes), add), m);
}

template <PyextDtype D>
void add_column_deviations_avx512(float* s1, float* s2, const float* add, const float* m, const RowElem<D>* x,
                                  int64_t C, int64_t rows) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const RowElem<D>*x0 = x + r * C, *x1 = x0 + C, *x2 = x1 + C, *x3 = x2 + C;
    for (int64_t c = 0; c < C; c += 16) {
      const __mmask16 lanes = channel_lanes(C, c);
      const __m512 a = _mm512_maskz_loadu_ps(lanes, add + c), mc = _mm512_maskz_loadu_ps(lanes, m + c);
      const __m512 d0 = deviation16<D>(x0 + c, lanes, a, mc), d1 = deviation16<D>(x1 + c, lanes, a, mc);
      const __m512 d2 = deviation16<D>(x2 + c, lanes, a, mc), d3 = deviation16<D>(x3 + c, lanes, a, mc);
      const __m512 t1 = _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3));
      const __m512 t2 = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(d0, d0), _mm512_mul_ps(d1, d1)),
                                      _mm512_add_ps(_mm512_mul_ps(d2, d2), _mm512_mul_ps(d3, d3)));
      _mm512_mask_storeu_ps(s1 + c, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, s1 + c), t1));
      _mm512_mask_storeu_ps(s2 + c, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, s2 + c), t2));
    }
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < C; c += 16) {
      const __mmask16 lanes = channel_lanes(C, c);
      const __m512 d = deviation16<D>(x + r * C + c, lanes, _mm512_maskz_loadu_ps(lanes, add + c),
                                      _mm512_maskz_loadu_ps(lanes, m + c));
      _mm512_mask_storeu_ps(s1 + c, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, s1 + c), d));
      _mm512_mask_storeu_ps(s2 + c, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, s2 + c), _mm512_mul_ps(d, d)));
    }
}

}  // namespace
}  // namespace pyext::cpu

#pragma GCC diagnostic pop
