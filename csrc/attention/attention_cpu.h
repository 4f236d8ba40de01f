// CPU flash-attention forward: softmax(q k^T * scale + bias) v for one (batch, head)
// at a time, on raw pointers so the SIMD units include no torch headers.
//
// The glue (attention_ops.cpp) reads q/k/v in their own layout (unit-stride head dims, any
// row stride: diffusers' (B, S, H, D)-transposed heads are read in place), packs each
// (batch, kv head)'s k and v into a SIMD-friendly layout (long k/v a chunk at a time,
// AttnCarry, so the packed copy stays small), then runs `forward` over blocks of
// query rows in parallel. Scores exist only for 4-8 query rows x 256 keys at a
// time; the full (Sq, Skv) matrix never does.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype_codes.h"

namespace pyext::cpu {

// Where keys come in chunks (the glue packs long k/v a chunk at a time, so the packed copy
// stays small), each query row's running output, max and sum go from one chunk's call to the
// next: o is rows x d fp32, m and l rows each. first: nothing carried in yet. last: the final
// chunk, whose call normalises into `out` instead of carrying out. m is in the units of the
// call's scores, which differ with and without a bias: every chunk of one row passes a bias or
// none does.
struct AttnCarry {
  float* o;
  float* m;
  float* l;
  bool first, last;
};

struct AttnKernel {
  // Bytes of packed k+v for one (batch, head).
  size_t (*packed_bytes)(int64_t skv, int64_t d);
  // Packs k and v (each skv rows of d, type t; a row ldk / ldv elements after the last) into `packed`.
  void (*pack)(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t skv, int64_t d, PyextDtype t,
               void* packed);
  // out[rows x d] = attention of q[rows x d] (type t; rows ldq and ldo elements apart) over one
  // packed k/v; with a carry (else null), over one chunk of the keys: out is written by the last
  // chunk only.
  // bias (else null): fp32, added to the scaled score of row r and key j (counted from this
  // chunk's first key) as bias[r * bias_stride + j]; stride 0 gives every row the same bias.
  // lse (else null): each row's natural-log log-sum-exp of its scores, written with out.
  // A row whose scores are all -inf gets lse -inf and output 0 with a bias (a fully masked
  // row, as torch's SDPA gives), NaN without (fp32 overflow: softmax's NaN).
  void (*forward)(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d,
                  float scale, const float* bias, int64_t bias_stride, PyextDtype t, void* out, int64_t ldo,
                  float* lse, const AttnCarry* carry);
  // Query rows the glue hands each parallel task (forward takes any count; this is its pass).
  int64_t query_block;
};

// fp32 accumulation everywhere; the *_bf16dot kernel (bf16 inputs only, needs
// AVX512_BF16) multiplies bf16 pairs with vdpbf16ps, rounding softmax
// probabilities to bf16 before the p @ v product as GPU flash attention does.
AttnKernel attention_kernel_scalar();
AttnKernel attention_kernel_avx2();
AttnKernel attention_kernel_avx512();
AttnKernel attention_kernel_avx512_bf16dot();
// bf16 inputs only, both products on a brgemm micro-kernel (attention_cpu_brgemm_impl.h): torch's
// oneDNN brgemm on AMX CPUs (an AVX-512 unit), and the plain C++ stand-in that the tests check the
// packing, blocking and softmax with on every CPU: with a portable softmax, and with the amx
// unit's AVX-512 one where the CPU has AVX-512.
AttnKernel attention_kernel_amx();
AttnKernel attention_kernel_brgemm_stand_in();
AttnKernel attention_kernel_brgemm_stand_in_avx512();

}  // namespace pyext::cpu
