"""Pure-PyTorch references of the op families whose Triton kernels check their launch configs
against them, one module per family (attention, fp8): each op's semantics, its `reference`
backend and its tests' oracle. They sit below both the op layer (pyext.ops) and the kernels
(pyext.kernels), and import neither."""
