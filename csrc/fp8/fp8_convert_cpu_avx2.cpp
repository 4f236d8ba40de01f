// AVX2 + F16C fp8 row kernels, 16 codes per step.
//
// Decoding is fp8_e4m3.h's, 16 lanes at a time: the 7 magnitude bits of an e4m3 code,
// shifted left by 7, are the fp16 encoding of value/256 (e4m3 has exponent bias 7, fp16
// has 15), for normals and subnormals alike. F16C widens that exactly to fp32 and one fp32
// multiply by (scale * 256) gives value * scale with a single rounding, the
// same product the reference computes. NaN codes are patched to fp32 0x7ff00000.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "fp8/fp8_convert_cpu.h"

namespace pyext::cpu {
namespace {

struct Decoded { __m256 lo, hi; };

inline Decoded decode16(const uint8_t* src, __m256 scale256) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
  const __m256i is_nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(mag, 7));
  h = _mm256_blendv_epi8(h, _mm256_or_si256(sign, _mm256_set1_epi16(0x7f80)), is_nan);
  return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale256),
          _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale256)};
}

// fp32 -> bf16 bits in the low half of each 32-bit lane, round to nearest even.
inline __m256i to_bf16_lanes(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_srli_epi32(bits, 16), is_nan);
}

template <PyextDtype kOut>
void rows_avx2(const uint8_t* src, void* dst, int64_t n, float scale, bool /*stream*/) {
  if (!(scale_is_simd_safe(scale))) return fp8_row_kernel_scalar(kOut)(src, dst, n, scale, false);
  const __m256 scale256 = _mm256_set1_ps(scale * 256.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Decoded d = decode16(src + i, scale256);
    if constexpr (kOut == PYEXT_F32) {
      float* out = static_cast<float*>(dst) + i;
      _mm256_storeu_ps(out, d.lo);
      _mm256_storeu_ps(out + 8, d.hi);
    } else if constexpr (kOut == PYEXT_F16) {
      auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i);
      _mm_storeu_si128(out, _mm256_cvtps_ph(d.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128(out + 1, _mm256_cvtps_ph(d.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      const __m256i packed = _mm256_packus_epi32(to_bf16_lanes(d.lo), to_bf16_lanes(d.hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i),
                          _mm256_permute4x64_epi64(packed, 0xD8));  // undo the per-lane pack order
    }
  }
  if (i < n) {
    constexpr size_t kEsize = PYEXT_DTYPE_SIZE(kOut);
    fp8_row_kernel_scalar(kOut)(src + i, static_cast<char*>(dst) + i * kEsize, n - i, scale, false);
  }
}

}  // namespace

Fp8RowFn fp8_row_kernel_avx2(PyextDtype out) {
  switch (out) {
    case PYEXT_BF16: return rows_avx2<PYEXT_BF16>;
    case PYEXT_F16: return rows_avx2<PYEXT_F16>;
    default: return rows_avx2<PYEXT_F32>;
  }
}

}  // namespace pyext::cpu
#else
#include "fp8/fp8_convert_cpu.h"
namespace pyext::cpu {
Fp8RowFn fp8_row_kernel_avx2(PyextDtype out) { return fp8_row_kernel_scalar(out); }
}  // namespace pyext::cpu
#endif
