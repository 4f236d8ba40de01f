// The fp8 layers call their op through these functions rather than torch.ops: a torch.ops call
// converts every argument against the schema and boxes it in Python, which costs as much as a
// small layer's whole GEMM. Here the tensors are unpacked and the op called through torch's
// dispatcher, typed, as torch's own functions are: autograd, tracing, fake tensors and dispatch
// modes see the same op call as through torch.ops. What the dispatcher cannot see, a
// __torch_function__ (a tensor subclass, or a mode), is left to torch.ops: the functions then
// return None and the caller makes that call instead.
#include "fp8/fp8_python.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace pyext {
namespace {

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::optional<c10::string_view>);

// A torch.Tensor or nn.Parameter, not a subclass, which may define __torch_function__.
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

// (x, w, scale, bias) -> op(x, w, scale, bias, backend=None), or None where torch.ops must make the call.
PyObject* call_linear(const c10::TypedOperatorHandle<LinearOp>& (*op)(), const char* name, PyObject* const* args,
                      Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "pyext._C.%s takes (x, w, scale, bias), got %zd arguments", name, nargs);
    return nullptr;
  }
  const bool has_bias = args[3] != Py_None;
  if (at::impl::torch_function_mode_enabled() || !plain_tensor(args[0]) || !plain_tensor(args[1]) ||
      !plain_tensor(args[2]) || (has_bias && !plain_tensor(args[3])))
    Py_RETURN_NONE;
  // Owned references, taken with the GIL held: another thread may swap a tensor's contents
  // (torch.utils.swap_tensors) while this call runs without it.
  const at::Tensor x = THPVariable_Unpack(args[0]), w = THPVariable_Unpack(args[1]), scale = THPVariable_Unpack(args[2]);
  const std::optional<at::Tensor> bias = has_bias ? std::optional<at::Tensor>(THPVariable_Unpack(args[3])) : std::nullopt;
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;  // as torch's own functions: a kernel in Python takes it back
    out = op().call(x, w, scale, bias, std::nullopt);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// The ops are defined by pyext's Python package (pyext/ops), before any layer runs.
const c10::TypedOperatorHandle<LinearOp>& linear_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pyext::fp8_linear", "").typed<LinearOp>();
  return op;
}

const c10::TypedOperatorHandle<LinearOp>& linear_dynamic_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyext::fp8_linear_dynamic", "").typed<LinearOp>();
  return op;
}

}  // namespace

PyObject* fp8_linear_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call_linear(linear_op, "fp8_linear", args, nargs);
}

PyObject* fp8_linear_dynamic_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return call_linear(linear_dynamic_op, "fp8_linear_dynamic", args, nargs);
}

}  // namespace pyext
