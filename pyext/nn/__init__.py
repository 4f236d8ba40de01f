from pyext.nn.fp8 import DEFAULT_SKIP, FP8Conv2d, FP8Linear, quantize_fp8, restore_fp8

__all__ = ["DEFAULT_SKIP", "FP8Conv2d", "FP8Linear", "quantize_fp8", "restore_fp8"]
