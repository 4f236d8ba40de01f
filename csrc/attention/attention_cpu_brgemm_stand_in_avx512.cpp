// attention_cpu_brgemm_impl.h with the amx unit's AVX-512 softmax and conversions on the stand-in
// micro-kernel: where a CPU has AVX-512 but no AMX, the tests' check of the amx path's vector code.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "attention/attention_cpu_brgemm_impl.h"
#include "attention/attention_cpu_vec_avx512.h"

namespace pyext::cpu {

AttnKernel attention_kernel_brgemm_stand_in_avx512() {
  return AttnKernel{attn::brgemm_packed_bytes, attn::brgemm_pack<attn::VecAvx512>,
                    attn::brgemm_forward<attn::VecAvx512, brgemm_bf16_stand_in, brgemm_release_stand_in>, attn::kBrgemmRows};
}

}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_brgemm_stand_in_avx512() { return attention_kernel_brgemm_stand_in(); }
}  // namespace pyext::cpu
#endif
