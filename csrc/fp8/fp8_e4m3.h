// Decoding of one fp8 e4m3fn code, shared by the CPU scalar unit (which tabulates it) and
// the CUDA upcast kernel, so both decode alike.
#pragma once
#include <cstdint>

#include "common/half_rounding.h"

namespace pyext {
namespace {  // internal linkage, as in half_rounding.h

// The 7 magnitude bits shifted left by 7 are the fp16 encoding of value / 256 (e4m3 has
// exponent bias 7, fp16 15), normals and subnormals alike. The NaN codes (0x7f, 0xff)
// decode to the fp32 NaN 0x7ff00000 with their sign.
PYEXT_HOST_DEVICE inline float fp8_e4m3_decode(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 8;
  if ((code & 0x7fu) == 0x7fu) return bits_float((sign << 16) | 0x7ff00000u);
  return fp16_to_float(static_cast<uint16_t>(sign | ((code & 0x7fu) << 7))) * 256.0f;
}

}  // namespace
}  // namespace pyext
