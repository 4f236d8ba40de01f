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

// A panel: channels [n0, n0 + kFp8Panel) of w decoded to bf16 in the VNNI pair layout,
// packed[k / 2][channel][k % 2], zero past N and K. The AVX-512 packer (fp8_gemm_supported()
// CPUs) and the scalar one write the same bits.
constexpr int64_t kFp8Panel = 64;
void fp8_pack_panel_avx512(const uint8_t* w, int64_t N, int64_t K, int64_t n0, uint16_t* packed);
void fp8_pack_panel_scalar(const uint8_t* w, int64_t N, int64_t K, int64_t n0, uint16_t* packed);

// The same GEMM on torch's micro-kernel (fp8_gemm_cpu_brgemm.cpp), for a linear with an even K or
// a convolution with an even C: kOneDnn is at::native::cpublas::brgemm (oneDNN's AMX kernel where
// cpublas::could_pack(bf16)), kStandIn a plain loop over the same layout, which the tests take as
// the oracle on every machine. A unit is a panel times a block of up to kFp8BrgemmRows rows (a
// convolution's blocks lie within one output row).
enum class Microkernel { kOneDnn, kStandIn };
constexpr int64_t kFp8BrgemmRows = 32;  // rows of x per unit: two AMX tiles of 16
int64_t fp8_brgemm_units(const Fp8GemmArgs& a);
void fp8_gemm_brgemm(const Fp8GemmArgs& a, int64_t unit_begin, int64_t unit_end, Microkernel mk, bool simd_pack);

}  // namespace pyext::cpu
