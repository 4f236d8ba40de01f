// pyext._C.fp8_linear and pyext._C.fp8_linear_dynamic: the layers' call of the ops
// pyext::fp8_linear and pyext::fp8_linear_dynamic without torch.ops (see fp8_python.cpp).
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace pyext {

PyObject* fp8_linear_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* fp8_linear_dynamic_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace pyext
