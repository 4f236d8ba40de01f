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
scale, a cache's state). So a replay first checks that every parameter, buffer, submodule and
attention processor is the one captured, at the address captured, and that the processors' plain
values (IP-Adapter scales) are unchanged (an assignment, a cast or a move drops the graphs), and
the model's methods that change adapters, caches, attention processors, FreeU or offload drop them
too; the next calls capture again. A value set on a layer by hand is not seen: restore and
optimize again after such a change.

All graphs of one model share one memory pool, and each replay's outputs are copied out at once,
so a graph's outputs are never read after another graph has run in the same memory.
"""
from __future__ import annotations

import copy
import enum
import functools
import types
import warnings

import torch

from pyext import _compat, _state

STATE = "graphs"  # pyext._state key on the model: what apply_capture replaced (_state.replace_attributes)
MAX_GRAPHS = 4  # each graph keeps its inputs and outputs resident; a few resolutions at most
# Methods of diffusers' models after which what a graph baked in may be stale.
DROPPING_METHODS = (
    "load_lora_adapter", "load_attn_procs", "set_adapters", "set_adapter", "add_adapter", "delete_adapters",
    "enable_adapters", "disable_adapters", "enable_lora", "disable_lora", "unload_lora", "fuse_lora", "unfuse_lora",
    "enable_cache", "disable_cache", "set_attention_backend", "reset_attention_backend", "set_attn_processor",
    "set_default_attn_processor", "fuse_qkv_projections", "unfuse_qkv_projections", "enable_group_offload",
    "enable_layerwise_casting", "load_state_dict", "enable_freeu", "disable_freeu", "set_attention_slice",
    "enable_forward_chunking", "disable_forward_chunking", _compat.MODULE_APPLY)
# Argument values a graph may bake in: compared by value, immutable.
PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


class CudaGraph:
    """One capture of fn(leaves) in a CUDA graph, as torch.cuda.graphs asks: warmed up on a side
    stream, captured into the shared pool; `replay` runs it again and returns the same outputs."""

    device_type = "cuda"

    def __init__(self, fn, leaves: list, pool):
        # On the inputs' device, which need not be the current one (a model placed by a device map).
        self.device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)),
                           torch.device("cuda", torch.cuda.current_device()))
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # The outer stream context puts the caller's stream back even when a capture fails
            # (torch.cuda.graph's own exit ends the capture first, and may raise there). Thread-local
            # errors: other threads of the process stay free to call CUDA during the capture.
            with torch.cuda.stream(side):
                fn(leaves)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    self.output = fn(leaves)
            torch.cuda.current_stream().wait_stream(side)

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
        functools.update_wrapper(self, eager_forward)  # its signature: pipelines read the forward's parameters
        self.model = model
        self.eager_forward = eager_forward  # the forward it replaced (the class's, bound, or another wrapper)
        self.graph_type = graph_type
        self.autocast = torch.amp.is_autocast_available(graph_type.device_type)  # (the meta device has none)
        self.graphs: dict = {}  # signature -> (graph, static input leaves)
        self.seen: set = set()  # signatures called once (eagerly); a few hundred at most
        self.state: tuple = ([], [])  # what the model held when captured (_snapshot)
        self.removed = False  # remove_capture ran: a reference kept elsewhere (an offload hook) calls eagerly
        self.pool = None
        self.failures: dict = {}  # signature -> why its capture failed (it runs eagerly)
        self.replays = self.eager_calls = 0

    def __deepcopy__(self, memo):
        # A copy of the model gets its own graphs, captured by its own calls.
        return Captured(copy.deepcopy(self.model, memo), copy.deepcopy(self.eager_forward, memo), self.graph_type)

    def __getstate__(self):
        # A pickled model keeps the mode, not the graphs. The class's forward is named, not pickled
        # as a bound method: unpickling that would look `forward` up on the model, which is this.
        state = dict(self.__dict__, graphs={}, seen=set(), failures={}, state=([], []), pool=None, replays=0,
                     eager_calls=0)
        if getattr(self.eager_forward, "__func__", None) is type(self.model).forward:
            state["eager_forward"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.eager_forward is None:
            self.eager_forward = types.MethodType(type(self.model).forward, self.model)

    def describe(self) -> str:
        return (f"the forward captured in CUDA graphs by pyext, one per input signature (up to {MAX_GRAPHS}) "
                "on its second call, and replayed after; other calls run eagerly")

    def drop(self) -> None:
        """Forget every graph (their memory goes back to the allocator); the next calls capture again."""
        self.graphs.clear()
        self.seen.clear()
        self.failures.clear()
        self.state = ([], [])
        self.pool = None

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # a user's torch.compile traces the forward: touch no state it would guard on
            return self.eager_forward(*args, **kwargs)
        key_leaves = self._signature(args, kwargs)
        if key_leaves is None:
            self.eager_calls += 1
            return self.eager_forward(*args, **kwargs)
        key, leaves, spec = key_leaves
        if self.graphs and not self._unchanged():
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
        out_leaves, out_spec = _compat.tree_flatten(graph.replay())
        self.replays += 1
        # A copy: the graph's outputs are overwritten by its next replay (and pool neighbours).
        return _compat.tree_unflatten([t.clone() for t in out_leaves], out_spec)

    def _signature(self, args, kwargs):
        """(key, leaves, spec) of a call a graph can replay, else None."""
        if self.removed or torch.is_grad_enabled():
            return None
        if _compat.has_hooks(self.model):
            self.drop()  # offload or a cache acts per call from now on: the graphs' memory goes back
            return None
        device = self.graph_type.device_type
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # inside someone else's capture (inductor's CUDA graphs): part of theirs
        leaves, spec = _compat.tree_flatten((args, kwargs))
        autocast = self.autocast and (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        parts = [torch.is_inference_mode_enabled(), autocast]  # what the forward's ops and the graph's inputs depend on
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != device or leaf.requires_grad:
                    return None
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
            elif isinstance(leaf, PLAIN_VALUES):
                parts.append((type(leaf), leaf))
            else:  # an object could change inside and keep its hash
                return None
        return (spec, tuple(parts)), leaves, spec

    def _unchanged(self) -> bool:
        """Every parameter, buffer, submodule and attention processor is the one captured, at the
        address captured, and the processors hold the values they held (IP-Adapter scales)."""
        held, values = self.state
        return all(d.get(name) is obj and (a is None or address(obj) == a) for d, name, obj, a in held) \
            and all(_frozen(d.get(name)) == value for d, name, value in values)

    def _snapshot(self) -> tuple:
        """(dict, name, what it held, its address or None) for each module's parameters, buffers,
        submodules and attention processor; (dict, name, value) for the processors' plain values."""
        held, values = [], []
        for module in self.model.modules():
            parameters, buffers, submodules = _compat.module_slots(module)
            held += [(d, name, t, address(t)) for d in (parameters, buffers) for name, t in d.items() if t is not None]
            held += [(submodules, name, child, None) for name, child in submodules.items()]
            processor = getattr(module, "processor", None)  # diffusers' attention layers
            if processor is not None:
                if "processor" in module.__dict__:  # (a processor that is a module is a submodule)
                    held.append((module.__dict__, "processor", processor, None))
                values += [(vars(processor), name, _frozen(v)) for name, v in vars(processor).items()
                           if _frozen(v) is not None]
        return held, values

    def _capture(self, key, leaves, spec):
        """Capture the signature `key`; None (and a warning naming why) where it cannot be captured."""
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def fn(inputs):
            args, kwargs = _compat.tree_unflatten(inputs, spec)
            return self.eager_forward(*args, **kwargs)

        why = None
        if any(map(_compat.has_hooks, self.model.modules())):
            why = "a submodule has offload or cache hooks, which act per call in Python"
        else:
            try:
                if self.pool is None:
                    self.pool = self.graph_type.pool()
                graph = self.graph_type(fn, static, self.pool)
                if not all(isinstance(t, torch.Tensor) for t in _compat.tree_leaves(graph.output)):
                    why = "the forward returns values that are not tensors"
            except Exception as e:  # noqa: BLE001 (what the forward does is diffusers'; it runs eagerly instead)
                why = f"{type(e).__name__}: {str(e)[:300]}"
                if e.__context__ is not None:  # a capture ended by its exit: the cause came first
                    why += f" (while handling {type(e.__context__).__name__}: {str(e.__context__)[:300]})"
        if why is not None:
            self.failures[key] = why
            warnings.warn(f"pyext compile='capture': {type(self.model).__name__} runs eagerly for this input "
                          f"signature, its forward could not be captured in a CUDA graph: {why}", stacklevel=3)
            return None
        if not self.graphs:
            self.state = self._snapshot()
        self.graphs[key] = (graph, static)
        return self.graphs[key]


def _frozen(value):
    """A plain value, or a list or tuple of them, as an immutable copy; None for anything else."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, PLAIN_VALUES) for v in value):
        return tuple(value)
    return value if isinstance(value, PLAIN_VALUES) and value is not None else None


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
    _state.replace_attributes(model, STATE, wrappers)
    return captured


def remove_capture(model: torch.nn.Module) -> None:
    """Give the model back what apply_capture replaced (unless something replaced it since)."""
    forward = _state.restore_attributes(model, STATE).get("forward")
    if forward is not None:
        forward.drop()
        forward.removed = True


def captured(model: torch.nn.Module) -> Captured | None:
    """The Captured forward apply_capture put on model, or None."""
    return (_state.get(model, STATE) or {}).get("forward", (None, None))[0]


def _then_drop(method, captured_forward: Captured, *args, **kwargs):
    try:
        return method(*args, **kwargs)
    finally:
        captured_forward.drop()
