// Torch glue for the CUDA tile blend: the CUDA implementation of
// torch.ops.pyext_C.tile_blend (schema in tile_blend_ops.cpp). Built only
// when torch has CUDA; it uses the device-generic c10 stream API (no c10/cuda
// headers) so it also compiles, for a syntax check, against a CPU-only torch.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "common/dtype_codes_torch.h"
#include "tile_blend/tile_blend_cuda.h"

namespace {

void check_like(const at::Tensor& x, const at::Tensor& tile, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == tile.scalar_type() && x.device() == tile.device() &&
                  x.dim() == tile.dim() && x.sizes().slice(0, x.dim() - 2) == tile.sizes().slice(0, tile.dim() - 2),
              "pyext tile_blend (CUDA): ", name, " must be contiguous, with the tile's dtype, device and leading dims");
  TORCH_CHECK((rows < 0 || x.size(-2) == rows) && (cols < 0 || x.size(-1) == cols), "pyext tile_blend (CUDA): ",
              name, " has shape ", x.sizes(), ", expected (..., ", rows, ", ", cols, ")");
}

void tile_blend_cuda(const at::Tensor& tile, at::Tensor& out, int64_t oy, int64_t ox, int64_t mode,
                     at::IntArrayRef sizes, const std::optional<at::Tensor>& above,
                     const std::optional<at::Tensor>& left, at::Tensor& bottom, at::Tensor& right) {
  TORCH_CHECK(tile.dim() >= 3 && tile.is_contiguous(), "pyext tile_blend (CUDA): tile must be contiguous (..., C, h, w)");
  check_like(out, tile, -1, -1, "out");
  const PyextDtype dt = pyext::dtype_code(tile.scalar_type(), "pyext tile_blend (CUDA)");
  const int64_t th = tile.size(-2), tw = tile.size(-1), H = out.size(-2), W = out.size(-1);
  const int64_t planes = th > 0 && tw > 0 ? tile.numel() / (th * tw) : 0;
  const c10::DeviceGuard guard(tile.device());
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(tile.device().type())->getStream(tile.device());
  const auto s = static_cast<cudaStream_t>(stream.native_handle());
  cudaError_t err;
  if (mode == 0) {
    TORCH_CHECK(sizes.size() == 2, "pyext tile_blend (CUDA): diffusers mode takes sizes = [crop_h, crop_w]");
    const int64_t ch = sizes[0], cw = sizes[1];
    TORCH_CHECK(ch >= 0 && ch <= th && cw >= 0 && cw <= tw && oy >= 0 && ox >= 0 && oy + ch <= H && ox + cw <= W,
                "pyext tile_blend (CUDA): crop must lie inside the tile and the output");
    const void* a = nullptr;
    const void* l = nullptr;
    int64_t ar = 0, lc = 0;
    if (above) { check_like(*above, tile, -1, tw, "above"); a = above->data_ptr(); ar = above->size(-2); }
    if (left) { check_like(*left, tile, th, -1, "left"); l = left->data_ptr(); lc = left->size(-1); }
    check_like(bottom, tile, -1, tw, "bottom");
    check_like(right, tile, th, -1, "right");
    TORCH_CHECK(bottom.size(-2) <= th && right.size(-1) <= tw, "pyext tile_blend (CUDA): strips larger than the tile");
    err = pyext_tile_blend_diffusers_cuda(dt, tile.data_ptr(), planes, th, tw, out.data_ptr(), H, W, oy, ox, ch, cw,
                                          ar ? a : nullptr, ar, lc ? l : nullptr, lc, bottom.data_ptr(),
                                          bottom.size(-2), right.data_ptr(), right.size(-1), s);
  } else {
    TORCH_CHECK(mode == 1 && sizes.size() == 4, "pyext tile_blend (CUDA): normalized mode takes 4 overlaps");
    TORCH_CHECK(sizes[0] >= 0 && sizes[1] >= 0 && sizes[2] >= 0 && sizes[3] >= 0 && sizes[0] <= th &&
                    sizes[1] <= th && sizes[2] <= tw && sizes[3] <= tw,
                "pyext tile_blend (CUDA): overlaps must be in [0, tile size]");
    TORCH_CHECK(oy >= 0 && ox >= 0 && oy + th <= H && ox + tw <= W, "pyext tile_blend (CUDA): tile past the output");
    err = pyext_tile_blend_normalized_cuda(dt, tile.data_ptr(), planes, th, tw, out.data_ptr(), H, W, oy, ox,
                                           sizes[0], sizes[1], sizes[2], sizes[3], s);
  }
  TORCH_CHECK(err == cudaSuccess, "pyext tile_blend (CUDA): kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(pyext_C, CUDA, m) { m.impl("tile_blend", tile_blend_cuda); }
