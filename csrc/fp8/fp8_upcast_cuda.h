// C launcher for the CUDA fp8 upcast kernel: plain pointers, sizes and a stream,
// so the .cu needs no torch headers (see fp8_cuda_glue.cpp for the torch side).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "common/dtype_codes.h"

#ifdef __cplusplus
extern "C" {
#endif

// dst[r, c] = round(decode(src[r, c]) * scale[per_row ? r : 0]) in out_type.
// Same bits as the CPU kernels (round to nearest even; NaN keeps its sign).
cudaError_t pyext_fp8_upcast_cuda(const uint8_t* src, void* dst, const float* scale, int64_t rows, int64_t cols,
                                  int per_row, PyextDtype out_type, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
