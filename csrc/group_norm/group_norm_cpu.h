// GroupNorm with an optional per-(n, c) pre-add (`shift`) and fused SiLU, on raw pointers so
// the SIMD units include no torch headers (semantics: pyext/ops/group_norm.py).
//
// Two passes over x. Pass 1 (`stats`) writes the moments of fixed chunks of every (n, group);
// `finish` merges them per group in a fixed order and folds mean, rstd, weight, bias and shift
// into per-(n, c) constants; pass 2 (`apply`) writes y. The chunks depend on the shape alone,
// so the result does not depend on how at::parallel_for splits the items among threads.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype_codes.h"

namespace pyext::cpu {

struct GroupNormArgs {
  PyextDtype dtype;                             // of x, y and shift
  const void* x;                                // channels-first (N, C, S) or channels-last (N, S, C)
  void* y;                                      // same layout as x
  int64_t N, C, S, G;                           // S: product of the spatial sizes; C % G == 0
  bool channels_last, silu;
  const void* weight; PyextDtype weight_dtype;  // (C,) or null (1)
  const void* bias; PyextDtype bias_dtype;      // (C,) or null (0)
  const void* shift;                            // (N, C) added to x before the norm, or null
  double eps;
  // The fixed partition. Channels-first: a group is Cg * S contiguous elements, cut into `chunks`
  // chunks of `chunk` elements; channels-last: a sample is S rows of C, cut into `chunks` blocks
  // of `chunk` rows. `apply_block`: elements per apply item of a channels-first plane.
  int64_t chunk, chunks, apply_block;
};

// Moments of a set of elements: count, mean, sum of squared deviations from the mean.
struct Moments {
  double count, mean, m2;
};

// Per (n, c), each (N, C): y = ((x + shift) - mean_hi) * scale + offset, then SiLU. x + shift is
// the value the statistics are of (rounded to fp32, as the reference computes it); mean_hi is its
// group's mean rounded to fp32, the rounding error folded into offset, so the subtraction cancels
// exactly where values sit close to a large mean (a large mean over a small spread stays accurate).
struct ChannelParams {
  float* shift;
  float* mean_hi;
  float* scale;
  float* offset;
};

// group_moments: the moments of every (n, group) of a 4-D x whose pixels each hold their C
// channels contiguously, and each row its pixels (channels-last, or a crop of a channels-last
// tensor: a tile's own pixels inside its window). Items are blocks of `rows` rows by `cols`
// columns of one sample, fixed by the shape alone, so the result does not depend on the threads.
struct MomentsArgs {
  PyextDtype dtype;
  const void* x;
  int64_t N, C, H, W, G;
  int64_t sample_stride, row_stride;  // in elements
  int64_t rows, cols, row_blocks, col_blocks;
};

struct GroupNormKernel {
  // Stats items: channels-first item (n * G + g) * chunks + k writes parts[item];
  // channels-last item n * chunks + k (a block of rows) writes parts[item * G + g] for every g.
  void (*stats)(const GroupNormArgs& a, Moments* parts, int64_t begin, int64_t end);
  // Merges each group's parts in order and fills p (serial: N * G * chunks merges).
  void (*finish)(const GroupNormArgs& a, const Moments* parts, const ChannelParams& p);
  // Apply items: channels-first (n * C + c) * ceil(S / apply_block) + b; channels-last as stats.
  void (*apply)(const GroupNormArgs& a, const ChannelParams& p, int64_t begin, int64_t end);
  // group_moments: item (n * row_blocks + block row) * col_blocks + block column writes
  // parts[item * G + g] for every g; merge_moments merges each (n, g)'s parts in item order into
  // mean and m2, each (N, G).
  void (*moments)(const MomentsArgs& a, Moments* parts, int64_t begin, int64_t end);
  void (*merge_moments)(const MomentsArgs& a, const Moments* parts, double* mean, double* m2);
};

// The kernels for x's dtype, from each SIMD unit (the AVX2/AVX-512 units fall back to the
// scalar one where the compiler cannot target them).
GroupNormKernel group_norm_kernel_scalar(PyextDtype dtype);
GroupNormKernel group_norm_kernel_avx2(PyextDtype dtype);
GroupNormKernel group_norm_kernel_avx512(PyextDtype dtype);

}  // namespace pyext::cpu
