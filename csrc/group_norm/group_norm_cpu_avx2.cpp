// AVX2 + FMA build of the GroupNorm kernels: the same source, auto-vectorised with 8 fp32 lanes.
// FMA contraction stays on (GCC's default): it only makes the sums and x * scale + offset closer.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma,f16c")
#define PYEXT_GN_F16C  // fp16 runs convert with vcvtph2ps / vcvtps2ph
#include "group_norm/group_norm_cpu_impl.h"

namespace pyext::cpu {
GroupNormKernel group_norm_kernel_avx2(PyextDtype dtype) { return kernel_for(dtype); }
}  // namespace pyext::cpu
#else
#include "group_norm/group_norm_cpu.h"
namespace pyext::cpu {
GroupNormKernel group_norm_kernel_avx2(PyextDtype dtype) { return group_norm_kernel_scalar(dtype); }
}  // namespace pyext::cpu
#endif
