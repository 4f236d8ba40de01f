// Drives every CPU attention kernel (raw-pointer API, no torch) over awkward shapes with
// exact-size heap buffers; built with -fsanitize=address,undefined by
// tests/test_attention_op.py::test_kernels_clean_under_sanitizers. v = 1 makes every fp32
// output exactly 1, so a wrong softmax normalisation is caught too; each shape runs once over
// all keys and once in two chunks of keys (AttnCarry), each without and with an exact-size
// bias (row 0 fully masked: output 0, lse -inf; key 0 masked in the others) and lse buffer.
// Rows of q, k, v and the output lie ld = d + 3 elements apart (the kernels read strided rows, as
// of diffusers' (B, S, H, D) layout), each buffer ending at its last row's last element.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include "attention/attention_cpu.h"
using namespace pyext::cpu;
int main() {
  AttnKernel ks[6] = {attention_kernel_scalar(), attention_kernel_avx2(), attention_kernel_avx512(),
                      attention_kernel_avx512_bf16dot(), attention_kernel_brgemm_stand_in(),
                      attention_kernel_brgemm_stand_in_avx512()};
  const char* names[6] = {"scalar", "avx2", "avx512", "bf16dot", "brgemm stand-in", "brgemm stand-in, avx512 softmax"};
  int64_t ds[] = {1, 2, 7, 8, 15, 16, 17, 33, 40, 48, 64, 72, 80, 100, 128, 160, 255, 256};
  int64_t ss[] = {1, 2, 15, 16, 17, 31, 33, 77, 255, 256, 257, 300};
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool runs[6] = {true, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), avx512,
                        avx512 && __builtin_cpu_supports("avx512bf16"), true, avx512};
  int fails = 0;
  for (int ki = 0; ki < 6; ++ki) {
    if (!runs[ki]) { printf("skipped %s (CPU lacks it)\n", names[ki]); continue; }
    for (PyextDtype t : {PYEXT_BF16, PYEXT_F16, PYEXT_F32}) {
      if (ki >= 3 && t != PYEXT_BF16) continue;
      size_t es = PYEXT_DTYPE_SIZE(t);
      for (int64_t d : ds) for (int64_t sq : {1L, 9L, 17L}) for (int64_t skv : ss) {
        const int64_t ld = d + 3, nq = (sq - 1) * ld + d, nkv = (skv - 1) * ld + d;  // elements
        // exact-size heap buffers so ASan catches any overrun
        char* q = (char*)malloc(nq * es); char* k = (char*)malloc(nkv * es); char* v = (char*)malloc(nkv * es);
        char* o = (char*)malloc(nq * es);
        for (int64_t i = 0; i < nq * (int64_t)es; ++i) q[i] = (i % 2) ? 0x3f : 0x00;  // small positive values
        for (int64_t i = 0; i < nkv * (int64_t)es; ++i) { k[i] = (i % 2) ? 0x3e : 0x11; v[i] = (i % 2) ? 0x3f : 0x22; }
        if (t == PYEXT_F32) { for (int64_t i=0;i<nq;++i) ((float*)q)[i]=0.01f*(i%7); for (int64_t i=0;i<nkv;++i) {((float*)k)[i]=0.02f*(i%5); ((float*)v)[i]=1.0f;} }
        float* bias = (float*)malloc(sq * skv * sizeof(float)); float* lse = (float*)malloc(sq * sizeof(float));
        for (int64_t i = 0; i < sq * skv; ++i) bias[i] = (sq > 1 && i < skv) || (skv > 1 && i % skv == 0) ? -INFINITY : 0.5f * (i % 3);
        // all keys in one call, then (skv > 1) in two chunks with exact-size carry buffers
        for (bool biased : {false, true}) for (int64_t split : {skv, skv / 2}) {
          if (split == 0) continue;
          float* co = (float*)malloc(sq * d * sizeof(float)); float* cm = (float*)malloc(sq * sizeof(float));
          float* cl = (float*)malloc(sq * sizeof(float));
          for (int64_t j0 = 0; j0 < skv; j0 = j0 ? skv : split) {
            const int64_t n = j0 ? skv - j0 : split;
            void* p = malloc(ks[ki].packed_bytes(n, d));
            ks[ki].pack(k + j0 * ld * es, ld, v + j0 * ld * es, ld, n, d, t, p);
            AttnCarry carry{co, cm, cl, j0 == 0, j0 + n == skv};
            ks[ki].forward(q, ld, sq, p, n, d, 0.1f, biased ? bias + j0 : nullptr, skv, t, o, ld, biased ? lse : nullptr,
                           split == skv ? nullptr : &carry);
            free(p);
          }
          free(co); free(cm); free(cl);
          const bool masked0 = biased && sq > 1;  // row 0 attends to nothing
          if (t == PYEXT_F32) for (int64_t i=0;i<sq*d;++i) { const float x = ((float*)o)[i / d * ld + i % d]; if (std::fabs(x-(masked0 && i < d ? 0.0f : 1.0f)) > 1e-5f) { if (fails++ < 5) printf("bad %s d=%ld sq=%ld skv=%ld split=%ld biased=%d %f\n", names[ki], d, sq, skv, split, biased, x); break; } }
          if (biased) for (int64_t r = 0; r < sq; ++r) if ((r == 0 && masked0) != (lse[r] == -INFINITY) || std::isnan(lse[r])) { if (fails++ < 5) printf("bad lse %s d=%ld sq=%ld skv=%ld split=%ld row %ld: %f\n", names[ki], d, sq, skv, split, r, lse[r]); break; }
        }
        free(q); free(k); free(v); free(o); free(bias); free(lse);
      }
    }
  }
  printf("done, fails=%d\n", fails);
  return fails != 0;
}
