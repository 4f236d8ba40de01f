// Torch glue for GEGLU: schema of torch.ops.pyext_C.geglu and its CPU implementation. User-facing
// validation lives in pyext/ops/geglu.py; the TORCH_CHECKs here only keep the raw-pointer kernels
// inside their buffers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/dtype_codes_torch.h"
#include "geglu/geglu_cpu.h"

namespace pyext::cpu {
namespace {

constexpr const char* kOp = "pyext geglu";
constexpr int64_t kSpan = 4096;        // elements of one row per item: a row of a wide FFN is several
constexpr int64_t kTaskElems = 32768;  // at::parallel_for grain, in elements

GegluSpan span_for_level(PyextDtype dtype) {
  switch (simd_level()) {
    case SimdLevel::kAvx512: return geglu_span_avx512(dtype);
    case SimdLevel::kAvx2: return geglu_span_avx2(dtype);
    default: return geglu_span_scalar(dtype);
  }
}

// x (..., 2 * D) -> (..., D): the first half of each row times gelu of the second.
at::Tensor geglu_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, kOp, ": x must be (..., 2 * D)");
  const int64_t two_d = x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = two_d / 2;
  at::Tensor y = at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  at::Tensor rows = x.reshape({-1, two_d});  // a view where x's rows are evenly spaced
  if (rows.stride(1) != 1) rows = rows.contiguous();
  GegluArgs a{};
  a.dtype = dtype_code(x.scalar_type(), kOp);
  a.x = rows.data_ptr();
  a.y = y.data_ptr();
  a.rows = rows.size(0);
  a.D = two_d / 2;
  a.x_stride = rows.stride(0);
  const GegluSpan span = span_for_level(a.dtype);
  const int64_t spans = (a.D + kSpan - 1) / kSpan;
  const int64_t grain = std::max<int64_t>(1, kTaskElems / std::min(a.D, kSpan));
  at::parallel_for(0, a.rows * spans, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / spans, start = item % spans * kSpan;
      span(a, row, start, std::min(a.D, start + kSpan));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) { m.def("geglu(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) { m.impl("geglu", geglu_cpu); }

}  // namespace pyext::cpu
