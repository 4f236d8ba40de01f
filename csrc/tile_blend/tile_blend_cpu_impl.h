// Body of the CPU tile-blend kernels, included by tile_blend_cpu_scalar.cpp and
// tile_blend_cpu_avx512.cpp, which compile it with different target flags. It lives in
// an anonymous namespace so each unit keeps its own instantiation (no ODR merge
// of an AVX-512 copy into the portable path).
//
// Rounding mirrors the PyTorch ops it replaces: diffusers' blend_v/blend_h compute
// a * w_a and b * w_b as separate dtype tensors and add them (each op in fp32, rounded
// to the dtype), so we round after each step too; fp32 is then bit-exact. No FMA
// contraction (see tile_blend_cpu_avx512.cpp). The per-element arithmetic is tile_blend_math.h.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>

#include "tile_blend/tile_blend_cpu.h"
#include "tile_blend/tile_blend_math.h"

namespace pyext::cpu {
namespace {

using tile_blend::edge_weight;
using tile_blend::ramp;
using tile_blend::rnd;
template <PyextDtype D> using Io = DtypeIo<D>;

template <PyextDtype D>
void diffusers_items(const TileBlendArgs& a, int64_t begin, int64_t end) {
  using T = typename Io<D>::T;
  const T* tile = static_cast<const T*>(a.tile);
  const T* above = static_cast<const T*>(a.above);
  const T* left = static_cast<const T*>(a.left);
  T* out = static_cast<T*>(a.out);
  T* bottom = static_cast<T*>(a.bottom);
  T* right = static_cast<T*>(a.right);
  const int64_t ev = above ? std::min(a.above_rows, a.th) : 0;  // blend_v extent
  const int64_t eh = left ? std::min(a.left_cols, a.tw) : 0;    // blend_h extent
  // Plain arrays, not std::vector: GCC 13 cannot inline std::allocator's always_inline members
  // into the implicit destructors generated under a SIMD unit's `#pragma GCC target`.
  const std::unique_ptr<float[]> wl(new float[eh]), wn(new float[eh]), row(new float[a.tw]);
  for (int64_t x = 0; x < eh; ++x) ramp(x, eh, wl[x], wn[x]);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item / a.th, y = item % a.th;
    const T* t = tile + (p * a.th + y) * a.tw;
    if (y < ev) {  // blend_v with the (already blended) tile above
      float wk, wnew;
      ramp(y, ev, wk, wnew);
      const T* ab = above + (p * a.above_rows + a.above_rows - ev + y) * a.tw;
      for (int64_t x = 0; x < a.tw; ++x)
        row[x] = rnd<D>(rnd<D>(Io<D>::load(ab[x]) * wk) + rnd<D>(Io<D>::load(t[x]) * wnew));
    } else {
      for (int64_t x = 0; x < a.tw; ++x) row[x] = Io<D>::load(t[x]);
    }
    if (eh) {  // then blend_h with the (already blended) tile to the left
      const T* lf = left + (p * a.th + y) * a.left_cols + a.left_cols - eh;
      for (int64_t x = 0; x < eh; ++x)
        row[x] = rnd<D>(rnd<D>(Io<D>::load(lf[x]) * wl[x]) + rnd<D>(row[x] * wn[x]));
    }
    if (y < a.crop_h) {
      T* o = out + (p * a.out_h + a.oy + y) * a.out_w + a.ox;
      for (int64_t x = 0; x < a.crop_w; ++x) o[x] = Io<D>::store(row[x]);
    }
    if (y >= a.th - a.bottom_rows) {
      T* b = bottom + (p * a.bottom_rows + y - (a.th - a.bottom_rows)) * a.tw;
      for (int64_t x = 0; x < a.tw; ++x) b[x] = Io<D>::store(row[x]);
    }
    if (a.right_cols) {
      T* r = right + (p * a.th + y) * a.right_cols;
      const float* src = row.get() + a.tw - a.right_cols;
      for (int64_t x = 0; x < a.right_cols; ++x) r[x] = Io<D>::store(src[x]);
    }
  }
}

template <PyextDtype D>
void normalized_items(const TileBlendArgs& a, int64_t begin, int64_t end) {
  using T = typename Io<D>::T;
  const T* tile = static_cast<const T*>(a.tile);
  T* out = static_cast<T*>(a.out);
  const std::unique_ptr<float[]> wx(new float[a.tw]);
  for (int64_t x = 0; x < a.tw; ++x) wx[x] = edge_weight(x, a.ov_left) * edge_weight(a.tw - 1 - x, a.ov_right);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item / a.th, y = item % a.th;
    const float wy = edge_weight(y, a.ov_top) * edge_weight(a.th - 1 - y, a.ov_bottom);
    const T* t = tile + (p * a.th + y) * a.tw;
    T* o = out + (p * a.out_h + a.oy + y) * a.out_w + a.ox;
    for (int64_t x = 0; x < a.tw; ++x) {
      const float w = wy * wx[x];
      o[x] = Io<D>::store(Io<D>::load(o[x]) + Io<D>::load(t[x]) * w);
    }
  }
}

inline void run_diffusers(const TileBlendArgs& a, int64_t b, int64_t e) {
  switch (a.dtype) {
    case PYEXT_F32: return diffusers_items<PYEXT_F32>(a, b, e);
    case PYEXT_F16: return diffusers_items<PYEXT_F16>(a, b, e);
    case PYEXT_BF16: return diffusers_items<PYEXT_BF16>(a, b, e);
  }
}

inline void run_normalized(const TileBlendArgs& a, int64_t b, int64_t e) {
  switch (a.dtype) {
    case PYEXT_F32: return normalized_items<PYEXT_F32>(a, b, e);
    case PYEXT_F16: return normalized_items<PYEXT_F16>(a, b, e);
    case PYEXT_BF16: return normalized_items<PYEXT_BF16>(a, b, e);
  }
}

}  // namespace
}  // namespace pyext::cpu
