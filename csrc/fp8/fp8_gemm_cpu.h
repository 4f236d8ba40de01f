// bf16 x fp8 GEMM that reads the fp8 weight directly: y = x @ (decode(w) * scale)^T + bias.
// Plain C++ on raw pointers so the SIMD unit includes no torch headers.
//
// The weight is never upcast as a whole: each panel of 64 output channels is decoded
// to bf16 straight into the GEMM's packed (VNNI pair) layout, so the packing that any
// bf16 GEMM does anyway is the only pass over the weight, and it reads half the bytes.
// The per-channel scale is applied to the fp32 accumulator (e4m3 values are exact in
// bf16), so the product is as exact as F.linear on the upcast weight, or more.
#pragma once
#include <cstdint>

namespace pyext::cpu {

// A convolution runs as an implicit GEMM over channels-last activations: row m of the
// GEMM is output pixel m, and its K = kh * kw * C inputs are the C channels of each of
// the kh * kw input pixels under the kernel (read in place, zeros outside the image).
struct Conv2dGeometry {
  int64_t batch, H, W, C;  // input, NHWC
  int64_t OH, OW;          // output
  int64_t kh, kw, sh, sw, ph, pw;
  // The brgemm GEMM's grid mode (stride 1, x already zero-padded: ph = pw = 0): output pixel (oh, ow)
  // is GEMM row oh * W + ow of its image, so under each tap a block of rows that spans output rows
  // is one run of x with a pixel's stride; the rows ow >= OW between them are computed and dropped.
  bool grid = false;
};

struct Fp8GemmArgs {
  const uint16_t* x;     // linear: (M, K) bf16 bits, row-major; conv: NHWC input
  const uint8_t* w;      // (N, K) e4m3fn codes, row-major; conv: (N, kh, kw, C)
  const float* scale;    // N floats, or 1 when per_tensor
  bool per_tensor;
  const uint16_t* bias;  // N bf16 bits or nullptr
  uint16_t* y;           // (M, N) bf16 bits, row-major (conv: NHWC output)
  int64_t M, N, K;
  const Conv2dGeometry* conv = nullptr;  // set for a convolution (C must be even)
};

// Work is a grid of (64-channel panel, block of rows) units; a thread runs a
// contiguous range of them, so each thread packs each of its panels once.
int64_t fp8_gemm_units(int64_t M, int64_t N);
void fp8_gemm_bf16_avx512(const Fp8GemmArgs& a, int64_t unit_begin, int64_t unit_end);

// True when this CPU can run fp8_gemm_bf16_avx512 (AVX-512 F/BW/VL + AVX512_BF16).
bool fp8_gemm_supported();

// A panel: channels [n0, n0 + kFp8Panel) of w (N rows of K codes, ld_w apart: a chunk of the
// weight's columns when ld_w > K) decoded to bf16 in the VNNI pair layout,
// packed[k / 2][channel][k % 2] with `ld` channels per pair row (a panel's own kFp8Panel, or a
// group's: fp8_gemm_brgemm), zero past N and K. The AVX-512 packer (fp8_brgemm_simd_supported()
// CPUs) and the scalar one write the same bits.
constexpr int64_t kFp8Panel = 64;
void fp8_pack_panel_avx512(const uint8_t* w, int64_t ld_w, int64_t N, int64_t K, int64_t n0, uint16_t* packed,
                           int64_t ld);
void fp8_pack_panel_scalar(const uint8_t* w, int64_t ld_w, int64_t N, int64_t K, int64_t n0, uint16_t* packed,
                           int64_t ld);

// Rows of K codes (ld_w apart) decoded to bf16 as they lie, ld_out apart: the small-M GEMM's A.
// The AVX-512 decoder (fp8_brgemm_simd_supported() CPUs) and the scalar one write the same bits.
void fp8_decode_rows_avx512(const uint8_t* w, int64_t ld_w, int64_t rows, int64_t K, uint16_t* out, int64_t ld_out);
void fp8_decode_rows_scalar(const uint8_t* w, int64_t ld_w, int64_t rows, int64_t K, uint16_t* out, int64_t ld_out);

// x (M rows of K bf16, K even) to xt[k / 2][m][2], x^T in VNNI pairs: the small-M GEMM's B. The
// AVX-512 one (fp8_brgemm_simd_supported() CPUs) and the scalar one write the same bits.
void fp8_transpose_pairs_avx512(const uint16_t* x, int64_t M, int64_t K, uint16_t* xt);
void fp8_transpose_pairs_scalar(const uint16_t* x, int64_t M, int64_t K, uint16_t* xt);

// y[r][c] = bf16(fma(acc[r][c], scale[c], bias[c])) for rows x cols of an fp32 block (ld_acc per
// row) into y (ld_y per row), rounded to nearest even: the AVX-512 epilogue (AVX512_BF16's conversion)
// and the scalar one (float_to_bf16) write the same bits, but for results below bf16's smallest
// normal, which the conversion flushes to zero.
void fp8_epilogue_avx512(const float* acc, int64_t ld_acc, int64_t rows, int64_t cols, const float* scale,
                         const float* bias, uint16_t* y, int64_t ld_y);
void fp8_epilogue_scalar(const float* acc, int64_t ld_acc, int64_t rows, int64_t cols, const float* scale,
                         const float* bias, uint16_t* y, int64_t ld_y);

// The same GEMM on torch's micro-kernel (fp8_gemm_cpu_brgemm.cpp), for a linear with an even K or
// a convolution with an even C: kOneDnn is at::native::cpublas::brgemm (oneDNN's AMX kernel where
// cpublas::could_pack(bf16)), kStandIn a plain loop over the same layout, which the tests take as
// the oracle on every machine.
//
// The work is split into tasks, one per thread: each takes a balanced share of the 64-channel
// panels (and, where there are fewer panels than threads, of the blocks of kFp8BrgemmRows rows; a
// convolution's blocks lie within one output row). A task decodes its panels a group at a time
// (Fp8BrgemmSplit::group of them, one buffer that stays in L2) and multiplies each group with every
// block of its rows, so x is read once per group rather than once per panel; where all its groups
// fit that buffer's budget they are decoded at once (Fp8BrgemmSplit::resident) and each block of
// rows goes through every group, writing its output rows whole. Where even one panel
// of the whole K would not stay in L2, the group is decoded a chunk of K at a time
// (Fp8BrgemmSplit::k_chunk; a convolution's chunks are whole taps), each chunk multiplied with a run
// of the task's blocks whose fp32 sums stay in L2 beside it.
//
// A linear of at most kFp8SmallRows rows instead multiplies y^T = w x^T: each panel's 64 rows of w
// are decoded as they lie (the A operand: no transpose; a chunk of K at a time where a panel would
// not stay in L2), and x^T is packed once per task as B. At few rows the decode is most of the
// work, and this one streams.
enum class Microkernel { kOneDnn, kStandIn };
constexpr int64_t kFp8BrgemmRows = 32;  // rows of x per micro-kernel call: two AMX tiles of 16
constexpr int64_t kFp8SmallRows = 64;
struct Fp8BrgemmSplit {
  int64_t panel_shares, row_shares;  // tasks = panel_shares x row_shares
  int64_t group;                     // panels decoded and multiplied together
  int64_t k_chunk;                   // columns of K decoded at a time: K, or less where K is large
  bool resident = false;             // all the task's panels decoded at once (they fit where a group does)
};
Fp8BrgemmSplit fp8_brgemm_split(const Fp8GemmArgs& a, int64_t threads);
// simd: the AVX-512 packer, row decoder and epilogue (fp8_brgemm_simd_supported(): AVX512_BF16 and
// AVX512_VBMI, which every AMX CPU has), else the scalar ones.
bool fp8_brgemm_simd_supported();
// Whether a convolution runs in grid mode (Conv2dGeometry::grid): stride 1 and output rows of at
// most 8 pixels, or shorter than a block where K is decoded whole: where it was faster than blocks
// within a row on an AMX CPU at SD1.5's 3x3 convolutions (docs/benchmarks.md); at 16 pixels with K
// decoded a tap at a time it was slower.
bool fp8_brgemm_grid_pays(const Conv2dGeometry& g);
void fp8_gemm_brgemm(const Fp8GemmArgs& a, const Fp8BrgemmSplit& split, int64_t task, Microkernel mk, bool simd);

}  // namespace pyext::cpu
