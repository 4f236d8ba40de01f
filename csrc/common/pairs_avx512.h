// bf16 pairs into the VNNI layout brgemm takes, with AVX-512: transposes of 32-bit words (a pair
// of bf16 each) and the interleave of two rows. Include only from a unit compiled with
// `#pragma GCC target("avx512f,avx512bw,...")`; common/pairs.h has the portable twins.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pyext::cpu {
namespace {

// The first n of 16 lanes (n <= 16).
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// In-register transpose of a 16 x 16 matrix of 32-bit lanes (r[i] = row i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e] = element 4L+e of rows i..i+3 in 128-bit lane L
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    t[e] = _mm512_shuffle_i32x4(r[e], r[e + 4], 0x88);
    t[e + 4] = _mm512_shuffle_i32x4(r[e], r[e + 4], 0xdd);
    t[e + 8] = _mm512_shuffle_i32x4(r[e + 8], r[e + 12], 0x88);
    t[e + 12] = _mm512_shuffle_i32x4(r[e + 8], r[e + 12], 0xdd);
  }
  for (int e = 0; e < 8; ++e) {
    r[e] = _mm512_shuffle_i32x4(t[e], t[e + 8], 0x88);
    r[e + 8] = _mm512_shuffle_i32x4(t[e], t[e + 8], 0xdd);
  }
}

// dst[p * ld_dst + r] = the pair (src[r * ld_src + 2p], src[r * ld_src + 2p + 1]) for `rows` rows
// and `pairs` pairs: src's rows, ld_src bf16 apart (any: the loads are unaligned), as columns of
// 32-bit words ld_dst apart.
inline void transpose_pairs_avx512(const uint16_t* src, int64_t rows, int64_t pairs, int64_t ld_src, uint32_t* dst,
                                   int64_t ld_dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t rs = std::min<int64_t>(16, rows - r0);
    const __mmask16 rmask = first_lanes(rs);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const int64_t ps = std::min<int64_t>(16, pairs - p0);
      const __mmask16 pmask = first_lanes(ps);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rs ? _mm512_maskz_loadu_epi32(pmask, src + (r0 + i) * ld_src + 2 * p0) : _mm512_setzero_si512();
      transpose16(r);  // r[j] = pair p0 + j of the 16 rows
      for (int64_t j = 0; j < ps; ++j) _mm512_mask_storeu_epi32(dst + (p0 + j) * ld_dst + r0, rmask, r[j]);
    }
  }
}

// dst[c] = the pair (a[c], b[c]) for n columns: two rows interleaved.
inline void interleave_rows_avx512(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = first_lanes(std::min<int64_t>(16, n - c));
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a + c));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + c));
    _mm512_mask_storeu_epi32(dst + c, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

}  // namespace
}  // namespace pyext::cpu
