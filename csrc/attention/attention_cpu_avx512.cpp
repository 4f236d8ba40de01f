// AVX-512 fp32 flash attention (16 keys or 16 output columns per vector).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "attention/attention_cpu_vec_avx512.h"

namespace pyext::cpu {
// 8 rows x 3 vectors = 24 accumulators of the 32 zmm registers.
AttnKernel attention_kernel_avx512() { return attn::Fp32Attention<attn::VecAvx512, 8, 3>::kernel(); }
}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_avx512() { return attention_kernel_scalar(); }
}  // namespace pyext::cpu
#endif
