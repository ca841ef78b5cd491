"""Bad input files are refused in one line that names the file (and the tensor, shard or token at fault), before
anything is read into the model or written (issue 37): token files, tokenizer JSON, Hugging Face directories and
checkpoint folders of another model."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from lightning_4d.data import load_tokenizer, read_token_file, write_token_file
from lightning_4d.models import LlamaConfig
from lightning_4d.tasks import CausalLMModule


def _refused(call, *match: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for text in match:
        assert text in message, message
    return message


# ---------------------------------------------------------------------------------------------- token files
def test_token_file_of_not_a_whole_number_of_tokens(tmp_path):
    path = write_token_file(tmp_path / "c.bin", np.arange(1000) % 256, 256, "byte")
    with open(path, "ab") as f:
        f.write(b"\x01")  # 2001 bytes of uint16 tokens
    before = path.read_bytes()
    _refused(lambda: read_token_file(path), str(path), "2001 bytes", "1000 uint16 tokens")
    assert path.read_bytes() == before  # nothing changed


def test_token_file_whose_dtype_differs_from_its_sidecar(tmp_path):
    path = write_token_file(tmp_path / "c.bin", np.arange(1000) % 256, 256, "byte")
    side = tmp_path / "c.bin.json"
    meta = json.loads(side.read_text())
    # the size agrees (500 uint32 = 1000 uint16), the dtype is not the one written for vocab_size 256
    side.write_text(json.dumps({**meta, "dtype": "uint32", "num_tokens": 500}))
    _refused(lambda: read_token_file(path), str(side), "'uint32' for vocab_size 256")
    # a sidecar consistent in itself (uint32 for a 70000 vocabulary) over uint16 data: the ids show it (ids 2 and 3
    # read as one: 2 + 3 * 65536)
    side.write_text(json.dumps({**meta, "dtype": "uint32", "num_tokens": 500, "vocab_size": 70000}))
    _refused(lambda: read_token_file(path), str(path), "token id 196610 at position 1", "not below")


# ---------------------------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("text", ["{not json", '{"model": {"type": "BPE"}}', ""])
def test_malformed_tokenizer_json(tmp_path, text):
    bad = tmp_path / "tokenizer.json"
    bad.write_text(text)
    _refused(lambda: load_tokenizer(str(bad)), str(bad))


# ------------------------------------------------------------------------------------- Hugging Face directories
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.test_hf_checkpoints import _hf_model

    out = tmp_path_factory.mktemp("hf") / "hf"
    _hf_model(out, shard=True)  # two safetensors files and an index
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    return out


def _edit_first_shard(hf_dir, dest, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, dest)
    shard = sorted(dest.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    key = "model.embed_tokens.weight" if "model.embed_tokens.weight" in tensors else sorted(tensors)[0]
    tensors[key] = edit(tensors[key])
    save_file(tensors, shard, metadata={"format": "pt"})
    return key


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("shape", lambda t: t[:-1].contiguous(), "has shape (255, 64), the model's is (256, 64)"),
        ("dtype", lambda t: t.to(torch.int8), "is torch.int8 (the model's torch.float32)"),
    ],
)
def test_hf_directory_with_a_tensor_of_wrong_shape_or_dtype(hf_dir, tmp_path, case, edit, message):
    key = _edit_first_shard(hf_dir, tmp_path / case, edit)
    module = CausalLMModule(model_config=str(hf_dir), init_from=str(tmp_path / case))
    _refused(module.configure_model, str(tmp_path / case), repr(key), message)


def test_hf_directory_of_another_floating_dtype_is_cast(hf_dir, tmp_path):
    """bfloat16 / float16 weights load into float32 parameters (the usual Hugging Face directory): cast, not refused."""
    key = _edit_first_shard(hf_dir, tmp_path / "fp16", lambda t: t.to(torch.float16))
    module = CausalLMModule(model_config=str(hf_dir), init_from=str(tmp_path / "fp16"))
    module.configure_model()
    from safetensors.torch import load_file

    saved = load_file(sorted((tmp_path / "fp16").glob("model-*.safetensors"))[0])[key]
    assert torch.equal(module.model.tok_embeddings.weight, saved.float())


def test_hf_directory_with_a_missing_shard(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path / "hf")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    module = CausalLMModule(model_config=str(hf_dir), init_from=str(tmp_path / "hf"))
    _refused(module.configure_model, str(tmp_path / "hf"), f"shard {shard.name!r}", "is missing")


# ------------------------------------------------------------------------------ checkpoints of another model
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A sharded folder of tiny-test weights, as our checkpoints hold them (DCP, keys ``state_dict.<name>``)."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    module = CausalLMModule("tiny-test")
    module.configure_model()
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=out, no_dist=True)
    torch.save({"hyper_parameters": {}}, out / "meta.pt")
    torch.save({"state_dict": module.state_dict()}, out.with_name("tiny-full.ckpt"))
    return out


@pytest.mark.parametrize("kind", ["folder", "file"])
@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"hidden_size": 128, "intermediate_size": 256}, "tensor 'model.tok_embeddings.weight' has shape (256, 64)"),
        ({"num_layers": 3}, "holds no tensor 'model.layers.2."),
    ],
)
def test_init_from_a_checkpoint_of_another_model(folder, kind, other, message):
    path = folder if kind == "folder" else folder.with_name("tiny-full.ckpt")
    config = dataclasses.replace(LlamaConfig.from_preset("tiny-test"), **other)
    module = CausalLMModule(config, init_from=str(path))
    _refused(module.configure_model, str(path), "is from another model", message)


def test_init_from_a_checkpoint_of_the_same_model_loads(folder):
    module = CausalLMModule("tiny-test", init_from=str(folder), init_seed=1)
    module.configure_model()
    reference = CausalLMModule("tiny-test")
    reference.configure_model()
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), reference.state_dict().values()))
