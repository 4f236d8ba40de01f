// fp8 (e4m3fn) -> bf16/fp16/fp32 row kernels: dst[i] = round(decode(src[i]) * scale).
// Plain C++ on raw pointers so the SIMD units include no torch headers.
//
// Rounding is IEEE round-to-nearest-even from the exact fp32 product, as in the
// PyTorch reference. NaN codes (0x7f, 0xff) decode to the fp32 NaN 0x7ff00000
// with their sign, which narrows to fp16 0x7f80 and bf16 0x7ff0 (sign kept), whatever the
// scale; a NaN scale times a code that is not NaN gives the scale's NaN, quieted.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype_codes.h"

namespace pyext::cpu {

// stream: the output is large and not read back soon (a whole-weight upcast), so the
// kernel may use non-temporal stores that skip the read-for-ownership of each line.
using Fp8RowFn = void (*)(const uint8_t* src, void* dst, int64_t n, float scale, bool stream);

Fp8RowFn fp8_row_kernel_scalar(PyextDtype out);
Fp8RowFn fp8_row_kernel_avx2(PyextDtype out);
Fp8RowFn fp8_row_kernel_avx512(PyextDtype out);

inline Fp8RowFn fp8_row_kernel(PyextDtype out, SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return fp8_row_kernel_avx512(out);
    case SimdLevel::kAvx2: return fp8_row_kernel_avx2(out);
    default: return fp8_row_kernel_scalar(out);
  }
}

// The SIMD kernels multiply by scale * 256, which is exact unless it overflows;
// rows with a larger (or NaN) scale take the scalar path.
inline bool scale_is_simd_safe(float scale) { return scale > -1.0e36f && scale < 1.0e36f; }

}  // namespace pyext::cpu
