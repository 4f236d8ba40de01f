// Portable build of the tile-blend kernels (any x86-64 / other CPUs).
#include "tile_blend/tile_blend_cpu_impl.h"

namespace pyext::cpu {
TileBlendFn tile_blend_diffusers_scalar() { return run_diffusers; }
TileBlendFn tile_blend_normalized_scalar() { return run_normalized; }
}  // namespace pyext::cpu
