// AVX-512 + AVX512_BF16 unit of the fp8-weight GEMM (see fp8_gemm_cpu.h).
//
// Register tile: kRows rows of x times one 64-channel panel = 6 x 4 zmm fp32
// accumulators. Each step takes one k pair: the panel holds, for that pair, 64
// channels x (w[n][k], w[n][k+1]) as four vectors, and x's (k, k+1) pair is broadcast
// as one 32-bit lane, so vdpbf16ps does 2 multiply-adds per lane (as oneDNN's bf16
// GEMM does).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,bmi2")
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "common/bf16_avx512.h"
#include "common/half_rounding.h"
#include "common/pairs_avx512.h"
#include "common/scratch.h"
#include "fp8/fp8_e4m3.h"
#include "fp8/fp8_gemm_cpu.h"
#include "fp8/fp8_lut_avx512.h"

namespace pyext::cpu {
namespace {

constexpr int kRows = 6;      // rows of x per register tile
constexpr int kVecs = 4;      // 16-channel vectors per panel
constexpr int kPanel = 16 * kVecs;
static_assert(kPanel == kFp8Panel);

// 32 e4m3fn codes -> 32 bf16, exact. Normal codes only need the exponent rebiased
// (bf16 keeps e4m3's 3 mantissa bits); the 7 subnormal magnitudes come from a table,
// and NaN (magnitude 0x7f) becomes the quiet NaN decode_e4m3 gives (fp8_e4m3.h), so that
// both packers write the same bits.
inline __m512i decode32(const uint8_t* src, __mmask32 valid) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(valid, src));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  // bf16 bits of m * 2^-9 for m = 0..7 (index = magnitude; only lanes below 8 use it).
  const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0, 0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  v = _mm512_mask_mov_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)),
                            _mm512_permutexvar_epi16(mag, subnormals));
  v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7ff0));
  return _mm512_or_si512(v, sign);
}

// Decodes channels [n0, n0 + 64) of w into packed[pair][64 channels][2] bf16, zero
// past N and past K.
void pack_panel(const uint8_t* w, int64_t N, int64_t K, int64_t n0, uint16_t* packed) {
  const int64_t pairs = (K + 1) / 2;
  for (int g = 0; g < kVecs; ++g) {
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 valid = K - k >= 32 ? ~__mmask32(0) : _bzhi_u32(~0u, static_cast<unsigned>(K - k));
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + g * 16 + i;
        r[i] = n < N ? decode32(w + n * K + k, valid) : _mm512_setzero_si512();
      }
      transpose16(r);  // r[j] = pair k/2 + j of the 16 channels
      const int64_t count = std::min<int64_t>(16, pairs - k / 2);
      for (int64_t j = 0; j < count; ++j)
        _mm512_store_si512(packed + ((k / 2 + j) * kPanel + g * 16) * 2, r[j]);
    }
  }
}

// y[m0 .. m0 + R)[n0 .. n0 + 64). rows[t * R + r] points at the C inputs of row r for
// tap t (a linear has one tap: its row of x); the panel holds the taps one after another.
template <int R>
void tile(const uint16_t* const* rows, int64_t taps, int64_t C, const uint16_t* packed, const Fp8GemmArgs& a,
          int64_t m0, int64_t n0) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t full_pairs = C / 2;
  for (int64_t t = 0; t < taps; ++t) {
    const uint16_t* const* x = rows + t * R;
    const uint16_t* panel = packed + t * full_pairs * kPanel * 2;
    for (int64_t p = 0; p < full_pairs; ++p) {
      const uint16_t* b = panel + p * kPanel * 2;
      __m512i bv[kVecs];
      for (int v = 0; v < kVecs; ++v) bv[v] = _mm512_load_si512(b + v * 32);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x[r] + 2 * p, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)bv[v]);
      }
    }
  }
  if (C % 2) {  // a linear's last, unpaired k: never read past the row (the panel's partner is zero)
    const uint16_t* b = packed + full_pairs * kPanel * 2;
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(rows[r][C - 1]);
      for (int v = 0; v < kVecs; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)_mm512_load_si512(b + v * 32));
    }
  }
  // Epilogue: scale per channel, bias, round to bf16 (RNE), store.
  for (int v = 0; v < kVecs; ++v) {
    const int64_t n = n0 + v * 16;
    if (n >= a.N) break;
    const __mmask16 m = a.N - n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (a.N - n)) - 1);
    const __m512 s = a.per_tensor ? _mm512_set1_ps(a.scale[0]) : _mm512_maskz_loadu_ps(m, a.scale + n);
    __m512 bias = _mm512_setzero_ps();
    if (a.bias)
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a.bias + n)), 16));
    for (int r = 0; r < R; ++r) {
      const __m512 out = _mm512_fmadd_ps(acc[r][v], s, bias);
      _mm256_mask_storeu_epi16(a.y + (m0 + r) * a.N + n, m, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

// Row pointers of the R rows from m0, per tap: rows of x for a linear; for a convolution
// the input pixel under each tap of each output pixel, or a zero row outside the image.
void row_pointers(const Fp8GemmArgs& a, int64_t m0, int R, const uint16_t* zeros, const uint16_t** rows) {
  if (!a.conv) {
    for (int r = 0; r < R; ++r) rows[r] = a.x + (m0 + r) * a.K;
    return;
  }
  const Conv2dGeometry& g = *a.conv;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r, ow = m % g.OW, oh = (m / g.OW) % g.OH, b = m / (g.OW * g.OH);
    for (int64_t dy = 0; dy < g.kh; ++dy) {
      const int64_t ih = oh * g.sh - g.ph + dy;
      for (int64_t dx = 0; dx < g.kw; ++dx) {
        const int64_t iw = ow * g.sw - g.pw + dx;
        const bool inside = ih >= 0 && ih < g.H && iw >= 0 && iw < g.W;
        rows[(dy * g.kw + dx) * R + r] = inside ? a.x + ((b * g.H + ih) * g.W + iw) * g.C : zeros;
      }
    }
  }
}

template <int R>
void run_tile(const Fp8GemmArgs& a, int64_t m0, int64_t n0, const uint16_t* packed, const uint16_t* zeros,
              const uint16_t** rows) {
  row_pointers(a, m0, R, zeros, rows);
  const int64_t taps = a.conv ? a.conv->kh * a.conv->kw : 1;
  tile<R>(rows, taps, a.conv ? a.conv->C : a.K, packed, a, m0, n0);
}

}  // namespace

// The brgemm GEMM's packer (fp8_brgemm_simd_supported() CPUs): pack_panel's layout from 64 codes
// of 16 channels at a time, decoded by table lookup (fp8_lut_avx512.h), then two 16 x 16
// transposes of pairs.
namespace {

PYEXT_VBMI_TARGET void pack_panel_lut(const uint8_t* w, int64_t ld_w, int64_t N, int64_t K, int64_t n0,
                                      uint16_t* packed, int64_t ld) {
  alignas(64) uint16_t table[128];  // bf16 of the non-negative codes (exact)
  for (uint32_t c = 0; c < 128; ++c) table[c] = float_to_bf16(fp8_e4m3_decode(c));
  __m512i planes[4];
  lut_planes(table, planes);
  const int64_t pairs = (K + 1) / 2;
  for (int g = 0; g < kVecs; ++g) {
    for (int64_t k = 0; k < K; k += 64) {
      const __mmask64 valid = _bzhi_u64(~0ull, static_cast<unsigned>(std::min<int64_t>(64, K - k)));
      __m512i r[2][16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + g * 16 + i;
        if (n < N) lookup64(planes, _mm512_maskz_loadu_epi8(valid, w + n * ld_w + k), &r[0][i], &r[1][i]);
        else r[0][i] = r[1][i] = _mm512_setzero_si512();
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t p0 = k / 2 + 16 * h;
        if (p0 >= pairs) break;
        transpose16(r[h]);  // r[h][j] = pair p0 + j of the 16 channels
        for (int64_t j = 0; j < std::min<int64_t>(16, pairs - p0); ++j)
          _mm512_store_si512(packed + ((p0 + j) * ld + g * 16) * 2, r[h][j]);
      }
    }
  }
}

PYEXT_VBMI_TARGET void decode_rows_lut(const uint8_t* w, int64_t ld_w, int64_t rows, int64_t K, uint16_t* out,
                                       int64_t ld_out) {
  alignas(64) uint16_t table[128];  // bf16 of the non-negative codes (exact)
  for (uint32_t c = 0; c < 128; ++c) table[c] = float_to_bf16(fp8_e4m3_decode(c));
  __m512i planes[4];
  lut_planes(table, planes);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += 64) {
      const int64_t left = std::min<int64_t>(64, K - k);
      __m512i a, b;
      lookup64(planes, _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, static_cast<unsigned>(left)), w + r * ld_w + k), &a, &b);
      uint16_t* o = out + r * ld_out + k;
      _mm512_mask_storeu_epi16(o, _bzhi_u32(~0u, static_cast<unsigned>(std::min<int64_t>(left, 32))), a);
      if (left > 32) _mm512_mask_storeu_epi16(o + 32, _bzhi_u32(~0u, static_cast<unsigned>(left - 32)), b);
    }
}

}  // namespace

void fp8_transpose_pairs_avx512(const uint16_t* x, int64_t M, int64_t K, uint16_t* xt) {
  transpose_pairs_avx512(x, M, K / 2, K, reinterpret_cast<uint32_t*>(xt), M);
}

void fp8_decode_rows_avx512(const uint8_t* w, int64_t ld_w, int64_t rows, int64_t K, uint16_t* out, int64_t ld_out) {
  decode_rows_lut(w, ld_w, rows, K, out, ld_out);
}

void fp8_pack_panel_avx512(const uint8_t* w, int64_t ld_w, int64_t N, int64_t K, int64_t n0, uint16_t* packed,
                           int64_t ld) {
  pack_panel_lut(w, ld_w, N, K, n0, packed, ld);
}

void fp8_epilogue_avx512(const float* acc, int64_t ld_acc, int64_t rows, int64_t cols, const float* scale,
                         const float* bias, uint16_t* y, int64_t ld_y) {
  // A row at a time, so that y's lines are written whole and in order: 32 columns make one
  // 64-byte store; the scales and biases are re-read from L1.
  const int64_t whole = cols / 32 * 32;
  const __mmask16 m = _bzhi_u32(0xffff, static_cast<unsigned>((cols - whole) % 16));
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * ld_acc;
    uint16_t* out = y + r * ld_y;
    for (int64_t c = 0; c < whole; c += 32) {
      const __m512 lo = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(scale + c), _mm512_loadu_ps(bias + c));
      const __m512 hi = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 16), _mm512_loadu_ps(scale + c + 16),
                                        _mm512_loadu_ps(bias + c + 16));
      _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    int64_t c = whole;
    if (cols - c >= 16) {
      const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(scale + c), _mm512_loadu_ps(bias + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(v));
      c += 16;
    }
    if (c < cols) {
      const __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, scale + c),
                                       _mm512_maskz_loadu_ps(m, bias + c));
      _mm256_mask_storeu_epi16(out + c, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

int64_t fp8_gemm_units(int64_t M, int64_t N) {
  return ((N + kPanel - 1) / kPanel) * ((M + kRows - 1) / kRows);
}

void fp8_gemm_bf16_avx512(const Fp8GemmArgs& a, int64_t unit_begin, int64_t unit_end) {
  const int64_t blocks = (a.M + kRows - 1) / kRows;
  const int64_t taps = a.conv ? a.conv->kh * a.conv->kw : 1;
  // Per-thread scratch, reused across calls and layers: the packed panel, a zero row for
  // the padding of convolutions, and the tile's row pointers.
  thread_local ScratchPtr<uint16_t> panel_buf, zero_buf;
  thread_local ScratchPtr<const uint16_t*> rows_buf;
  thread_local size_t panel_cap = 0, zero_cap = 0, rows_cap = 0;
  uint16_t* packed = grow(panel_buf, panel_cap, static_cast<size_t>((a.K + 1) / 2) * kPanel * 2 * 2, false);
  const uint16_t* zeros = a.conv ? grow(zero_buf, zero_cap, static_cast<size_t>(a.conv->C) * 2, true) : nullptr;
  const uint16_t** rows = grow(rows_buf, rows_cap, static_cast<size_t>(taps) * kRows * sizeof(void*), false);
  const int64_t panels = (a.N + kPanel - 1) / kPanel;
  for (int64_t u = unit_begin; u < unit_end;) {
    const int64_t panel = u / blocks, n0 = panel * kPanel;
    const int64_t first = u, last = std::min(unit_end, (panel + 1) * blocks);
    pack_panel(a.w, a.N, a.K, n0, packed);
    // While this panel computes, pull the next panel's fp8 rows into L2, a share per
    // tile: packing then decodes from cache instead of waiting on DRAM.
    const uint8_t* next = panel + 1 < panels ? a.w + (n0 + kPanel) * a.K : nullptr;
    const int64_t next_bytes = next ? std::min<int64_t>(kPanel, a.N - n0 - kPanel) * a.K : 0;
    const int64_t share = (next_bytes + (last - first) * 64 - 1) / ((last - first) * 64) * 64;
    for (; u < last; ++u) {
      if (next) {
        for (int64_t off = (u - first) * share, end = std::min(next_bytes, off + share); off < end; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
      }
      const int64_t m0 = (u % blocks) * kRows;
      switch (std::min<int64_t>(kRows, a.M - m0)) {
        case 6: run_tile<6>(a, m0, n0, packed, zeros, rows); break;
        case 5: run_tile<5>(a, m0, n0, packed, zeros, rows); break;
        case 4: run_tile<4>(a, m0, n0, packed, zeros, rows); break;
        case 3: run_tile<3>(a, m0, n0, packed, zeros, rows); break;
        case 2: run_tile<2>(a, m0, n0, packed, zeros, rows); break;
        default: run_tile<1>(a, m0, n0, packed, zeros, rows); break;
      }
    }
  }
}

bool fp8_gemm_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool fp8_brgemm_simd_supported() { return fp8_gemm_supported() && __builtin_cpu_supports("avx512vbmi"); }

}  // namespace pyext::cpu
#else
#include "fp8/fp8_e4m3.h"
#include "fp8/fp8_gemm_cpu.h"
namespace pyext::cpu {
int64_t fp8_gemm_units(int64_t, int64_t) { return 0; }
void fp8_gemm_bf16_avx512(const Fp8GemmArgs&, int64_t, int64_t) {}
bool fp8_gemm_supported() { return false; }
bool fp8_brgemm_simd_supported() { return false; }
void fp8_pack_panel_avx512(const uint8_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*, int64_t) {}
void fp8_decode_rows_avx512(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t) {}
void fp8_transpose_pairs_avx512(const uint16_t*, int64_t, int64_t, uint16_t*) {}
void fp8_epilogue_avx512(const float*, int64_t, int64_t, int64_t, const float*, const float*, uint16_t*, int64_t) {}
}  // namespace pyext::cpu
#endif
