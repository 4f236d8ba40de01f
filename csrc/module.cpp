// The Python module pyext._C: build facts for `python -m pyext info` and the block pool's scope.
// The kernels are registered as torch.ops.pyext_C.* by each family's file
// (TORCH_LIBRARY_FRAGMENT), so this file needs Python's C API only, not torch's headers; the
// functions that call ops from Python live with their family (fp8/fp8_python.cpp).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <initializer_list>

#include "common/block_pool.h"
#include "common/cpu_features.h"
#include "fp8/fp8_gemm_cpu.h"
#include "fp8/fp8_python.h"

namespace {

bool append_name(PyObject* list, const char* name) {
  PyObject* s = PyUnicode_FromString(name);
  bool ok = s != nullptr && PyList_Append(list, s) == 0;
  Py_XDECREF(s);
  return ok;
}

PyObject* cpu_capabilities(PyObject*, PyObject*) {
  using pyext::cpu::SimdLevel;
  PyObject* levels = PyList_New(0);
  if (levels == nullptr) return nullptr;
  const int have = static_cast<int>(pyext::cpu::simd_level());
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512})
    if (static_cast<int>(l) <= have && !append_name(levels, pyext::cpu::simd_name(l))) return Py_DECREF(levels), nullptr;
  // bf16 dot products: the fused fp8 GEMM and the bf16 attention kernel use them.
  if (pyext::cpu::simd_level() == SimdLevel::kAvx512 && pyext::cpu::fp8_gemm_supported() &&
      !append_name(levels, "avx512_bf16"))
    return Py_DECREF(levels), nullptr;
  return levels;
}

PyObject* pool_open(PyObject*, PyObject* arg) {
  unsigned long long cache_bytes = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(pyext::pool::open(static_cast<size_t>(cache_bytes)));
}

PyObject* pool_close(PyObject*, PyObject*) {
  pyext::pool::close();
  Py_RETURN_NONE;
}

PyObject* pool_stats(PyObject*, PyObject*) {
  pyext::pool::Stats s = pyext::pool::stats();
  return Py_BuildValue("{s:O,s:K,s:K,s:K}", "open", s.open ? Py_True : Py_False, "cached_bytes",
                       static_cast<unsigned long long>(s.cached_bytes), "hits", static_cast<unsigned long long>(s.hits),
                       "misses", static_cast<unsigned long long>(s.misses));
}

PyObject* built_with_cuda(PyObject*, PyObject*) {
#ifdef PYEXT_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"cpu_capabilities", cpu_capabilities, METH_NOARGS,
     "SIMD levels the CPU kernels use on this machine (PYEXT_CPU_SIMD caps them)."},
    {"pool_open", pool_open, METH_O, "Opens a block pool scope (pyext._memory.reused_blocks)."},
    {"pool_close", pool_close, METH_NOARGS, "Closes a block pool scope."},
    {"pool_stats", pool_stats, METH_NOARGS, "The block pool's state: open, cached_bytes, hits, misses."},
    {"built_with_cuda", built_with_cuda, METH_NOARGS, "Whether the CUDA kernels were built."},
    {"fp8_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pyext::fp8_linear_call)), METH_FASTCALL,
     "fp8_linear(x, w, scale, bias): torch.ops.pyext.fp8_linear without torch.ops; None where a "
     "__torch_function__ needs torch.ops."},
    {"fp8_linear_dynamic", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pyext::fp8_linear_dynamic_call)),
     METH_FASTCALL,
     "fp8_linear_dynamic(x, w, scale, bias): torch.ops.pyext.fp8_linear_dynamic without torch.ops; None where a "
     "__torch_function__ needs torch.ops."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "pyext's compiled kernels (torch.ops.pyext_C).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
