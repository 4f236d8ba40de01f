// Portable fp8 decode and IEEE round-to-nearest-even narrowing, bit-exact with
// the SIMD kernels (and the PyTorch reference) for every input, NaN included.
#include <cstring>

#include "fp8_convert.h"

namespace pyext::cpu {

static uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

float fp8_decode(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t exp = (code >> 3) & 0xf, man = code & 0x7;
  if (exp == 0xf && man == 0x7) return float_of(sign | 0x7ff00000u);  // NaN
  float mag = exp == 0 ? static_cast<float>(man) * (1.0f / 512.0f)   // subnormal: m * 2^-9
                       : float_of(((exp + 120) << 23) | (man << 20));
  return sign ? -mag : mag;
}

uint16_t fp32_to_bf16_bits(float value) {
  const uint32_t u = bits_of(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(u >> 16);  // NaN keeps sign/payload
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

uint16_t fp32_to_fp16_bits(float value) {
  uint32_t u = bits_of(value);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u | ((u >> 13) & 0x3ffu);  // NaN: quiet, payload top bits
  if (u >= 0x47800000u) return sign | 0x7c00u;                         // >= 65536: inf
  if (u < 0x38800000u) {
    // Result is an fp16 subnormal (or zero): adding 0.5 aligns the value so the
    // FPU's own round-to-nearest-even rounds it at the fp16 subnormal ulp (2^-24).
    const float magic = float_of(126u << 23);  // 0.5
    return sign | static_cast<uint16_t>(bits_of(float_of(u) + magic) - bits_of(magic));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(u >> 13);
}

namespace {

struct DecodeTable {
  float value[256];
  DecodeTable() { for (int c = 0; c < 256; ++c) value[c] = fp8_decode(static_cast<uint8_t>(c)); }
};

template <OutType kOut>
void rows_scalar(const uint8_t* src, void* dst, int64_t n, float scale, bool /*stream*/) {
  static const DecodeTable table;
  for (int64_t i = 0; i < n; ++i) {
    // A NaN code keeps its own NaN whatever the scale: for NaN * NaN, x86 returns whichever
    // operand the compiler put first.
    const float d = table.value[src[i]];
    const float v = d != d ? d : d * scale;
    if constexpr (kOut == OutType::kF32) static_cast<float*>(dst)[i] = v;
    else if constexpr (kOut == OutType::kBF16) static_cast<uint16_t*>(dst)[i] = fp32_to_bf16_bits(v);
    else static_cast<uint16_t*>(dst)[i] = fp32_to_fp16_bits(v);
  }
}

}  // namespace

Fp8RowFn fp8_row_kernel_scalar(OutType out) {
  switch (out) {
    case OutType::kBF16: return rows_scalar<OutType::kBF16>;
    case OutType::kF16: return rows_scalar<OutType::kF16>;
    default: return rows_scalar<OutType::kF32>;
  }
}

}  // namespace pyext::cpu
