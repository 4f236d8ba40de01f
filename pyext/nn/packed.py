"""Conv2d/Linear weights packed once into oneDNN's blocked layout, for CPU inference.

torch's eager CPU convolution reorders a plain weight into oneDNN's blocked layout on every
call. At a UNet's small spatial sizes that reorder costs more than the convolution itself
(bench/cpu_runtimes.py; docs/benchmarks.md, "CPU runtimes"). OpenVINO and inductor's freezing pack once;
`PackedWeight` does the same in eager mode.

A PackedWeight is the layer's `weight` Parameter itself, so the layer stays an nn.Conv2d /
nn.Linear and holds one copy of its weights, in the packed layout only:
- F.conv2d / F.linear with it run oneDNN's kernels on the packed weight (`__torch_function__`);
  a convolution is packed for the input shape it sees (a plain copy until its first call),
  repacked when the shape changes;
- a 3x3 convolution (stride 1, padding 1) whose input shape suits Winograd (pyext.ops.winograd's
  rule) keeps its weight plain, stored (3, 3, in, out) as the Winograd op reads it, and runs that op;
- an fp32 Linear of up to CONV_LINEAR_MAX_IN input features runs as a oneDNN 1x1 convolution over
  its rows, its weight packed for the row count it sees (repacked when that changes);
- any other use (a read, a copy, `.to(...)`, state_dict's values) sees the plain weight,
  unpacked on demand; a write (load_state_dict, into a slice too) repacks (pyext.nn.stored).
Wider fp32 Linears up to BLAS_LINEAR_BYTES stay plain: torch's BLAS is faster on them than oneDNN.
`pack(module)` / `unpack(module)` convert a model's layers; unpacking is exact. A cast or move
(`module.to(...)`) unpacks a layer first and packs it again if it stays packable.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyext import _compat, dispatch, memory
from pyext._ext import kernel_missing
from pyext._memory import trim_heap
from pyext.dispatch import PyextError
from pyext.nn.stored import StoredWeight, probe_like
from pyext.ops import winograd

# oneDNN packs fp32 anywhere; bf16 only where the CPU computes it natively (the reorder refuses
# otherwise). fp16 convolutions have no oneDNN CPU path worth packing for.
DTYPES = (torch.float32, torch.bfloat16)


# fp32 Linears with up to this many input features run as oneDNN 1x1 convolutions, whose kernels
# beat both torch's BLAS addmm and oneDNN's packed GEMM on every SD1.5 UNet linear shape; at
# twice as many input features the convolution was much slower than BLAS (docs/benchmarks.md,
# "CPU runtimes").
CONV_LINEAR_MAX_IN = 2560
# Wider fp32 Linear weights up to this size stay plain: torch's BLAS addmm beat oneDNN's packed
# GEMM on the UNet's shapes of such weights.
BLAS_LINEAR_BYTES = 32 << 20
# A model's first call packs its convolutions for their input shapes; glibc keeps the plain
# copies they replace as free heap. Where pyext.memory's release_after_optimize is on, the heap is
# trimmed whenever this much has been repacked since the last trim: a few milliseconds each,
# against the seconds the repacking itself takes.
TRIM_AFTER_REPACKED_BYTES = 64 << 20
_repacked_since_trim = 0


def dtype_reason(dtype: torch.dtype) -> str | None:
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        return None if _compat.cpu_has_native_bf16() else "bf16 packing needs native bf16 (AVX512-BF16/AMX)"
    return f"{dtype} is not packed (supported: {', '.join(map(str, DTYPES))})"


@dataclass
class _Packed:
    """What every alias of one PackedWeight shares (Parameter creation and `.data` make aliases)."""

    tensor: torch.Tensor               # the mkldnn-layout weight, or a plain one: for Winograd, for BLAS,
                                       # or a layer's until its first call
    conv: tuple | None                 # (stride, padding, dilation, groups) of a Conv2d, None for a Linear
    input_shape: tuple | None = None   # the input shape a convolution weight is packed for (a Linear's:
                                       # (1, in, rows, 1), the 1x1 convolution it runs as)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workspace: winograd.Workspace | None = None  # Winograd's buffer, shared by the layers pack() packed together

    @property
    def winograd(self) -> bool:
        """A plain weight ((3, 3, in, out) in memory) for winograd_conv3x3 rather than oneDNN's layout."""
        return self.conv is not None and self.input_shape is not None and not self.tensor.is_mkldnn

    def __reduce_ex__(self, protocol):
        # Pickling a packed weight (torch.save(module)) reaches its state here, before oneDNN's
        # layout, whose opaque memory torch cannot serialize; a shallow copy.copy never does.
        raise PyextError(
            "pyext: a module whose weights pyext packed for oneDNN (pyext.optimize's prepack option) cannot be "
            "pickled (torch.save(module), pickle.dumps): oneDNN's packed layout is memory torch cannot serialize. "
            "Save the weights instead (torch.save(module.state_dict()) or save_pretrained: the plain values), "
            "call pyext.restore(pipe) first (exact), or optimize with prepack=\"off\"")

    def dense(self) -> torch.Tensor:
        t = self.tensor  # read once: a repack elsewhere replaces it whole
        dense = t.to_dense() if t.is_mkldnn else t.contiguous()
        return dense.flatten(1) if self.conv is None else dense  # a Linear packed as (out, in, 1, 1)

    def pack(self, dense: torch.Tensor, input_shape: tuple | None = None) -> None:
        """Callers that may race with for_input hold `lock`; nothing is changed if packing raises."""
        winograd = input_shape is not None and _winograd_suits(self.conv, dense, input_shape)
        if self.conv is None and input_shape is not None:  # a 1x1 convolution over the rows
            tensor = _compat.mkldnn_reorder_conv_weight(dense.contiguous()[:, :, None, None], (0, 0), (1, 1), (1, 1),
                                                        1, list(input_shape))
        elif input_shape is None and (self.conv is not None or _conv_linear(dense) or _blas_linear(dense)):
            # BLAS, or plain until the first call gives the input shape that a convolution's (or a
            # Linear's 1x1 convolution's) layout depends on: packed once, for it. A copy, as every
            # other form is: the caller's tensor (a mapped file's, a deepcopy's source) stays its own.
            tensor = dense.clone(memory_format=torch.contiguous_format)
        elif self.conv is None:
            tensor = _compat.mkldnn_reorder_linear_weight(dense.contiguous())
        elif winograd:
            tensor = dense.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)
        else:
            stride, padding, dilation, groups = self.conv
            tensor = _compat.mkldnn_reorder_conv_weight(dense.contiguous(), padding, stride, dilation, groups,
                                                        list(input_shape))
        self.tensor, self.input_shape = tensor, input_shape

    def for_input(self, shape: tuple) -> torch.Tensor:
        """The weight to run a convolution's input shape on: oneDNN's layout, else plain for Winograd."""
        # A convolution's blocked layout depends on the input shape; one packed for another
        # shape runs, but up to 10x slower (measured at SD1.5 UNet shapes), so repack.
        with self.lock:
            if shape != self.input_shape:
                dense = self.dense()
                nbytes = dense.numel() * dense.element_size()
                self.pack(dense, shape)
                del dense  # (freed before a trim)
                _repacked(nbytes)
            return self.tensor


def _repacked(nbytes: int) -> None:
    global _repacked_since_trim
    if not memory.settings().release_after_optimize:
        return
    _repacked_since_trim += nbytes  # (racy across threads: at worst one trim sooner or later)
    if _repacked_since_trim >= TRIM_AFTER_REPACKED_BYTES:
        _repacked_since_trim = 0
        trim_heap()


def _conv_linear(weight: torch.Tensor) -> bool:
    """A Linear weight that runs as a 1x1 convolution over the input's rows."""
    return weight.dtype == torch.float32 and weight.numel() > 0 and weight.shape[1] <= CONV_LINEAR_MAX_IN


def _blas_linear(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.numel() * 4 <= BLAS_LINEAR_BYTES


def _winograd_suits(conv: tuple | None, weight: torch.Tensor, input_shape: tuple) -> bool:
    if conv != ((1, 1), (1, 1), (1, 1), 1) or tuple(weight.shape[2:]) != (3, 3) or weight.dtype not in winograd.DTYPES:
        return False
    if len(input_shape) != 4 or input_shape[1] != weight.shape[1]:
        return False  # a wrong input goes the plain way, to F.conv2d's own error
    if kernel_missing("winograd_conv3x3") or dispatch.marked_unusable("winograd_conv3x3", "cpp", weight.device):
        return False  # keep oneDNN's packing rather than F.conv2d on a plain weight
    n, _, h, w = input_shape
    return winograd.winograd_reason(n, weight.shape[1], weight.shape[0], h, w) is None


class PackedWeight(StoredWeight):
    @staticmethod
    def __new__(cls, packed: _Packed, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                   device=like.device, requires_grad=False)

    def __init__(self, packed: _Packed, like: torch.Tensor):
        self.packed = packed

    @classmethod
    def of(cls, weight: torch.Tensor, conv: tuple | None, workspace: winograd.Workspace | None = None) -> "PackedWeight":
        packed = _Packed(None, conv, workspace=workspace)
        packed.pack(weight.detach())
        return cls(packed, weight.detach())  # keeps the plain weight's strides (channels-last or not)

    def __deepcopy__(self, memo):
        packed = _Packed(None, self.packed.conv, workspace=self.packed.workspace)
        packed.pack(self.packed.dense(), self.packed.input_shape)
        copy = PackedWeight(packed, self)
        if getattr(self, "_is_param", False):  # a Parameter: stays one in the copied module
            copy._is_param = True
        memo[id(self)] = copy
        return copy

    def __repr__(self) -> str:
        p = self.packed
        kind = "Linear" if p.conv is None else "Conv2d"
        layout = "oneDNN layout" if p.tensor.is_mkldnn else "plain" if p.input_shape else "plain until its first call"
        shape = f", input {p.input_shape}" if p.input_shape else ""
        return f"PackedWeight({tuple(self.shape)}, {self.dtype}, {layout} for {kind}{shape})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fast = _fast_path(func, args, kwargs)
        if fast is not None:
            return fast
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def values(self) -> torch.Tensor:
        return self.packed.dense()

    def store(self, values: torch.Tensor) -> None:
        if values.shape != self.shape:
            raise PyextError(f"pyext: storing a {tuple(values.shape)} tensor in a {tuple(self.shape)} packed weight")
        with self.packed.lock:
            self.packed.pack(values.to(self.dtype), self.packed.input_shape)

    def alias(self) -> "PackedWeight":
        return PackedWeight(self.packed, self)  # shares the packed weight

    def adopt(self, other: "PackedWeight") -> None:
        self.packed = other.packed

    def stored_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed.tensor,)


def _fast_path(func, args, kwargs, add: torch.Tensor | None = None):
    """oneDNN on the packed weight for F.conv2d / F.linear on a CPU input of the weight's dtype; else None.
    add (F.conv2d only): plus this tensor as oneDNN's post-op (_fusable_add); None where it cannot be."""
    if func not in (F.conv2d, F.linear):
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    call = dict(zip(names, args)) | kwargs
    x, weight, bias = call.get("input"), call.get("weight"), call.get("bias")
    # oneDNN's kernels record no autograd graph: a call that needs one (the weight too, when it is
    # trained) takes the plain path, whose gradients are those of a plain layer.
    if not (isinstance(weight, PackedWeight) and isinstance(x, torch.Tensor) and not isinstance(x, PackedWeight)
            and x.device.type == "cpu" and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))):
        return None
    if func is F.linear:
        return _linear(x, weight, bias) if add is None else None
    stride, padding, dilation, groups = weight.packed.conv
    if (call.get("stride", 1), call.get("padding", 0), call.get("dilation", 1), call.get("groups", 1)) != \
            weight.packed.conv or x.dim() != 4:
        return None  # called with other arguments than the layer's (F.pad + padding 0, say): plain path
    tensor = weight.packed.for_input(tuple(x.shape))
    if add is not None:
        if not (tensor.is_mkldnn and _fusable_add(add, x, weight)):
            return None
        return _compat.mkldnn_conv_add(x, add, tensor, bias, padding, stride, dilation, groups)
    if not tensor.is_mkldnn:  # plain: the shape suits Winograd
        with winograd.using_workspace(weight.packed.workspace):
            y = torch.ops.pyext.winograd_conv3x3(x, tensor, bias, None)  # channels-last, as oneDNN gives it here
        return y if x.is_contiguous(memory_format=torch.channels_last) else y.contiguous()
    return _compat.mkldnn_conv(x, tensor, bias, padding, stride, dilation, groups)


def conv_add(conv: nn.Conv2d, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """other + conv(x). Where the layer's weight is packed in oneDNN's layout for a channels-last x
    and `other` is a channels-last tensor of the output's shape (groups 1), one oneDNN call with
    the add as its post-op: the output is written once, not written, read and written again, and
    the sum is rounded once, from fp32. Otherwise the layer's call, then the add. The caller makes
    sure nothing watches the layer's own output (a hook on it, or a forward of its own, would be
    bypassed)."""
    weight = conv.weight
    if isinstance(weight, PackedWeight) and weight.packed.conv is not None and isinstance(other, torch.Tensor) \
            and not torch.compiler.is_compiling():
        y = _fast_path(F.conv2d, (x, weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups), {},
                       add=other)
        if y is not None:
            return y
    return other + conv(x)


def _fusable_add(add: torch.Tensor, x: torch.Tensor, weight: "PackedWeight") -> bool:
    """Whether oneDNN's add post-op takes `add` as it is: the convolution's output shape and x's
    dtype, x and `add` channels-last (torch copies another layout of `add` into it first), groups 1
    (torch runs other groups' convolution, then the add), on the CPU, no gradient asked for."""
    (sh, sw), (ph, pw), (dh, dw), groups = weight.packed.conv
    (n, _, h, w), (out, _, kh, kw) = x.shape, weight.shape
    shape = (n, out, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1)
    return (groups == 1 and tuple(add.shape) == shape and add.device.type == "cpu" and add.dtype == x.dtype
            and all(t.is_contiguous(memory_format=torch.channels_last) for t in (x, add))
            and not (torch.is_grad_enabled() and add.requires_grad))


def _linear(x, weight, bias):
    packed = weight.packed
    if _conv_linear(weight):
        k, n = weight.shape[1], weight.shape[0]
        rows = x.numel() // k
        if x.dim() == 0 or x.shape[-1] != k or rows == 0:
            return None  # the plain path: F.linear's own error, or an empty result
        # (rows, k) in memory is a channels-last (1, k, rows, 1) image, and the output likewise.
        x4 = x.reshape(1, rows, 1, k).permute(0, 3, 1, 2)
        y = _compat.mkldnn_conv(x4, packed.for_input(tuple(x4.shape)), bias, (0, 0), (1, 1), (1, 1), 1)
        return y.permute(0, 2, 3, 1).reshape(*x.shape[:-1], n)
    tensor = packed.tensor
    return F.linear(x, tensor, bias) if not tensor.is_mkldnn else _compat.mkldnn_linear(x, tensor, bias)


def weight_reason(w: torch.Tensor) -> str | None:
    """Why a weight is not packable where it sits (device, dtype); None when it is."""
    if w.device.type != "cpu":
        return f"on {w.device.type}: oneDNN packing is for the CPU"
    return dtype_reason(w.dtype)


def skip_reason(module: nn.Module, name: str = "") -> str | None:
    """Why pack() leaves a layer (named `name` in its model) plain; None when it packs it."""
    if _compat.is_peft_adapter_layer(name):
        return ("a LoRA adapter layer (PEFT writes its weights in place, hotswap into slices a packed "
                "layout cannot take)")
    w = getattr(module, "weight", None)
    if isinstance(w, PackedWeight):
        return "already packed"
    if type(module) not in _PACKED_CLASS:
        return "not a plain Conv2d/Linear"
    if isinstance(module, nn.Conv2d) and (isinstance(module.padding, str) or module.padding_mode != "zeros"):
        return f"padding {module.padding!r}, mode {module.padding_mode!r}: only numeric zero padding"
    if isinstance(module, nn.Linear) and not _conv_linear(w) and _blas_linear(w):
        return (f"an fp32 Linear of over {CONV_LINEAR_MAX_IN} input features and at most "
                f"{BLAS_LINEAR_BYTES >> 20} MiB: torch's BLAS runs it faster than oneDNN (measured)")
    return weight_reason(w)


def _conv_args(module: nn.Module) -> tuple | None:
    if isinstance(module, nn.Linear):
        return None
    return (tuple(module.stride), tuple(module.padding), tuple(module.dilation), module.groups)


def _unchanged_by(fn, weight: torch.Tensor) -> bool:
    """Whether `fn` (what Module._apply maps over tensors) hands a tensor like `weight` back as it is."""
    probe = probe_like(weight)
    return fn(probe) is probe


class _Packable:
    """A layer whose weight is packed whenever it sits on the CPU in a packable dtype.

    torch's Module._apply (`.to()`, `.float()`, offload moves) would write a cast result into
    the packed Parameter's metadata and leave the packed tensor stale; here the weight is
    unpacked first, cast or moved plain, and packed again if it is still packable, requiring grad
    as it did (a weight being trained stays trained)."""

    def _apply(self, fn, recurse=True):
        w = self.weight
        if isinstance(w, PackedWeight) and _unchanged_by(fn, w):
            # `.to("cpu")` on the CPU, a cast to the dtype it has: keep the packed weight as it is.
            del self._parameters["weight"]
            try:
                return super()._apply(fn, recurse)
            finally:
                self._parameters["weight"] = w
        trained = w.requires_grad
        self._unpack_weight(trained)
        out = super()._apply(fn, recurse)
        if weight_reason(self.weight) is None:  # the layer itself was packable when packed
            self._pack_weight(trained)
        return out

    def _pack_weight(self, requires_grad: bool) -> None:
        self.weight = nn.Parameter(PackedWeight.of(self.weight, _conv_args(self), self._workspace),
                                   requires_grad=requires_grad)

    def _unpack_weight(self, requires_grad: bool) -> None:
        w = self.weight
        if isinstance(w, PackedWeight):
            dense = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype).copy_(w.packed.dense())
            self.weight = nn.Parameter(dense, requires_grad=requires_grad)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # Savers (safetensors, torch.save) need plain tensors: the values a plain layer gives.
        if isinstance(self.weight, PackedWeight):
            destination[prefix + "weight"] = self.weight.packed.dense()


class PackedConv2d(_Packable, nn.Conv2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            _unpack_for_compile(self)
            return nn.Conv2d.forward(self, input)
        return super().forward(input)


class PackedLinear(_Packable, nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            _unpack_for_compile(self)
            return nn.Linear.forward(self, input)
        return super().forward(input)


_PACKED_CLASS = {nn.Conv2d: PackedConv2d, nn.Linear: PackedLinear}


@dataclass
class PackReport:
    packed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{len(self.packed)} Conv2d/Linear weights packed for oneDNN ({len(self.skipped)} left plain)"


_PACKED_MODELS: weakref.WeakSet = weakref.WeakSet()  # the models pack() changed, while they live


@torch.compiler.disable  # runs eagerly when torch.compile first meets a packed layer: one graph break, then none
def _unpack_for_compile(layer: nn.Module) -> None:
    """torch.compile cannot trace oneDNN's packed weights (opaque tensors), and inductor packs
    weights itself: the packed models holding this layer go back to plain weights (exact)."""
    holders = [m for m in list(_PACKED_MODELS) if any(sub is layer for sub in m.modules())]
    for model in holders:
        unpack(model)
    if isinstance(layer, _Packable):  # a copy of a packed model, which pack() never saw
        _unpack_layer(layer)


def pack(model: nn.Module, layers: tuple[type, ...] = (nn.Conv2d, nn.Linear)) -> PackReport:
    """Pack the model's plain Conv2d/Linear weights in place (only the packed copy is kept).
    The layers become PackedConv2d/PackedLinear (still nn.Conv2d/nn.Linear to diffusers and PEFT).
    If torch.compile later traces the model, its first compiled call unpacks it (exact)."""
    report = PackReport()
    workspace = winograd.Workspace()  # the model's Winograd layers run one at a time: one buffer for all
    for name, module in model.named_modules():
        if not isinstance(module, layers):
            continue
        reason = skip_reason(module, name)
        if reason:
            report.skipped[name] = reason
            continue
        module._workspace = workspace
        module._trainable = module.weight.requires_grad  # packed weights are frozen; unpack thaws them
        module.__class__ = _PACKED_CLASS[type(module)]
        module._pack_weight(requires_grad=False)
        report.packed.append(name)
    if report.packed:
        _PACKED_MODELS.add(model)
    return report


def unpack(model: nn.Module) -> list[str]:
    """Plain layers and weights again (exact: packing only reorders)."""
    _PACKED_MODELS.discard(model)
    done = []
    for name, module in model.named_modules():
        if isinstance(module, _Packable):
            _unpack_layer(module)
            done.append(name)
    return done


def _unpack_layer(module: nn.Module) -> None:
    module._unpack_weight(module._trainable)
    module.__class__ = next(plain for plain, cls in _PACKED_CLASS.items() if cls is type(module))
    del module._trainable, module._workspace
