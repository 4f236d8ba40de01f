// Torch glue for the fp8 CPU kernels: schemas of the private ops
// torch.ops.pyext_C.fp8_upcast_out / fp8_linear and their CPU implementations.
// Input validation with user-facing messages lives in pyext/ops/fp8.py; the
// TORCH_CHECKs here only guard the raw-pointer kernels.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common/dtype_codes_torch.h"
#include "fp8/fp8_convert_cpu.h"
#include "fp8/fp8_gemm_cpu.h"

namespace pyext::cpu {
namespace {

void check_fp8_weight(const at::Tensor& w, const at::Tensor& scale) {
  // The weight arrives as a uint8 view of the e4m3 codes: the kernels read bytes, and
  // torch's op checkers cannot compare float8 tensors.
  TORCH_CHECK(w.scalar_type() == at::kByte, "pyext fp8: weight must be the uint8 view of float8_e4m3fn codes, got ",
              w.scalar_type());
  TORCH_CHECK(w.dim() >= 1, "pyext fp8: weight must have at least one dimension");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "pyext fp8: scale must be float32");
  TORCH_CHECK(scale.numel() == 1 || scale.numel() == w.size(0),
              "pyext fp8: scale must have 1 or weight.size(0) elements");
}

// The fused GEMM runs here (PYEXT_CPU_SIMD=avx512 or uncapped, and the CPU has AVX512_BF16).
bool fused_gemm_available() { return simd_level() == SimdLevel::kAvx512 && fp8_gemm_supported(); }

// The ops mean "upcast the weight to bf16, then GEMM"; the fused GEMM applies the scale to
// the fp32 accumulator instead, which agrees (to rounding) only while every decoded weight
// times its scale is a finite bf16 (|scale| * 448 within bf16's range) and no nonzero one
// underflows (|scale| * 2^-9, the smallest e4m3 magnitude, at least bf16's smallest normal, or
// a zero scale): an upcast weight of 0 times an inf activation is NaN, the fused GEMM's inf * a
// tiny scale is inf. NaN fails the test. (pyext.ops.fp8.scales_fuse_exactly says the same.)
bool scales_fuse_exactly(const at::Tensor& scale) {
  constexpr float kBf16Max = 3.38953139e38f, kBf16Tiny = 1.17549435e-38f, kFp8Max = 448.0f, kFp8Min = 0x1p-9f;
  const float* s = scale.data_ptr<float>();
  return std::all_of(s, s + scale.numel(), [](float v) {
    const float a = std::fabs(v);
    return a * kFp8Max <= kBf16Max && (a == 0.0f || a * kFp8Min >= kBf16Tiny);
  });
}

// Multiply-adds a thread must get to be worth waking the pool (a GEMM unit is 6 x 64 x K).
int64_t fused_gemm_grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 20) / (6 * 64 * K)); }

// Upcasts rows [row0, row0 + nrows) of a (rows, cols) fp8 matrix into dst,
// in parallel. A single (per-tensor) scale is split by element chunks instead.
void upcast_rows(const uint8_t* src, const float* scale, bool per_row, int64_t row0, int64_t nrows,
                 int64_t cols, void* dst, at::ScalarType dtype) {
  const PyextDtype code = dtype_code(dtype, "pyext fp8");
  const Fp8RowFn fn = fp8_row_kernel(code, simd_level());
  const int64_t esize = PYEXT_DTYPE_SIZE(code);
  char* out = static_cast<char*>(dst);
  constexpr int64_t kGrainElems = 1 << 15;  // enough work per task to amortise the fork
  // Outputs well past the L3 (32 MiB on the Zen 4 this was tuned on) cannot be read back
  // from cache anyway: stream them to memory. Smaller ones stay cached for the caller
  // (FP8Conv2d's upcast path hands the buffer straight to the conv).
  const bool stream = nrows * cols * esize > (48 << 20);
  if (!per_row) {
    const int64_t n = nrows * cols;
    const uint8_t* s = src + row0 * cols;
    at::parallel_for(0, n, kGrainElems, [&](int64_t b, int64_t e) { fn(s + b, out + b * esize, e - b, scale[0], stream); });
    return;
  }
  at::parallel_for(0, nrows, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      fn(src + (row0 + r) * cols, out + r * cols * esize, cols, scale[row0 + r], stream);
  });
}

void fp8_upcast_out_cpu(const at::Tensor& w, const at::Tensor& scale, at::Tensor& out) {
  check_fp8_weight(w, scale);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == w.sizes(), "pyext fp8: out must be contiguous, with w's shape ",
              w.sizes(), ", got ", out.sizes());
  at::assert_no_overlap(out, w);
  const at::Tensor wc = w.contiguous(), sc = scale.contiguous();
  if (w.numel() == 0) return;
  const int64_t rows = w.size(0), cols = w.numel() / rows;
  upcast_rows(static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(), sc.numel() != 1, 0, rows, cols,
              out.data_ptr(), out.scalar_type());
}

// y = x @ (w * scale)^T + bias, upcasting the weight tile by tile into a buffer
// that stays in L2, so the full-precision weight never exists in memory and the
// upcast costs no memory traffic beyond reading the fp8 bytes once.
at::Tensor fp8_linear_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  check_fp8_weight(w, scale);
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "pyext fp8_linear: shape mismatch");
  const int64_t K = w.size(1), N = w.size(0);
  const int64_t M = K ? x.numel() / K : c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  const at::Tensor x2 = (x.dim() == 2 ? x : x.reshape({M, K})).contiguous();
  const at::Tensor wc = w.contiguous(), sc = scale.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  if (M == 0 || N == 0 || K == 0) {
    at::Tensor y = at::empty({M, N}, x.options());
    return (K == 0 && M * N > 0 ? (bias ? y.copy_(bias->expand({M, N})) : y.zero_()) : y).view(out_shape);
  }

  // bf16 on AVX512_BF16: the GEMM decodes the fp8 weight in its own packing step.
  if (tile_rows == 0 && x.scalar_type() == at::kBFloat16 && fused_gemm_available() && scales_fuse_exactly(sc)) {
    const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    TORCH_CHECK(!bias || (bc.scalar_type() == at::kBFloat16 && bc.numel() == N), "pyext fp8_linear: bias must be bf16[N]");
    at::Tensor y = at::empty({M, N}, x.options());
    const Fp8GemmArgs args{reinterpret_cast<const uint16_t*>(x2.data_ptr()),
                           static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(), sc.numel() == 1,
                           bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr,
                           reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K};
    at::parallel_for(0, fp8_gemm_units(M, N), fused_gemm_grain(K),
                     [&](int64_t b, int64_t e) { fp8_gemm_bf16_avx512(args, b, e); });
    return y.view(out_shape);
  }

  // Otherwise upcast the weight tile by tile into a buffer and use torch's GEMM.
  // Tile width (weight rows upcast at once). Narrow tiles keep the upcast weight in
  // cache but cost GEMM efficiency (every call re-packs x, and each distinct tile shape
  // is another oneDNN primitive), so tiles are as wide as an L3-sized buffer allows
  // and split N evenly (no odd tail shape). tile_rows > 0 sets the width, for the bench;
  // tile_rows < 0 takes this path with the automatic width.
  const int64_t esize = x.element_size();
  constexpr int64_t kTileBytes = 8 << 20;
  int64_t tile = std::min(N, tile_rows > 0 ? tile_rows : std::max<int64_t>(16, kTileBytes / (K * esize)));
  const int64_t ntiles = (N + tile - 1) / tile;
  tile = (N + ntiles - 1) / ntiles;
  // One scratch buffer per thread, reused across calls and layers (no page faults per call).
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < tile * K || buffer.scalar_type() != x.scalar_type())
    buffer = at::empty({tile * K}, x.options());
  const uint8_t* src = static_cast<const uint8_t*>(wc.data_ptr());
  if (ntiles == 1) {  // the whole weight in one tile: torch's own linear call (a small one costs less than mm_out)
    upcast_rows(src, sc.data_ptr<float>(), sc.numel() != 1, 0, N, K, buffer.data_ptr(), x.scalar_type());
    const at::Tensor wt = buffer.as_strided({K, N}, {1, K});  // the upcast weight, transposed
    const at::Tensor y = bias ? at::addmm(*bias, x2, wt) : at::mm(x2, wt);
    return x.dim() == 2 ? y : y.view(out_shape);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nb = std::min(tile, N - n0);
    at::Tensor wt = buffer.narrow(0, 0, nb * K).view({nb, K});
    upcast_rows(src, sc.data_ptr<float>(), sc.numel() != 1, n0, nb, K, wt.data_ptr(), x.scalar_type());
    at::Tensor y_tile = y.narrow(1, n0, nb);
    if (bias) at::addmm_out(y_tile, bias->narrow(0, n0, nb), x2, wt.t());
    else at::mm_out(y_tile, x2, wt.t());
  }
  return y.view(out_shape);
}

// Convolution as an implicit GEMM over channels-last activations (see fp8_gemm_cpu.h).
// x: (B, C, H, W) bf16 in channels-last memory; w: (N, kh, kw, C) uint8 codes.
// Returns (B, N, OH, OW) bf16 in channels-last memory.
at::Tensor fp8_conv2d_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding) {
  TORCH_CHECK(fused_gemm_available(), "pyext fp8_conv2d: the C++ kernel needs AVX-512 and AVX512_BF16");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 4, "pyext fp8_conv2d: weight must be uint8 (N, kh, kw, C)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(1) == w.size(3) && x.size(1) % 2 == 0,
              "pyext fp8_conv2d: x must be bf16 (B, C, H, W) with an even C matching the weight");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && stride[0] > 0 && stride[1] > 0 && padding[0] >= 0 &&
              padding[1] >= 0, "pyext fp8_conv2d: stride and padding must be two non-negative ints (stride > 0)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && (scale.numel() == 1 || scale.numel() == w.size(0)),
              "pyext fp8_conv2d: scale must be float32 with 1 or N elements");
  TORCH_CHECK(x.size(1) > 0, "pyext fp8_conv2d: x has no input channels");
  const at::Tensor xc = x.contiguous(at::MemoryFormat::ChannelsLast), wc = w.contiguous(), sc = scale.contiguous();
  TORCH_CHECK(scales_fuse_exactly(sc), "pyext fp8_conv2d: every |scale| * 448 must be a finite bf16 and no nonzero weight may underflow");
  const Conv2dGeometry g{x.size(0), x.size(2), x.size(3), x.size(1), 0, 0, w.size(1), w.size(2),
                         stride[0], stride[1], padding[0], padding[1]};
  const int64_t OH = (g.H + 2 * g.ph - g.kh) / g.sh + 1, OW = (g.W + 2 * g.pw - g.kw) / g.sw + 1;
  TORCH_CHECK(OH > 0 && OW > 0, "pyext fp8_conv2d: the kernel is larger than the padded input");
  Conv2dGeometry geom = g;
  geom.OH = OH;
  geom.OW = OW;
  const int64_t N = w.size(0), M = g.batch * OH * OW, K = g.kh * g.kw * g.C;
  at::Tensor y = at::empty({g.batch, N, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (M == 0 || N == 0) return y;
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias || (bc.scalar_type() == at::kBFloat16 && bc.numel() == N), "pyext fp8_conv2d: bias must be bf16[N]");
  Fp8GemmArgs args{reinterpret_cast<const uint16_t*>(xc.data_ptr()), static_cast<const uint8_t*>(wc.data_ptr()),
                   sc.data_ptr<float>(), sc.numel() == 1, bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr,
                   reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K};
  args.conv = &geom;
  at::parallel_for(0, fp8_gemm_units(M, N), fused_gemm_grain(K),
                   [&](int64_t b, int64_t e) { fp8_gemm_bf16_avx512(args, b, e); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) {
  m.def("fp8_conv2d(Tensor x, Tensor w, Tensor scale, Tensor? bias, int[] stride, int[] padding) -> Tensor");
  m.def("fp8_upcast_out(Tensor w, Tensor scale, Tensor(a!) out) -> ()");
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, int tile_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) {
  m.impl("fp8_upcast_out", fp8_upcast_out_cpu);
  m.impl("fp8_linear", fp8_linear_cpu);
  m.impl("fp8_conv2d", fp8_conv2d_cpu);
}

}  // namespace pyext::cpu
