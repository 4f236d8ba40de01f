// AVX-512 build of the tile-blend kernels: the same source, auto-vectorised with
// 16 fp32 lanes (the half_rounding.h conversions are branch-free so that they vectorise). AVX-512F implies FMA and GCC contracts a*b+c
// by default, which would change rounding versus the PyTorch ops we mirror: off.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c")
#pragma GCC optimize("fp-contract=off")
#include "tile_blend/tile_blend_cpu_impl.h"

namespace pyext::cpu {
TileBlendFn tile_blend_diffusers_avx512() { return run_diffusers; }
TileBlendFn tile_blend_normalized_avx512() { return run_normalized; }
}  // namespace pyext::cpu
#else
#include "tile_blend/tile_blend_cpu.h"
namespace pyext::cpu {
TileBlendFn tile_blend_diffusers_avx512() { return nullptr; }
TileBlendFn tile_blend_normalized_avx512() { return nullptr; }
}  // namespace pyext::cpu
#endif
