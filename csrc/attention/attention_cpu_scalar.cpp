// Portable flash attention: the same algorithm with one-lane "vectors". The
// reference path for every CPU and the baseline the SIMD units are tested against.
#include "attention/attention_cpu_vec_scalar.h"

namespace pyext::cpu {
AttnKernel attention_kernel_scalar() { return attn::Fp32Attention<attn::VecScalar, 4, 4>::kernel(); }
}  // namespace pyext::cpu
