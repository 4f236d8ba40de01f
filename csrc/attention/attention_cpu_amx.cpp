// AMX flash attention for bf16 inputs: attention_cpu_brgemm_impl.h on torch's oneDNN brgemm, its
// softmax and conversions compiled for AVX-512 (every AMX CPU has it).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "attention/attention_cpu_brgemm_impl.h"
#include "attention/attention_cpu_vec_avx512.h"

namespace pyext::cpu {

AttnKernel attention_kernel_amx() {
  return AttnKernel{attn::brgemm_packed_bytes, attn::brgemm_pack,
                    attn::brgemm_forward<attn::VecAvx512, brgemm_bf16_onednn, brgemm_release_onednn>};
}

}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_amx() { return attention_kernel_brgemm_stand_in(); }
}  // namespace pyext::cpu
#endif
