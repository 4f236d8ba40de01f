// Winograd F(4x4, 3x3) convolution on the CPU: the transforms around the batched GEMM that
// torch's BLAS runs (winograd_ops.cpp). Raw pointers only, so the SIMD units include no
// torch headers. Layouts: x and y channels-last (N, H, W, C); each of the 36 Winograd points is
// one GEMM: V (36, tiles, Ci) @ U (36, Ci, Co) = M (36, tiles, Co), with U stored (Ci, 36, Co)
// and V, M stored as shown. fp32 only.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"

namespace pyext::cpu {

constexpr int64_t kWinogradTile = 4;    // output pixels per tile side
constexpr int64_t kWinogradPoints = 36;  // (4 + 3 - 1)^2

struct WinogradArgs {
  const float* x;        // (n, h, w, ci) input, zero padding 1 on every side implied
  float* y;              // (n, h, w, co) output (stride 1, padding 1: same size)
  const float* bias;     // (co) or null
  int64_t n, h, w, ci, co;
  int64_t tiles_y, tiles_x;  // ceil(h / 4), ceil(w / 4): tile t = (img * tiles_y + ty) * tiles_x + tx
};

// Tiles [t_begin, t_end) of one chunk starting at tile `first`: V[p][t - first][c].
using WinogradInputFn = void (*)(const WinogradArgs& a, float* v, int64_t first, int64_t chunk,
                                 int64_t t_begin, int64_t t_end);
// y for tiles [t_begin, t_end) from M[p][t - first][c], plus bias; false when a value written is
// not finite (the caller then recomputes directly: Winograd spreads an inf over a whole tile).
using WinogradOutputFn = bool (*)(const WinogradArgs& a, const float* m, int64_t first, int64_t chunk,
                                  int64_t t_begin, int64_t t_end);

// U[ci][p][co] = (G g G^T)[p] for input channels [ci_begin, ci_end), from the weight stored
// (3, 3, ci, co), so that co is innermost in both.
using WinogradWeightFn = void (*)(const float* g, float* u, int64_t ci, int64_t co, int64_t ci_begin,
                                  int64_t ci_end);

struct WinogradKernels {
  WinogradWeightFn weight;
  WinogradInputFn input;
  WinogradOutputFn output;
};

WinogradKernels winograd_scalar();
WinogradKernels winograd_avx2();    // null members where not compiled
WinogradKernels winograd_avx512();

}  // namespace pyext::cpu
