"""Hugging Face weights in (``init_from``) and out (``export-hf``), against transformers' own ``LlamaForCausalLM``
(issue 14). Tiny models built from configs with random weights: no download."""

from __future__ import annotations

import json

import pytest
import torch

from tests._launch import SCRIPTS, python_run, torchrun

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is a test dependency")

from lightning_4d.export_hf import export_hf  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.models.hf_mapping import hf_name, rotary_from_hf, rotary_to_hf  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

# 1e-5 relative (the bound); measured: ~3e-7 of the largest logit on one process, see the prints
REL = 1e-5


def _hf_model(tmp, shard: bool, **overrides) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    fields.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).float().eval()
    # sharded: about half the weights per file (two safetensors files + model.safetensors.index.json)
    model.save_pretrained(tmp, max_shard_size="400KB" if shard else "5GB")
    return model


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    return err


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("case", ["llama2", "llama3.1", "llama3.2-tied"])
def test_init_from_hf_on_one_process_gives_transformers_logits(tmp_path, ids, case):
    overrides = {
        "llama2": {},
        "llama3.1": {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "llama3.2-tied": {"tie_word_embeddings": True},
    }[case]
    hf = _hf_model(tmp_path, shard=False, **overrides)
    module = CausalLMModule(model_config=str(tmp_path), init_from=str(tmp_path))
    assert module.model_config.tie_word_embeddings == (case == "llama3.2-tied")
    assert (module.model_config.rope_scaling is not None) == (case == "llama3.1")
    module.configure_model()
    with torch.no_grad():
        err = _close(module(ids).float(), hf(ids).logits)
    print(f"\n{case}: max |ours - transformers| / max |transformers| = {err:.2e}")
    assert err < REL


def test_name_map_and_rotary_permutation_are_inverse():
    w = torch.randn(4 * 16, 64)
    assert torch.equal(rotary_to_hf(rotary_from_hf(w, 16), 16), w)
    assert hf_name("layers.3.attention.wq.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="not a parameter"):
        hf_name("layers.0.attention.bogus.weight")


def test_from_hf_refuses_what_our_llama_lacks(tmp_path):
    _hf_model(tmp_path, shard=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, attention_bias=True)))
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="mistral")))
    with pytest.raises(ValueError, match="model_type='mistral'"):
        LlamaConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match="holds no Hugging Face config.json"):
        LlamaConfig.from_hf(tmp_path / "nowhere")


IMPORT_LAYOUTS = [{"dp": 2, "tp": 2, "zero": 3}, {"pp": 2, "tp": 2, "m": 2}, {"cp": 2, "dp": 2, "zero": 1}]


@pytest.mark.slow
def test_init_from_hf_sharded_under_parallel_layouts(tmp_path, ids):
    hf = _hf_model(tmp_path / "hf", shard=True)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 2
    torch.save(ids, tmp_path / "ids.pt")
    torchrun(
        4,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "import",
        "--hf",
        str(tmp_path / "hf"),
        "--out",
        str(tmp_path),
        "--ids",
        str(tmp_path / "ids.pt"),
        "--layouts",
        json.dumps(IMPORT_LAYOUTS),
        timeout=600,
    )
    for i, layout in enumerate(IMPORT_LAYOUTS):
        seen = 0
        for path in sorted(tmp_path.glob(f"import{i}_rank*.pt")):
            for batch, logits in torch.load(path):
                with torch.no_grad():
                    err = _close(logits, hf(batch).logits)
                print(f"\n{layout} {path.name}: relative error {err:.2e}")
                assert err < REL
                seen += 1
        assert seen >= 2, f"{layout}: no rank returned logits"


EXPORT_LAYOUTS = [{"dp": 2, "tp": 2, "zero": 1}, {"pp": 2, "dp": 2, "m": 2, "zero": 1}]


@pytest.mark.slow
def test_export_hf_after_training_loads_in_transformers(tmp_path, ids):
    torch.save(ids, tmp_path / "ids.pt")
    torchrun(
        4,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "export",
        "--out",
        str(tmp_path),
        "--ids",
        str(tmp_path / "ids.pt"),
        "--layouts",
        json.dumps(EXPORT_LAYOUTS),
        timeout=600,
    )
    for i, layout in enumerate(EXPORT_LAYOUTS):
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"export{i}").float().eval()
        seen = 0
        for path in sorted(tmp_path.glob(f"export{i}_rank*.pt")):
            for batch, logits in torch.load(path):
                with torch.no_grad():
                    err = _close(hf(batch).logits, logits[..., :256])
                print(f"\nexport {layout} {path.name}: relative error {err:.2e}")
                assert err < REL
                seen += 1
        assert seen >= 2

    # bfloat16, with a tokenizer given: the files transformers reads, weights in bf16, the tokenizer copied
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["def f(x): return x + 1"] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    out = export_hf(
        tmp_path / "ckpt0" / "last.ckpt", tmp_path / "bf16", dtype="bfloat16", tokenizer=tmp_path / "tokenizer.json"
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_hf_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        export_hf(tmp_path / "ckpt", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype='int8'"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", dtype="int8")


@pytest.mark.slow
def test_cli_validate_with_hf_model_config_and_init_from(tmp_path):
    """YAML / command line: ``model_config: <hf dir>`` and ``init_from: <hf dir>``; the val_loss printed equals
    transformers' loss on the same batch."""
    import re
    import sys

    import torch.nn.functional as F

    from lightning_4d.data import LMDataModule

    hf = _hf_model(tmp_path / "hf", shard=True)
    data = ["--data.seq_length=32", "--data.micro_batch_size=2", "--data.global_batch_size=2", "--data.val_samples=2"]
    cmd = [
        sys.executable,
        "-m",
        "lightning_4d",
        "validate",
        "--config",
        "configs/tiny.yaml",
        f"--model.model_config={tmp_path / 'hf'}",
        f"--model.init_from={tmp_path / 'hf'}",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.limit_val_batches=1",
        "--trainer.logger=false",
        # without a logger LightningCLI saves config.yaml in default_root_dir (the cwd by default): keep it here
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks=null",
        *data,
    ]
    proc = python_run(*cmd[1:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = float(re.search(r"val_loss\D+([0-9.]+)", proc.stdout).group(1))
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=2, val_samples=2, seed=1234)
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    print(f"\nCLI val_loss {printed}, transformers {expected}")
    assert printed == pytest.approx(expected, rel=1e-5)
