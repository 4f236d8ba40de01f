"""Nearest 2x upsampling then a 3x3 convolution (diffusers' Upsample2D) as one 2x2 convolution of
the small input.

After nearest 2x upsampling, output pixel (2i + a, 2j + b) of a 3x3 convolution with padding 1
reads input rows i - 1 + a and i + a of the small image (zero outside it), and columns j - 1 + b
and j + b: two per axis, under the weight's rows and columns summed pairwise (0 | 1 + 2 for phase
0, 0 + 1 | 2 for phase 1). Each phase (a, b) is thus a 2x2 convolution of the small image, and one
2x2 convolution with padding 1 and the four phases' output channels computes them all: phase
(a, b) is the window [a, a + H) x [b, b + W) of its (H + 1) x (W + 1) result. Interleaving the
phases gives the upsampled output: 4/9 of the multiplies, and no upsampled copy of the input.

The phase weights are sums of up to four weights, taken in fp32 (fp64 for fp64) and rounded to
the weight's dtype: in bf16 one more rounding than the plain path makes (tests bound the
difference). Whether the phases are faster depends on the shape, the dtype and the machine (a
tiny image, fp32's Winograd path): `pyext.dispatch` times both on the first call of each shape on
this machine (after a call of each, so that neither pays its packing in the timing), checks that
they agree, and keeps the faster; where nothing is timed (PYEXT_DISPATCH=static, tracing) the block
runs its plain path.

`phase_upsamplers(module)` gives each plain Upsample2D of the module the forward of
`PhasedUpsample2D` (by __class__ swap: the same module, parameters, state_dict and hooks). It
runs the plain forward wherever the phases could be seen or do not apply: hooks or a per-instance
forward on its conv, a TorchFunctionMode, autograd, an output size, a norm, not on a CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import _compat, _state, dispatch
from pyext.kernels import relative_close
from pyext.nn.packed import PackedConv2d, weight_reason
from pyext.nn.stored import StoredWeight
from pyext.nn.swap import swap_all, swap_back

STATE = "upsample_phases"  # pyext._state key: a block's _Phases

# The phases' output against the plain path's, relative to its largest magnitude, in the dtype's
# rounding: a bf16 sum of weights adds about one rounding of the output.
AGREE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def phase_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out, in, 3, 3) -> (4 out, in, 2, 2): the 2x2 kernels of phases (0, 0), (0, 1), (1, 0), (1, 1)."""
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))  # the sums in fp32 at least
    pairs = ((0, (1, 2)), ((0, 1), 2))  # phase 0: tap 0 | taps 1 + 2; phase 1: taps 0 + 1 | tap 2

    def take(t, axis, taps):
        return sum(t.select(axis, i) for i in ((taps,) if isinstance(taps, int) else taps))

    kernels = []
    for rows in pairs:
        r = torch.stack([take(w, 2, taps) for taps in rows], 2)  # (out, in, 2, 3)
        kernels += [torch.stack([take(r, 3, taps) for taps in cols], 3) for cols in pairs]
    return torch.cat(kernels, 0).to(weight.dtype)


def interleave(z: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """(N, 4 C, H + 1, W + 1) phase outputs -> (N, C, 2 H, 2 W) in `memory_format`."""
    n, c4, h1, w1 = z.shape
    c, h, w = c4 // 4, h1 - 1, w1 - 1
    out = torch.empty((n, c, 2 * h, 2 * w), dtype=z.dtype, device=z.device, memory_format=memory_format)
    phases, grid = z.unflatten(1, (2, 2, c)), out.unflatten(3, (w, 2)).unflatten(2, (h, 2))
    for a in (0, 1):
        for b in (0, 1):
            grid[:, :, :, a, :, b] = phases[:, a, b, :, a:a + h, b:b + w]
    return out


@dataclass
class _Phases:
    """A conv's phase weight and bias, for the weight's version, dtype and device they were made
    from, and the weight packed for oneDNN for the input shape `packed_for`. A cache: a copy or a
    pickle of the module carries none (oneDNN's layout has no storage to copy), and its first call
    makes its own."""

    source: tuple
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None
    packed_for: tuple | None = None

    def __reduce__(self):
        return _no_phases, ()


def _no_phases() -> None:
    return None


def _source(conv: nn.Conv2d) -> tuple:
    w, b = conv.weight, conv.bias
    return (id(w), w._version, w.dtype, w.device, id(b), None if b is None else b._version)


def _values(weight: torch.Tensor) -> torch.Tensor:
    """The weight's plain values: a packed one's from its store (which may hold tensors made under
    inference_mode, which a detach of the wrapper cannot alias)."""
    return weight.values() if isinstance(weight, StoredWeight) else weight.detach()


def _phases(block: nn.Module) -> _Phases:
    conv = _conv(block)
    source = _source(conv)
    phases = _state.get(block, STATE)
    if phases is None or phases.source != source:
        with torch.no_grad():
            bias = None if conv.bias is None else conv.bias.detach().repeat(4)
            phases = _Phases(source, phase_weight(_values(conv.weight)), bias)
        _state.put(block, STATE, phases)  # not a parameter: no state_dict entry, no second copy saved
    return phases


def phased(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's upsample + conv by the phases."""
    p = _phases(block)
    if type(_conv(block)) is PackedConv2d and weight_reason(p.weight) is None:  # packed as prepack packed the conv
        if p.packed_for != tuple(x.shape):
            p.packed = _compat.mkldnn_reorder_conv_weight(p.weight, (1, 1), (1, 1), (1, 1), 1, tuple(x.shape))
            p.packed_for = tuple(x.shape)
        z = _compat.mkldnn_conv(x, p.packed, p.bias, (1, 1), (1, 1), (1, 1), 1)
    else:
        z = F.conv2d(x, p.weight, p.bias, padding=1)
    fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 1 \
        else torch.contiguous_format
    return interleave(z, fmt)


def _conv(block: nn.Module) -> nn.Module:
    return block.conv if block.name == "conv" else block.Conv2d_0


def _upsample_2d() -> type:
    from diffusers.models.upsampling import Upsample2D  # imported on first use: pyext imports no diffusers

    return Upsample2D


def phasable(block: nn.Module) -> bool:
    """A diffusers Upsample2D (the class itself) that interpolates 2x and then runs a 3x3 conv with
    padding 1, stride 1, no groups, no dilation, zero padding, and no norm."""
    if type(block) is not _upsample_2d() or not block.use_conv or block.use_conv_transpose or not block.interpolate:
        return False
    conv = _conv(block)
    return (isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and conv.padding == (1, 1)
            and conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and block.norm is None)


def unseen(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether the phases are invisible on this call: a plain, unhooked conv (or pyext's packed
    one) whose parameters track their changes (not inference tensors); a 4-D CPU input; no
    TorchFunctionMode; no gradient asked for."""
    conv = _conv(block)
    if type(conv) not in (nn.Conv2d, PackedConv2d) or "forward" in conv.__dict__ or _compat.torch_hooks(conv):
        return False
    if x.dim() != 4 or x.device.type != "cpu" or x.dtype != conv.weight.dtype or _compat.torch_function_mode_active():
        return False
    params = [t for t in (conv.weight, conv.bias) if t is not None]
    if any(t.is_inference() for t in params):  # made under inference_mode: no version to see changes by
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in [x, *params]):
        return False
    return True


@functools.lru_cache(maxsize=None)
def phased_upsample_2d() -> type:
    """PhasedUpsample2D, made once diffusers is imported."""
    base = _upsample_2d()

    class PhasedUpsample2D(base):
        """Upsample2D's forward, by the phases where dispatch measured them faster for the shape."""

        def forward(self, hidden_states: torch.Tensor, output_size=None, *args, **kwargs) -> torch.Tensor:
            if output_size is not None or args or kwargs or not unseen(self, hidden_states):
                return base.forward(self, hidden_states, output_size, *args, **kwargs)
            x = hidden_states
            if dispatch.mode(x.device) != "measured" or not dispatch.can_measure(x.device):
                return base.forward(self, x)  # nothing timed: the plain path
            conv = _conv(self)
            key = str((str(x.dtype).removeprefix("torch."), tuple(x.shape), conv.out_channels,
                       x.is_contiguous(memory_format=torch.channels_last)))
            runs = {"plain": lambda: base.forward(self, x), "phases": lambda: phased(self, x)}
            decision = dispatch.known_choice("upsample_conv", key, x.device)
            if decision is None or decision["backend"] not in runs:
                for run in runs.values():  # each path's one-time work (packing for this shape) outside the timing
                    try:
                        run()
                    except Exception:  # noqa: BLE001 - the measurement runs it again and records why it failed
                        pass
                decision = dispatch.measured_choice(
                    "upsample_conv", key, x.device, runs,
                    close=functools.partial(relative_close, rel=AGREE.get(x.dtype, 3e-2)))
            return runs[decision["backend"]]()

    return PhasedUpsample2D


def is_phased(block: nn.Module) -> bool:
    return type(block) is phased_upsample_2d()


def phase_upsamplers(module: nn.Module) -> list[str]:
    """Give each phasable Upsample2D in the module the phased forward; their names."""
    return swap_all(module, phasable, _phase).swapped


def _phase(block: nn.Module) -> None:
    block.__class__ = phased_upsample_2d()


def unphase_upsamplers(module: nn.Module) -> list[str]:
    """Undo phase_upsamplers: the blocks' own class again, their phase weights dropped."""
    return swap_back(module, phased_upsample_2d(), _upsample_2d(), lambda block: _state.pop(block, STATE))
