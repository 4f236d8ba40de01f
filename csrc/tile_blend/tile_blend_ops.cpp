// Torch glue for the fused tile blend: schema of torch.ops.pyext_C.tile_blend and
// its CPU implementation. User-facing validation lives in pyext/ops/tile_blend.py;
// the TORCH_CHECKs here only keep the raw-pointer kernels inside their buffers.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "common/dtype_codes_torch.h"
#include "tile_blend/tile_blend_cpu.h"

namespace pyext::cpu {
namespace {

constexpr int64_t kModeDiffusers = 0, kModeNormalized = 1;

// Checks x is contiguous, of tile's dtype/device, shaped (leading..., rows, cols).
void check_plane_tensor(const at::Tensor& x, const at::Tensor& tile, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == tile.scalar_type() && x.device() == tile.device(),
              "pyext tile_blend: ", name, " must be contiguous with the tile's dtype and device");
  TORCH_CHECK(x.dim() == tile.dim() && x.sizes().slice(0, x.dim() - 2) == tile.sizes().slice(0, tile.dim() - 2),
              "pyext tile_blend: ", name, " must have the tile's leading (batch, channel) dims");
  TORCH_CHECK((rows < 0 || x.size(-2) == rows) && (cols < 0 || x.size(-1) == cols), "pyext tile_blend: ", name,
              " has shape ", x.sizes(), ", expected (..., ", rows, ", ", cols, ")");
}

// Fills TileBlendArgs from tensors after checking every extent the kernel touches.
TileBlendArgs make_args(const at::Tensor& tile, at::Tensor& out, int64_t oy, int64_t ox, int64_t mode,
                        at::IntArrayRef sizes, const std::optional<at::Tensor>& above,
                        const std::optional<at::Tensor>& left, at::Tensor& bottom, at::Tensor& right) {
  TORCH_CHECK(tile.dim() >= 3 && tile.is_contiguous(), "pyext tile_blend: tile must be contiguous (..., C, h, w)");
  TileBlendArgs a{};
  a.dtype = dtype_code(tile.scalar_type(), "pyext tile_blend");
  a.th = tile.size(-2);
  a.tw = tile.size(-1);
  check_plane_tensor(out, tile, -1, -1, "out");
  a.out_h = out.size(-2);
  a.out_w = out.size(-1);
  a.oy = oy;
  a.ox = ox;
  a.tile = tile.data_ptr();
  a.out = out.data_ptr();
  if (mode == kModeDiffusers) {
    TORCH_CHECK(sizes.size() == 2, "pyext tile_blend: diffusers mode takes sizes = [crop_h, crop_w]");
    a.crop_h = sizes[0];
    a.crop_w = sizes[1];
    TORCH_CHECK(a.crop_h >= 0 && a.crop_h <= a.th && a.crop_w >= 0 && a.crop_w <= a.tw,
                "pyext tile_blend: crop must lie inside the tile");
    TORCH_CHECK(oy >= 0 && ox >= 0 && oy + a.crop_h <= a.out_h && ox + a.crop_w <= a.out_w,
                "pyext tile_blend: cropped tile extends past the output");
    if (above) {
      check_plane_tensor(*above, tile, -1, a.tw, "above");
      a.above = above->data_ptr();
      a.above_rows = above->size(-2);
      if (a.above_rows == 0) a.above = nullptr;
    }
    if (left) {
      check_plane_tensor(*left, tile, a.th, -1, "left");
      a.left = left->data_ptr();
      a.left_cols = left->size(-1);
      if (a.left_cols == 0) a.left = nullptr;
    }
    check_plane_tensor(bottom, tile, -1, a.tw, "bottom");
    check_plane_tensor(right, tile, a.th, -1, "right");
    a.bottom_rows = bottom.size(-2);
    a.right_cols = right.size(-1);
    TORCH_CHECK(a.bottom_rows <= a.th && a.right_cols <= a.tw, "pyext tile_blend: strips larger than the tile");
    a.bottom = bottom.data_ptr();
    a.right = right.data_ptr();
  } else {
    TORCH_CHECK(mode == kModeNormalized, "pyext tile_blend: mode must be 0 (diffusers) or 1 (normalized)");
    TORCH_CHECK(sizes.size() == 4, "pyext tile_blend: normalized mode takes sizes = [top, bottom, left, right]");
    a.ov_top = sizes[0];
    a.ov_bottom = sizes[1];
    a.ov_left = sizes[2];
    a.ov_right = sizes[3];
    TORCH_CHECK(std::min({a.ov_top, a.ov_bottom, a.ov_left, a.ov_right}) >= 0 && a.ov_top <= a.th &&
                    a.ov_bottom <= a.th && a.ov_left <= a.tw && a.ov_right <= a.tw,
                "pyext tile_blend: overlaps must be in [0, tile size]");
    TORCH_CHECK(oy >= 0 && ox >= 0 && oy + a.th <= a.out_h && ox + a.tw <= a.out_w,
                "pyext tile_blend: tile extends past the output");
  }
  return a;
}

void tile_blend_cpu(const at::Tensor& tile, at::Tensor& out, int64_t oy, int64_t ox, int64_t mode,
                    at::IntArrayRef sizes, const std::optional<at::Tensor>& above,
                    const std::optional<at::Tensor>& left, at::Tensor& bottom, at::Tensor& right) {
  const TileBlendArgs a = make_args(tile, out, oy, ox, mode, sizes, above, left, bottom, right);
  const int64_t items = tile.numel() / std::max<int64_t>(a.tw, 1);
  if (items == 0 || a.tw == 0) return;
  const bool avx512 = simd_level() == SimdLevel::kAvx512 && tile_blend_diffusers_avx512() != nullptr;
  const TileBlendFn fn = mode == kModeDiffusers
                             ? (avx512 ? tile_blend_diffusers_avx512() : tile_blend_diffusers_scalar())
                             : (avx512 ? tile_blend_normalized_avx512() : tile_blend_normalized_scalar());
  // Rows are independent (each writes its own output row and strip rows); ~32K elements per task.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / a.tw);
  at::parallel_for(0, items, grain, [&](int64_t b, int64_t e) { fn(a, b, e); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) {
  m.def(
      "tile_blend(Tensor tile, Tensor(a!) out, int oy, int ox, int mode, int[] sizes, Tensor? above, "
      "Tensor? left, Tensor(b!) bottom, Tensor(c!) right) -> ()");
}

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) { m.impl("tile_blend", tile_blend_cpu); }

}  // namespace pyext::cpu
