// Torch glue of the Winograd convolution: schema of torch.ops.pyext_C.winograd_conv3x3 and its
// CPU implementation. Per chunk of tiles: input transform, the 36 GEMMs (the SIMD unit's own
// where it has one, else one batched at::bmm, torch's BLAS), output transform. The weight is
// transformed on every call (cheap next to the convolutions this is chosen for), so no second
// copy of the weights is kept.
// User-facing validation lives in pyext/ops/winograd.py; the TORCH_CHECKs here only keep the
// raw-pointer kernels inside their buffers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/bmm.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "winograd/winograd_cpu.h"

namespace pyext::cpu {
namespace {

// Bytes of V and M per chunk (at least kMinChunkTiles tiles, for an efficient GEMM). A kept
// workspace adds them to the peak of every caller (a tiled VAE's small tiles): no larger than the
// GEMMs need to run at full speed (docs/benchmarks.md, "CPU runtimes").
constexpr int64_t kChunkBytes = 2 << 20;
constexpr int64_t kMinChunkTiles = 64;

// The transformed weight and tile buffers live in `workspace` when the caller passes one large
// enough (pyext.ops.winograd.Workspace: the packed layers of one model share one, grown to their
// largest call, so fresh buffers this large are not mapped anew on every call, whose page faults
// cost as much as the transforms); otherwise in a buffer of this call's own, freed after it.
// Nothing is kept between calls here.

WinogradKernels kernels() {
  const SimdLevel level = simd_level();
  if (level == SimdLevel::kAvx512 && winograd_avx512().input) return winograd_avx512();
  if (level >= SimdLevel::kAvx2 && winograd_avx2().input) return winograd_avx2();
  return winograd_scalar();
}

at::Tensor winograd_conv3x3_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& workspace) {
  TORCH_CHECK(x.dim() == 4 && weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3 &&
                  weight.size(1) == x.size(1),
              "pyext winograd_conv3x3: x (N, Ci, H, W) and weight (Co, Ci, 3, 3) expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "pyext winograd_conv3x3: fp32 only");
  const int64_t n = x.size(0), ci = x.size(1), h = x.size(2), w = x.size(3), co = weight.size(0);
  const at::Tensor xl = x.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor g = weight.permute({2, 3, 1, 0}).contiguous();  // (3, 3, Ci, Co): a view when stored so
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == co, "pyext winograd_conv3x3: bias (Co,) fp32");
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({n, co, h, w}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (y.numel() == 0) return y;
  if (ci == 0) return b.defined() ? y.copy_(b.view({1, co, 1, 1}).expand_as(y)) : y.zero_();

  const WinogradKernels k = kernels();
  WinogradArgs a{};
  a.x = xl.data_ptr<float>();
  a.y = y.data_ptr<float>();
  a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  a.n = n; a.h = h; a.w = w; a.ci = ci; a.co = co;
  a.tiles_y = (h + kWinogradTile - 1) / kWinogradTile;
  a.tiles_x = (w + kWinogradTile - 1) / kWinogradTile;
  const int64_t tiles = n * a.tiles_y * a.tiles_x;

  const int64_t per_tile = kWinogradPoints * (ci + co) * 4;
  const int64_t chunk = std::min(tiles, std::max(kMinChunkTiles, kChunkBytes / per_tile));
  const int64_t u_size = kWinogradPoints * ci * (k.gemm ? panels(co) * kPanel : co);
  const int64_t needed = u_size + kWinogradPoints * chunk * (ci + co);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const bool fits = workspace && workspace->defined() && workspace->device().is_cpu() &&
                    workspace->scalar_type() == at::kFloat && workspace->is_contiguous() && workspace->numel() >= needed;
  const at::Tensor buffer = fits ? *workspace : at::empty({needed}, f32);
  float* base = buffer.data_ptr<float>();
  at::parallel_for(0, ci, 1, [&](int64_t lo, int64_t hi) { k.weight(g.data_ptr<float>(), base, ci, co, lo, hi); });

  std::atomic<bool> finite{true};
  for (int64_t first = 0; first < tiles; first += chunk) {
    const int64_t count = std::min(chunk, tiles - first);
    at::Tensor v = at::from_blob(base + u_size, {kWinogradPoints, count, ci}, f32);
    at::Tensor m = at::from_blob(base + u_size + kWinogradPoints * count * ci, {kWinogradPoints, count, co}, f32);
    at::parallel_for(first, first + count, 1, [&](int64_t lo, int64_t hi) {
      k.input(a, v.data_ptr<float>(), first, count, lo, hi);
    });
    if (k.gemm) {
      at::parallel_for(0, kWinogradPoints * panels(co), 1, [&](int64_t lo, int64_t hi) {
        k.gemm(v.data_ptr<float>(), base, m.data_ptr<float>(), count, ci, co, lo, hi);
      });
    } else {
      at::bmm_out(m, v, at::from_blob(base, {kWinogradPoints, ci, co}, {co, kWinogradPoints * co, 1}, f32));
    }
    at::parallel_for(first, first + count, 1, [&](int64_t lo, int64_t hi) {
      if (!k.output(a, m.data_ptr<float>(), first, count, lo, hi)) finite = false;
    });
  }
  // An inf or NaN input (or an overflow in the transforms) spreads over whole tiles, where a direct
  // convolution keeps it to each pixel's 3x3 neighbourhood: give the direct result there.
  if (!finite) {
    const std::vector<int64_t> one{1, 1};
    return at::conv2d(xl, weight, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, one, one)
        .contiguous(at::MemoryFormat::ChannelsLast);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) { m.def("winograd_conv3x3(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? workspace=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) { m.impl("winograd_conv3x3", winograd_conv3x3_cpu); }

}  // namespace pyext::cpu
