"""pyext: compiled kernels and a one-call optimizer for Hugging Face diffusers pipelines.

Importing pyext never touches the GPU and never fails for a missing extension:
without pyext._C the PyTorch reference backends run, and `python -m pyext info`
says why the extension is missing.
"""
import warnings

from pyext import memory, ops
from pyext._ext import EXT, EXT_ERROR
from pyext.dispatch import PyextError
from pyext.nn import FP8Conv2d, FP8Linear, quantize_fp8, restore_fp8
from pyext.optimize import optimize, plan, report, restore
from pyext.options import OptimizeOptions
from pyext.parallel import context_parallel_plan

__version__ = "0.1.0"

if EXT is None:
    warnings.warn(EXT_ERROR, stacklevel=2)

__all__ = ["memory", "ops", "PyextError", "OptimizeOptions", "optimize", "plan", "report", "restore", "FP8Conv2d", "FP8Linear", "quantize_fp8", "restore_fp8",
           "context_parallel_plan", "__version__"]
