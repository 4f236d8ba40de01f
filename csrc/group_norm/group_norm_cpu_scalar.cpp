// Portable build of the GroupNorm kernels (any x86-64 / other CPUs; SSE2 vectors on x86-64).
#include "group_norm/group_norm_cpu_impl.h"

namespace pyext::cpu {
GroupNormKernel group_norm_kernel_scalar(PyextDtype dtype) { return kernel_for(dtype); }
}  // namespace pyext::cpu
