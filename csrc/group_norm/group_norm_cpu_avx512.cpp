// AVX-512 build of the GroupNorm kernels: the same source, auto-vectorised with 16 fp32 lanes, and
// the channels-last passes written in intrinsics.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define PYEXT_GN_F16C  // fp16 runs convert with vcvtph2ps / vcvtps2ph
#define PYEXT_GN_AVX512  // the channels-last passes in intrinsics (group_norm_rows_avx512.h)
#include "group_norm/group_norm_cpu_impl.h"

namespace pyext::cpu {
GroupNormKernel group_norm_kernel_avx512(PyextDtype dtype) { return kernel_for(dtype); }
}  // namespace pyext::cpu
#else
#include "group_norm/group_norm_cpu.h"
namespace pyext::cpu {
GroupNormKernel group_norm_kernel_avx512(PyextDtype dtype) { return group_norm_kernel_scalar(dtype); }
}  // namespace pyext::cpu
#endif
