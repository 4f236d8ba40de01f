"""pyext.checkpoint: fp8 checkpoints with per-tensor checksums, and clear errors for damaged,
incomplete or foreign directories."""
import json
import struct

import pytest
import torch
import torch.nn as nn
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config

from pyext import PyextError, checkpoint
from pyext.nn import FP8Linear


class Tiny(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 64):
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, 16)

    def forward(self, x):
        return self.down(self.up(x))


def fp8_model() -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    model.up = FP8Linear.from_linear(model.up)
    return model


@pytest.fixture
def saved(tmp_path):
    model = fp8_model()
    checkpoint.save_pretrained(model, str(tmp_path), max_shard_size="6KB")
    return model, tmp_path


def tensor_data_offsets(path):
    """{key: (begin, end)} byte ranges of each tensor in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def test_round_trip_with_checksums(saved):
    model, path = saved
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [s.name for s in shards]
    assert all(len(d) == 64 for files in manifest["files"].values() for d in files.values())
    loaded = checkpoint.from_pretrained(Tiny, str(path))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_flipped_byte_names_the_tensor_and_the_file(saved):
    _, path = saved
    shard = next(s for s in sorted(path.glob("*.safetensors")) if "up.weight" in tensor_data_offsets(s))
    begin, _ = tensor_data_offsets(shard)["up.weight"]
    raw = bytearray(shard.read_bytes())
    raw[begin + 5] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(PyextError, match=rf"tensor 'up.weight' in .*{shard.name} does not match its saved SHA-256"):
        checkpoint.from_pretrained(Tiny, str(path))
    loaded = checkpoint.from_pretrained(Tiny, str(path), verify=False)  # the opt-out loads the damaged bytes
    assert int(loaded.up.weight.codes.reshape(-1)[5]) == raw[begin + 5]


def test_missing_shard_names_the_file(saved):
    _, path = saved
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(PyextError, match=rf"lacks the shard file\(s\) {victim.name}"):
        checkpoint.from_pretrained(Tiny, str(path))


def test_missing_shard_of_a_checkpoint_without_checksums(saved):
    """Manifests written before checksums existed: diffusers' index still names the shards."""
    _, path = saved
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    (path / checkpoint.MANIFEST).write_text(json.dumps({"format": 1, "layers": manifest["layers"]}))
    checkpoint.from_pretrained(Tiny, str(path))  # still loads, with nothing to verify
    victim = sorted(path.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(PyextError, match=rf"lacks the shard file\(s\) {victim.name}"):
        checkpoint.from_pretrained(Tiny, str(path))


def test_empty_directory(tmp_path):
    with pytest.raises(PyextError, match=rf"pyext.checkpoint.from_pretrained: {tmp_path} is empty. Expected an fp8 "
                                         r"checkpoint written by pyext.checkpoint.save_pretrained"):
        checkpoint.from_pretrained(Tiny, str(tmp_path))


def test_plain_model_directory(tmp_path):
    Tiny().save_pretrained(str(tmp_path))
    with pytest.raises(PyextError, match=r"holds config.json, diffusion_pytorch_model.safetensors but no "
                                         r"pyext_fp8.json.*quantize_fp8"):
        checkpoint.from_pretrained(Tiny, str(tmp_path))


def test_not_a_directory(tmp_path):
    with pytest.raises(PyextError, match="is not a directory"):
        checkpoint.from_pretrained(Tiny, str(tmp_path / "nowhere"))


def test_truncated_shard_names_the_file(saved):
    _, path = saved
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(PyextError, match=rf"pyext.checkpoint.from_pretrained: .*{shard.name} cannot be read as "
                                         r"safetensors .*truncated or damaged"):
        checkpoint.from_pretrained(Tiny, str(path))


def test_damaged_header_names_the_file(saved):
    _, path = saved
    shard = sorted(path.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[12:20] = b"########"
    shard.write_bytes(bytes(raw))
    with pytest.raises(PyextError, match=rf"{shard.name} cannot be read as safetensors"):
        checkpoint.from_pretrained(Tiny, str(path))


@pytest.mark.parametrize("manifest,match", [
    ("{not json", "pyext_fp8.json cannot be read .*JSONDecodeError"),
    ('{"format": 2}', "pyext_fp8.json lists no fp8 layers"),
    ('{"format": 2, "layers": {"nope.layer": {"per_channel": true, "compute_dtype": "float32"}}}',
     "names fp8 layer 'nope.layer'.*Tiny built from this config lacks"),
    ('{"format": 2, "layers": {"up": {"per_channel": true, "compute_dtype": "bogus"}}}',
     "names fp8 layer 'up'.*cannot take"),
])
def test_damaged_or_foreign_manifest_names_the_file(saved, manifest, match):
    _, path = saved
    (path / checkpoint.MANIFEST).write_text(manifest)
    with pytest.raises(PyextError, match=f"pyext.checkpoint.from_pretrained: .*{match}"):
        checkpoint.from_pretrained(Tiny, str(path))


def test_missing_config_names_the_file(saved):
    _, path = saved
    (path / "config.json").unlink()
    with pytest.raises(PyextError, match=r"config.json cannot be read"):
        checkpoint.from_pretrained(Tiny, str(path))


def test_a_model_converted_by_quantize_fp8_saves_its_codes(tmp_path, monkeypatch):
    """quantize_fp8 puts a save_pretrained on the instance that writes plain weights; the fp8
    checkpoint still writes the codes."""
    from safetensors.torch import load_file

    import pyext.nn.fp8 as fp8_module
    from pyext import quantize_fp8

    monkeypatch.setattr(fp8_module, "MIN_NUMEL", 0)
    torch.manual_seed(0)
    model = Tiny()
    assert quantize_fp8(model, skip=()).converted == ["down"]  # (`up` holds the model's first parameter)
    checkpoint.save_pretrained(model, str(tmp_path))
    [shard] = tmp_path.glob("*.safetensors")
    saved = load_file(shard)
    assert saved["down.weight"].dtype == torch.uint8 and "down.weight_scale" in saved
    loaded = checkpoint.from_pretrained(Tiny, str(tmp_path))
    assert torch.equal(loaded.down.weight, model.down.weight)


def test_a_module_that_is_not_a_diffusers_model_is_refused_before_writing(tmp_path):
    model = nn.Sequential(FP8Linear.from_linear(nn.Linear(64, 64)))
    with pytest.raises(PyextError, match=r"save_pretrained: model is a torch\.nn\.modules\.container\.Sequential, "
                                         r"not a diffusers model.*ModelMixin.*nothing was written"):
        checkpoint.save_pretrained(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
