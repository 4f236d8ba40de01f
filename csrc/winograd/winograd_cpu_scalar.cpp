// Portable build of the Winograd transforms.
#include "winograd/winograd_cpu_impl.h"

namespace pyext::cpu {
WinogradKernels winograd_scalar() { return kKernels; }
}  // namespace pyext::cpu
