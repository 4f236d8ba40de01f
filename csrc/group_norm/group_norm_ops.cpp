// Torch glue for GroupNorm (+ shift, + SiLU): schema of torch.ops.pyext_C.group_norm and its CPU
// implementation. User-facing validation lives in pyext/ops/group_norm.py; the TORCH_CHECKs here
// only keep the raw-pointer kernels inside their buffers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common/dtype_codes_torch.h"
#include "group_norm/group_norm_cpu.h"

namespace pyext::cpu {
namespace {

constexpr const char* kOp = "pyext group_norm";
// A stats chunk's fp32 values stay in L1 / L2 for the second pass: kChunk elements channels-first;
// channels-last blocks of whole rows, about kBlock elements in kMinRows..kMaxRows rows (each block
// also does per-channel and per-group work, which few rows would not amortise; the per-channel
// fp32 sums run over at most kMaxRows rows).
constexpr int64_t kChunk = 4096, kBlock = 32768, kMinRows = 8, kMaxRows = 256;
constexpr int64_t kApplyBlock = 4096;  // channels-first apply item: part of one plane
constexpr int64_t kTaskElems = 32768;   // at::parallel_for grain, in elements

GroupNormKernel kernel_for_level(PyextDtype dtype) {
  switch (simd_level()) {
    case SimdLevel::kAvx512: return group_norm_kernel_avx512(dtype);
    case SimdLevel::kAvx2: return group_norm_kernel_avx2(dtype);
    default: return group_norm_kernel_scalar(dtype);
  }
}

int64_t grain(int64_t elems_per_item) { return std::max<int64_t>(1, kTaskElems / std::max<int64_t>(1, elems_per_item)); }

// weight / bias: (C,) contiguous, x's dtype or float32.
const void* param(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name, PyextDtype& dtype) {
  if (!t) return nullptr;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(1) && t->is_contiguous() && t->device() == x.device() &&
                  (t->scalar_type() == x.scalar_type() || t->scalar_type() == at::kFloat),
              kOp, ": ", name, " must be a contiguous (C,) tensor of x's dtype or float32 on x's device");
  dtype = dtype_code(t->scalar_type(), kOp);
  return t->data_ptr();
}

at::Tensor group_norm_cpu(const at::Tensor& x, int64_t num_groups, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& shift, double eps,
                          bool silu) {
  TORCH_CHECK(x.dim() >= 2, kOp, ": x must be (N, C, *spatial)");
  GroupNormArgs a{};
  a.dtype = dtype_code(x.scalar_type(), kOp);
  a.N = x.size(0);
  a.C = x.size(1);
  a.S = 1;
  for (int64_t d = 2; d < x.dim(); ++d) a.S *= x.size(d);
  a.G = num_groups;
  TORCH_CHECK(a.G >= 1 && a.C % a.G == 0, kOp, ": num_groups must divide the channels");
  // A tensor that is both (C == 1, or one pixel) takes the channels-first path.
  a.channels_last = !x.is_contiguous() && ((x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
                                           (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)));
  TORCH_CHECK(x.is_contiguous() || a.channels_last, kOp, ": x must be contiguous or channels-last");
  at::Tensor y = at::empty_like(x);  // x's strides: both are dense
  if (x.numel() == 0) return y;
  a.x = x.data_ptr();
  a.y = y.data_ptr();
  a.silu = silu;
  a.eps = eps;
  a.weight = param(weight, x, "weight", a.weight_dtype);
  a.bias = param(bias, x, "bias", a.bias_dtype);
  if (shift) {
    TORCH_CHECK(shift->dim() == 2 && shift->size(0) == a.N && shift->size(1) == a.C && shift->is_contiguous() &&
                    shift->scalar_type() == x.scalar_type() && shift->device() == x.device(),
                kOp, ": shift must be a contiguous (N, C) tensor of x's dtype on x's device");
    a.shift = shift->data_ptr();
  }

  int64_t stats_items, stats_elems, apply_items, apply_elems, part_count;
  if (a.channels_last) {
    a.chunk = std::clamp<int64_t>(kBlock / a.C, kMinRows, kMaxRows);
    a.chunks = (a.S + a.chunk - 1) / a.chunk;
    stats_items = apply_items = a.N * a.chunks;
    stats_elems = apply_elems = a.chunk * a.C;
    part_count = stats_items * a.G;
  } else {
    const int64_t len = a.C / a.G * a.S;
    a.chunk = kChunk;
    a.chunks = (len + kChunk - 1) / kChunk;
    stats_items = part_count = a.N * a.G * a.chunks;
    stats_elems = std::min(len, kChunk);
    a.apply_block = kApplyBlock;
    apply_items = a.N * a.C * ((a.S + kApplyBlock - 1) / kApplyBlock);
    apply_elems = std::min(a.S, kApplyBlock);
  }
  const GroupNormKernel k = kernel_for_level(a.dtype);
  std::vector<Moments> parts(part_count);
  const int64_t nc = a.N * a.C;
  std::vector<float> values(4 * nc);
  const ChannelParams p{values.data(), values.data() + nc, values.data() + 2 * nc, values.data() + 3 * nc};
  at::parallel_for(0, stats_items, grain(stats_elems), [&](int64_t b, int64_t e) { k.stats(a, parts.data(), b, e); });
  k.finish(a, parts.data(), p);
  at::parallel_for(0, apply_items, grain(apply_elems), [&](int64_t b, int64_t e) { k.apply(a, p, b, e); });
  return y;
}

// group_moments' blocks: at most kMomentPixels pixels (the per-channel fp32 sums run over no more),
// whole rows where a row is that short.
constexpr int64_t kMomentPixels = 256;

// (mean, m2), each (N, G) float64: the mean and the sum of squared deviations from it of every
// (sample, group) of x, whose pixels hold their channels contiguously and rows their pixels.
std::tuple<at::Tensor, at::Tensor> group_moments_cpu(const at::Tensor& x, int64_t num_groups) {
  constexpr const char* op = "pyext group_moments";
  TORCH_CHECK(x.dim() == 4, op, ": x must be (N, C, H, W)");
  MomentsArgs a{};
  a.dtype = dtype_code(x.scalar_type(), op);
  a.N = x.size(0), a.C = x.size(1), a.H = x.size(2), a.W = x.size(3), a.G = num_groups;
  TORCH_CHECK(a.G >= 1 && a.C % a.G == 0, op, ": num_groups must divide the channels");
  TORCH_CHECK((a.C == 1 || x.stride(1) == 1) && (a.W == 1 || x.stride(3) == a.C), op,
              ": each pixel's channels, and each row's pixels, must be contiguous (channels-last or a crop of it)");
  auto opts = x.options().dtype(at::kDouble);
  at::Tensor mean = at::empty({a.N, a.G}, opts), m2 = at::empty({a.N, a.G}, opts);
  if (a.N == 0) return {mean, m2};
  if (a.H * a.W == 0) return {mean.fill_(NAN), m2.zero_()};  // torch's mean of nothing
  a.x = x.data_ptr();
  a.sample_stride = x.stride(0), a.row_stride = x.stride(2);
  a.cols = std::min(a.W, kMomentPixels);
  a.rows = std::max<int64_t>(1, kMomentPixels / a.cols);
  a.row_blocks = (a.H + a.rows - 1) / a.rows, a.col_blocks = (a.W + a.cols - 1) / a.cols;
  const int64_t items = a.N * a.row_blocks * a.col_blocks;
  const GroupNormKernel k = kernel_for_level(a.dtype);
  std::vector<Moments> parts(items * a.G);
  at::parallel_for(0, items, grain(a.rows * a.cols * a.C),
                   [&](int64_t b, int64_t e) { k.moments(a, parts.data(), b, e); });
  k.merge_moments(a, parts.data(), mean.data_ptr<double>(), m2.data_ptr<double>());
  return {mean, m2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) {
  m.def("group_norm(Tensor x, int num_groups, Tensor? weight, Tensor? bias, Tensor? shift, float eps, bool silu) "
        "-> Tensor");
  m.def("group_moments(Tensor x, int num_groups) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) {
  m.impl("group_norm", group_norm_cpu);
  m.impl("group_moments", group_moments_cpu);
}

}  // namespace pyext::cpu
