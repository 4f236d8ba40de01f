// Winograd F(4x4, 3x3) convolution on the CPU: the transforms around the 36 GEMMs, one per
// Winograd point (winograd_ops.cpp). Raw pointers only, so the SIMD units include no torch
// headers. Layouts: x and y channels-last (N, H, W, C); V (36, tiles, Ci) @ U (36, Ci, Co) =
// M (36, tiles, Co), with V and M stored as shown. U is stored as the unit's GEMM reads it:
// (Ci, 36, Co) for torch's batched GEMM where the unit has no GEMM of its own, or in panels of
// kPanel output channels, (36, ceil(Co / kPanel), Ci, kPanel) zero-padded, for the unit's GEMM.
// fp32 only.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"

namespace pyext::cpu {

constexpr int64_t kWinogradTile = 4;    // output pixels per tile side
constexpr int64_t kWinogradPoints = 36;  // (4 + 3 - 1)^2
constexpr int64_t kPanel = 32;           // output channels per panel of U (two AVX-512 vectors)

inline int64_t panels(int64_t co) { return (co + kPanel - 1) / kPanel; }

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

// U = (G g G^T)[p] for input channels [ci_begin, ci_end), from the weight stored (3, 3, ci, co),
// so that co is innermost in both; U in the unit's layout (see above).
using WinogradWeightFn = void (*)(const float* g, float* u, int64_t ci, int64_t co, int64_t ci_begin,
                                  int64_t ci_end);

// M[p] = V[p] @ U[p] for the (point, panel) pairs [task_begin, task_end) of 36 * panels(co),
// U in panels: each pair writes kPanel columns of M[p] (fewer in the last panel).
using WinogradGemmFn = void (*)(const float* v, const float* u, float* m, int64_t count, int64_t ci, int64_t co,
                                int64_t task_begin, int64_t task_end);

struct WinogradKernels {
  WinogradWeightFn weight;
  WinogradInputFn input;
  WinogradOutputFn output;
  WinogradGemmFn gemm = nullptr;  // null: U is (Ci, 36, Co) and torch's batched GEMM runs
};

WinogradKernels winograd_scalar();
WinogradKernels winograd_avx2();    // null members where not compiled
WinogradKernels winograd_avx512();

}  // namespace pyext::cpu
