// GEGLU on raw pointers, so the SIMD units include no torch headers (semantics: pyext/ops/geglu.py):
// y[r, j] = a * gelu(g) with a = x[r, j], g = x[r, D + j] and gelu(g) = g / 2 * (1 + erf(g / sqrt 2)),
// computed in fp32 and rounded once.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype_codes.h"

namespace pyext::cpu {

struct GegluArgs {
  PyextDtype dtype;  // of x and y
  const void* x;     // (rows, 2 * D), rows x_stride elements apart, each row's 2 * D contiguous
  void* y;           // (rows, D) contiguous
  int64_t rows, D, x_stride;
};

// Writes y[row, begin:end].
using GegluSpan = void (*)(const GegluArgs& a, int64_t row, int64_t begin, int64_t end);

GegluSpan geglu_span_scalar(PyextDtype dtype);
GegluSpan geglu_span_avx2(PyextDtype dtype);
GegluSpan geglu_span_avx512(PyextDtype dtype);

}  // namespace pyext::cpu
