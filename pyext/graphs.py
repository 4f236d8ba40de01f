"""A denoiser's forward replayed from CUDA graphs that pyext captures itself (compile="capture").

A step of an eager denoiser is hundreds of kernel launches driven by Python; on a fast GPU the
launches, not the kernels, set its time. pyext captures the eager forward (diffusers' code with
pyext's kernels) in a CUDA graph per input signature and replays it: a step is then one graph
launch. No compiler runs, so there is no compile time and nothing for a compiler to reject.

Per input signature (the arguments' structure, each tensor's shape, strides, dtype and device,
every other argument's value): the first call runs eagerly (measured dispatch makes its choices,
lazy state is built), the second captures, later ones copy their tensors into the captured inputs
and replay. What a graph cannot follow runs eagerly: grad mode, tensors off the GPU, arguments
that are neither tensors nor hashable values, outputs that are not tensors, offload hooks, an
enclosing capture or compile, a signature beyond MAX_GRAPHS.

A graph bakes in the addresses of the weights and every Python value its forward read (a LoRA
scale, a cache's state). So a replay first checks that the weights are where they were (a move or
`.to()` drops the graphs), and the model's methods that change adapters, caches, attention
processors or offload drop them too; the next calls capture again. A value set on a layer by
hand is not seen: restore and optimize again after such a change.

All graphs of one model share one memory pool, and each replay's outputs are copied out at once,
so a graph's outputs are never read after another graph has run in the same memory.
"""
from __future__ import annotations

import copy
import functools
import warnings

import torch
from torch.utils import _pytree as pytree

from pyext import _compat, _state

STATE = "graphs"  # pyext._state key on the model: its Captured forward
MAX_GRAPHS = 4  # each graph keeps its inputs and outputs resident; a few resolutions at most
# Methods of diffusers' models after which what a graph baked in may be stale.
DROPPING_METHODS = (
    "load_lora_adapter", "load_attn_procs", "set_adapters", "set_adapter", "add_adapter", "delete_adapters",
    "enable_adapters", "disable_adapters", "enable_lora", "disable_lora", "unload_lora", "fuse_lora", "unfuse_lora",
    "enable_cache", "disable_cache", "set_attention_backend", "reset_attention_backend", "set_attn_processor",
    "set_default_attn_processor", "fuse_qkv_projections", "unfuse_qkv_projections", "enable_group_offload",
    "enable_layerwise_casting", "load_state_dict")


class CudaGraph:
    """One capture of fn(leaves) in a CUDA graph, as torch.cuda.graphs asks: warmed up on a side
    stream, captured into the shared pool; `replay` runs it again and returns the same outputs."""

    device_type = "cuda"

    def __init__(self, fn, leaves: list, pool):
        # On the inputs' device, which need not be the current one (a model placed by a device map).
        self.device = next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(leaves)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = fn(leaves)

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()

    def replay(self):
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.output


class Captured:
    """The forward put on one model instance: replays a graph per input signature (see the module)."""

    def __init__(self, model: torch.nn.Module, eager_forward, graph_type=CudaGraph):
        self.model = model
        self.eager_forward = eager_forward  # the forward it replaced (the class's, bound, or another wrapper)
        self.graph_type = graph_type
        self.graphs: dict = {}  # signature -> (graph, static input leaves)
        self.seen: set = set()  # signatures called once (eagerly); a few hundred at most
        self.weights: tuple = ()  # (tensors, their addresses) when the graphs were captured
        self.pool = None
        self.failures: dict = {}  # signature -> why its capture failed (it runs eagerly)
        self.replays = self.eager_calls = 0

    def __deepcopy__(self, memo):
        # A copy of the model gets its own graphs, captured by its own calls.
        return Captured(copy.deepcopy(self.model, memo), copy.deepcopy(self.eager_forward, memo), self.graph_type)

    def describe(self) -> str:
        return (f"the forward captured in CUDA graphs by pyext, one per input signature (up to {MAX_GRAPHS}) "
                "on its second call, and replayed after; other calls run eagerly")

    def drop(self) -> None:
        """Forget every graph (their memory goes back to the allocator); the next calls capture again."""
        self.graphs.clear()
        self.seen.clear()
        self.failures.clear()
        self.weights = ()
        self.pool = None

    def __call__(self, *args, **kwargs):
        key_leaves = self._signature(args, kwargs)
        if key_leaves is None:
            self.eager_calls += 1
            return self.eager_forward(*args, **kwargs)
        key, leaves, spec = key_leaves
        if self.graphs and not self._weights_unmoved():
            self.drop()
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.failures or key not in self.seen or len(self.graphs) >= MAX_GRAPHS:
                if len(self.seen) >= 256:  # keys that never repeat (a Python number that changes per step)
                    self.seen.clear()
                self.seen.add(key)
                self.eager_calls += 1
                return self.eager_forward(*args, **kwargs)
            entry = self._capture(key, leaves, spec)
            if entry is None:
                self.eager_calls += 1
                return self.eager_forward(*args, **kwargs)
        graph, static = entry
        for dst, src in zip(static, leaves):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        out_leaves, out_spec = pytree.tree_flatten(graph.replay())
        self.replays += 1
        # A copy: the graph's outputs are overwritten by its next replay (and pool neighbours).
        return pytree.tree_unflatten([t.clone() for t in out_leaves], out_spec)

    def _signature(self, args, kwargs):
        """(key, leaves, spec) of a call a graph can replay, else None."""
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or _compat.has_accelerate_hook(self.model) \
                or _compat.has_diffusers_hooks(self.model):
            return None
        if self.graph_type.device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # inside someone else's capture (inductor's CUDA graphs): part of theirs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != self.graph_type.device_type or leaf.requires_grad:
                    return None
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None
                parts.append((type(leaf), leaf))
        return (spec, tuple(parts)), leaves, spec

    def _weights_unmoved(self) -> bool:
        tensors, addresses = self.weights
        return all(address(t) == a for t, a in zip(tensors, addresses))

    def _capture(self, key, leaves, spec):
        """Capture the signature `key`; None (and a warning naming why) where it cannot be captured."""
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def fn(inputs):
            args, kwargs = pytree.tree_unflatten(inputs, spec)
            return self.eager_forward(*args, **kwargs)

        why = None
        if any(_compat.has_accelerate_hook(m) or _compat.has_diffusers_hooks(m) for m in self.model.modules()):
            why = "a submodule has offload or cache hooks, which act per call in Python"
        else:
            try:
                if self.pool is None:
                    self.pool = self.graph_type.pool()
                graph = self.graph_type(fn, static, self.pool)
                if not all(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(graph.output)):
                    why = "the forward returns values that are not tensors"
            except Exception as e:  # noqa: BLE001 (what the forward does is diffusers'; it runs eagerly instead)
                why = f"{type(e).__name__}: {str(e)[:300]}"
        if why is not None:
            self.failures[key] = why
            warnings.warn(f"pyext compile='capture': {type(self.model).__name__} runs eagerly for this input "
                          f"signature, its forward could not be captured in a CUDA graph: {why}", stacklevel=3)
            return None
        if not self.graphs:
            tensors = [*self.model.parameters(), *self.model.buffers()]
            self.weights = (tensors, tuple(address(t) for t in tensors))
        self.graphs[key] = (graph, static)
        return self.graphs[key]


def address(t: torch.Tensor) -> int:
    """Where a tensor's data is; for one without storage of its own (a tensor subclass wrapping
    others, an opaque packed weight), the object."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def capture_reason(device: torch.device, offload: str) -> str | None:
    """Why CUDA graphs (pyext's or inductor's) do not apply to a pipeline here, or None."""
    if device.type != "cuda":
        return (f"CUDA graphs replay CUDA kernels, and this pipeline runs on {device.type}; "
                "on a CPU use compile='compile' or compile='trace'")
    if offload != "off":
        return (f"offload={offload!r} moves weights between calls, which a captured graph cannot follow; "
                "use compile='compile', or offload='off'")
    return None


def apply_capture(model: torch.nn.Module, graph_type=CudaGraph) -> Captured:
    """Replace model's forward (on the instance) by a Captured one, and the model's methods that
    can make its graphs stale (DROPPING_METHODS, those it has) by ones that drop them after the call."""
    captured = Captured(model, model.forward, graph_type)
    wrappers = {"forward": captured}
    for name in DROPPING_METHODS:
        method = getattr(model, name, None)
        if callable(method):
            wrappers[name] = functools.partial(_then_drop, method, captured)
    # (wrapper, what the instance held before: another wrapper of the same name, or nothing)
    replaced = {name: (w, model.__dict__.get(name)) for name, w in wrappers.items()}
    model.__dict__.update(wrappers)
    _state.put(model, STATE, replaced)
    return captured


def remove_capture(model: torch.nn.Module) -> None:
    """Give the model back what apply_capture replaced (unless something replaced it since)."""
    for name, (wrapper, before) in (_state.pop(model, STATE) or {}).items():
        if isinstance(wrapper, Captured):
            wrapper.drop()
        if model.__dict__.get(name) is wrapper:
            if before is None:
                del model.__dict__[name]
            else:
                model.__dict__[name] = before


def captured(model: torch.nn.Module) -> Captured | None:
    """The Captured forward apply_capture put on model, or None."""
    return (_state.get(model, STATE) or {}).get("forward", (None, None))[0]


def _then_drop(method, captured_forward: Captured, *args, **kwargs):
    try:
        return method(*args, **kwargs)
    finally:
        captured_forward.drop()
