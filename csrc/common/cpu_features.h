// Run-time CPU feature detection. The SIMD kernels are compiled into separate
// translation units with their own target attributes and chosen here, so the
// package runs on any x86-64 and uses AVX-512 only where the CPU has it.
#pragma once

namespace pyext::cpu {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Highest level both compiled in and supported by this CPU; PYEXT_CPU_SIMD
// (scalar|avx2|avx512) caps it, which the tests use to exercise every path.
SimdLevel simd_level();
const char* simd_name(SimdLevel level);
bool simd_compiled(SimdLevel level);

}  // namespace pyext::cpu
