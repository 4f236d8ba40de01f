// attention_cpu_brgemm_impl.h on the stand-in micro-kernel, compiled for any CPU: the tests' check
// of the AMX path's packing, blocking and softmax where there is no AMX.
#include "attention/attention_cpu_brgemm_impl.h"
#include "attention/attention_cpu_vec_scalar.h"

namespace pyext::cpu {

AttnKernel attention_kernel_brgemm_stand_in() {
  return AttnKernel{attn::brgemm_packed_bytes, attn::brgemm_pack<attn::VecScalar>,
                    attn::brgemm_forward<attn::VecScalar, brgemm_bf16_stand_in, brgemm_release_stand_in>, attn::kBrgemmRows};
}

}  // namespace pyext::cpu
