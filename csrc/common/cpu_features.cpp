#include "common/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace pyext::cpu {

bool simd_compiled(SimdLevel level) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  (void)level;
  return true;
#else
  return level == SimdLevel::kScalar;
#endif
}

static SimdLevel detect() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return SimdLevel::kAvx2;
#endif
  return SimdLevel::kScalar;
}

SimdLevel simd_level() {
  SimdLevel level = detect();
  if (const char* cap = std::getenv("PYEXT_CPU_SIMD")) {
    SimdLevel want = !std::strcmp(cap, "scalar") ? SimdLevel::kScalar
                     : !std::strcmp(cap, "avx2") ? SimdLevel::kAvx2
                                                 : SimdLevel::kAvx512;
    if (static_cast<int>(want) < static_cast<int>(level)) level = want;
  }
  return level;
}

const char* simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace pyext::cpu
