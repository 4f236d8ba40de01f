// Fused tile blend for tiled VAE decode/encode: one decoded tile goes into the
// preallocated output in one pass, overlap ramps included (see pyext/ops/tile_blend.py
// for the semantics). Raw pointers only, so the SIMD units include no torch headers.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype_codes.h"

namespace pyext::cpu {

// Every tensor holds `planes` (batch * channels) contiguous row-major planes.
// Work items are (plane, tile row) pairs: item = plane * th + y.
struct TileBlendArgs {
  PyextDtype dtype;
  const void* tile; int64_t th, tw;                 // (planes, th, tw)
  void* out; int64_t out_h, out_w, oy, ox;          // (planes, out_h, out_w); tile row 0 col 0 lands at (oy, ox)
  // diffusers mode: crop, neighbour strips in, own strips out (null/0 when absent)
  int64_t crop_h, crop_w;
  const void* above; int64_t above_rows;            // (planes, above_rows, tw): bottom rows of the tile above
  const void* left; int64_t left_cols;              // (planes, th, left_cols): right columns of the tile to the left
  void* bottom; int64_t bottom_rows;                // (planes, bottom_rows, tw) <- last rows of the blended tile
  void* right; int64_t right_cols;                  // (planes, th, right_cols) <- last columns of the blended tile
  // normalized mode: overlap (ramp) lengths on each side, 0 at image edges
  int64_t ov_top, ov_bottom, ov_left, ov_right;
};

using TileBlendFn = void (*)(const TileBlendArgs& args, int64_t item_begin, int64_t item_end);

TileBlendFn tile_blend_diffusers_scalar();
TileBlendFn tile_blend_normalized_scalar();
TileBlendFn tile_blend_diffusers_avx512();
TileBlendFn tile_blend_normalized_avx512();

}  // namespace pyext::cpu
