// Per-element arithmetic of the tile blend, shared by the CPU units and the CUDA kernel so
// that they round alike. Callers multiply and add without FMA contraction (the PyTorch ops
// they mirror round the product): fp-contract=off on the CPU, __fmul_rn/__fadd_rn in CUDA.
#pragma once
#include <cstdint>

#include "common/half_rounding.h"

namespace pyext::tile_blend {
namespace {  // internal linkage, as in half_rounding.h

// Rounds an fp32 intermediate to the tile dtype and back (identity for fp32).
template <PyextDtype D> PYEXT_HOST_DEVICE inline float rnd(float v) { return DtypeIo<D>::load(DtypeIo<D>::store(v)); }

// diffusers' ramp weights for step k of an extent e: (1 - k/e, k/e) in double, then fp32,
// as PyTorch does with a Python-float scalar.
PYEXT_HOST_DEVICE inline void ramp(int64_t k, int64_t e, float& keep, float& take) {
  const double t = static_cast<double>(k) / static_cast<double>(e);
  keep = static_cast<float>(1.0 - t);
  take = static_cast<float>(t);
}

// Normalized mode's symmetric ramp weight of index k (0-based from the tile edge) inside an
// overlap of length ov: (k + 0.5) / ov, so two tiles' ramps over the same overlap sum to 1.
PYEXT_HOST_DEVICE inline float edge_weight(int64_t k, int64_t ov) {
  return k < ov ? (static_cast<float>(k) + 0.5f) / static_cast<float>(ov) : 1.0f;
}

}  // namespace
}  // namespace pyext::tile_blend
