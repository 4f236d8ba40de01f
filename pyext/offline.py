"""Diffusers pipelines built offline, with seeded RANDOM weights, from bundled configs.

Benchmarks and tests need the real architectures (shapes decide speed and memory)
but may not download anything, so pyext ships each architecture's component
configs in pyext/configs/<arch>_<size>.json and builds the models from them:

    pipe = pyext.offline.build_pipeline("sd15", "tiny")       # a few M params, CPU-fast
    pipe = pyext.offline.build_pipeline("sd15", "full")       # the real SD1.5 shapes (1.07B)
    pipe = pyext.offline.build_pipeline("flux", "full", dtype=torch.bfloat16)

The images are noise-like: the weights are random. `load_pipeline` loads real
weights (a local folder, or a hub id the user can reach) for real images.

Tokenizers are generated, not downloaded: CLIP gets a byte-level vocabulary
(every byte alone and with "</w>", no merges), T5 a character-level Unigram
vocabulary. Token ids therefore differ from the real tokenizers; the shapes that
reach the models (77 CLIP positions, T5 sequence length) do not.
"""
from __future__ import annotations

import contextlib
import json
import os
import string
import tempfile
import zlib
from importlib import resources

import torch

from pyext.dispatch import PyextError

ARCHS = ("sd15", "sdxl", "sd3", "flux")
SIZES = ("tiny", "full")
# Full Flux is 16.8B parameters (12B transformer + 4.8B T5): 67 GB in fp32. Building it needs
# an explicit 16-bit dtype or device="meta", so a default call cannot exhaust a machine's memory.
_FP32_REFUSED = {("flux", "full")}


def load_config(arch: str, size: str = "tiny") -> dict:
    """The bundled config of one arch/size: {"pipeline", "extra", "components": {name: {"class", "config"}}}."""
    if arch not in ARCHS or size not in SIZES:
        raise PyextError(f"pyext.offline: unknown arch/size {arch!r}/{size!r}; supported archs {ARCHS}, sizes {SIZES}")
    text = resources.files("pyext").joinpath("configs", f"{arch}_{size}.json").read_text()
    return json.loads(text)


# ---------------------------------------------------------------- tokenizers
def _byte_symbols() -> list[str]:
    """One printable character per byte value (the byte-level BPE convention CLIP uses):
    printable Latin-1 bytes stand for themselves, the others map to chr(256 + i)."""
    def printable(b):
        return 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
    others = [b for b in range(256) if not printable(b)]
    return [chr(b) if printable(b) else chr(256 + others.index(b)) for b in range(256)]


def _clip_tokenizer(config: dict):
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"] = 512  # ids 512/513 are what the configs' bos/eos_token_id say
    vocab["<|endoftext|>"] = 513
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        with open(vocab_file, "w") as f:
            json.dump(vocab, f)
        with open(merges_file, "w") as f:
            f.write("#version: 0.2\n")
        # Positional file arguments: the parameter names changed between transformers 4 and 5.
        return CLIPTokenizer(vocab_file, merges_file, **config)


def _t5_tokenizer(config: dict):
    from transformers import T5Tokenizer

    # Unigram pieces: specials first (pad=0, eos=1, unk=2 as T5 has them), then characters.
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in chars] + [("\u2581" + c, -1.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, **config)


_TOKENIZERS = {"CLIPTokenizer": _clip_tokenizer, "T5Tokenizer": _t5_tokenizer}


# ---------------------------------------------------------------- models
def _build_component(name: str, cls_name: str, config: dict, dtype: torch.dtype, device: str, seed: int):
    import diffusers
    import transformers

    if cls_name in _TOKENIZERS:
        return _TOKENIZERS[cls_name](config)
    if cls_name.endswith("Scheduler"):  # holds float32 CPU tensors of its own: no default dtype/device
        return getattr(diffusers, cls_name).from_config(config)
    # fork_rng: seeding here must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]), _construction(dtype, device):
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))  # per component: independent of order
        if hasattr(transformers, cls_name):
            cls = getattr(transformers, cls_name)
            return cls(cls.config_class(**config)).eval()
        return getattr(diffusers, cls_name)(**config).eval()


@contextlib.contextmanager
def _construction(dtype: torch.dtype, device: str):
    """Modules created inside get `dtype` parameters on `device` ("meta": shapes only)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_pipeline(arch: str, size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0,
                   device: str | torch.device = "cpu"):
    """A diffusers pipeline of `arch` ("sd15", "sdxl", "sd3", "flux") with seeded random weights.

    size "tiny": a few M parameters, same component types; "full": the published
    architecture. Weights are created on the CPU from `seed` (each component from its own
    seed, so they do not depend on build order) and then moved to `device`; the same
    (arch, size, dtype, seed) gives the same weights everywhere. device="meta" builds shapes
    only (parameter counts, memory planning) in no time and no memory.
    """
    import diffusers

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise PyextError(f"pyext.offline.build_pipeline: dtype {dtype} not supported; use float32, float16 or bfloat16")
    spec = load_config(arch, size)
    meta = str(device) == "meta"
    if (arch, size) in _FP32_REFUSED and dtype == torch.float32 and not meta:
        raise PyextError(f"pyext.offline.build_pipeline: {arch}/{size} in float32 needs ~67 GB; "
                         "pass dtype=torch.bfloat16 (~34 GB) or device='meta'")
    parts = {name: _build_component(name, comp["class"], comp["config"], dtype, "meta" if meta else "cpu", seed)
             for name, comp in spec["components"].items()}
    pipe = getattr(diffusers, spec["pipeline"])(**parts, **spec["extra"])
    pipe.set_progress_bar_config(disable=True)
    if not meta and str(device) != "cpu":
        pipe.to(device)
    return pipe


def load_pipeline(path_or_id: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs):
    """Real weights: DiffusionPipeline.from_pretrained on a local folder (e.g. one written by
    `pipe.save_pretrained`) or a hub id the user has access to (a download)."""
    import diffusers

    index = os.path.join(str(path_or_id), "model_index.json")
    if os.path.isfile(index):
        # A folder saved from a pipeline with a component set to None (SD3 without T5) records
        # it as [null, null] and from_pretrained then refuses it: pass those Nones again.
        with open(index) as f:
            saved = json.load(f)
        cls = getattr(diffusers, saved["_class_name"], None)
        if cls is not None:
            expected, _ = cls._get_signature_keys(cls)
            kwargs = {name: None for name in expected if saved.get(name, [None])[0] is None} | kwargs
    pipe = diffusers.DiffusionPipeline.from_pretrained(path_or_id, torch_dtype=dtype, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
