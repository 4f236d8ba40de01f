"""Every private name pyext uses from diffusers, accelerate and torch, in one place.

Upstream may rename or move any of these in a minor release. Each is reached through this
module only, imported lazily (importing pyext must not import diffusers), and
`tests/test_compat.py` resolves all of them, so a moved name fails CI loudly instead of
silently turning a technique off. The same tests run the AutoencoderKL forwards that
`pyext.vae.stages` re-implements as steps against diffusers' own. `CHECKED` says which releases
they were read from.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
import types

import torch
# torch: nested arguments as a flat list of leaves and the structure to rebuild them.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401

CHECKED = {"torch": "2.11-2.13", "diffusers": "0.35-0.42", "accelerate": "1.10-1.15", "transformers": "4.45-5.23"}

# torch: the function F.scaled_dot_product_attention is (what a TorchFunctionMode sees).
SDPA = torch._C._nn.scaled_dot_product_attention


def call_as_method(func, args: tuple, kwargs: dict):
    """func(*args, **kwargs) from a TorchFunctionMode's handler. A Tensor method written in Python
    (torch/_tensor.py: unflatten, split, ...) reaches the handler as that function, which calls
    super(); torch.compile (torch 2.11 to 2.13) cannot trace that super() call there and breaks the graph.
    Called as a method of the tensor instead, it runs the same code, and compiles in place."""
    if isinstance(func, types.FunctionType) and getattr(torch.Tensor, func.__name__, None) is func:
        return getattr(args[0], func.__name__)(*args[1:], **kwargs)
    return func(*args, **kwargs)


# Attributes that upstream hooks and wrappers put on modules and pipelines.
ACCELERATE_HOOK = "_hf_hook"  # accelerate's ModelHook on a module (offload, device maps)
ACCELERATE_OLD_FORWARD = "_old_forward"  # the forward accelerate's wrapper calls at call time
DIFFUSERS_HOOKS = "_diffusers_hook"  # diffusers' HookRegistry on a module
PIPE_MODEL_HOOKS = "_all_hooks"  # enable_model_cpu_offload's hooks, on the pipeline
PIPE_OFFLOAD_DEVICE = "_offload_device"  # the device enable_*_cpu_offload was given
COMPILED_CALL = "_compiled_call_impl"  # what nn.Module.compile() sets
COMPILED_ORIGINAL = "_orig_mod"  # the module a torch.compile OptimizedModule wraps
CONV_PADDING = "_reversed_padding_repeated_twice"  # nn.Conv2d's cached padding
VAE_TILED_ENCODE = "_tiled_encode"  # AutoencoderKL's tiled encoder, called by _encode
PARALLEL_CONFIG = "_parallel_config"  # what enable_parallelism sets on a model and its attention processors
RING_MESH = "_ring_mesh"  # ContextParallelConfig's device mesh of the ring
ULYSSES_MESH = "_ulysses_mesh"  # ContextParallelConfig's device mesh of Ulysses
CP_PLAN = "_cp_plan"  # the inputs a diffusers model class splits along the sequence for context parallelism

# Private functions and constants, as "module:name".
_NAMES = {
    "group_offload_hook": "diffusers.hooks.group_offloading:_GROUP_OFFLOADING",
    "layer_tracker_hook": "diffusers.hooks.group_offloading:_LAYER_EXECUTION_TRACKER",
    "lazy_prefetch_hook": "diffusers.hooks.group_offloading:_LAZY_PREFETCH_GROUP_OFFLOADING",
    "apply_group_offload_config": "diffusers.hooks.group_offloading:_apply_group_offloading",
    "attention_backend_registry": "diffusers.models.attention_dispatch:_AttentionBackendRegistry",
    "context_parallel_input": "diffusers.models._modeling_parallel:ContextParallelInput",
    "context_parallel_output": "diffusers.models._modeling_parallel:ContextParallelOutput",
    "suggest_memory_format": "torch._prims_common:suggest_memory_format",
}


def _resolve(key: str):
    module, _, name = _NAMES[key].partition(":")
    return getattr(importlib.import_module(module), name)


def check_names() -> dict[str, str]:
    """Every private name that does not resolve here: {name: why}. Empty when all do."""
    missing = {}
    for key, spec in _NAMES.items():
        try:
            _resolve(key)
        except (ImportError, AttributeError) as err:
            missing[spec] = f"{type(err).__name__}: {err}"
    missing.update({f"torch.ops.mkldnn.{op}": "missing" for op in MKLDNN_OPS if not hasattr(torch.ops.mkldnn, op)})
    missing.update({f"torch.ops.aten.{op}": "missing" for op in SDPA_KERNELS if not hasattr(torch.ops.aten, op)})
    return missing


def is_channels_last(t: torch.Tensor) -> bool:
    """A 4-D tensor whose strides torch's convolutions read as channels-last (Tensor's
    suggest_memory_format): a (N, C, 1, 1) weight made channels-last counts, where is_contiguous
    alone cannot tell its two layouts apart."""
    return t.dim() == 4 and _suggest_memory_format()(t) == torch.channels_last


@functools.cache
def _suggest_memory_format():
    return _resolve("suggest_memory_format")  # once: is_channels_last runs on every fp8 conv call


# ----------------------------------------------------------------------------- hooks

# PEFT's adapter layers (lora_A.<adapter>, lora_B.<adapter>, lora_embedding_A, ...): PEFT loads,
# scales and swaps their weights in place, hotswap into slices of them.
PEFT_ADAPTER_LAYER = re.compile(r"(^|\.)lora_")


def is_peft_adapter_layer(name: str) -> bool:
    return bool(PEFT_ADAPTER_LAYER.search(name))


def has_accelerate_hook(module) -> bool:
    return hasattr(module, ACCELERATE_HOOK)


def has_diffusers_hooks(module) -> bool:
    # (a registry may be there without hooks: a cache-aware model's cache_context makes one per call)
    return bool(getattr(getattr(module, DIFFUSERS_HOOKS, None), "hooks", None))


def has_hooks(module) -> bool:
    """Offload or cache hooks act on this module's calls (accelerate's or diffusers')."""
    return has_accelerate_hook(module) or has_diffusers_hooks(module)


def torch_function_mode_active() -> bool:
    """A TorchFunctionMode (pyext's exact VAE tiling, a profiler or tracer of torch calls) sees each
    torch function called now."""
    return torch._C._is_torch_function_mode_enabled()


def torch_hooks(module) -> bool:
    """torch hooks on this module's calls (forward, pre-forward, backward), its own or global ones."""
    from torch.nn.modules import module as nn_module

    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    every = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks, nn_module._global_backward_hooks,
             nn_module._global_backward_pre_hooks)
    return any(own) or any(every)


def group_offload_config(module):
    """diffusers' GroupOffloadingConfig of the first group-offloaded submodule, or None."""
    name = _resolve("group_offload_hook")
    for sub in module.modules():
        registry = getattr(sub, DIFFUSERS_HOOKS, None)
        hook = registry.get_hook(name) if registry is not None else None
        if hook is not None:
            return hook.config
    return None


def remove_group_offload(module) -> None:
    """Drop group offloading's hooks; each group's weights go back to where they are stored."""
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(module)
    for key in ("group_offload_hook", "layer_tracker_hook", "lazy_prefetch_hook"):
        registry.remove_hook(_resolve(key), recurse=True)


def apply_group_offload(module, config) -> None:
    """Re-enable group offloading with a config read by group_offload_config (same settings)."""
    _resolve("apply_group_offload_config")(module, config)


def _with_sub_pipelines(pipe) -> list:
    # Combined pipelines (Stable Cascade, Kandinsky) offload through their sub-pipelines,
    # which keep the hooks and the device.
    subs = [v for v in vars(pipe).values() if isinstance(getattr(v, "components", None), dict)]
    return [pipe, *subs]


def pipeline_model_hooks(pipe) -> list:
    return [h for p in _with_sub_pipelines(pipe) for h in getattr(p, PIPE_MODEL_HOOKS, None) or []]


def pipeline_offload_device(pipe):
    return next((d for p in _with_sub_pipelines(pipe) if (d := getattr(p, PIPE_OFFLOAD_DEVICE, None)) is not None),
                None)


# ----------------------------------------------------------------------------- attention

def active_attention_backend(processor) -> str:
    """The diffusers attention-dispatch backend a processor uses: its own, else the global one."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = getattr(processor, "_attention_backend", None) or _resolve("attention_backend_registry").get_active_backend()[0]
    return AttentionBackendName(backend).value


def _context_parallel_config(obj):
    """The ContextParallelConfig enable_parallelism left on a model or processor, or None."""
    return getattr(getattr(obj, PARALLEL_CONFIG, None), "context_parallel_config", None)


def knows_context_parallelism(processor) -> bool:
    """Whether enable_parallelism gives the processor its config (it splits its own attention)."""
    return hasattr(processor, PARALLEL_CONFIG)


def context_parallel_groups(obj) -> tuple | None:
    """(ring group, Ulysses group), each None at degree 1, of the context parallelism
    enable_parallelism left on a model or processor; None without one, or with the uneven chunks
    of ring_anything / ulysses_anything."""
    cp = _context_parallel_config(obj)
    if cp is None or getattr(cp, "ring_anything", False) or getattr(cp, "ulysses_anything", False):
        return None
    ring = getattr(cp, RING_MESH).get_group() if (cp.ring_degree or 1) > 1 else None
    ulysses = getattr(cp, ULYSSES_MESH).get_group() if (cp.ulysses_degree or 1) > 1 else None
    return ring, ulysses


def diffusers_cp_plan(split_inputs, gather_outputs) -> dict:
    """A cp_plan for enable_parallelism: each (module path, argument) split, each module's output
    gathered, along dim 1 of (batch, tokens, channels)."""
    split, gather = _resolve("context_parallel_input"), _resolve("context_parallel_output")
    plan: dict = {}
    for path, argument in split_inputs:
        plan.setdefault(path, {})[argument] = split(split_dim=1, expected_dims=3, split_output=False)
    for path in gather_outputs:
        plan[path] = gather(gather_dim=1, expected_dims=3)
    return plan


def context_parallel_degrees(model) -> tuple[int, int] | None:
    """(ring degree, Ulysses degree) of the context parallelism enabled on a model, or None."""
    cp = _context_parallel_config(model)
    return None if cp is None else (cp.ring_degree or 1, cp.ulysses_degree or 1)


def context_parallel_plan(model) -> dict | None:
    return getattr(type(model), CP_PLAN, None)


def splits_self_attention_only(processor) -> bool:
    """Whether the processor passes its parallel config only when it has no encoder_hidden_states
    (Wan's processors: cross-attention keys are not split, so that attention stays local)."""
    return _self_attention_only(type(processor))


@functools.lru_cache(maxsize=None)
def _self_attention_only(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return False
    return "if encoder_hidden_states is None else None" in source


def take_parallel_config(processor):
    """Clear the processor's parallel config so that diffusers calls plain SDPA on the local
    chunks; returns what puts it back."""
    config = getattr(processor, PARALLEL_CONFIG)
    setattr(processor, PARALLEL_CONFIG, None)
    return lambda: setattr(processor, PARALLEL_CONFIG, config)


# ----------------------------------------------------------------------------- compile

MODULE_APPLY = "_apply"  # what nn.Module.to / cuda / half / float call on the module with each conversion


def module_slots(module) -> tuple[dict, dict, dict]:
    """nn.Module's own dicts of its parameters, buffers and submodules (what assignment changes)."""
    return module._parameters, module._buffers, module._modules


def is_compiled_in_place(module) -> bool:
    return getattr(module, COMPILED_CALL, None) is not None


def uncompile_in_place(module) -> None:
    setattr(module, COMPILED_CALL, None)


def inductor_freezing(autotune: bool = False):
    """A context in which inductor compiles with weight freezing: the weights become constants of
    the graph, packed for oneDNN once (torch._inductor.config; torch.compile's `options` do not
    reach the freezing passes). With `autotune`, inductor also times its C++ GEMM template (on the
    CPU's AMX or AVX-512 micro-kernels) against ATen's oneDNN GEMM for each GEMM shape of the graph
    on this machine, and keeps the faster (max_autotune)."""
    import torch._inductor.config as inductor_config

    if autotune:
        return inductor_config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return inductor_config.patch(freezing=True)


def compiled_original(module):
    """The eager module behind a torch.compile wrapper, or the module itself."""
    return getattr(module, COMPILED_ORIGINAL, module)


# ----------------------------------------------------------------------------- profiler

def profiler_events(prof) -> list:
    """The events a finished torch.profiler.profile recorded, each with name(), start_ns(), end_ns()
    and, for a "[memory]" event, nbytes(): the kineto results, which torch exposes privately."""
    return list(prof.profiler.kineto_results.events())


# ----------------------------------------------------------------------------- model metadata

def keep_in_fp32_modules(model, dtype: torch.dtype) -> list[str]:
    """Module names the model's own loader keeps in fp32 when it loads in `dtype`.

    diffusers keeps `_keep_in_fp32_modules` for any 16-bit dtype; transformers keeps them
    for fp16 only (bf16 has fp32's range), and `_keep_in_fp32_modules_strict` for both."""
    if dtype == torch.float32:
        return []
    names = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if type(model).__module__.startswith("diffusers.") or dtype == torch.float16:
        names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return names


def skip_layerwise_casting_patterns(model) -> list[str]:
    """The regexes of layers a model asks fp8 weight storage to leave alone."""
    return list(getattr(model, "_skip_layerwise_casting_patterns", None) or [])


def cast_own_tensors(module, dtype: torch.dtype) -> None:
    """Cast a module's own floating parameters and buffers, not its children's, through
    nn.Module._apply (so layers that track their dtype there, like pyext's fp8 layers, see it)."""
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)


# ----------------------------------------------------------------------------- SDPA's CUDA kernels
# Two of the kernels torch's SDPA chooses among, called as SDPA calls them for an input without a
# mask and with a head dim that is a multiple of 8 (no padding, no copy), arguments by name (an
# argument added upstream cannot shift the others). Each returns (output, log-sum-exp or None),
# the log-sum-exp when asked for: float32 (batch, heads, q length), the natural log.
SDPA_KERNELS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention")


def sdpa_cudnn(q, k, v, scale: float, lse: bool):
    out, logsumexp = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, attn_bias=None, compute_log_sumexp=lse, dropout_p=0.0, is_causal=False, return_debug_mask=False,
        scale=scale)[:2]
    return out, (logsumexp.reshape(q.shape[:3]) if lse else None)  # cuDNN's is (batch, heads, q length, 1)


def sdpa_flash(q, k, v, scale: float, lse: bool):
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=scale)[:2]
    return out, (logsumexp if lse else None)  # always computed


# ----------------------------------------------------------------------------- oneDNN (CPU)
# torch's private oneDNN ops that inductor's freezing uses; pyext.nn.packed calls them eagerly.
MKLDNN_OPS = ("_reorder_convolution_weight", "_reorder_linear_weight", "_convolution_pointwise", "_linear_pointwise")


def mkldnn_reorder_conv_weight(weight, padding, stride, dilation, groups, input_shape):
    return torch.ops.mkldnn._reorder_convolution_weight(weight, list(padding), list(stride), list(dilation),
                                                        groups, input_shape)


def mkldnn_reorder_linear_weight(weight):
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def mkldnn_conv(x, packed, bias, padding, stride, dilation, groups):
    return torch.ops.mkldnn._convolution_pointwise(x, packed, bias, list(padding), list(stride), list(dilation),
                                                   groups, "none", [], None)


def mkldnn_conv_add(x, other, packed, bias, padding, stride, dilation, groups):
    """The convolution plus `other` (its output's shape and layout), the add as oneDNN's post-op."""
    return torch.ops.mkldnn._convolution_pointwise.binary(x, other, packed, bias, list(padding), list(stride),
                                                          list(dilation), groups, "add", None, None, [], None)


def mkldnn_linear(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def im2col_conv2d(x, weight, bias, stride, padding):
    """torch's own CPU convolution (im2col + GEMM: groups 1, dilation 1), which never reorders the
    weight into oneDNN's layout as torch's default CPU path does on every call."""
    return torch.ops.aten._slow_conv2d_forward(x, weight, list(weight.shape[2:]), bias, list(stride), list(padding))


# ----------------------------------------------------------------------------- devices

def cpu_has_native_bf16() -> bool:
    """oneDNN computes bf16 natively here (AVX512-BF16 or AMX). Without it torch emulates bf16
    GEMMs and convolutions, over 100x slower than fp32 ones (2-core AVX2: 4.8 s vs 0.04 s for
    512x1920 @ 1920x1920)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.lru_cache(maxsize=None)
def cpu_conv_im2col(dtype: torch.dtype, dims: int) -> bool:
    """Whether torch's CPU convolution with `dims` spatial dimensions in `dtype` lowers to im2col
    (its slow_conv2d / slow_conv3d, with a column buffer of kernel-size times the input) rather
    than running in oneDNN: the choice depends on the dtype and on what this CPU computes natively
    (bf16 on AVX512-BF16 or AMX). Asked of a 3x3 (x3) convolution of a VAE decoder's size."""
    shape = (1, 64, 64, 64) if dims == 2 else (1, 8, 3, 8, 8)
    x, w = torch.empty(shape, dtype=dtype), torch.empty(shape[1], shape[1], *[3] * dims, dtype=dtype)
    backend = torch._C._select_conv_backend(x, w, None, [1] * dims, [1] * dims, [1] * dims, False, [0] * dims, 1, None)
    return backend.name.startswith("Slow")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own check, private in torch.cpu)."""
    return bool(torch.cpu._is_amx_tile_supported())
