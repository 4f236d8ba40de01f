// The bf16 micro-kernel the AMX kernels are built on, torch-free so that SIMD units can call it:
// torch's oneDNN brgemm (at::native::cpublas::brgemm, AMX tiles where could_pack(bf16) holds) and
// a plain C++ stand-in over the same layout, which the tests take as the oracle on every CPU.
//
// C[m][n] (+)= sum over k of A[m][k] * B[k][n] for M x K bf16 A (row-major, ld_a elements per row)
// and K x N bf16 B in the VNNI pair layout B[k / 2][n][k % 2] (ld_b columns per pair row; K even),
// into fp32 C (ld_c per row), adding to C when add_C.
#pragma once
#include <cstdint>

namespace pyext::cpu {

using BrgemmBf16 = void (*)(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                            const uint16_t* A, const uint16_t* B, float* C);

void brgemm_bf16_onednn(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                        const uint16_t* A, const uint16_t* B, float* C);
void brgemm_bf16_stand_in(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                          const uint16_t* A, const uint16_t* B, float* C);

// Ends this thread's use of oneDNN's micro-kernel (its AMX tile state); nothing for the stand-in.
void brgemm_release_onednn();
void brgemm_release_stand_in();

// torch packs bf16 for its brgemm here: oneDNN is on and the CPU has AMX.
bool brgemm_amx_available();

}  // namespace pyext::cpu
