// AVX-512 (F, BW, VL) fp8 row kernels, 32 codes per step; same decoding trick
// as the AVX2 unit (see fp8_convert_avx2.cpp), masked loads/stores for the tail.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#include <immintrin.h>

#include "fp8_convert.h"

namespace pyext::cpu {
namespace {

inline __m512i to_bf16_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(is_nan, rounded, _mm512_srli_epi32(bits, 16));
}

template <OutType kOut, bool kStream = false>
inline void step32(const uint8_t* src, void* dst, __m512 scale256, __mmask32 mask) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, src));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
  const __mmask32 is_nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
  __m512i h = _mm512_or_si512(sign, _mm512_slli_epi16(mag, 7));
  h = _mm512_mask_mov_epi16(h, is_nan, _mm512_or_si512(sign, _mm512_set1_epi16(0x7f80)));
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), scale256);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), scale256);
  const __mmask16 mlo = static_cast<__mmask16>(mask), mhi = static_cast<__mmask16>(mask >> 16);
  if constexpr (kStream) {  // full 64-byte aligned lines only (see rows_avx512)
    if constexpr (kOut == OutType::kF32) {
      _mm512_stream_ps(static_cast<float*>(dst), lo);
      _mm512_stream_ps(static_cast<float*>(dst) + 16, hi);
    } else {
      const __m256i a = kOut == OutType::kF16 ? _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                              : _mm512_cvtepi32_epi16(to_bf16_lanes(lo));
      const __m256i b = kOut == OutType::kF16 ? _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                              : _mm512_cvtepi32_epi16(to_bf16_lanes(hi));
      _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  } else if constexpr (kOut == OutType::kF32) {
    float* out = static_cast<float*>(dst);
    _mm512_mask_storeu_ps(out, mlo, lo);
    _mm512_mask_storeu_ps(out + 16, mhi, hi);
  } else {
    __m256i a, b;
    if constexpr (kOut == OutType::kF16) {
      a = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      b = _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      a = _mm512_cvtepi32_epi16(to_bf16_lanes(lo));
      b = _mm512_cvtepi32_epi16(to_bf16_lanes(hi));
    }
    uint16_t* out = static_cast<uint16_t*>(dst);
    _mm256_mask_storeu_epi16(out, mlo, a);
    _mm256_mask_storeu_epi16(out + 16, mhi, b);
  }
}

template <OutType kOut>
void rows_avx512(const uint8_t* src, void* dst, int64_t n, float scale, bool stream) {
  if (!scale_is_simd_safe(scale)) return fp8_row_kernel_scalar(kOut)(src, dst, n, scale, false);
  const __m512 scale256 = _mm512_set1_ps(scale * 256.0f);
  constexpr int64_t kEsize = kOut == OutType::kF32 ? 4 : 2;
  char* out = static_cast<char*>(dst);
  int64_t i = 0;
  if (stream) {
    // Cached stores up to the first 64-byte line boundary, then whole lines with
    // non-temporal stores; the fence orders them before the caller reads the output.
    while (i + 32 <= n && reinterpret_cast<uintptr_t>(out + i * kEsize) % 64 != 0) {
      step32<kOut>(src + i, out + i * kEsize, scale256, ~__mmask32(0));
      i += 32;
    }
    for (; i + 32 <= n; i += 32) step32<kOut, true>(src + i, out + i * kEsize, scale256, ~__mmask32(0));
    _mm_sfence();
  }
  for (; i + 32 <= n; i += 32) step32<kOut>(src + i, out + i * kEsize, scale256, ~__mmask32(0));
  if (i < n) step32<kOut>(src + i, out + i * kEsize, scale256, _bzhi_u32(~0u, static_cast<unsigned>(n - i)));
}

}  // namespace

Fp8RowFn fp8_row_kernel_avx512(OutType out) {
  switch (out) {
    case OutType::kBF16: return rows_avx512<OutType::kBF16>;
    case OutType::kF16: return rows_avx512<OutType::kF16>;
    default: return rows_avx512<OutType::kF32>;
  }
}

}  // namespace pyext::cpu
#else
#include "fp8_convert.h"
namespace pyext::cpu {
Fp8RowFn fp8_row_kernel_avx512(OutType out) { return fp8_row_kernel_scalar(out); }
}  // namespace pyext::cpu
#endif
