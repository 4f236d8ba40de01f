// One-lane "vector" traits for attention_cpu_impl.h and attention_cpu_brgemm_impl.h: the portable
// units (the scalar kernel and the brgemm stand-in) compile the SIMD algorithms with them.
#pragma once
#include <cmath>

#include "attention/attention_cpu_impl.h"
#include "common/pairs.h"

namespace pyext::cpu::attn {
namespace {

struct VecScalar {
  using reg = float;
  static constexpr int64_t kW = 1;
  static reg zero() { return 0.0f; }
  static reg set1(float x) { return x; }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg x) { *p = x; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg max(reg a, reg b) { return a > b ? a : b; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static float reduce_max(reg x) { return x; }
  static float reduce_add(reg x) { return x; }
  static reg exp2(reg x) { return std::exp2(x); }
  static void store_bf16(uint16_t* p, reg x) { *p = float_to_bf16(x); }
  // brgemm_pack's layouts (attention_cpu_brgemm_impl.h)
  static void transpose_pairs(const uint16_t* src, int64_t rows, int64_t pairs, int64_t ld_src, uint32_t* dst,
                              int64_t ld_dst) {
    pyext::cpu::transpose_pairs(src, rows, pairs, ld_src, dst, ld_dst);
  }
  static void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
    pyext::cpu::interleave_rows(a, b, n, dst);
  }
};

}  // namespace
}  // namespace pyext::cpu::attn
