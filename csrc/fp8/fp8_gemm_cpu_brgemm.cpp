// The fp8-weight GEMM on torch's oneDNN micro-kernel, at::native::cpublas::brgemm, on the AMX
// tiles of CPUs where torch packs bf16 for it (see fp8_gemm_cpu.h).
//
// A thread runs a contiguous range of (64-channel panel, block of rows) units. It decodes each of
// its panels once, into the VNNI pair layout brgemm takes (kept in L2, reused by every block of
// rows), has brgemm accumulate a block in fp32, and then applies the per-channel scale and the
// bias and rounds to bf16 (the epilogue). The stand-in micro-kernel is a plain loop over the same
// layout: the oracle the tests check the decode, blocking and epilogue with on every machine.
//
// A convolution is the same GEMM over channels-last input (fp8_gemm_cpu.h), K = kh * kw * C. Its
// block is a run of output pixels within one output row, so under each tap of the kernel the
// block's inputs are one strided run of an input row: brgemm reads them in place (ld_a = stride * C)
// and adds each tap's products into the block, with the tap's C / 2 pairs of the panel as B. Taps
// that fall outside the image (the zero padding) add nothing.
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>

#include "common/brgemm.h"
#include "common/half_rounding.h"
#include "common/scratch.h"
#include "fp8/fp8_e4m3.h"
#include "fp8/fp8_gemm_cpu.h"

namespace pyext::cpu {
namespace {

// bf16 bits of every e4m3 code (exact: bf16 keeps e4m3's 3 mantissa bits and its range).
const std::array<uint16_t, 256>& bf16_of_code() {
  static const std::array<uint16_t, 256> table = [] {
    std::array<uint16_t, 256> t{};
    for (uint32_t c = 0; c < 256; ++c) t[c] = float_to_bf16(fp8_e4m3_decode(c));
    return t;
  }();
  return table;
}

void multiply(Microkernel mk, int64_t M, int64_t N, int64_t K, int64_t ld_a, bool add, const uint16_t* A,
              const uint16_t* B, float* C) {
  (mk == Microkernel::kStandIn ? brgemm_bf16_stand_in : brgemm_bf16_onednn)(M, N, K, ld_a, kFp8Panel, kFp8Panel, add,
                                                                            A, B, C);
}

int64_t floor_div(int64_t n, int64_t d) { return n >= 0 ? n / d : -((-n + d - 1) / d); }

// Blocks of rows per panel: a linear's rows, a convolution's output rows, kFp8BrgemmRows at a time.
int64_t row_blocks(const Fp8GemmArgs& a) {
  if (!a.conv) return (a.M + kFp8BrgemmRows - 1) / kFp8BrgemmRows;
  const Conv2dGeometry& g = *a.conv;
  return g.batch * g.OH * ((g.OW + kFp8BrgemmRows - 1) / kFp8BrgemmRows);
}

// acc = the products of output pixels [ow0, ow0 + rows) of output row (b, oh) with the panel's
// cols channels: per tap, the output pixels whose input pixel is inside the image.
void conv_block(Microkernel mk, const Fp8GemmArgs& a, const uint16_t* packed, int64_t b, int64_t oh, int64_t ow0,
                int64_t rows, int64_t cols, float* acc) {
  const Conv2dGeometry& g = *a.conv;
  std::fill(acc, acc + rows * kFp8Panel, 0.0f);
  for (int64_t dy = 0; dy < g.kh; ++dy) {
    const int64_t ih = oh * g.sh - g.ph + dy;
    if (ih < 0 || ih >= g.H) continue;
    for (int64_t dx = 0; dx < g.kw; ++dx) {
      // Output pixels ow with 0 <= ow * sw - pw + dx < W.
      const int64_t lo = std::max(ow0, -floor_div(dx - g.pw, g.sw));
      const int64_t hi = std::min(ow0 + rows, floor_div(g.W - 1 + g.pw - dx, g.sw) + 1);
      if (lo >= hi) continue;
      const uint16_t* x = a.x + ((b * g.H + ih) * g.W + lo * g.sw - g.pw + dx) * g.C;
      const uint16_t* tap = packed + (dy * g.kw + dx) * g.C * kFp8Panel;  // the tap's C / 2 pairs of 64 x 2
      multiply(mk, hi - lo, cols, g.C, g.sw * g.C, true, x, tap, acc + (lo - ow0) * kFp8Panel);
    }
  }
}

// y[m0 + r][n0 + c] = bf16(C[r][c] * scale + bias) for the block's rows and the panel's channels.
void epilogue(const Fp8GemmArgs& a, const float* C, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  float scale[kFp8Panel], bias[kFp8Panel];
  for (int64_t c = 0; c < cols; ++c) {
    scale[c] = a.scale[a.per_tensor ? 0 : n0 + c];
    bias[c] = a.bias ? bf16_to_float(a.bias[n0 + c]) : 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* y = a.y + (m0 + r) * a.N + n0;
    for (int64_t c = 0; c < cols; ++c) y[c] = float_to_bf16(C[r * kFp8Panel + c] * scale[c] + bias[c]);
  }
}

}  // namespace

void fp8_pack_panel_scalar(const uint8_t* w, int64_t N, int64_t K, int64_t n0, uint16_t* packed) {
  const std::array<uint16_t, 256>& bf16 = bf16_of_code();
  for (int64_t p = 0; p < (K + 1) / 2; ++p)
    for (int64_t c = 0; c < kFp8Panel; ++c) {
      const int64_t n = n0 + c;
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t k = 2 * p + j;
        packed[(p * kFp8Panel + c) * 2 + j] = n < N && k < K ? bf16[w[n * K + k]] : 0;
      }
    }
}

int64_t fp8_brgemm_units(const Fp8GemmArgs& a) { return ((a.N + kFp8Panel - 1) / kFp8Panel) * row_blocks(a); }

void fp8_gemm_brgemm(const Fp8GemmArgs& a, int64_t unit_begin, int64_t unit_end, Microkernel mk, bool simd_pack) {
  TORCH_CHECK(a.conv ? a.conv->C % 2 == 0 : a.K % 2 == 0,
              "pyext fp8 brgemm: a linear with an even K or a convolution with an even C only");
  // Per-thread scratch, reused across calls and layers: the decoded panel and the fp32 block.
  thread_local ScratchPtr<uint16_t> panel_buf;
  thread_local ScratchPtr<float> acc_buf;
  thread_local size_t panel_cap = 0, acc_cap = 0;
  uint16_t* packed = grow(panel_buf, panel_cap, static_cast<size_t>(a.K) * kFp8Panel * sizeof(uint16_t));
  float* acc = grow(acc_buf, acc_cap, kFp8BrgemmRows * kFp8Panel * sizeof(float));
  const int64_t blocks = row_blocks(a);
  const int64_t row_runs = a.conv ? (a.conv->OW + kFp8BrgemmRows - 1) / kFp8BrgemmRows : 0;  // blocks per output row
  int64_t decoded = -1;
  for (int64_t u = unit_begin; u < unit_end; ++u) {
    const int64_t panel = u / blocks, block = u % blocks, n0 = panel * kFp8Panel;
    const int64_t cols = std::min<int64_t>(kFp8Panel, a.N - n0);
    if (panel != decoded) {
      (simd_pack ? fp8_pack_panel_avx512 : fp8_pack_panel_scalar)(a.w, a.N, a.K, n0, packed);
      decoded = panel;
    }
    if (!a.conv) {
      const int64_t m0 = block * kFp8BrgemmRows, rows = std::min(kFp8BrgemmRows, a.M - m0);
      multiply(mk, rows, cols, a.K, a.K, false, a.x + m0 * a.K, packed, acc);
      epilogue(a, acc, m0, rows, n0, cols);
      continue;
    }
    const Conv2dGeometry& g = *a.conv;
    const int64_t out_row = block / row_runs, ow0 = (block % row_runs) * kFp8BrgemmRows;
    const int64_t rows = std::min(kFp8BrgemmRows, g.OW - ow0);
    conv_block(mk, a, packed, out_row / g.OH, out_row % g.OH, ow0, rows, cols, acc);
    epilogue(a, acc, out_row * g.OW + ow0, rows, n0, cols);
  }
  if (mk == Microkernel::kOneDnn) brgemm_release_onednn();  // the thread's AMX tile state
}

}  // namespace pyext::cpu
