/* The one numbering of floating dtypes in csrc: CPU kernels, the C launchers of the .cu
 * kernels and the torch glue all pass these. Plain C, so .cu files built without torch
 * headers include it too; dtype_codes_torch.h maps at::ScalarType onto it. */
#pragma once

typedef enum PyextDtype { PYEXT_F32 = 0, PYEXT_F16 = 1, PYEXT_BF16 = 2 } PyextDtype;

/* Bytes per element (a macro, so C++ can use it in constant expressions). */
#define PYEXT_DTYPE_SIZE(dtype) ((dtype) == PYEXT_F32 ? 4 : 2)
