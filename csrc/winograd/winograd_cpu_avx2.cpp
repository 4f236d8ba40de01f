// AVX2 build of the Winograd transforms: the same source, auto-vectorised over channels
// (8 fp32 lanes).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma")
#define PYEXT_WINOGRAD_STREAM  // the transformed weight is stored with vmovntps
#include "winograd/winograd_cpu_impl.h"

namespace pyext::cpu {
WinogradKernels winograd_avx2() { return kKernels; }
}  // namespace pyext::cpu
#else
#include "winograd/winograd_cpu.h"
namespace pyext::cpu {
WinogradKernels winograd_avx2() { return {nullptr, nullptr, nullptr}; }
}  // namespace pyext::cpu
#endif
