// Portable fp8 row kernels: the shared decode (fp8_e4m3.h) and narrowing (half_rounding.h),
// bit-exact with the SIMD kernels (and the PyTorch reference) for every input, NaN included.
#include "common/half_rounding.h"
#include "fp8/fp8_convert_cpu.h"
#include "fp8/fp8_e4m3.h"

namespace pyext::cpu {
namespace {

struct DecodeTable {
  float value[256];
  DecodeTable() { for (uint32_t c = 0; c < 256; ++c) value[c] = fp8_e4m3_decode(c); }
};

template <PyextDtype kOut>
void rows_scalar(const uint8_t* src, void* dst, int64_t n, float scale, bool /*stream*/) {
  static const DecodeTable table;
  for (int64_t i = 0; i < n; ++i) {
    // A NaN code keeps its own NaN whatever the scale: for NaN * NaN, x86 returns whichever
    // operand the compiler put first.
    const float d = table.value[src[i]];
    const float v = d != d ? d : d * scale;
    if constexpr (kOut == PYEXT_F32) static_cast<float*>(dst)[i] = v;
    else if constexpr (kOut == PYEXT_BF16) static_cast<uint16_t*>(dst)[i] = float_to_bf16(v);
    else static_cast<uint16_t*>(dst)[i] = float_to_fp16(v);
  }
}

}  // namespace

Fp8RowFn fp8_row_kernel_scalar(PyextDtype out) {
  switch (out) {
    case PYEXT_BF16: return rows_scalar<PYEXT_BF16>;
    case PYEXT_F16: return rows_scalar<PYEXT_F16>;
    default: return rows_scalar<PYEXT_F32>;
  }
}

}  // namespace pyext::cpu
