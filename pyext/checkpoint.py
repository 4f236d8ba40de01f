"""Save an fp8-stored model in safetensors shards and load it back without re-quantizing.

Inside `state_dict_form("codes")` an fp8 layer's state-dict entries are its codes (uint8) and
scale bits (int32), so diffusers' `save_pretrained` shards them as it does any weight; a small
`pyext_fp8.json` beside the shards names the fp8 layers, so loading can rebuild
those layers before the saved tensors are assigned to them.

safetensors itself has no checksums: a flipped byte in a shard loads silently.
The manifest therefore also lists every shard with a SHA-256 of each tensor's
bytes, and loading checks them (`verify=False` skips the hashing).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os

import torch
import torch.nn as nn

from pyext.dispatch import PyextError
from pyext.nn.fp8 import FP8Conv2d, FP8Linear, state_dict_form

MANIFEST = "pyext_fp8.json"
FORMAT = 2  # 1: layers only; 2: layers and per-tensor checksums ("files")
_WHERE = "pyext.checkpoint.from_pretrained"


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order (what safetensors stores)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def _shards(path: str) -> list[str]:
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


def save_pretrained(model: nn.Module, path: str, max_shard_size: str | int = "5GB", **kwargs) -> list[str]:
    """model.save_pretrained(path, max_shard_size=...) plus the manifest (fp8 layers and the
    checksum of every saved tensor); returns the fp8 layers' names."""
    from diffusers import ModelMixin

    if not isinstance(model, ModelMixin):  # from_pretrained rebuilds the model from its config: diffusers' API
        raise PyextError(f"pyext.checkpoint.save_pretrained: model is a {type(model).__module__}."
                         f"{type(model).__qualname__}, not a diffusers model (a diffusers.ModelMixin, such as a "
                         "pipeline's unet or transformer); nothing was written. Save another module's weights with "
                         "torch.save(model.state_dict())")
    # The class's method: the one pyext puts on converted instances writes dequantized weights.
    with state_dict_form("codes"):
        type(model).save_pretrained(model, path, max_shard_size=max_shard_size, safe_serialization=True, **kwargs)
    layers = {name: {"per_channel": m.per_channel, "compute_dtype": str(m.compute_dtype).removeprefix("torch.")}
              for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Conv2d))}
    # Hashed as read back from disk, so the checksums describe exactly the bytes in the files.
    files = {shard: {key: _digest(t) for key, t in _load_shard(path, shard).items()}
             for shard in _shards(path)}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "layers": layers, "checksum": "sha256", "files": files}, f, indent=1)
    return list(layers)


def _read_manifest(path: str) -> dict:
    if not os.path.isdir(path):
        raise PyextError(f"{_WHERE}: {path!r} is not a directory; expected the directory written by "
                         "pyext.checkpoint.save_pretrained")
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        present = sorted(os.listdir(path))
        what = "is empty" if not present else \
            f"holds {', '.join(present[:6])}{' ...' if len(present) > 6 else ''} but no {MANIFEST}"
        raise PyextError(f"{_WHERE}: {path} {what}. Expected an fp8 checkpoint written by "
                         f"pyext.checkpoint.save_pretrained ({MANIFEST}, config.json and *.safetensors); "
                         "a plain diffusers model loads with its class's from_pretrained, then pyext.quantize_fp8")
    try:
        with open(manifest) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise PyextError(f"{_WHERE}: {manifest} cannot be read ({type(err).__name__}: {err}); the checkpoint is "
                         "damaged: save the model again with pyext.checkpoint.save_pretrained") from err
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise PyextError(f"{_WHERE}: {manifest} lists no fp8 layers ('layers'); the checkpoint is damaged: save "
                         "the model again with pyext.checkpoint.save_pretrained")
    return data


def _load_shard(path: str, shard: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, shard)
    try:
        return load_file(file)
    except MemoryError:
        raise
    except Exception as err:  # safetensors' own error types: a truncated file, a damaged header
        raise PyextError(f"{_WHERE}: {file} cannot be read as safetensors ({type(err).__name__}: {err}); the file "
                         "is truncated or damaged: save the model again") from err


def _check_shards_present(path: str, manifest: dict) -> None:
    """Every shard the manifest or diffusers' index names must exist: say which file is missing."""
    expected = set(manifest.get("files", {}))
    for index in glob.glob(os.path.join(path, "*.safetensors.index.json")):
        with open(index) as f:
            expected |= set(json.load(f).get("weight_map", {}).values())
    missing = sorted(expected - set(_shards(path)))
    if missing:
        raise PyextError(f"{_WHERE}: {path} lacks the shard file(s) {', '.join(missing)} that the checkpoint lists")


def _verify(path: str, shard: str, tensors: dict[str, torch.Tensor], digests: dict[str, str]) -> None:
    for key, digest in digests.items():
        if key not in tensors:
            raise PyextError(f"{_WHERE}: {os.path.join(path, shard)} lacks tensor {key!r}, which its checksum "
                             "list names; the file is damaged or was replaced")
        if _digest(tensors[key]) != digest:
            raise PyextError(f"{_WHERE}: tensor {key!r} in {os.path.join(path, shard)} does not match its saved "
                             "SHA-256: the file is corrupt. Save the model again (or pass verify=False to load "
                             "it unchecked)")


def _empty_fp8(module: nn.Module, per_channel: bool, dtype: torch.dtype) -> nn.Module:
    """An fp8 layer shaped like `module` with meta storage, filled by load_state_dict(assign=True)."""
    module = module.to(dtype)
    new = FP8Linear.from_linear(module, per_channel) if isinstance(module, nn.Linear) \
        else FP8Conv2d.from_conv(module, per_channel)
    return new


def from_pretrained(cls, path: str, device: str | torch.device = "cpu", verify: bool = True) -> nn.Module:
    """Load a model saved by `save_pretrained`: fp8 layers come back as saved (no re-quantization).

    With `verify` (the default) every tensor is checked against the manifest's SHA-256
    (checkpoints written before checksums existed have none to check)."""
    from accelerate import init_empty_weights

    manifest = _read_manifest(path)
    _check_shards_present(path, manifest)
    try:
        config = cls.load_config(path)
    except (OSError, ValueError) as err:
        raise PyextError(f"{_WHERE}: {os.path.join(path, 'config.json')} cannot be read: {err}") from err
    with init_empty_weights():
        model = cls.from_config(config)
    for name, spec in manifest["layers"].items():
        try:
            layer = model.get_submodule(name)
            per_channel, dtype = bool(spec["per_channel"]), getattr(torch, spec["compute_dtype"])
        except (AttributeError, KeyError, TypeError) as err:
            raise PyextError(f"{_WHERE}: {os.path.join(path, MANIFEST)} names fp8 layer {name!r} ({spec!r}), which "
                             f"{cls.__name__} built from this config lacks or cannot take ({err}); the manifest belongs "
                             "to another model or is damaged") from err
        if not isinstance(layer, (nn.Linear, nn.Conv2d)) or not isinstance(dtype, torch.dtype):
            raise PyextError(f"{_WHERE}: {os.path.join(path, MANIFEST)} names {name!r} as an fp8 layer, but in "
                             f"{cls.__name__} it is a {type(layer).__name__}; the manifest belongs to another model")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, _empty_fp8(layer, per_channel, dtype))
    state = {}
    for shard in _shards(path):
        tensors = _load_shard(path, shard)
        if verify:
            _verify(path, shard, tensors, manifest.get("files", {}).get(shard, {}))
        state.update({key: t.to(device) for key, t in tensors.items()})
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # a tensor of another shape: torch's message names it
        raise PyextError(f"{_WHERE}: {path} does not match {cls.__name__}: {err}") from err
    if missing or unexpected:
        raise PyextError(f"{_WHERE}: {path} does not match {cls.__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for m in model.modules():
        if isinstance(m, FP8Conv2d):
            m.use_kernel_layout()  # safetensors stores contiguous tensors
    return model.eval()
