// Torch glue for the CUDA fp8 upcast: registers the CUDA implementation of
// torch.ops.pyext_C.fp8_upcast_out, and pyext::fp8_linear's CUDA kernel, which runs the
// upcast_cublas backend for the signatures pyext's dispatch armed (fp8_linear_entry.h). Built
// only when torch has CUDA. It uses the
// device-generic c10 stream API (no c10/cuda headers) so it also compiles, for a
// syntax check, against a CPU-only torch.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "common/dtype_codes_torch.h"
#include "fp8/fp8_linear_entry.h"
#include "fp8/fp8_upcast_cuda.h"

namespace {

void fp8_upcast_out_cuda(const at::Tensor& w, const at::Tensor& scale, at::Tensor& out) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "pyext fp8_upcast (CUDA): weight must be the uint8 view of e4m3 codes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && (scale.numel() == 1 || scale.numel() == w.size(0)),
              "pyext fp8_upcast (CUDA): scale must be float32 with 1 or weight.size(0) elements");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == w.sizes(),
              "pyext fp8_upcast (CUDA): out must be contiguous, with w's shape ", w.sizes(), ", got ", out.sizes());
  at::assert_no_overlap(out, w);
  TORCH_CHECK(w.device() == out.device() && scale.device() == w.device(),
              "pyext fp8_upcast (CUDA): weight, scale and out must be on one device");
  const PyextDtype out_type = pyext::dtype_code(out.scalar_type(), "pyext fp8_upcast (CUDA)");
  if (w.numel() == 0) return;
  const c10::DeviceGuard guard(w.device());
  const at::Tensor wc = w.contiguous(), sc = scale.contiguous();
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(w.device().type())->getStream(w.device());
  const int64_t rows = w.size(0), cols = w.numel() / rows;
  const cudaError_t err = pyext_fp8_upcast_cuda(static_cast<const uint8_t*>(wc.data_ptr()), out.data_ptr(),
                                                sc.data_ptr<float>(), rows, cols, sc.numel() != 1, out_type,
                                                static_cast<cudaStream_t>(stream.native_handle()));
  TORCH_CHECK(err == cudaSuccess, "pyext fp8_upcast (CUDA): kernel launch failed: ", cudaGetErrorString(err));
}

// pyext/ops/fp8.py's upcast_cublas backend: the weight upcast into a fresh tensor (from the caching
// allocator, so a captured CUDA graph can replay it), then torch's linear (cuBLAS).
at::Tensor fp8_linear_upcast_cublas(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                    const std::optional<at::Tensor>& bias) {
  at::Tensor weight = at::empty(w.sizes(), x.options());
  fp8_upcast_out_cuda(w, scale, weight);
  return at::linear(x, weight, bias);
}

const bool upcast_cublas_armable = (pyext::register_armable("upcast_cublas", fp8_linear_upcast_cublas), true);

at::Tensor fp8_linear_entry_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& bias, std::optional<c10::string_view> backend) {
  return pyext::fp8_linear_entry(x, w, scale, bias, backend);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyext_C, CUDA, m) { m.impl("fp8_upcast_out", fp8_upcast_out_cuda); }

// pyext::fp8_linear is defined in Python (pyext/ops/fp8.py), which works without this extension.
TORCH_LIBRARY_IMPL(pyext, CUDA, m) { m.impl("fp8_linear", fp8_linear_entry_cuda); }
