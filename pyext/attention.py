"""pyext attention inside diffusers pipelines, on one pipeline (or model) instance only.

    report = pyext.attention.apply(pipe)               # or apply(pipe.unet), apply(pipe, backend="cpp")
    print(report)                                      # layers patched per component, skips, fallbacks
    pyext.attention.status(pipe)                       # the same, as a dict, with call counters
    pyext.attention.remove(pipe)                       # back to diffusers' own attention

Design. Every diffusers attention layer (`Attention`, and `AttentionModuleMixin` layers such as
FluxAttention) hands its work to a processor, and the processors of this diffusers compute the
core softmax(QK^T)V with torch's `scaled_dot_product_attention` (SDPA), either directly (the
"*2_0" processors: SD1.5/SDXL UNet, the VAE, SD3's joint attention, IP-Adapter) or through
diffusers' attention dispatcher, whose default "native" backend calls SDPA (Flux and the newer
transformers). So pyext leaves the processors alone and changes only that one call: a forward
pre-hook on the layer enters a `TorchFunctionMode` that sends SDPA calls to
`pyext.ops.attention`, and a forward hook (always_call, so also after an exception) leaves it.

Why this way:
- Everything the processor does around the core call (projections, cross and joint attention,
  QK norms, rotary embeddings, group/spatial norm, residual, rescale_output_factor, IP-Adapter
  branches) is diffusers' own code, not a copy that can drift.
- Nothing global changes: no function of torch or diffusers is replaced, not even for one call.
  Torch keeps the mode stack per thread, so another thread (or another pipeline) calling SDPA
  while a patched layer runs is not affected. The hooks and the state live on the layer modules.
  (With a ring, the processor's parallel config is lifted during the layer's forward: another
  thread running the same model at that moment would attend to its local chunks only.)
- Processors installed later (`fuse_qkv_projections`, `set_attn_processor`, IP-Adapter loading)
  are routed too, since the hook does not care which processor runs. A processor that does not
  call SDPA (e.g. `AttnProcessor`, which `set_default_attn_processor` installs, or the flash /
  sage / flex dispatcher backends) cannot be routed: `status()` lists those layers as skipped, and
  their calls are counted as fallbacks.
- An SDPA call pyext's op cannot take (dropout, causal, autograd, autocast, a
  tensor subclass, or an input the op or a forced backend refuses) runs torch's SDPA unchanged
  and is counted with its reason.
- diffusers' ring attention (context parallelism) asks its backend for a log-sum-exp that its
  native SDPA backend cannot give. For the forward of a layer whose processor holds a ring config
  (with or without Ulysses), the pre-hook lifts the config off the processor (diffusers then
  calls SDPA on the local chunks) and pyext computes that call across the ranks (`pyext.ring`:
  Ulysses, then the ring); the exit hook puts the config back. Processors that call SDPA
  directly know nothing of context parallelism (SD3's): in a model whose sharding is pyext's
  (`pyext.parallel`), pyext computes their calls across the ranks the model's config names.

Cost: in eager mode every torch call inside a patched layer passes through the mode's Python
handler; a traced or compiled denoiser pays none of it. torch.compile traces hooks and mode: the
graph holds torch.ops.pyext.attention and breaks no more often than plain diffusers' (the
handler calls Tensor methods written in Python as methods, which dynamo traces in place);
compiled calls are not counted in status().
Do not call apply()/remove() on a model while it runs in another thread.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from pyext import _compat, _state, dispatch, ops, parallel, ring
from pyext.dispatch import PyextError
from pyext.reference.attention import attention_reference

_SDPA = _compat.SDPA  # what F.scaled_dot_product_attention is
STATE = "attention"  # pyext._state key of the _Layer on each patched attention module
_pyext_attention = ops.attention  # module-level so tests can observe the calls
# diffusers dispatcher backends whose (non context-parallel) path calls torch SDPA; pyext then
# replaces the SDPA kernel they would have picked.
_SDPA_DISPATCH_BACKENDS = {"native", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math"}


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _local_call(processor, args, kwargs) -> bool:
    """A forward whose attention diffusers keeps local under context parallelism: cross-attention
    in the processors that split only self-attention (Wan's: the text is not split)."""
    encoder_states = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
    return encoder_states is not None and _compat.splits_self_attention_only(processor)


def _needs_torch(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """Why this SDPA call must stay with torch, or None when pyext's op can take it."""
    if dropout_p:
        return "dropout"
    if is_causal:
        return "causal"
    if any(type(t) is not torch.Tensor for t in (q, k, v, attn_mask) if t is not None):
        return "tensor subclass"
    if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] and not enable_gqa:
        return "k/v heads differ from q's without enable_gqa"  # torch's own error
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "autograd (pyext.ops.attention has no backward)"
    if torch.is_autocast_enabled(q.device.type):
        return "autocast"  # SDPA's autocast casts would be skipped by a custom op
    return None


class _RouteSDPA(TorchFunctionMode):
    """Entered for one forward of one layer: its SDPA calls go to the layer's pyext attention."""

    def __init__(self, layer: "_Layer"):
        super().__init__()
        self.layer = layer
        self.sdpa_calls = 0
        self.groups = None  # (ring group, Ulysses group) when pyext computes this forward across ranks
        self.whole = 0  # then: how many last tokens every rank holds whole (pyext.ring.split_attention)
        self.restore = None  # puts back the processor's parallel config pyext took

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return _compat.call_as_method(func, args, kwargs)
        self.sdpa_calls += 1
        return self.layer.attention(args, kwargs, self.groups, self.whole)


class _ThreadModes(threading.local):
    """The modes a thread entered on one layer, there from its first use in each thread: a
    compiled forward then reads an attribute that never appears later (torch.compile guards
    on what it reads, and a change compiles again)."""

    def __init__(self):
        self.modes = []


class _Layer:
    """pyext's state on one attention module: the backend, the hooks and the call counters."""

    def __init__(self, module: torch.nn.Module, backend: str | None, model: torch.nn.Module):
        self.backend = backend
        self.model = weakref.ref(model)  # the component the layer is in: its context parallelism
        self.calls = 0  # forwards of the layer
        self.pyext_calls = 0  # SDPA calls that pyext computed
        self.fallbacks = Counter()  # reason -> attention computations left to torch
        self._fresh()
        self.handles = [
            # The mode should cover the layer's forward only: the pre-hook goes after the
            # pre-hooks present now, the exit hook before every forward hook.
            module.register_forward_pre_hook(self._enter, with_kwargs=True),
            module.register_forward_hook(self._exit, prepend=True, always_call=True),
        ]

    def _fresh(self):
        self.lock = threading.Lock()
        self.local = _ThreadModes()

    # A Lock and a thread-local cannot be copied or pickled: deepcopy/torch.save of a patched
    # model get fresh ones (the hooks and handles are copied with the model by torch). The model
    # goes as itself, so that a copy of the model refers to the copy.
    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("lock", "local")}
        state["model"] = self.model()
        return state

    def __setstate__(self, state):
        model = state.pop("model")
        self.__dict__.update(state)
        self.model = weakref.ref(model) if model is not None else lambda: None
        self._fresh()

    def _enter(self, module, args, kwargs):
        mode = _RouteSDPA(self)
        processor = getattr(module, "processor", None)
        aware = _compat.knows_context_parallelism(processor)
        # Without context parallelism both lookups are two attribute reads, so that a compiled
        # forward traces nothing else.
        if aware:
            groups, whole = _compat.context_parallel_groups(processor), 0
        else:
            groups, whole = self._split_by_pyext(module, args, kwargs)
        if aware and groups is not None and groups[0] is None:
            groups = None  # without a ring, diffusers' own Ulysses calls SDPA on the gathered tokens: routed as usual
        if groups is not None and route_problem(module) is None and not _local_call(processor, args, kwargs):
            mode.groups, mode.whole = groups, whole
            if aware:
                # diffusers' ring needs a forward that returns the log-sum-exp, which its native
                # SDPA backend lacks: for this forward the processor runs without its parallel
                # config (plain SDPA on the local chunks), and pyext computes that call across
                # the ranks.
                mode.restore = _compat.take_parallel_config(processor)
        mode.__enter__()
        self.local.modes.append(mode)

    def _split_by_pyext(self, module, args, kwargs) -> tuple:
        """(groups, whole tokens) for a processor that knows no context parallelism, in a model
        whose sharding is pyext's: its calls then run across the ranks the model's config names."""
        model = self.model()
        groups = None if model is None else _compat.context_parallel_groups(model)
        plan = None if groups is None else parallel.own_plan(model)
        if plan is None:
            return None, 0
        whole = 0
        if plan.whole_tail is not None:
            names = _forward_parameters(type(module))
            position = names.index(plan.whole_tail) if plan.whole_tail in names else len(args)
            tail = kwargs.get(plan.whole_tail, args[position] if position < len(args) else None)
            whole = 0 if tail is None else tail.shape[1]
        return groups, whole

    def _exit(self, module, args, output):
        modes = self.local.modes
        if not modes:  # an earlier pre-hook raised before ours ran
            return
        mode = modes.pop()
        try:
            mode.__exit__(None, None, None)
        finally:
            if mode.restore is not None:
                mode.restore()
        if torch.compiler.is_compiling():  # compiled calls go uncounted (count); finding why reads sources
            return
        no_sdpa = None if mode.sdpa_calls else f"no SDPA call ({route_problem(module) or 'processor skipped it'})"
        self.count(no_sdpa, calls=1)

    def count(self, fallback: str | None = None, calls: int = 0, pyext: int = 0):
        if torch.compiler.is_compiling():  # a lock would break the graph; compiled calls go uncounted
            return
        with self.lock:
            self.calls += calls
            self.pyext_calls += pyext
            if fallback:
                self.fallbacks[fallback] += 1

    def attention(self, args, kwargs, groups=None, whole: int = 0):
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
        reason = _needs_torch(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        if groups is not None:
            if reason is not None:
                raise PyextError(f"pyext context-parallel attention: {reason} is not supported; supported: "
                                 "inference without dropout, causal masks or autocast")
            return self._across(q, k, v, scale, attn_mask, groups, whole)
        if reason is None:
            try:  # PyextError comes from validation/backend selection, before any work is done
                out = _pyext_attention(q, k, v, scale=scale, backend=self.backend, attn_mask=attn_mask)
            except PyextError as e:
                reason = str(e).splitlines()[0]
            else:
                self.count(pyext=1)
                return out
        self.count(reason)
        return _SDPA(*args, **kwargs)

    def _across(self, q, k, v, scale, attn_mask, groups, whole):
        ring_group, ulysses_group = groups

        def attend(q, k, v, mask):
            return _pyext_attention(q, k, v, scale=scale, backend=self.backend, attn_mask=mask, return_lse=True)

        def reference(q, k, v, mask):
            return attention_reference(q, k, v, scale=scale, attn_mask=mask, return_lse=True)

        ring.check_split(q, k, attn_mask, ring_group, ulysses_group, whole)  # an error, not a fallback
        try:
            out = ring.split_attention(q, k, v, attend, ring_group, ulysses_group, attn_mask, whole)
        except PyextError as e:  # the op refused these inputs: every rank does, so the split starts over
            self.count(str(e).splitlines()[0])
            return ring.split_attention(q, k, v, reference, ring_group, ulysses_group, attn_mask, whole)
        self.count(pyext=1)
        return out

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------- finding the layers
def _attention_classes() -> tuple:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return (Attention, AttentionModuleMixin)


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls: type) -> list[str]:
    return list(inspect.signature(cls.forward).parameters)[1:]  # without self


@functools.lru_cache(maxsize=None)
def _processor_kind(cls: type) -> str:
    """'sdpa', 'dispatcher', 'none' (computes attention itself) or 'unknown' (no source)."""
    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return "unknown"
    if "dispatch_attention_fn" in source:
        return "dispatcher"
    return "sdpa" if "scaled_dot_product_attention" in source else "none"


def route_problem(module) -> str | None:
    """Why the layer's current processor cannot reach pyext, or None when it can."""
    processor = getattr(module, "processor", None)
    kind = _processor_kind(type(processor))
    if kind == "none":
        return f"processor {type(processor).__name__} does not call SDPA"
    if kind == "dispatcher":
        name = _compat.active_attention_backend(processor)
        if name not in _SDPA_DISPATCH_BACKENDS:
            return f"diffusers attention backend {name!r} does not call SDPA"
    return None


def _components(obj) -> dict:
    if isinstance(getattr(obj, "components", None), dict):  # a DiffusionPipeline
        return {name: c for name, c in obj.components.items() if isinstance(c, torch.nn.Module)}
    if isinstance(obj, torch.nn.Module):
        return {type(obj).__name__: obj}
    raise PyextError(f"pyext.attention: expected a diffusers pipeline or a torch.nn.Module, got {type(obj).__name__}")


def attention_layers(model: torch.nn.Module) -> dict:
    classes = _attention_classes()
    return {name: m for name, m in model.named_modules() if isinstance(m, classes)}


def _not_diffusers_reason(model) -> str:
    if type(model).__module__.startswith("transformers."):
        return "transformers model: its attention is not diffusers' (not patched)"
    return "no diffusers attention layers"


# ---------------------------------------------------------------- report
@dataclass
class ComponentReport:
    patched: int = 0  # layers whose attention reaches pyext now
    skipped: dict = field(default_factory=dict)  # layer name (or "*": whole component) -> why not
    calls: int = 0  # forwards of the hooked layers since apply()
    pyext_calls: int = 0  # attention computations pyext did
    fallbacks: dict = field(default_factory=dict)  # reason -> attention computations left to torch


@dataclass
class AttentionReport:
    backend: str | None
    components: dict = field(default_factory=dict)  # component name -> ComponentReport

    @property
    def patched(self) -> int:
        return sum(c.patched for c in self.components.values())

    @property
    def pyext_calls(self) -> int:
        return sum(c.pyext_calls for c in self.components.values())

    @property
    def fallbacks(self) -> int:
        return sum(sum(c.fallbacks.values()) for c in self.components.values())

    def __str__(self) -> str:
        lines = [f"pyext attention (backend={self.backend or 'auto'}): {self.patched} layers patched, "
                 f"{self.pyext_calls} pyext calls, {self.fallbacks} fallbacks"]
        for name, c in self.components.items():
            lines.append(f"  {name}: {c.patched} patched, {len(c.skipped)} skipped, "
                         f"{c.pyext_calls} pyext calls, fallbacks {dict(c.fallbacks) or 0}")
            lines += [f"    skipped {layer or '(the layer itself)'}: {why}" for layer, why in c.skipped.items()]
        return "\n".join(lines)


def _report(obj) -> AttentionReport:
    report = AttentionReport(backend=None)
    backends = set()
    for comp_name, model in _components(obj).items():
        comp = report.components[comp_name] = ComponentReport()
        layers = attention_layers(model)
        if not layers:
            comp.skipped["*"] = _not_diffusers_reason(model)
            continue
        fallbacks = Counter()
        for name, module in layers.items():
            layer = _state.get(module, STATE)
            problem = "not patched (added after apply(); call apply() again)" if layer is None \
                else route_problem(module)
            if problem:
                comp.skipped[name] = problem
            else:
                comp.patched += 1
            if layer is not None:
                backends.add(layer.backend)
                with layer.lock:
                    comp.calls += layer.calls
                    comp.pyext_calls += layer.pyext_calls
                    fallbacks.update(layer.fallbacks)
        comp.fallbacks = dict(fallbacks)
    if len(backends) == 1:
        report.backend = backends.pop()
    return report


# ---------------------------------------------------------------- public API
def _check_backend(backend: str | None) -> None:
    if backend is None:
        return
    known = {b.name: b for b in dispatch.ops()["attention"].backends}
    if backend not in known:
        raise PyextError(f"pyext.attention.apply: unknown backend {backend!r}; backends are: {', '.join(known)}")
    missing = known[backend].unavailable()
    if missing:
        raise PyextError(f"pyext.attention.apply: backend {backend!r} is unavailable here: {missing}")


def apply(pipe_or_model, backend: str | None = None) -> AttentionReport:
    """Route the attention of every diffusers attention layer of a pipeline's components (or of
    one model) to pyext.ops.attention(..., backend=backend). Idempotent; applying again with
    another backend switches the backend; layers added since the last call get patched."""
    _check_backend(backend)
    for model in _components(pipe_or_model).values():
        for module in attention_layers(model).values():
            layer = _state.get(module, STATE)
            if layer is None:
                _state.put(module, STATE, _Layer(module, backend, model))
            else:
                layer.backend = backend
    return _report(pipe_or_model)


def remove(pipe_or_model) -> list[str]:
    """Remove pyext's hooks and state; returns the names ("component.layer") of the layers restored.
    The processors were never replaced, so they are the same objects they were."""
    restored = []
    for comp_name, model in _components(pipe_or_model).items():
        for name, module in attention_layers(model).items():
            layer = _state.pop(module, STATE)
            if layer is not None:
                layer.remove()
                restored.append(f"{comp_name}.{name}" if name else comp_name)
    return restored


def status(pipe_or_model) -> dict:
    """The report of apply() as a dict, now: layers patched/skipped per component, call counters."""
    rep = _report(pipe_or_model)
    return {"backend": rep.backend, "patched": rep.patched, "pyext_calls": rep.pyext_calls,
            "fallbacks": rep.fallbacks, "components": {k: asdict(v) for k, v in rep.components.items()}}
