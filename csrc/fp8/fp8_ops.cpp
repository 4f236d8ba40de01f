// Torch glue for the fp8 CPU kernels: schemas of the private ops
// torch.ops.pyext_C.fp8_upcast_out / fp8_linear / fp8_conv2d and their CPU implementations, and
// the kernel of the public pyext::fp8_linear for the call signatures pyext's dispatch armed
// (fp8_linear_entry, at the end; fp8_linear_entry.h). Input validation with user-facing messages lives in
// pyext/ops/fp8.py; the TORCH_CHECKs here only guard the raw-pointer kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/addmm.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/brgemm.h"
#include "common/dtype_codes_torch.h"
#include "common/half_rounding.h"
#include "fp8/fp8_convert_cpu.h"
#include "fp8/fp8_gemm_cpu.h"
#include "fp8/fp8_linear_entry.h"

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

// Units of the AVX-512 GEMM a thread must get to be worth waking the pool: 2^20 multiply-adds (a
// unit is its 6-row tile x 64 x K).
int64_t fused_gemm_grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 20) / (6 * kFp8Panel * K)); }

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

// A layer this small (in multiply-adds) costs less as a plain loop than as a call of
// torch's GEMM, whose set-up alone exceeds the work.
constexpr int64_t kDirectMacs = int64_t{1} << 14;

// dst[i] = float(src[i]) for n elements of a float32 / float16 / bfloat16 array.
void to_float(const void* src, int64_t n, float* dst, PyextDtype dtype) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_elem(src, i, dtype);
}

// out[j] = dot(a, b + j * K) for R rows of b, each a sum of four interleaved fp32 partial sums,
// which the compiler keeps in one vector register per row.
template <int R>
void dot_rows(const float* __restrict a, const float* __restrict b, int64_t K, float* out) {
  float part[R][4] = {};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4)
    for (int j = 0; j < R; ++j)
      for (int l = 0; l < 4; ++l) part[j][l] += a[k + l] * b[j * K + k + l];
  for (int j = 0; j < R; ++j) {
    float sum = (part[j][0] + part[j][1]) + (part[j][2] + part[j][3]);
    for (int64_t t = k; t < K; ++t) sum += a[t] * b[j * K + t];
    out[j] = sum;
  }
}

// y = x2 @ upcast(w)^T + bias for small layers: the weight is upcast to x's dtype (the op's
// rounding), then every product is summed in fp32, as torch's CPU GEMMs do for every dtype.
at::Tensor fp8_linear_direct(const at::Tensor& x2, const uint8_t* w, const float* scale, bool per_row,
                             const std::optional<at::Tensor>& bias, int64_t M, int64_t N, int64_t K) {
  const at::ScalarType dtype = x2.scalar_type();
  const PyextDtype code = dtype_code(dtype, "pyext fp8_linear");
  const int64_t esize = x2.element_size();
  struct Scratch { std::vector<float> w, row, acc, bias; std::vector<char> upcast; };
  thread_local Scratch scratch;
  Scratch& buf = scratch;
  buf.w.resize(N * K);
  buf.row.resize(K);
  buf.acc.resize(N);
  if (dtype == at::kFloat) {
    upcast_rows(w, scale, per_row, 0, N, K, buf.w.data(), dtype);
  } else {
    buf.upcast.resize(N * K * esize);
    upcast_rows(w, scale, per_row, 0, N, K, buf.upcast.data(), dtype);
    to_float(buf.upcast.data(), N * K, buf.w.data(), code);
  }
  if (bias) {
    buf.bias.resize(N);
    to_float(bias->contiguous().data_ptr(), N, buf.bias.data(), code);
  }
  at::Tensor y = at::empty({M, N}, x2.options());
  const char* xs = static_cast<const char*>(x2.data_ptr());
  char* ys = static_cast<char*>(y.data_ptr());
  float* acc = buf.acc.data();
  for (int64_t m = 0; m < M; ++m) {
    const float* a = buf.row.data();
    if (dtype == at::kFloat) a = reinterpret_cast<const float*>(xs) + m * K;
    else to_float(xs + m * K * esize, K, buf.row.data(), code);
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) dot_rows<4>(a, buf.w.data() + n * K, K, acc + n);
    for (; n < N; ++n) dot_rows<1>(a, buf.w.data() + n * K, K, acc + n);
    if (bias)
      for (int64_t j = 0; j < N; ++j) acc[j] += buf.bias[j];
    for (int64_t j = 0; j < N; ++j) store_elem(ys, m * N + j, acc[j], code);
  }
  return y;
}

// y = x @ (w * scale)^T + bias, upcasting the weight tile by tile into a buffer
// that stays in L2, so the full-precision weight never exists in memory and the
// upcast costs no memory traffic beyond reading the fp8 bytes once.
at::Tensor fp8_linear_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  check_fp8_weight(w, scale);
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "pyext fp8_linear: shape mismatch");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == w.size(0)),
              "pyext fp8_linear: bias must have x's dtype and weight.size(0) elements");
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

  if (tile_rows == 0 && M * N * K <= kDirectMacs) {
    const at::Tensor y = fp8_linear_direct(x2, static_cast<const uint8_t*>(wc.data_ptr()), sc.data_ptr<float>(),
                                           sc.numel() != 1, bias, M, N, K);
    return x.dim() == 2 ? y : y.view(out_shape);
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

// A brgemm op refuses to run without torch's AMX kernel, but on the stand-in.
void require_brgemm(const char* op, bool stand_in) {
  TORCH_CHECK(stand_in || brgemm_amx_available(), op, ": torch's brgemm has no AMX kernel for bf16 on this CPU "
              "(cpublas::could_pack)");
}

// Runs a brgemm op's GEMM, a task per thread, on torch's AMX kernel or with the tests' switches:
// the stand-in micro-kernel (any CPU) and the scalar packer, decoder and epilogue (any CPU with the
// SIMD ones too).
void run_brgemm(const Fp8GemmArgs& args, bool stand_in, bool scalar) {
  const Microkernel mk = stand_in ? Microkernel::kStandIn : Microkernel::kOneDnn;
  const bool simd = !scalar && fp8_brgemm_simd_supported();
  const Fp8BrgemmSplit split = fp8_brgemm_split(args, at::get_num_threads());
  at::parallel_for(0, split.panel_shares * split.row_shares, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) fp8_gemm_brgemm(args, split, t, mk, simd);
  });
}

// The GEMM on torch's brgemm (fp8_gemm_cpu_brgemm.cpp) for bf16 x and an even K. Scales that do not
// fuse exactly take fp8_linear_cpu's upcast path, as there. stand_in and scalar: run_brgemm's.
at::Tensor fp8_linear_brgemm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& bias, bool stand_in, bool scalar) {
  check_fp8_weight(w, scale);
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1) && w.size(1) % 2 == 0 && x.scalar_type() == at::kBFloat16,
              "pyext fp8_linear brgemm: x must be bf16 with an even K matching the weight");
  require_brgemm("pyext fp8_linear brgemm", stand_in);
  const int64_t K = w.size(1), N = w.size(0), M = K ? x.numel() / K : 0;
  const at::Tensor wc = w.contiguous(), sc = scale.contiguous();
  if (M == 0 || N == 0 || K == 0 || !scales_fuse_exactly(sc)) return fp8_linear_cpu(x, w, scale, bias, -1);
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias || (bc.scalar_type() == at::kBFloat16 && bc.numel() == N), "pyext fp8_linear: bias must be bf16[N]");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  const Fp8GemmArgs args{reinterpret_cast<const uint16_t*>(x2.data_ptr()), static_cast<const uint8_t*>(wc.data_ptr()),
                         sc.data_ptr<float>(), sc.numel() == 1,
                         bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr,
                         reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K};
  run_brgemm(args, stand_in, scalar);
  return y.view(out_shape);
}

at::Tensor fp8_linear_brgemm_armed(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                   const std::optional<at::Tensor>& bias) {
  return fp8_linear_brgemm_cpu(x, w, scale, bias, false, false);
}

// Convolution as an implicit GEMM over channels-last activations (see fp8_gemm_cpu.h).
// x: (B, C, H, W) bf16 in channels-last memory; w: (N, kh, kw, C) uint8 codes.
// Returns (B, N, OH, OW) bf16 in channels-last memory; `gemm(args)` runs the GEMM's units.
template <class Gemm>
at::Tensor fp8_conv2d_implicit(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                               const Gemm& gemm) {
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
  gemm(args);
  return y;
}

at::Tensor fp8_conv2d_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding) {
  TORCH_CHECK(fused_gemm_available(), "pyext fp8_conv2d: the C++ kernel needs AVX-512 and AVX512_BF16");
  return fp8_conv2d_implicit(x, w, scale, bias, stride, padding, [](const Fp8GemmArgs& args) {
    at::parallel_for(0, fp8_gemm_units(args.M, args.N), fused_gemm_grain(args.K),
                     [&](int64_t b, int64_t e) { fp8_gemm_bf16_avx512(args, b, e); });
  });
}

// The convolution on torch's brgemm; stand_in and scalar: run_brgemm's.
at::Tensor fp8_conv2d_brgemm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                 at::IntArrayRef padding, bool stand_in, bool scalar) {
  require_brgemm("pyext fp8_conv2d brgemm", stand_in);
  return fp8_conv2d_implicit(x, w, scale, bias, stride, padding, [&](const Fp8GemmArgs& args) {
    const Conv2dGeometry& g = *args.conv;
    if (!fp8_brgemm_grid_pays(g)) return run_brgemm(args, stand_in, scalar);
    // Output rows shorter than a block: grid mode (fp8_gemm_cpu.h) on a zero-padded copy of x, whose
    // blocks span output rows.
    at::Tensor padded = at::zeros({g.batch, g.H + 2 * g.ph, g.W + 2 * g.pw, g.C}, x.options()).permute({0, 3, 1, 2});
    padded.narrow(2, g.ph, g.H).narrow(3, g.pw, g.W).copy_(x);
    Conv2dGeometry grid = g;
    grid.H += 2 * g.ph, grid.W += 2 * g.pw, grid.ph = grid.pw = 0, grid.grid = true;
    Fp8GemmArgs on_grid = args;
    on_grid.x = reinterpret_cast<const uint16_t*>(padded.data_ptr());
    on_grid.conv = &grid;
    run_brgemm(on_grid, stand_in, scalar);
  });
}

// ---- pyext::fp8_linear without entering Python (fp8_linear_entry.h)
class ArmedSignatures {
 public:
  using Key = std::vector<int64_t>;

  static void key_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, Key& key) {
    key.clear();
    for (const at::Tensor* t : {&x, &w, &scale, bias ? &*bias : nullptr}) {
      if (t == nullptr) {
        key.push_back(-1);
        continue;
      }
      key.push_back(static_cast<int64_t>(t->scalar_type()));
      key.push_back(static_cast<int64_t>(t->device().type()));
      key.push_back(t->device().index());  // each GPU's choice is its own
      key.push_back(t->dim());
      key.insert(key.end(), t->sizes().begin(), t->sizes().end());
      key.insert(key.end(), t->strides().begin(), t->strides().end());
    }
  }

  // The backend armed for key, or nullptr.
  Fp8LinearFn find(const Key& key) const {
    std::shared_lock lock(mutex_);
    const auto it = keys_.find(key);
    return it == keys_.end() ? nullptr : it->second;
  }
  void add(Key key, Fp8LinearFn fn) {
    std::unique_lock lock(mutex_);
    if (keys_.size() >= kMaxKeys) keys_.clear();  // the Python side keeps its own bounded table
    keys_[std::move(key)] = fn;
  }
  void erase(const Key& key) {
    std::unique_lock lock(mutex_);
    keys_.erase(key);
  }
  void clear() {
    std::unique_lock lock(mutex_);
    keys_.clear();
  }

 private:
  struct Hash {
    size_t operator()(const Key& key) const {
      size_t h = 0;
      for (int64_t v : key) h = h * 1000003u ^ std::hash<int64_t>()(v);
      return h;
    }
  };
  static constexpr size_t kMaxKeys = 4096;
  mutable std::shared_mutex mutex_;
  std::unordered_map<Key, Fp8LinearFn, Hash> keys_;
};

ArmedSignatures& armed_linear() {
  static ArmedSignatures table;
  return table;
}

// The backends a signature can be armed with, by their names in pyext's dispatch.
std::unordered_map<std::string, Fp8LinearFn>& armable() {
  static std::unordered_map<std::string, Fp8LinearFn> backends;
  return backends;
}

void fp8_linear_arm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                    const std::optional<at::Tensor>& bias, c10::string_view backend) {
  const auto it = armable().find(std::string(backend));
  TORCH_CHECK(it != armable().end(), "pyext fp8_linear_arm: no armable backend '", backend, "' in this build");
  ArmedSignatures::Key key;
  ArmedSignatures::key_of(x, w, scale, bias, key);
  armed_linear().add(std::move(key), it->second);
}

void fp8_linear_disarm() { armed_linear().clear(); }

at::Tensor fp8_linear_cpp(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias) {
  return fp8_linear_cpu(x, w, scale, bias, 0);
}

const bool cpu_backends_armable = [] {
  pyext::register_armable("cpp", fp8_linear_cpp);
  pyext::register_armable("brgemm", fp8_linear_brgemm_armed);
  return true;
}();

at::Tensor fp8_linear_entry_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                const std::optional<at::Tensor>& bias, std::optional<c10::string_view> backend) {
  return pyext::fp8_linear_entry(x, w, scale, bias, backend);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) {
  m.def("fp8_linear_dispatch(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, str? backend=None) -> Tensor");
  m.def("fp8_linear_arm(Tensor x, Tensor w, Tensor scale, Tensor? bias, str backend) -> ()", fp8_linear_arm);
  m.def("fp8_linear_disarm() -> ()", fp8_linear_disarm);
  m.def("fp8_conv2d(Tensor x, Tensor w, Tensor scale, Tensor? bias, int[] stride, int[] padding) -> Tensor");
  m.def("fp8_conv2d_brgemm(Tensor x, Tensor w, Tensor scale, Tensor? bias, int[] stride, int[] padding, "
        "bool stand_in=False, bool scalar=False) -> Tensor");
  m.def("fp8_upcast_out(Tensor w, Tensor scale, Tensor(a!) out) -> ()");
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, int tile_rows=0) -> Tensor");
  m.def("fp8_linear_brgemm(Tensor x, Tensor w, Tensor scale, Tensor? bias, bool stand_in=False, "
        "bool scalar=False) -> Tensor");
  m.def("fp8_brgemm_available() -> bool", brgemm_amx_available);  // AMX: see common/brgemm.h
}

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) {
  m.impl("fp8_upcast_out", fp8_upcast_out_cpu);
  m.impl("fp8_linear", fp8_linear_cpu);
  m.impl("fp8_linear_brgemm", fp8_linear_brgemm_cpu);
  m.impl("fp8_conv2d", fp8_conv2d_cpu);
  m.impl("fp8_conv2d_brgemm", fp8_conv2d_brgemm_cpu);
}

// pyext::fp8_linear is defined in Python (pyext/ops/fp8.py), which works without this extension.
TORCH_LIBRARY_IMPL(pyext, CPU, m) { m.impl("fp8_linear", fp8_linear_entry_cpu); }

}  // namespace pyext::cpu

void pyext::register_armable(const char* backend, Fp8LinearFn fn) { cpu::armable()[backend] = fn; }

at::Tensor pyext::fp8_linear_entry(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                   const std::optional<at::Tensor>& bias, std::optional<c10::string_view> backend) {
  using cpu::ArmedSignatures;
  const bool autograd = c10::GradMode::is_enabled() &&
                        (x.requires_grad() || scale.requires_grad() || (bias && bias->requires_grad()));
  if (!backend && !autograd) {
    thread_local ArmedSignatures::Key key;  // reused: no allocation per call
    ArmedSignatures::key_of(x, w, scale, bias, key);
    if (const Fp8LinearFn armed = cpu::armed_linear().find(key)) {
      try {
        return armed(x, w, scale, bias);
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const std::exception&) {
        cpu::armed_linear().erase(key);
      }
    }
  }
  static const auto dispatch =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyext_C::fp8_linear_dispatch", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::optional<c10::string_view>)>();
  return dispatch.call(x, w, scale, bias, backend);
}
