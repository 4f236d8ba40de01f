// Scalar fp32 <-> bf16 / fp16 conversions, the one set every CPU unit and .cu kernel uses,
// so all paths round alike: IEEE round-to-nearest-even from fp32; a NaN stays NaN, quiet,
// with its sign and the top bits of its payload (what F16C's vcvtps2ph does). The SIMD
// units' vector conversions are tested bit-exact against these through the ops
// (tests/test_fp8_ops.py, tests/test_tile_blend.py).
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype_codes.h"

#ifdef __CUDACC__
#define PYEXT_HOST_DEVICE __host__ __device__
#else
#define PYEXT_HOST_DEVICE
#endif

namespace pyext {
// Internal linkage: SIMD units include this under their own `#pragma GCC target`, and an
// out-of-line AVX-512 copy must never be merged into the portable units by the linker.
namespace {

PYEXT_HOST_DEVICE inline uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

PYEXT_HOST_DEVICE inline float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Branch-free (every case computed, one selected) so that loops over them vectorise; the
// float arithmetic runs unconditionally, as GCC will not if-convert it (-ftrapping-math).
// Multi-way selects are bit masks: GCC 12 keeps nested ternaries as branches for AVX2 and SSE.
PYEXT_HOST_DEVICE inline uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }
PYEXT_HOST_DEVICE inline uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

PYEXT_HOST_DEVICE inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

PYEXT_HOST_DEVICE inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // quiet
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

PYEXT_HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  const uint32_t normal = ((exp + 112u + (112u & mask_if(exp == 0x1f))) << 23) | (mant << 13);  // inf/NaN: exponent 255
  // Subnormal (or zero): 2^-14 * (1 + mant / 1024) - 2^-14 = mant * 2^-24, exact.
  const float subnormal = bits_float((113u << 23) | (mant << 13)) - bits_float(113u << 23);
  return bits_float(sign | select_bits(mask_if(exp == 0), float_bits(subnormal), normal));
}

PYEXT_HOST_DEVICE inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f) & 0x7fffffffu, sign = (float_bits(f) >> 16) & 0x8000u;
  // Normal results: rebias the exponent (-112 << 23) and round to nearest even; a carry
  // out of the mantissa rounds up into the next binade, or to inf from 65520 up.
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  // Subnormal results (and zero): adding 0.5 aligns the value so that the FPU's own
  // round-to-nearest-even rounds it at the fp16 subnormal ulp, 2^-24.
  const uint32_t subnormal = float_bits(bits_float(u) + 0.5f) - float_bits(0.5f);
  const uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);  // quiet, top payload bits
  const uint32_t magnitude = select_bits(mask_if(u > 0x7f800000u), nan,
                                         select_bits(mask_if(u >= 0x47800000u), 0x7c00u,
                                                     select_bits(mask_if(u < 0x38800000u), subnormal, normal)));
  return static_cast<uint16_t>(sign | magnitude);
}

// Elements of a dtype code: storage type T, load to fp32, store rounded from fp32.
template <PyextDtype D> struct DtypeIo;
template <> struct DtypeIo<PYEXT_F32> {
  using T = float;
  PYEXT_HOST_DEVICE static float load(T v) { return v; }
  PYEXT_HOST_DEVICE static T store(float v) { return v; }
};
template <> struct DtypeIo<PYEXT_F16> {
  using T = uint16_t;
  PYEXT_HOST_DEVICE static float load(T v) { return fp16_to_float(v); }
  PYEXT_HOST_DEVICE static T store(float v) { return float_to_fp16(v); }
};
template <> struct DtypeIo<PYEXT_BF16> {
  using T = uint16_t;
  PYEXT_HOST_DEVICE static float load(T v) { return bf16_to_float(v); }
  PYEXT_HOST_DEVICE static T store(float v) { return float_to_bf16(v); }
};

// Element i of a float32 / float16 / bfloat16 array, as fp32; and its store, rounded.
PYEXT_HOST_DEVICE inline float load_elem(const void* p, int64_t i, PyextDtype t) {
  switch (t) {
    case PYEXT_BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case PYEXT_F16: return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

PYEXT_HOST_DEVICE inline void store_elem(void* p, int64_t i, float f, PyextDtype t) {
  switch (t) {
    case PYEXT_BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(f); break;
    case PYEXT_F16: static_cast<uint16_t*>(p)[i] = float_to_fp16(f); break;
    default: static_cast<float*>(p)[i] = f;
  }
}

// n values src[c] * k, rounded to type t, into p from element i0: the switch outside the loop,
// so that the loop vectorises.
template <PyextDtype D>
inline void store_scaled_row_as(void* p, int64_t i0, const float* src, float k, int64_t n) {
  typename DtypeIo<D>::T* d = static_cast<typename DtypeIo<D>::T*>(p) + i0;
  for (int64_t c = 0; c < n; ++c) d[c] = DtypeIo<D>::store(src[c] * k);
}

inline void store_scaled_row(void* p, int64_t i0, const float* src, float k, int64_t n, PyextDtype t) {
  switch (t) {
    case PYEXT_BF16: return store_scaled_row_as<PYEXT_BF16>(p, i0, src, k, n);
    case PYEXT_F16: return store_scaled_row_as<PYEXT_F16>(p, i0, src, k, n);
    default: return store_scaled_row_as<PYEXT_F32>(p, i0, src, k, n);
  }
}

}  // namespace
}  // namespace pyext
