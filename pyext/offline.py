"""Diffusers pipelines built offline, with seeded RANDOM weights, from bundled configs.

Benchmarks and tests need the real architectures (shapes decide speed and memory)
but may not download anything, so pyext ships each architecture's component
configs in pyext/configs/<arch>_<size>.json and builds the models from them:

    pipe = pyext.offline.build_pipeline("sd15", "tiny")       # a few M params, CPU-fast
    pipe = pyext.offline.build_pipeline("sd15", "full")       # the real SD1.5 shapes (1.07B)
    pipe = pyext.offline.build_pipeline("flux", "full", dtype=torch.bfloat16)
    out = pyext.offline.run_example(pipe, "sd15")             # (1, 3, 64, 64), floats in [0, 1]

Archs and sizes (SIZES). Every arch has "tiny": < 5M parameters, the real component types,
a 2-step example in seconds on a CPU. Images: sd15, sdxl, sd3, flux, sana, pixart_sigma,
auraflow, lumina2, qwenimage, chroma, stable_cascade (prior + decoder + VQGAN). Videos:
cogvideox, wan21, wan22 (two transformers split at Wan 2.2 A14B's boundary_ratio), ltx,
hunyuanvideo, animatediff. sd15, sdxl, sd3 and flux also have "full", the published shapes.
cogvideox has "bench": CogVideoX-2b's transformer (1.69B) and VAE with a T5 text encoder of
T5-XXL's width cut to 2 of its 24 layers, so that the whole pipeline is ~2.4B parameters
(~10 GB in fp32); its example, a short low-resolution clip, takes minutes on a 2-core CPU in
float32 (bfloat16 is far slower on CPUs without native bf16 arithmetic). sdxl and flux have
"bench" too, the latency bench's CPU presets: the published denoiser widths with fewer layers
(SDXL's UNet with transformer depths 1, 2, 2 for 1, 2, 10; Flux's transformer with 1 double and 2
single blocks for 19 and 38), their VAEs in full, and text encoders of the published widths cut to
2 layers (T5-XXL to 1), whose outputs have the published shapes.

A config's "call" holds its example's keyword arguments (size, frames, text length), since
the pipelines' signatures differ; `run_example` adds prompt, steps, seed and output type and
returns images as (N, C, H, W) and videos as (N, F, C, H, W).

The images are noise-like: the weights are random. `load_pipeline` loads real
weights (a local folder, or a hub id the user can reach) for real images.

Tokenizers are generated, not downloaded: token ids differ from the real tokenizers, the
shapes that reach the models do not. CLIP gets a byte-level vocabulary (every byte alone and
with "</w>", no merges); T5 (standing in for UMT5 too) a character-level Unigram vocabulary;
Gemma characters with byte fallback. Qwen2 and Llama 3 get a byte-level BPE whose merges make
whole tokens of the words listed in the config: the words of the pipeline's fixed prompt
template (and of the example prompt), so the template has as many tokens as with the real
tokenizer and the pipelines' hard-coded template lengths (Qwen-Image drops 34 tokens,
HunyuanVideo 95) cut where they should.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import string
import sys
import tempfile
import zlib
from collections import Counter
from importlib import resources

import torch

from pyext.dispatch import PyextError

SIZES = {
    "sd15": ("tiny", "full"), "sdxl": ("tiny", "full", "bench"), "sd3": ("tiny", "full"),
    "flux": ("tiny", "full", "bench"),
    "cogvideox": ("tiny", "bench"), "wan21": ("tiny",), "wan22": ("tiny",), "ltx": ("tiny",),
    "hunyuanvideo": ("tiny",), "animatediff": ("tiny",), "sana": ("tiny",), "pixart_sigma": ("tiny",),
    "auraflow": ("tiny",), "lumina2": ("tiny",), "qwenimage": ("tiny",), "chroma": ("tiny",),
    "stable_cascade": ("tiny",),
}
ARCHS = tuple(SIZES)
PROMPT = "a photo of an astronaut riding a horse on mars"
# Full Flux is 16.8B parameters (12B transformer + 4.8B T5): 67 GB in fp32. Building it needs
# an explicit 16-bit dtype or device="meta", so a default call cannot exhaust a machine's memory.
_FP32_REFUSED = {("flux", "full")}


def load_config(arch: str, size: str = "tiny") -> dict:
    """The bundled config of one arch/size:
    {"pipeline", "extra", "call", "components": {name: {"class", "config"}}}."""
    if arch not in SIZES:
        raise PyextError(f"pyext.offline: unknown arch {arch!r} (size {size!r}); supported archs {ARCHS}")
    if size not in SIZES[arch]:
        raise PyextError(f"pyext.offline: no size {size!r} for arch {arch!r}; it has {SIZES[arch]}")
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


def _gemma_tokenizer(config: dict):
    from transformers import GemmaTokenizer

    # Specials at Gemma's ids (pad 0, eos 1, bos 2, unk 3), the 256 byte-fallback pieces, then
    # characters: no merges, so every character is a token and any other one falls back to bytes.
    chars = "\u2581" + string.ascii_letters + string.digits + string.punctuation
    vocab = {s: i for i, s in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    return GemmaTokenizer(vocab=vocab, add_bos_token=True, **config)


def _word_bpe(words: list[str]) -> tuple[dict, list]:
    """Byte-level BPE vocabulary and merges under which each of `words`, alone or after a space,
    is a single token; any other text falls back to single bytes.

    The merges are learnt BPE-style (most frequent pair first, ties broken by the pair itself,
    so it is deterministic) until every word is one symbol: encoding replays the merges in the
    same order, which gives each word back as one token.
    """
    symbols = _byte_symbols()
    words = [[symbols[b] for b in form.encode()] for form in dict.fromkeys(f for w in words for f in (w, " " + w))]
    merges = []
    while pairs := Counter(p for w in words for p in zip(w, w[1:])):
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        merges.append((a, b))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab, merges


def _qwen2_tokenizer(config: dict):
    from transformers import Qwen2Tokenizer

    config = dict(config)
    vocab, merges = _word_bpe(config.pop("words"))
    chat = ["<|im_start|>", "<|im_end|>"]  # the chat-template markers Qwen-Image's prompt template uses
    vocab.update({t: len(vocab) + i for i, t in enumerate(["<|endoftext|>", *chat])})
    # Specials as Qwen2.5-VL has them: pad (and unk) <|endoftext|>, eos <|im_end|>.
    return Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", extra_special_tokens=chat, **config)


# Llama 3's pre-tokenizer split: letters runs with one leading non-letter, digits in threes, ...
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_tokenizer(config: dict):
    """Llama 3's tokenizer kind (HunyuanVideo's text encoder is a Llama 3): byte-level BPE with
    Llama 3's split and header/turn specials, <|begin_of_text|> prepended. transformers ships no
    class for it (LlamaTokenizer is the SentencePiece kind), so it is a PreTrainedTokenizerFast,
    whose tokenizer.json round-trips as is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    config = dict(config)
    vocab, merges = _word_bpe(config.pop("words"))
    bos, eos, pad = "<|begin_of_text|>", "<|end_of_text|>", "<pad>"
    headers = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    vocab.update({t: len(vocab) + i for i, t in enumerate([bos, eos, pad, *headers])})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
                                   extra_special_tokens=headers, **config)


# By the class name in the configs. In transformers 5 the "Fast" names are aliases of these
# classes (T5TokenizerFast is T5Tokenizer), so UMT5/T5-fast pipelines use "T5Tokenizer".
_TOKENIZERS = {"CLIPTokenizer": _clip_tokenizer, "T5Tokenizer": _t5_tokenizer, "GemmaTokenizer": _gemma_tokenizer,
               "Qwen2Tokenizer": _qwen2_tokenizer, "PreTrainedTokenizerFast": _llama3_tokenizer}


# ---------------------------------------------------------------- models
def _build_component(name: str, cls_name: str, config: dict, dtype: torch.dtype, device: str, seed: int, home):
    """One pipeline component; `home` is the pipeline's module, where classes that diffusers does
    not export (Stable Cascade's PaellaVQModel) are found, as the pipeline imports them."""
    import diffusers
    import transformers

    if cls_name in _TOKENIZERS:
        return _TOKENIZERS[cls_name](config)
    if cls_name.endswith("Scheduler"):  # holds float32 CPU tensors of its own: no default dtype/device
        return getattr(diffusers, cls_name).from_config(config)
    # fork_rng: seeding here must not change the caller's random stream (a GPU's too, where the
    # weights are made on it).
    gpu = torch.device(device)
    with torch.random.fork_rng(devices=[gpu.index or 0] if gpu.type == "cuda" else []), _construction(dtype, device):
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))  # per component: independent of order
        if hasattr(transformers, cls_name):
            cls = getattr(transformers, cls_name)
            return cls(cls.config_class(**config)).eval()
        return (getattr(diffusers, cls_name, None) or getattr(home, cls_name))(**config).eval()


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
                   device: str | torch.device = "cpu", on_device: bool = False, without: tuple[str, ...] = ()):
    """A diffusers pipeline of `arch` (one of ARCHS) with seeded random weights.

    size "tiny": a few M parameters, same component types; "full": the published
    architecture; "bench": a benchmark preset (SIZES says which arch has which). Weights
    are created on the CPU from `seed` (each component from its own seed, so they do not
    depend on build order) and then moved to `device`; the same (arch, size, dtype, seed)
    gives the same weights everywhere. device="meta" builds shapes only (parameter counts,
    memory planning) in no time and no memory.

    on_device=True creates the weights on `device` itself, from its own random generator: the
    same weights on every build there, not the CPU's. For a model that would take minutes to
    build on the host (full Flux on a GPU). `without` names components left out (None), such as
    text encoders and their tokenizers where the caller passes prompt embeddings.
    """
    import diffusers

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise PyextError(f"pyext.offline.build_pipeline: dtype {dtype} not supported; use float32, float16 or bfloat16")
    spec = load_config(arch, size)
    meta = str(device) == "meta"
    if (arch, size) in _FP32_REFUSED and dtype == torch.float32 and not meta:
        raise PyextError(f"pyext.offline.build_pipeline: {arch}/{size} in float32 needs ~67 GB; "
                         "pass dtype=torch.bfloat16 (~34 GB) or device='meta'")
    unknown = sorted(set(without) - set(spec["components"]))
    if unknown:
        raise PyextError(f"pyext.offline.build_pipeline: without={unknown} names no component of {arch}/{size}; "
                         f"its components are {sorted(spec['components'])}")
    cls = getattr(diffusers, spec["pipeline"])
    home = sys.modules[cls.__module__]
    made_on = "meta" if meta else str(device) if on_device else "cpu"
    parts = {name: None if name in without else _build_component(name, comp["class"], comp["config"], dtype, made_on,
                                                                 seed, home)
             for name, comp in spec["components"].items()}
    # A pipeline may build modules of its own (AnimateDiff's UNetMotionModel from unet + motion
    # adapter): on the same device and dtype, and without drawing from the caller's random stream.
    with torch.random.fork_rng(devices=[]), _construction(dtype, made_on):
        pipe = cls(**parts, **spec["extra"])
    pipe.set_progress_bar_config(disable=True)
    if not meta and str(device) != made_on:
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


def example_call(arch: str, size: str = "tiny") -> dict:
    """The keyword arguments of `arch`'s example generation (size, frames, text length...), a copy;
    empty (the pipeline's defaults) for a config without a "call", as the "full" ones."""
    return load_config(arch, size).get("call", {})


def run_example(pipe, arch: str, size: str = "tiny", steps: int = 2, seed: int = 0, **overrides) -> torch.Tensor:
    """One generation of PROMPT with the config's example call: float in [0, 1], shaped (N, C, H, W)
    for images and (N, F, C, H, W) for videos. `overrides` replace or add call arguments."""
    params = inspect.signature(pipe.__call__).parameters
    # Every denoising loop runs `steps` steps (Stable Cascade's prior has a loop of its own).
    loops = {k: steps for k in ("num_inference_steps", "prior_num_inference_steps") if k in params}
    kwargs = {"output_type": "pt", **loops, **example_call(arch, size), **overrides}
    out = pipe(PROMPT, generator=torch.Generator().manual_seed(seed), **kwargs)
    return (out.frames if hasattr(out, "frames") else out.images).float()


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
