// Portable flash attention: the same algorithm with one-lane "vectors". The
// reference path for every CPU and the baseline the SIMD units are tested against.
#include "attention/attention_cpu_impl.h"

namespace pyext::cpu {
namespace attn {
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
};

}  // namespace
}  // namespace attn

AttnKernel attention_kernel_scalar() { return attn::Fp32Attention<attn::VecScalar, 4, 4>::kernel(); }
}  // namespace pyext::cpu
