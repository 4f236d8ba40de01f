// AVX-512 build of the Winograd convolution: the transforms (the same source as the other units,
// auto-vectorised over channels, 16 fp32 lanes) and a GEMM of its own over U in panels: torch's
// BLAS (MKL) runs its AVX2 code on AMD CPUs, at under half the rate of oneDNN's AVX-512
// convolutions there, which left Winograd barely ahead of them (docs/benchmarks.md, "CPU runtimes").
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
// GCC 12 flags its own AVX-512 intrinsics' deliberately undefined pass-through operands.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PYEXT_WINOGRAD_STREAM  // the transformed weight is stored with vmovntps
#define PYEXT_WINOGRAD_PANELS  // ... in panels, for gemm() below
#include <immintrin.h>

#include <array>
#include <utility>

#include "winograd/winograd_cpu_impl.h"

namespace pyext::cpu {
namespace {

constexpr int kRows = 12;        // rows of M per register tile: 12 x 2 accumulators
constexpr int64_t kDepth = 128;  // input channels per pass: a panel's 128 x 32 floats (16 KiB) stay in L1

// c[r][0:kPanel] (+)= sum_k a[r][k] * b[k][0:kPanel] for R rows and `depth` channels, b a panel's
// rows; `mask` keeps the columns that exist (the last panel's padding is never stored).
template <int R>
void tile(const float* a, int64_t lda, const float* b, int64_t depth, float* c, int64_t ldc, __mmask32 mask,
          bool accumulate) {
  const __mmask16 lo = static_cast<__mmask16>(mask), hi = static_cast<__mmask16>(mask >> 16);
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    acc[r][0] = accumulate ? _mm512_maskz_loadu_ps(lo, c + r * ldc) : _mm512_setzero_ps();
    acc[r][1] = accumulate ? _mm512_maskz_loadu_ps(hi, c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel), b1 = _mm512_loadu_ps(b + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, lo, acc[r][0]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, hi, acc[r][1]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask32, bool);

template <int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, kRows>());  // kTiles[r - 1]: r rows

// One (point, panel) pair per task: the panel's columns of M[p], pass by pass over the input
// channels (each pass's slice of the panel stays in L1 while every row block reads it).
void gemm(const float* v, const float* u, float* m, int64_t count, int64_t ci, int64_t co, int64_t task_begin,
          int64_t task_end) {
  const int64_t np = panels(co);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t p = task / np, panel = task % np, n = std::min(kPanel, co - panel * kPanel);
    const __mmask32 mask = n == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << n) - 1);
    const float* a = v + p * count * ci;
    const float* b = u + (p * np + panel) * ci * kPanel;
    float* c = m + p * count * co + panel * kPanel;
    for (int64_t k0 = 0; k0 < ci; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, ci - k0);
      for (int64_t r0 = 0; r0 < count; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, count - r0);
        kTiles[rows - 1](a + r0 * ci + k0, ci, b + k0 * kPanel, depth, c + r0 * co, co, mask, k0 > 0);
      }
    }
  }
}

}  // namespace

WinogradKernels winograd_avx512() { return {kKernels.weight, kKernels.input, kKernels.output, gemm}; }
}  // namespace pyext::cpu
#else
#include "winograd/winograd_cpu.h"
namespace pyext::cpu {
WinogradKernels winograd_avx512() { return {nullptr, nullptr, nullptr}; }
}  // namespace pyext::cpu
#endif
