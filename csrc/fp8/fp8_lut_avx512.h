// fp8 codes to 16-bit outputs by table lookup on AVX512_VBMI, for the AVX-512 units: the outputs of
// the 128 non-negative codes, split into low- and high-byte planes of two registers each; 64 codes
// take one vpermi2b per plane (the index's bit 7 is ignored) and a negative code's output is its
// positive twin's with the sign bit flipped. Compiled for VBMI by attribute: call only where the
// CPU has it.
#pragma once
#include <immintrin.h>

#include <cstdint>

#define PYEXT_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c,bmi2")))

namespace pyext::cpu {
namespace {

// planes: low bytes of outputs 0-63, 64-127; high bytes 0-63, 64-127 of the 128 in `table`.
PYEXT_VBMI_TARGET inline void lut_planes(const uint16_t* table, __m512i* planes) {
  for (int half = 0; half < 2; ++half) {
    const __m512i a = _mm512_loadu_si512(table + 64 * half), b = _mm512_loadu_si512(table + 64 * half + 32);
    planes[half] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(b), 1);
    planes[2 + half] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(a, 8))),
                                          _mm512_cvtepi16_epi8(_mm512_srli_epi16(b, 8)), 1);
  }
}

// The outputs of 64 codes: 0-31 in first, 32-63 in second.
PYEXT_VBMI_TARGET inline void lookup64(const __m512i* planes, __m512i codes, __m512i* first, __m512i* second) {
  // unpacklo/hi interleave within 128-bit lanes: reorder the codes' qwords so that the
  // low unpack yields outputs 0-31 and the high one outputs 32-63
  const __m512i c = _mm512_permutexvar_epi64(_mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0), codes);
  const __m512i lo = _mm512_permutex2var_epi8(planes[0], c, planes[1]);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(planes[2], c, planes[3]), c,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0x78);  // hi ^ (c & 0x80)
  *first = _mm512_unpacklo_epi8(lo, hi);
  *second = _mm512_unpackhi_epi8(lo, hi);
}

}  // namespace
}  // namespace pyext::cpu
