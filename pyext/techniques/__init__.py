"""The techniques `pyext.optimize` composes, in the order they run.

Module-changing techniques first (they run with offload hooks suspended), then placement,
then compilation, which must capture the final modules.
"""
from pyext.techniques.activations import FuseGEGLU
from pyext.techniques.base import Entry, Technique
from pyext.techniques.compile import Compile
from pyext.techniques.layout import ChannelsLast
from pyext.techniques.norms import FuseNorms, UpsamplePhases
from pyext.techniques.packing import Prepack
from pyext.techniques.placement import Device, Offload
from pyext.techniques.routing import Attention
from pyext.techniques.vae_memory import VAESlicing, VAETiling
from pyext.techniques.weights import FP8, DType

TECHNIQUES: tuple[Technique, ...] = (DType(), FP8(), ChannelsLast(), FuseNorms(), UpsamplePhases(), FuseGEGLU(), Prepack(),
                                     Attention(), VAETiling(), VAESlicing(), Device(), Offload(), Compile())

__all__ = ["Entry", "Technique", "TECHNIQUES"]
