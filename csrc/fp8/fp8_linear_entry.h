// pyext::fp8_linear's kernel on each device (CPU: fp8_ops.cpp; CUDA: fp8_cuda_glue.cpp). pyext's
// dispatch (Python) chooses a backend per call signature: the dtype, device, sizes and strides of
// every argument. Once it keeps, as the automatic choice for a signature, a backend that the
// extension also runs (one registered here by its dispatch name), it arms that signature with it
// (torch.ops.pyext_C.fp8_linear_arm), and later calls with it run that backend straight from
// torch's dispatcher. Every other call (a forced backend, a signature not armed, inputs that need
// autograd) goes to the Python dispatch, registered as pyext_C::fp8_linear_dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace pyext {

using Fp8LinearFn = at::Tensor (*)(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                   const std::optional<at::Tensor>& bias);

// Makes `fn` the backend that fp8_linear_arm(..., backend) arms a signature with (at load time).
void register_armable(const char* backend, Fp8LinearFn fn);

// The armed backend for an armed signature, else the Python dispatch. If it throws (other than out
// of memory), the signature is disarmed and the Python dispatch runs the call: its backend makes
// the same kernel calls, and a failure there is handled as any backend's (marked, warned, passed on).
at::Tensor fp8_linear_entry(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, std::optional<c10::string_view> backend);

}  // namespace pyext
