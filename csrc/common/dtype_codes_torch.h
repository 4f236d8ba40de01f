// The torch side of dtype_codes.h, for the CPU ops and the CUDA glue.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "common/dtype_codes.h"

namespace pyext {

// `op` names the caller in the error ("pyext attention"): the public ops validate dtypes
// with user-facing messages first, so this only guards the raw-pointer kernels.
inline PyextDtype dtype_code(c10::ScalarType dtype, const char* op) {
  switch (dtype) {
    case c10::kFloat: return PYEXT_F32;
    case c10::kHalf: return PYEXT_F16;
    case c10::kBFloat16: return PYEXT_BF16;
    default: TORCH_CHECK(false, op, ": dtype must be float32, float16 or bfloat16, got ", dtype);
  }
}

}  // namespace pyext
