// 16 fp32 lanes to bf16 with AVX512F alone, rounded to nearest even with NaN made quiet: the same
// bits as float_to_bf16 (half_rounding.h), denormals included (AVX512_BF16's vcvtneps2bf16 flushes
// them). Include only from a unit compiled with `#pragma GCC target("avx512f,avx512bw,...")`.
#pragma once
#include <immintrin.h>

namespace pyext::cpu {
namespace {

inline __m256i bf16_round_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, nan));
}

}  // namespace
}  // namespace pyext::cpu
