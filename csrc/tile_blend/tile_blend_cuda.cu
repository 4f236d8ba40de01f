// Fused tile blend on the GPU: one thread per tile element, one launch per tile.
// Each thread computes its blended value (rounded after each step as diffusers'
// tensor ops do) and writes it to every place that wants it: the cropped output,
// the bottom strip and the right strip. No FMA contraction (__fmul_rn/__fadd_rn)
// so results match the CPU kernels bit for bit.
#include "tile_blend/tile_blend_cuda.h"
#include "tile_blend/tile_blend_math.h"

namespace {

using pyext::tile_blend::edge_weight;
using pyext::tile_blend::ramp;
using pyext::tile_blend::rnd;
template <PyextDtype D> using Io = pyext::DtypeIo<D>;

template <PyextDtype D, typename T = typename Io<D>::T>
__global__ void diffusers_kernel(const T* __restrict__ tile, int64_t n, int64_t th, int64_t tw, T* __restrict__ out,
                                 int64_t out_h, int64_t out_w, int64_t oy, int64_t ox, int64_t crop_h, int64_t crop_w,
                                 const T* __restrict__ above, int64_t above_rows, int64_t ev, const T* __restrict__ left,
                                 int64_t left_cols, int64_t eh, T* __restrict__ bottom, int64_t bottom_rows,
                                 T* __restrict__ right, int64_t right_cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t x = i % tw, y = (i / tw) % th, p = i / (tw * th);
    float v = Io<D>::load(tile[i]);
    float keep, take;
    if (y < ev) {
      ramp(y, ev, keep, take);
      const float a = Io<D>::load(above[(p * above_rows + above_rows - ev + y) * tw + x]);
      v = rnd<D>(rnd<D>(__fmul_rn(a, keep)) + rnd<D>(__fmul_rn(v, take)));
    }
    if (x < eh) {
      ramp(x, eh, keep, take);
      const float l = Io<D>::load(left[(p * th + y) * left_cols + left_cols - eh + x]);
      v = rnd<D>(rnd<D>(__fmul_rn(l, keep)) + rnd<D>(__fmul_rn(v, take)));
    }
    const T b = Io<D>::store(v);
    if (y < crop_h && x < crop_w) out[(p * out_h + oy + y) * out_w + ox + x] = b;
    if (y >= th - bottom_rows) bottom[(p * bottom_rows + y - (th - bottom_rows)) * tw + x] = b;
    if (x >= tw - right_cols) right[(p * th + y) * right_cols + x - (tw - right_cols)] = b;
  }
}

template <PyextDtype D, typename T = typename Io<D>::T>
__global__ void normalized_kernel(const T* __restrict__ tile, int64_t n, int64_t th, int64_t tw, T* __restrict__ out,
                                  int64_t out_h, int64_t out_w, int64_t oy, int64_t ox, int64_t ov_top,
                                  int64_t ov_bottom, int64_t ov_left, int64_t ov_right) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t x = i % tw, y = (i / tw) % th, p = i / (tw * th);
    const float wy = __fmul_rn(edge_weight(y, ov_top), edge_weight(th - 1 - y, ov_bottom));
    const float wx = __fmul_rn(edge_weight(x, ov_left), edge_weight(tw - 1 - x, ov_right));
    T* o = out + (p * out_h + oy + y) * out_w + ox + x;
    *o = Io<D>::store(__fadd_rn(Io<D>::load(*o), __fmul_rn(Io<D>::load(tile[i]), __fmul_rn(wy, wx))));
  }
}

unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 * 32 ? blocks : 65535 * 32);  // grid-stride beyond this
}

template <PyextDtype D, typename T = typename Io<D>::T>
cudaError_t launch_diffusers(const void* tile, int64_t planes, int64_t th, int64_t tw, void* out, int64_t out_h,
                             int64_t out_w, int64_t oy, int64_t ox, int64_t crop_h, int64_t crop_w, const void* above,
                             int64_t above_rows, const void* left, int64_t left_cols, void* bottom,
                             int64_t bottom_rows, void* right, int64_t right_cols, cudaStream_t stream) {
  const int64_t n = planes * th * tw;
  if (n == 0) return cudaSuccess;
  const int64_t ev = above ? (above_rows < th ? above_rows : th) : 0;
  const int64_t eh = left ? (left_cols < tw ? left_cols : tw) : 0;
  constexpr int kThreads = 256;
  diffusers_kernel<D><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(tile), n, th, tw, static_cast<T*>(out), out_h, out_w, oy, ox, crop_h, crop_w,
      static_cast<const T*>(above), above_rows, ev, static_cast<const T*>(left), left_cols, eh,
      static_cast<T*>(bottom), bottom_rows, static_cast<T*>(right), right_cols);
  return cudaGetLastError();
}

template <PyextDtype D, typename T = typename Io<D>::T>
cudaError_t launch_normalized(const void* tile, int64_t planes, int64_t th, int64_t tw, void* out, int64_t out_h,
                              int64_t out_w, int64_t oy, int64_t ox, int64_t t, int64_t b, int64_t l, int64_t r,
                              cudaStream_t stream) {
  const int64_t n = planes * th * tw;
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  normalized_kernel<D><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(tile), n, th, tw, static_cast<T*>(out), out_h, out_w, oy, ox, t, b, l, r);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t pyext_tile_blend_diffusers_cuda(PyextDtype dtype, const void* tile, int64_t planes, int64_t th,
                                                       int64_t tw, void* out, int64_t out_h, int64_t out_w, int64_t oy,
                                                       int64_t ox, int64_t crop_h, int64_t crop_w, const void* above,
                                                       int64_t above_rows, const void* left, int64_t left_cols,
                                                       void* bottom, int64_t bottom_rows, void* right,
                                                       int64_t right_cols, cudaStream_t stream) {
  const auto launch = [&](auto f) {
    return f(tile, planes, th, tw, out, out_h, out_w, oy, ox, crop_h, crop_w, above, above_rows, left, left_cols,
             bottom, bottom_rows, right, right_cols, stream);
  };
  switch (dtype) {
    case PYEXT_F32: return launch(launch_diffusers<PYEXT_F32>);
    case PYEXT_F16: return launch(launch_diffusers<PYEXT_F16>);
    case PYEXT_BF16: return launch(launch_diffusers<PYEXT_BF16>);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t pyext_tile_blend_normalized_cuda(PyextDtype dtype, const void* tile, int64_t planes, int64_t th,
                                                        int64_t tw, void* out, int64_t out_h, int64_t out_w,
                                                        int64_t oy, int64_t ox, int64_t ov_top, int64_t ov_bottom,
                                                        int64_t ov_left, int64_t ov_right, cudaStream_t stream) {
  const auto launch = [&](auto f) {
    return f(tile, planes, th, tw, out, out_h, out_w, oy, ox, ov_top, ov_bottom, ov_left, ov_right, stream);
  };
  switch (dtype) {
    case PYEXT_F32: return launch(launch_normalized<PYEXT_F32>);
    case PYEXT_F16: return launch(launch_normalized<PYEXT_F16>);
    case PYEXT_BF16: return launch(launch_normalized<PYEXT_BF16>);
    default: return cudaErrorInvalidValue;
  }
}
