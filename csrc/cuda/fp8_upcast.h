// C launcher for the CUDA fp8 upcast kernel: plain pointers, sizes and a stream,
// so the .cu needs no torch headers (see fp8_cuda_glue.cpp for the torch side).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dst[r, c] = round(decode(src[r, c]) * scale[per_row ? r : 0]); out_type 0 bf16, 1 fp16, 2 fp32.
// Same bits as the CPU kernels (round to nearest even; NaN keeps its sign).
cudaError_t pyext_fp8_upcast_cuda(const uint8_t* src, void* dst, const float* scale, int64_t rows, int64_t cols,
                                  int per_row, int out_type, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
