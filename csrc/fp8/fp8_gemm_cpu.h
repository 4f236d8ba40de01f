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

}  // namespace pyext::cpu
