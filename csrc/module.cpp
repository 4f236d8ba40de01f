// The Python module pyext._C: build facts for `python -m pyext info`. The kernels
// themselves are registered as torch.ops.pyext_C.* by each family's file.
#include <torch/extension.h>

#include "common/block_pool.h"
#include "common/cpu_features.h"
#include "fp8/fp8_gemm_cpu.h"

TORCH_LIBRARY(pyext_C, m) {}  // each kernel family adds its ops with TORCH_LIBRARY_FRAGMENT

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pyext::cpu::SimdLevel;
  m.def("cpu_capabilities", [] {
    std::vector<std::string> levels;
    for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512})
      if (static_cast<int>(l) <= static_cast<int>(pyext::cpu::simd_level())) levels.push_back(pyext::cpu::simd_name(l));
    // bf16 dot products: the fused fp8 GEMM and the bf16 attention kernel use them.
    if (pyext::cpu::simd_level() == SimdLevel::kAvx512 && pyext::cpu::fp8_gemm_supported()) levels.push_back("avx512_bf16");
    return levels;
  }, "SIMD levels the CPU kernels use on this machine (PYEXT_CPU_SIMD caps them).");
  m.def("pool_open", &pyext::pool::open, "Opens a block pool scope (pyext._memory.reused_blocks).");
  m.def("pool_close", &pyext::pool::close);
  m.def("pool_stats", [] {
    pyext::pool::Stats s = pyext::pool::stats();
    return py::dict(py::arg("open") = s.open, py::arg("cached_bytes") = s.cached_bytes, py::arg("hits") = s.hits,
                    py::arg("misses") = s.misses);
  });
  m.def("built_with_cuda", [] {
#ifdef PYEXT_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
