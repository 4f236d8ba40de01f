"""Public ops. Each is a torch.library custom op (torch.ops.pyext.*) with several backends."""
from pyext.ops.attention import attention
from pyext.ops.fp8 import FP8, FP8_MAX, fp8_linear, fp8_quantize, fp8_upcast
from pyext.ops.fp8_conv import fp8_conv2d
from pyext.ops.fp8_dynamic import fp8_linear_dynamic
from pyext.ops.geglu import geglu
from pyext.ops.group_moments import group_moments
from pyext.ops.group_norm import group_norm
from pyext.ops.tile_blend import tile_blend_diffusers, tile_blend_normalized
from pyext.ops.winograd import winograd_conv3x3

__all__ = ["FP8", "FP8_MAX", "attention", "fp8_conv2d", "fp8_linear", "fp8_linear_dynamic", "fp8_quantize", "fp8_upcast",
           "geglu", "group_moments", "group_norm", "tile_blend_diffusers", "tile_blend_normalized", "winograd_conv3x3"]
