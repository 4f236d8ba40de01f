// The fp8-weight GEMM on torch's oneDNN micro-kernel, at::native::cpublas::brgemm, on the AMX
// tiles of CPUs where torch packs bf16 for it (see fp8_gemm_cpu.h).
//
// A task decodes its 64-channel panels a group at a time into the VNNI pair layout brgemm takes
// (one buffer kept in L2, reused by every block of the task's rows; all the task's groups at once
// where they fit, each block of rows then going through every group), has brgemm multiply a block
// of rows with the whole group in fp32, and then applies the per-channel scale and the bias and
// rounds to bf16 (the epilogue). The stand-in micro-kernel is a plain loop over the same layout:
// the oracle the tests check the decode, blocking and epilogue with on every machine.
//
// A convolution is the same GEMM over channels-last input (fp8_gemm_cpu.h), K = kh * kw * C. Its
// block is a run of output pixels within one output row, so under each tap of the kernel the
// block's inputs are one strided run of an input row: brgemm reads them in place (ld_a = stride * C)
// and adds each tap's products into the block, with the tap's C / 2 pairs of the group as B. Taps
// that fall outside the image (the zero padding) add nothing.
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "common/brgemm.h"
#include "common/pairs.h"
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

// A group's decoded panels, `ld` channels per pair row.
struct Group {
  uint16_t* packed;
  int64_t n0, cols, ld;
};

void multiply(Microkernel mk, int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, bool add, const uint16_t* A,
              const uint16_t* B, float* C) {
  (mk == Microkernel::kStandIn ? brgemm_bf16_stand_in : brgemm_bf16_onednn)(M, N, K, ld_a, ld_b, ld_b, add, A, B, C);
}
int64_t floor_div(int64_t n, int64_t d) { return n >= 0 ? n / d : -((-n + d - 1) / d); }

// GEMM rows of one image in grid mode: through the last output row's last pixel.
int64_t grid_rows(const Conv2dGeometry& g) { return (g.OH - 1) * g.W + g.OW; }

// Blocks of rows, kFp8BrgemmRows at a time: a linear's rows; a convolution's output pixels within
// one output row, or in grid mode an image's GEMM rows across output rows.
int64_t row_blocks(const Fp8GemmArgs& a) {
  if (!a.conv) return (a.M + kFp8BrgemmRows - 1) / kFp8BrgemmRows;
  const Conv2dGeometry& g = *a.conv;
  if (g.grid) return g.batch * ((grid_rows(g) + kFp8BrgemmRows - 1) / kFp8BrgemmRows);
  return g.batch * g.OH * ((g.OW + kFp8BrgemmRows - 1) / kFp8BrgemmRows);
}

// Block `block`'s GEMM rows [m0, m0 + rows) of image b (a linear: b = 0, its rows; a convolution's
// output pixels numbered oh * OW + ow, in grid mode oh * W + ow).
struct BlockRows {
  int64_t b, m0, rows;
};
BlockRows block_rows(const Fp8GemmArgs& a, int64_t block) {
  if (!a.conv) {
    const int64_t m0 = block * kFp8BrgemmRows;
    return {0, m0, std::min(kFp8BrgemmRows, a.M - m0)};
  }
  const Conv2dGeometry& g = *a.conv;
  if (g.grid) {
    const int64_t per_image = (grid_rows(g) + kFp8BrgemmRows - 1) / kFp8BrgemmRows, m0 = block % per_image * kFp8BrgemmRows;
    return {block / per_image, m0, std::min(kFp8BrgemmRows, grid_rows(g) - m0)};
  }
  const int64_t runs = (g.OW + kFp8BrgemmRows - 1) / kFp8BrgemmRows;  // blocks per output row
  const int64_t out_row = block / runs, ow0 = (block % runs) * kFp8BrgemmRows;
  return {out_row / g.OH, out_row % g.OH * g.OW + ow0, std::min(kFp8BrgemmRows, g.OW - ow0)};
}

// acc (+)= the products of output pixels [ow0, ow0 + rows) of output row (b, oh) with the group's
// channels under taps [t0, t1), whose pairs the group holds from its first row: per tap, the output
// pixels whose input pixel is inside the image.
void conv_block(Microkernel mk, const Fp8GemmArgs& a, const Group& grp, int64_t t0, int64_t t1, int64_t b,
                int64_t oh, int64_t ow0, int64_t rows, float* acc) {
  const Conv2dGeometry& g = *a.conv;
  if (t0 == 0) std::fill(acc, acc + rows * grp.ld, 0.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t dy = t / g.kw, dx = t % g.kw, ih = oh * g.sh - g.ph + dy;
    if (ih < 0 || ih >= g.H) continue;
    // Output pixels ow with 0 <= ow * sw - pw + dx < W.
    const int64_t lo = std::max(ow0, -floor_div(dx - g.pw, g.sw));
    const int64_t hi = std::min(ow0 + rows, floor_div(g.W - 1 + g.pw - dx, g.sw) + 1);
    if (lo >= hi) continue;
    const uint16_t* x = a.x + ((b * g.H + ih) * g.W + lo * g.sw - g.pw + dx) * g.C;
    const uint16_t* tap = grp.packed + (t - t0) * g.C * grp.ld;  // the tap's C / 2 pairs of ld x 2
    multiply(mk, hi - lo, grp.cols, g.C, g.sw * g.C, grp.ld, true, x, tap, acc + (lo - ow0) * grp.ld);
  }
}

// Grid mode: acc (+)= GEMM rows [m0, m0 + rows) of image b under taps [t0, t1), one run of x each.
void grid_block(Microkernel mk, const Fp8GemmArgs& a, const Group& grp, int64_t t0, int64_t t1, int64_t b,
                int64_t m0, int64_t rows, float* acc) {
  const Conv2dGeometry& g = *a.conv;
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* x = a.x + (b * g.H * g.W + m0 + t / g.kw * g.W + t % g.kw) * g.C;
    multiply(mk, rows, grp.cols, g.C, g.C, grp.ld, t > 0, x, grp.packed + (t - t0) * g.C * grp.ld, acc);
  }
}

// acc (+)= block `block` of the rows times the group's columns [k0, k1) of K (a sum from k0 = 0).
void accumulate(Microkernel mk, const Fp8GemmArgs& a, const Group& grp, int64_t block, int64_t k0, int64_t k1,
                float* acc) {
  const BlockRows r = block_rows(a, block);
  if (!a.conv)
    return multiply(mk, r.rows, grp.cols, k1 - k0, a.K, grp.ld, k0 > 0, a.x + r.m0 * a.K + k0, grp.packed, acc);
  const Conv2dGeometry& g = *a.conv;
  if (g.grid) return grid_block(mk, a, grp, k0 / g.C, k1 / g.C, r.b, r.m0, r.rows, acc);
  conv_block(mk, a, grp, k0 / g.C, k1 / g.C, r.b, r.m0 / g.OW, r.m0 % g.OW, r.rows, acc);
}

// y's rows of block `block` from its fp32 sums: scale, bias, rounding; in grid mode the output
// pixels only, a run per output row.
void store_block(bool simd, const Fp8GemmArgs& a, const float* acc, int64_t ld, int64_t cols, const float* scale,
                 const float* bias, int64_t n0, int64_t block) {
  const auto epilogue = simd ? fp8_epilogue_avx512 : fp8_epilogue_scalar;
  const BlockRows r = block_rows(a, block);
  if (!a.conv || !a.conv->grid) {
    const int64_t first = a.conv ? r.b * a.conv->OH * a.conv->OW + r.m0 : r.m0;
    return epilogue(acc, ld, r.rows, cols, scale, bias, a.y + first * a.N + n0, a.N);
  }
  const Conv2dGeometry& g = *a.conv;
  for (int64_t m = r.m0; m < r.m0 + r.rows;) {
    const int64_t oh = m / g.W, ow = m % g.W, run = std::min(g.W - ow, r.m0 + r.rows - m);
    const int64_t valid = std::min(run, std::max<int64_t>(0, g.OW - ow));
    if (valid > 0)
      epilogue(acc + (m - r.m0) * ld, ld, valid, cols, scale, bias, a.y + ((r.b * g.OH + oh) * g.OW + ow) * a.N + n0, a.N);
    m += run;
  }
}

// [begin, end) of n things split into `shares` balanced shares.
std::pair<int64_t, int64_t> share(int64_t n, int64_t shares, int64_t i) { return {n * i / shares, n * (i + 1) / shares}; }

bool small_linear(const Fp8GemmArgs& a) { return !a.conv && a.M <= kFp8SmallRows; }

// The small-M GEMM (fp8_gemm_cpu.h): y^T = w x^T for the task's share of the panels.
void gemm_small(const Fp8GemmArgs& a, const Fp8BrgemmSplit& split, int64_t task, Microkernel mk, bool simd) {
  const int64_t M = a.M, K = a.K, panels = (a.N + kFp8Panel - 1) / kFp8Panel, kc = split.k_chunk;
  const auto [p0, p1] = share(panels, split.panel_shares, task);
  thread_local ScratchPtr<uint16_t> xt_buf, w_buf;
  thread_local ScratchPtr<float> acc_buf;
  thread_local size_t xt_cap = 0, w_cap = 0, acc_cap = 0;
  uint16_t* xt = grow(xt_buf, xt_cap, static_cast<size_t>(K) * M * sizeof(uint16_t));
  // The decoded rows lie ld_wd apart: 64 bytes past the chunk, so that the micro-kernel's loads of 16
  // rows never fall 4 KiB apart, into the same cache sets.
  const int64_t ld_wd = kc + 32;
  uint16_t* wd = grow(w_buf, w_cap, static_cast<size_t>(kFp8Panel) * ld_wd * sizeof(uint16_t));
  // acc: the panel's channels x M (the product), then M x its channels (the epilogue's rows), and the
  // panel's scales and biases.
  float* acc = grow(acc_buf, acc_cap, static_cast<size_t>(2 * kFp8Panel * M + 2 * kFp8Panel) * sizeof(float));
  float* rows = acc + kFp8Panel * M;
  float* scale = rows + kFp8Panel * M;
  float* bias = scale + kFp8Panel;
  (simd ? fp8_transpose_pairs_avx512 : fp8_transpose_pairs_scalar)(a.x, M, K, xt);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kFp8Panel, cols = std::min(kFp8Panel, a.N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {  // a chunk of each row at a time, kept in L2
      const int64_t k1 = std::min(K, k0 + kc);
      (simd ? fp8_decode_rows_avx512 : fp8_decode_rows_scalar)(a.w + n0 * K + k0, K, cols, k1 - k0, wd, ld_wd);
      multiply(mk, cols, M, k1 - k0, ld_wd, M, k0 > 0, wd, xt + k0 * M, acc);
    }
    for (int64_t c = 0; c < cols; ++c) {
      scale[c] = a.scale[a.per_tensor ? 0 : n0 + c];
      bias[c] = a.bias ? bf16_to_float(a.bias[n0 + c]) : 0.0f;
      for (int64_t m = 0; m < M; ++m) rows[m * kFp8Panel + c] = acc[c * M + m];
    }
    (simd ? fp8_epilogue_avx512 : fp8_epilogue_scalar)(rows, kFp8Panel, M, cols, scale, bias, a.y + n0, a.N);
  }
  if (mk == Microkernel::kOneDnn) brgemm_release_onednn();
}

// Decoded groups stay within kGroupBytes, at most kMaxGroup panels (320 channels per micro-kernel
// call: SD1.5's 320-channel layers in one call, where a call of 256 and one of 64 per block of rows
// were slower; 512 channels, whose fp32 block outgrows L1, were slower too). A K too large for
// that is decoded kChunkBytes at a time, a chunk which every block of rows multiplies while it is
// in L2 (a quarter of kGroupBytes was faster than the whole: the
// micro-kernel reads less of both operands from L2 per block).
constexpr size_t kGroupBytes = size_t{1} << 20;
constexpr size_t kChunkBytes = size_t{256} << 10;
constexpr int64_t kMaxGroup = 5;
// The small-M GEMM's chunk of each decoded row (8 KiB), which with x^T's chunk stays in L2.
constexpr int64_t kSmallChunk = 4096;
// The fp32 sums of the blocks one chunk of K is multiplied with, at most.
constexpr size_t kChunkSumBytes = size_t{512} << 10;
// Panels per group: at most `most`, in groups as even as they come (7 as 4 + 3, not 5 + 2), so that
// the micro-kernel calls take one or two shapes of similar width.
int64_t even_groups(int64_t panels, int64_t most) {
  most = std::clamp<int64_t>(most, 1, panels);
  const int64_t groups = (panels + most - 1) / most;
  return (panels + groups - 1) / groups;
}

// A GEMM below this many multiply-adds runs as one task: waking a thread costs more.
constexpr int64_t kMinTaskWork = int64_t{1} << 22;

}  // namespace

void fp8_pack_panel_scalar(const uint8_t* w, int64_t ld_w, int64_t N, int64_t K, int64_t n0, uint16_t* packed,
                           int64_t ld) {
  const std::array<uint16_t, 256>& bf16 = bf16_of_code();
  for (int64_t p = 0; p < (K + 1) / 2; ++p)
    for (int64_t c = 0; c < kFp8Panel; ++c) {
      const int64_t n = n0 + c;
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t k = 2 * p + j;
        packed[(p * ld + c) * 2 + j] = n < N && k < K ? bf16[w[n * ld_w + k]] : 0;
      }
    }
}

void fp8_decode_rows_scalar(const uint8_t* w, int64_t ld_w, int64_t rows, int64_t K, uint16_t* out, int64_t ld_out) {
  const std::array<uint16_t, 256>& bf16 = bf16_of_code();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) out[r * ld_out + k] = bf16[w[r * ld_w + k]];
}

void fp8_transpose_pairs_scalar(const uint16_t* x, int64_t M, int64_t K, uint16_t* xt) {
  transpose_pairs(x, M, K / 2, K, reinterpret_cast<uint32_t*>(xt), M);
}

void fp8_epilogue_scalar(const float* acc, int64_t ld_acc, int64_t rows, int64_t cols, const float* scale,
                         const float* bias, uint16_t* y, int64_t ld_y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ld_y + c] = float_to_bf16(std::fma(acc[r * ld_acc + c], scale[c], bias[c]));
}

Fp8BrgemmSplit fp8_brgemm_split(const Fp8GemmArgs& a, int64_t threads) {
  const int64_t panels = (a.N + kFp8Panel - 1) / kFp8Panel, blocks = row_blocks(a);
  if (a.M * a.N * a.K < kMinTaskWork) threads = 1;
  Fp8BrgemmSplit split;
  // Panels, unless they do not split evenly and the rows do (then every task decodes every panel,
  // a small cost beside that many rows); the small-M GEMM splits panels only.
  const bool by_rows = !small_linear(a) && panels % threads != 0 && blocks >= threads;
  split.panel_shares = by_rows ? 1 : std::max<int64_t>(1, std::min(panels, threads));
  split.row_shares = small_linear(a) ? 1 : std::max<int64_t>(1, std::min(blocks, threads / split.panel_shares));
  const int64_t per_task = (panels + split.panel_shares - 1) / split.panel_shares;
  if (small_linear(a)) {
    // The small-M GEMM decodes each panel's rows as they lie, a chunk of each at a time.
    split.group = 1;
    split.k_chunk = std::min(kSmallChunk, a.K);
    return split;
  }
  // A group of up to kMaxGroup panels whose whole K fits kGroupBytes; where even one panel's does
  // not, up to kMaxGroup panels whose one tap of a convolution fits it, decoded kChunkBytes at a time:
  // a convolution's chunk is a run of whole taps, a linear's a multiple of the packer's 64 codes.
  // Where all the task's panels fit, they stay decoded together (resident).
  const int64_t fit = static_cast<int64_t>(kGroupBytes / (static_cast<size_t>(a.K) * kFp8Panel * sizeof(uint16_t)));
  split.group = even_groups(per_task, std::min(fit, kMaxGroup));
  split.k_chunk = a.K;
  split.resident = fit >= per_task;
  if (fit == 0) {
    const int64_t unit = a.conv ? a.conv->C : 64;
    const int64_t tap_fit = static_cast<int64_t>(kGroupBytes / (static_cast<size_t>(unit) * kFp8Panel * sizeof(uint16_t)));
    split.group = even_groups(per_task, std::min(tap_fit, kMaxGroup));
    const size_t row_bytes = static_cast<size_t>(split.group) * kFp8Panel * sizeof(uint16_t);
    split.k_chunk = std::min(a.K, std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / row_bytes) / unit) * unit);
  }
  return split;
}

bool fp8_brgemm_grid_pays(const Conv2dGeometry& g) {
  const size_t panel_bytes = static_cast<size_t>(g.kh * g.kw * g.C) * kFp8Panel * sizeof(uint16_t);
  return g.sh == 1 && g.sw == 1 && (g.OW <= 8 || (g.OW < kFp8BrgemmRows && panel_bytes <= kGroupBytes));
}

void fp8_gemm_brgemm(const Fp8GemmArgs& a, const Fp8BrgemmSplit& split, int64_t task, Microkernel mk, bool simd) {
  TORCH_CHECK(a.conv ? a.conv->C % 2 == 0 : a.K % 2 == 0,
              "pyext fp8 brgemm: a linear with an even K or a convolution with an even C only");
  if (small_linear(a)) return gemm_small(a, split, task, mk, simd);
  const int64_t panels = (a.N + kFp8Panel - 1) / kFp8Panel, ld = split.group * kFp8Panel, kc = split.k_chunk;
  const auto [p0, p1] = share(panels, split.panel_shares, task / split.row_shares);
  const auto [b0, b1] = share(row_blocks(a), split.row_shares, task % split.row_shares);
  const int64_t groups = (p1 - p0 + split.group - 1) / split.group, n_first = p0 * kFp8Panel;
  const int64_t n_end = std::min(a.N, p1 * kFp8Panel);
  // Blocks whose sums are kept while K is decoded a chunk at a time: their fp32 blocks stay in L2
  // beside the chunk; one when the whole K is decoded at once.
  const int64_t run = kc == a.K ? 1 : std::max<int64_t>(1, kChunkSumBytes / (kFp8BrgemmRows * ld * sizeof(float)));
  // Per-thread scratch, reused across calls and layers: the decoded groups (every one of the task's
  // when resident, else one), the fp32 blocks, the task's scales and biases.
  thread_local ScratchPtr<uint16_t> group_buf;
  thread_local ScratchPtr<float> acc_buf, epi_buf;
  thread_local size_t group_cap = 0, acc_cap = 0, epi_cap = 0;
  const size_t group_elems = static_cast<size_t>(kc + 1) * ld;
  uint16_t* packed = grow(group_buf, group_cap, (split.resident ? groups : 1) * group_elems * sizeof(uint16_t));
  float* acc = grow(acc_buf, acc_cap, run * kFp8BrgemmRows * ld * sizeof(float));
  float* scale = grow(epi_buf, epi_cap, 2 * (n_end - n_first) * sizeof(float));
  float* bias = scale + (n_end - n_first);
  for (int64_t n = n_first; n < n_end; ++n) {
    scale[n - n_first] = a.scale[a.per_tensor ? 0 : n];
    bias[n - n_first] = a.bias ? bf16_to_float(a.bias[n]) : 0.0f;
  }
  // The task's group i, its decoded panels in `buf`.
  const auto group = [&](int64_t i, uint16_t* buf) {
    const int64_t g0 = p0 + i * split.group, n0 = g0 * kFp8Panel;
    return Group{buf, n0, std::min(a.N, std::min(p1, g0 + split.group) * kFp8Panel) - n0, ld};
  };
  const auto decode = [&](const Group& grp, int64_t k0, int64_t k1) {
    for (int64_t c = 0; c < grp.cols; c += kFp8Panel)
      (simd ? fp8_pack_panel_avx512 : fp8_pack_panel_scalar)(a.w + k0, a.K, a.N, k1 - k0, grp.n0 + c,
                                                           grp.packed + c * 2, ld);
  };
  const auto store = [&](const Group& grp, const float* sums, int64_t block) {
    store_block(simd, a, sums, ld, grp.cols, scale + grp.n0 - n_first, bias + grp.n0 - n_first, grp.n0, block);
  };
  if (split.resident) {
    // Every group decoded once; then each block of rows goes through all of them, so that its rows
    // of y are written whole, a block at a time, not a group's columns of every row at a time.
    for (int64_t i = 0; i < groups; ++i) decode(group(i, packed + i * group_elems), 0, a.K);
    for (int64_t block = b0; block < b1; ++block)
      for (int64_t i = 0; i < groups; ++i) {
        const Group grp = group(i, packed + i * group_elems);
        accumulate(mk, a, grp, block, 0, a.K, acc);
        store(grp, acc, block);
      }
  } else {
    for (int64_t i = 0; i < groups; ++i) {  // a group at a time over all the task's blocks
      const Group grp = group(i, packed);
      for (int64_t r0 = b0; r0 < b1; r0 += run) {
        const int64_t r1 = std::min(b1, r0 + run);
        for (int64_t k0 = 0; k0 < a.K; k0 += kc) {
          const int64_t k1 = std::min(a.K, k0 + kc);
          if (kc < a.K || r0 == b0) decode(grp, k0, k1);  // the whole K: decoded once for all the task's blocks
          for (int64_t block = r0; block < r1; ++block)
            accumulate(mk, a, grp, block, k0, k1, acc + (block - r0) * kFp8BrgemmRows * ld);
        }
        for (int64_t block = r0; block < r1; ++block) store(grp, acc + (block - r0) * kFp8BrgemmRows * ld, block);
      }
    }
  }
  if (mk == Microkernel::kOneDnn) brgemm_release_onednn();  // the thread's AMX tile state
}

}  // namespace pyext::cpu
