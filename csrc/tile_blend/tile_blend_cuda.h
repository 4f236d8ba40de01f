// C launcher for the CUDA tile blend: plain pointers, sizes and a stream, so the
// .cu needs no torch headers (tile_blend_cuda_glue.cpp is the torch side). Semantics:
// pyext/ops/tile_blend.py (same as the CPU kernel in tile_blend_cpu_impl.h).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "common/dtype_codes.h"

#ifdef __cplusplus
extern "C" {
#endif

// All tensors hold `planes` contiguous row-major planes.
// diffusers mode: blend_v with the last rows of `above` (null: none), blend_h with the last
// columns of `left`, write the crop to out at (oy, ox), the last rows/cols to bottom/right.
cudaError_t pyext_tile_blend_diffusers_cuda(PyextDtype dtype, const void* tile, int64_t planes, int64_t th, int64_t tw,
                                            void* out, int64_t out_h, int64_t out_w, int64_t oy, int64_t ox,
                                            int64_t crop_h, int64_t crop_w, const void* above, int64_t above_rows,
                                            const void* left, int64_t left_cols, void* bottom, int64_t bottom_rows,
                                            void* right, int64_t right_cols, cudaStream_t stream);

// normalized mode: out[oy + y, ox + x] += w(y, x) * tile[y, x] with symmetric edge ramps.
cudaError_t pyext_tile_blend_normalized_cuda(PyextDtype dtype, const void* tile, int64_t planes, int64_t th, int64_t tw,
                                             void* out, int64_t out_h, int64_t out_w, int64_t oy, int64_t ox,
                                             int64_t ov_top, int64_t ov_bottom, int64_t ov_left, int64_t ov_right,
                                             cudaStream_t stream);

#ifdef __cplusplus
}
#endif
