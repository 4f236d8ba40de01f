// AVX-512 (F, BW, VL) fp8 row kernels, 32 codes per step; same decoding trick
// as the AVX2 unit (see fp8_convert_cpu_avx2.cpp), masked loads/stores for the tail.
// Long rows of 16-bit outputs on CPUs with AVX512_VBMI take table lookups instead
// (rows_lut): fewer instructions per code, so the upcast runs at memory speed.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#include <immintrin.h>

#include "fp8/fp8_convert_cpu.h"
#include "fp8/fp8_lut_avx512.h"

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

template <PyextDtype kOut, bool kStream = false>
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
    if constexpr (kOut == PYEXT_F32) {
      _mm512_stream_ps(static_cast<float*>(dst), lo);
      _mm512_stream_ps(static_cast<float*>(dst) + 16, hi);
    } else {
      const __m256i a = kOut == PYEXT_F16 ? _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                              : _mm512_cvtepi32_epi16(to_bf16_lanes(lo));
      const __m256i b = kOut == PYEXT_F16 ? _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                              : _mm512_cvtepi32_epi16(to_bf16_lanes(hi));
      _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  } else if constexpr (kOut == PYEXT_F32) {
    float* out = static_cast<float*>(dst);
    _mm512_mask_storeu_ps(out, mlo, lo);
    _mm512_mask_storeu_ps(out + 16, mhi, hi);
  } else {
    __m256i a, b;
    if constexpr (kOut == PYEXT_F16) {
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

// Converts the codes before out's first 64-byte line boundary (cached stores, fewer
// than one step) and returns their count, so the rest can be streamed in whole lines;
// clears `stream` when out is not aligned to its element size (no line boundary to reach).
template <PyextDtype kOut>
int64_t align_head(const uint8_t* src, char* out, int64_t n, __m512 scale256, bool* stream) {
  constexpr int64_t kEsize = PYEXT_DTYPE_SIZE(kOut);
  const int64_t gap = (64 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % 64)) % 64;
  if (gap % kEsize) {
    *stream = false;
    return 0;
  }
  const int64_t k = gap / kEsize < n ? gap / kEsize : n;
  if (k) step32<kOut>(src, out, scale256, _bzhi_u32(~0u, static_cast<unsigned>(k)));
  return k;
}

// The vpermi2b lookups (fp8_lut_avx512.h): compiled for it, run only where the CPU reports it.
bool cpu_has_vbmi() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
  }();
  return has;
}

// Shorter rows take the arithmetic kernel: building the table costs more than the lookups
// save there (measured per output dtype, one thread, in cache: `python -m bench.fp8`).
template <PyextDtype kOut>
constexpr int64_t kLutMinRow = kOut == PYEXT_BF16 ? 256 : 640;

struct Iota128 {
  alignas(64) uint8_t v[128];
  constexpr Iota128() : v() {
    for (int i = 0; i < 128; ++i) v[i] = static_cast<uint8_t>(i);
  }
};
constexpr Iota128 kCodes;

// 16-bit outputs by table lookup (fp8_lut_avx512.h). The table holds the outputs of the 128
// non-negative codes, computed by step32 itself, so every value is the arithmetic kernel's bit for
// bit. A negative code's output is its positive twin's with the sign bit flipped: the decoded value
// is negated, the product with the scale and the round-to-nearest-even of a negated value are the
// negated results, and a NaN keeps its own sign through the multiply on x86.
// The tests check all 256 codes against the reference, positive and negative scales.
template <PyextDtype kOut>
PYEXT_VBMI_TARGET void rows_lut(const uint8_t* src, char* out, int64_t n, __m512 scale256, bool stream) {
  alignas(64) uint16_t table[128];
  for (int j = 0; j < 128; j += 32) step32<kOut>(kCodes.v + j, table + j, scale256, ~__mmask32(0));
  __m512i planes[4];
  lut_planes(table, planes);
  int64_t i = 0;
  __m512i a, b;
  if (stream) {  // whole 64-byte lines with non-temporal stores (the caller aligned out)
    for (; i + 64 <= n; i += 64) {
      lookup64(planes, _mm512_loadu_si512(src + i), &a, &b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + 2 * i), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + 2 * i + 64), b);
    }
    _mm_sfence();
  }
  for (; i + 64 <= n; i += 64) {
    lookup64(planes, _mm512_loadu_si512(src + i), &a, &b);
    _mm512_storeu_si512(out + 2 * i, a);
    _mm512_storeu_si512(out + 2 * i + 64, b);
  }
  if (i < n) {
    const int64_t left = n - i;  // 1..63
    lookup64(planes, _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, static_cast<unsigned>(left)), src + i), &a, &b);
    _mm512_mask_storeu_epi16(out + 2 * i, _bzhi_u32(~0u, static_cast<unsigned>(left < 32 ? left : 32)), a);
    if (left > 32) _mm512_mask_storeu_epi16(out + 2 * i + 64, _bzhi_u32(~0u, static_cast<unsigned>(left - 32)), b);
  }
}

template <PyextDtype kOut>
void rows_avx512(const uint8_t* src, void* dst, int64_t n, float scale, bool stream) {
  if (!scale_is_simd_safe(scale)) return fp8_row_kernel_scalar(kOut)(src, dst, n, scale, false);
  const __m512 scale256 = _mm512_set1_ps(scale * 256.0f);
  constexpr int64_t kEsize = PYEXT_DTYPE_SIZE(kOut);
  char* out = static_cast<char*>(dst);
  int64_t i = 0;
  if constexpr (kOut != PYEXT_F32) {
    if (n >= kLutMinRow<kOut> && cpu_has_vbmi()) {
      if (stream) i = align_head<kOut>(src, out, n, scale256, &stream);
      rows_lut<kOut>(src + i, out + i * kEsize, n - i, scale256, stream);
      return;
    }
  }
  // Cached stores up to the first 64-byte line boundary, then whole lines with
  // non-temporal stores; the fence orders them before the caller reads the output.
  if (stream) i = align_head<kOut>(src, out, n, scale256, &stream);
  if (stream) {
    for (; i + 32 <= n; i += 32) step32<kOut, true>(src + i, out + i * kEsize, scale256, ~__mmask32(0));
    _mm_sfence();
  }
  for (; i + 32 <= n; i += 32) step32<kOut>(src + i, out + i * kEsize, scale256, ~__mmask32(0));
  if (i < n) step32<kOut>(src + i, out + i * kEsize, scale256, _bzhi_u32(~0u, static_cast<unsigned>(n - i)));
}

}  // namespace

Fp8RowFn fp8_row_kernel_avx512(PyextDtype out) {
  switch (out) {
    case PYEXT_BF16: return rows_avx512<PYEXT_BF16>;
    case PYEXT_F16: return rows_avx512<PYEXT_F16>;
    default: return rows_avx512<PYEXT_F32>;
  }
}

}  // namespace pyext::cpu
#else
#include "fp8/fp8_convert_cpu.h"
namespace pyext::cpu {
Fp8RowFn fp8_row_kernel_avx512(PyextDtype out) { return fp8_row_kernel_scalar(out); }
}  // namespace pyext::cpu
#endif
