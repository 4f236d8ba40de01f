// Body of the Winograd transforms, compiled by the scalar, AVX2 and AVX-512 units with their
// own target flags (anonymous namespace: each unit keeps its own copy). Every loop runs over a
// block of channels, the innermost dimension of the channels-last tensors, so it vectorises.
// The matrices are Lavin and Gray's for F(4x4, 3x3) (interpolation points 0, ±1, ±2, ∞).
#pragma once
#include <algorithm>
#include <cstdint>

#include "winograd/winograd_cpu.h"
#ifdef PYEXT_WINOGRAD_STREAM
#include <immintrin.h>
#endif

namespace pyext::cpu {
namespace {

constexpr int64_t kBlock = 64;  // channels per pass: 36 x 64 floats stay in L1 (whole panels of U)
static_assert(kBlock % kPanel == 0);
constexpr int64_t kIn = 6;      // input tile side

// One tile's input window (6x6, zero outside the image) -> B^T d B for channels [c0, c0 + cw).
inline void input_tile(const WinogradArgs& a, float* v, int64_t chunk, int64_t t, int64_t local, int64_t c0,
                       int64_t cw) {
  const int64_t tx = t % a.tiles_x, ty = (t / a.tiles_x) % a.tiles_y, img = t / (a.tiles_x * a.tiles_y);
  const int64_t y0 = ty * kWinogradTile - 1, x0 = tx * kWinogradTile - 1;
  float d[kIn][kIn][kBlock];
  for (int64_t i = 0; i < kIn; ++i) {
    const int64_t yy = y0 + i;
    for (int64_t j = 0; j < kIn; ++j) {
      const int64_t xx = x0 + j;
      float* dst = d[i][j];
      if (yy < 0 || yy >= a.h || xx < 0 || xx >= a.w) {
        for (int64_t c = 0; c < cw; ++c) dst[c] = 0.0f;
      } else {
        const float* src = a.x + ((img * a.h + yy) * a.w + xx) * a.ci + c0;
        for (int64_t c = 0; c < cw; ++c) dst[c] = src[c];
      }
    }
  }
  // Rows, then columns, of B^T d B, in place per 6-vector.
  float r[kIn][kBlock];
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t k = 0; k < kIn; ++k) {
      for (int64_t c = 0; c < cw; ++c) {
        float e[kIn];
        for (int64_t i = 0; i < kIn; ++i) e[i] = pass == 0 ? d[i][k][c] : d[k][i][c];
        r[0][c] = 4.0f * e[0] - 5.0f * e[2] + e[4];
        r[1][c] = -4.0f * (e[1] + e[2]) + e[3] + e[4];
        r[2][c] = 4.0f * (e[1] - e[2]) - e[3] + e[4];
        r[3][c] = 2.0f * (e[3] - e[1]) - e[2] + e[4];
        r[4][c] = 2.0f * (e[1] - e[3]) - e[2] + e[4];
        r[5][c] = 4.0f * e[1] - 5.0f * e[3] + e[5];
      }
      for (int64_t i = 0; i < kIn; ++i)
        for (int64_t c = 0; c < cw; ++c) (pass == 0 ? d[i][k][c] : d[k][i][c]) = r[i][c];
    }
  }
  for (int64_t i = 0; i < kIn; ++i)
    for (int64_t j = 0; j < kIn; ++j) {
      float* dst = v + ((i * kIn + j) * chunk + local) * a.ci + c0;
      for (int64_t c = 0; c < cw; ++c) dst[c] = d[i][j][c];
    }
}

void input_transform(const WinogradArgs& a, float* v, int64_t first, int64_t chunk, int64_t t_begin, int64_t t_end) {
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t c0 = 0; c0 < a.ci; c0 += kBlock) input_tile(a, v, chunk, t, t - first, c0, std::min(kBlock, a.ci - c0));
}

// A^T m A for one tile's 36 points of channels [c0, c0 + cw), plus bias, into y (cropped at the
// edges). bad[c] turns NaN once any value written is not finite (x - x is 0 only for finite x).
inline void output_tile(const WinogradArgs& a, const float* m, int64_t chunk, int64_t t, int64_t local, int64_t c0,
                        int64_t cw, float* bad) {
  const int64_t tx = t % a.tiles_x, ty = (t / a.tiles_x) % a.tiles_y, img = t / (a.tiles_x * a.tiles_y);
  float s[kIn][kIn][kBlock];
  for (int64_t i = 0; i < kIn; ++i)
    for (int64_t j = 0; j < kIn; ++j) {
      const float* src = m + ((i * kIn + j) * chunk + local) * a.co + c0;
      for (int64_t c = 0; c < cw; ++c) s[i][j][c] = src[c];
    }
  float o[kWinogradTile][kIn][kBlock];  // A^T applied along i
  for (int64_t j = 0; j < kIn; ++j)
    for (int64_t c = 0; c < cw; ++c) {
      const float e0 = s[0][j][c], e1 = s[1][j][c], e2 = s[2][j][c], e3 = s[3][j][c], e4 = s[4][j][c],
                  e5 = s[5][j][c];
      const float p12 = e1 + e2, m12 = e1 - e2, p34 = e3 + e4, m34 = e3 - e4;
      o[0][j][c] = e0 + p12 + p34;
      o[1][j][c] = m12 + 2.0f * m34;
      o[2][j][c] = p12 + 4.0f * p34;
      o[3][j][c] = m12 + 8.0f * m34 + e5;
    }
  for (int64_t i = 0; i < kWinogradTile; ++i) {
    const int64_t yy = ty * kWinogradTile + i;
    if (yy >= a.h) break;
    float q[kWinogradTile][kBlock];  // then along j
    for (int64_t c = 0; c < cw; ++c) {
      const float e0 = o[i][0][c], e1 = o[i][1][c], e2 = o[i][2][c], e3 = o[i][3][c], e4 = o[i][4][c],
                  e5 = o[i][5][c];
      const float p12 = e1 + e2, m12 = e1 - e2, p34 = e3 + e4, m34 = e3 - e4;
      const float b = a.bias ? a.bias[c0 + c] : 0.0f;
      q[0][c] = e0 + p12 + p34 + b;
      q[1][c] = m12 + 2.0f * m34 + b;
      q[2][c] = p12 + 4.0f * p34 + b;
      q[3][c] = m12 + 8.0f * m34 + e5 + b;
    }
    for (int64_t j = 0; j < kWinogradTile; ++j) {
      const int64_t xx = tx * kWinogradTile + j;
      if (xx >= a.w) break;
      float* dst = a.y + ((img * a.h + yy) * a.w + xx) * a.co + c0;
      for (int64_t c = 0; c < cw; ++c) {
        dst[c] = q[j][c];
        bad[c] += q[j][c] - q[j][c];
      }
    }
  }
}

bool output_transform(const WinogradArgs& a, const float* m, int64_t first, int64_t chunk, int64_t t_begin,
                      int64_t t_end) {
  float bad[kBlock] = {};
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t c0 = 0; c0 < a.co; c0 += kBlock)
      output_tile(a, m, chunk, t, t - first, c0, std::min(kBlock, a.co - c0), bad);
  for (float b : bad)
    if (b != b) return false;
  return true;
}

// G's rows applied to 3 blocks of channels (G: 6x3, points 0, ±1, ±2, ∞).
inline void g_rows(const float* g0, const float* g1, const float* g2, float (*out)[kBlock], int64_t cw) {
  for (int64_t c = 0; c < cw; ++c) {
    const float even = (g0[c] + g2[c]) * (-1.0f / 6.0f), odd = g1[c] * (-1.0f / 6.0f);
    const float even2 = g0[c] * (1.0f / 24.0f) + g2[c] * (1.0f / 6.0f), odd2 = g1[c] * (1.0f / 12.0f);
    out[0][c] = 0.25f * g0[c];
    out[1][c] = even + odd;
    out[2][c] = even - odd;
    out[3][c] = even2 + odd2;
    out[4][c] = even2 - odd2;
    out[5][c] = g2[c];
  }
}

// U is larger than the caches and is next read by the GEMM: stores that bypass the cache save
// the read-for-ownership of every line. Units that target AVX define PYEXT_WINOGRAD_STREAM
// (dst 32-byte aligned, n a multiple of 8; plain stores otherwise).
inline void store_streaming(float* dst, const float* src, int64_t n) {
#ifdef PYEXT_WINOGRAD_STREAM
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0 && n % 8 == 0) {
    for (int64_t c = 0; c < n; c += 8) _mm256_stream_ps(dst + c, _mm256_loadu_ps(src + c));
    return;
  }
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c];
}

// Without PYEXT_WINOGRAD_PANELS, U is stored (ci, 36, co): torch's batched GEMM reads U[p] as a
// (ci, co) matrix with row stride 36 co, and the transform writes one input channel's 36 points
// close together (faster than 36 planes apart, measured on SD's channel counts). With it,
// U is in panels (36, panels, ci, kPanel) for the unit's own GEMM, the padding columns zero.
inline void store_u(float* u, const float* r, int64_t i, int64_t p, int64_t c0, int64_t cw, int64_t ci, int64_t co) {
#ifdef PYEXT_WINOGRAD_PANELS
  // c0 is a multiple of kBlock, itself a multiple of kPanel: the block covers whole panels
  for (int64_t c = 0; c < cw; c += kPanel) {
    float* dst = u + ((p * panels(co) + (c0 + c) / kPanel) * ci + i) * kPanel;
    const int64_t n = std::min(kPanel, cw - c);
    if (n == kPanel) {
      store_streaming(dst, r + c, kPanel);
    } else {
      for (int64_t k = 0; k < kPanel; ++k) dst[k] = k < n ? r[c + k] : 0.0f;
    }
  }
#else
  store_streaming(u + (i * kWinogradPoints + p) * co + c0, r, cw);
#endif
}

void weight_transform(const float* g, float* u, int64_t ci, int64_t co, int64_t ci_begin, int64_t ci_end) {
  const int64_t plane = ci * co;  // one (kh, kw) slice of g
  float t[3][kIn][kBlock], r[kIn][kBlock];
  for (int64_t i = ci_begin; i < ci_end; ++i)
    for (int64_t c0 = 0; c0 < co; c0 += kBlock) {
      const int64_t cw = std::min(kBlock, co - c0);
      const float* k = g + i * co + c0;  // k + (kh * 3 + kw) * plane: tap (kh, kw)
      for (int64_t kw = 0; kw < 3; ++kw) g_rows(k + kw * plane, k + (3 + kw) * plane, k + (6 + kw) * plane, t[kw], cw);
      for (int64_t p = 0; p < kIn; ++p) {
        g_rows(t[0][p], t[1][p], t[2][p], r, cw);
        for (int64_t q = 0; q < kIn; ++q) store_u(u, r[q], i, p * kIn + q, c0, cw, ci, co);
      }
    }
#ifdef PYEXT_WINOGRAD_STREAM
  _mm_sfence();  // the streamed stores are visible before the GEMM reads U
#endif
}

constexpr WinogradKernels kKernels{weight_transform, input_transform, output_transform};

}  // namespace
}  // namespace pyext::cpu
