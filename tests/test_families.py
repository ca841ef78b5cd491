"""The model-family interface (issue 22): the registry finds each family's models, and the ONE splitter and ONE
``StageChunk`` of ``features/pipeline/runtime.py`` run both families' stages, on one process with no process group: the
two pp ranks' chunks of a pp=2 split, run one after the other, give the unsplit model's logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lightning_4d.config import ParallelConfig
from lightning_4d.families.native_llama import LLAMA
from lightning_4d.families.registry import FAMILIES, estimate_config, find_models
from lightning_4d.features.pipeline.runtime import PrunedLayer, pipeline_chunks, split_model
from lightning_4d.models import LlamaConfig
from lightning_4d.models.llama import LlamaModel

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is a test dependency")

from lightning_4d.adapters.hf_llama import HF_LLAMA  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_length=64
)


def _ours() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(**TINY)).eval()


def _theirs() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).float().eval()


class _Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2), model)


def test_registry_finds_each_family_and_its_config():
    import transformers

    from lightning_4d.features.moe.hf_mixtral import HF_MIXTRAL

    assert [f.name for f in FAMILIES] == [LLAMA.name, HF_LLAMA.name, HF_MIXTRAL.name]
    ours, theirs = _ours(), _theirs()
    mixtral = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    assert [(n, f) for n, f, _ in find_models(_Holder(ours))] == [("inner.1", LLAMA)]
    assert [(n, f) for n, f, _ in find_models(_Holder(theirs))] == [("inner.1", HF_LLAMA)]
    assert [(n, f) for n, f, _ in find_models(_Holder(mixtral))] == [("inner.1", HF_MIXTRAL)]
    assert estimate_config(_Holder(mixtral)).num_experts == 4
    assert find_models(nn.Linear(2, 2)) == []
    assert estimate_config(_Holder(ours)) == ours.config
    hf = estimate_config(_Holder(theirs))
    assert (hf.hidden_size, hf.num_layers, hf.num_kv_heads, hf.vocab_size) == (64, 4, 2, 256)


def test_transformers_llama_refuses_activation_checkpointing():
    config = ParallelConfig(data_parallel_size=1, activation_checkpointing="full").resolve(1)
    with pytest.raises(ValueError, match="activation_checkpointing='full' is not supported for a transformers"):
        HF_LLAMA.validate(_theirs(), config)
    LLAMA.validate(_ours(), config)  # ours takes it


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ours", "transformers"])
def test_one_splitter_and_stage_chunk_give_the_unsplit_logits(family):
    model = _ours() if family == "ours" else _theirs()
    fam = LLAMA if family == "ours" else HF_LLAMA
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        full = full if isinstance(full, torch.Tensor) else full.logits
    config = ParallelConfig(data_parallel_size=1, pipeline_parallel_size=2, zero_stage=0).resolve(2)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    ((s0, chunk0),) = split_model(fam, first, config, pp_rank=0)
    ((s1, chunk1),) = split_model(fam, second, config, pp_rank=1)
    assert (s0, s1) == (0, 1) and pipeline_chunks(first) == [(0, chunk0)]
    # the union keeps the unsplit names: rank 0 holds layers 0-1 and the embedding, rank 1 layers 2-3 and the head
    names0, names1 = {n for n, _ in first.named_parameters()}, {n for n, _ in second.named_parameters()}
    assert not names0 & names1
    assert names0 | names1 == {n for n, _ in model.named_parameters()}
    if family == "transformers":
        assert isinstance(first.model.layers[2], PrunedLayer) and first.lm_head is None
    with torch.no_grad():
        logits = chunk1(chunk0(ids))
    assert torch.allclose(logits, full, rtol=0, atol=1e-5 * full.abs().max().item())


def test_union_conversion_reaches_modules_no_chunk_holds():
    """``to`` on a split transformers Llama goes through its chunk and also converts the rotary embedding's buffers,
    which belong to no chunk."""
    model = _theirs()
    config = ParallelConfig(data_parallel_size=1, pipeline_parallel_size=2, zero_stage=0).resolve(2)
    split_model(HF_LLAMA, model, config, pp_rank=1)
    model.to(torch.float64)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float64
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_transformers_attention_repeats_kv_heads_where_ours_does(monkeypatch):
    """The transformers adapter's attention goes through our SDPA call (``sdpa_causal``): where ours repeats the kv
    heads (float32 GQA on CUDA, whose ``enable_gqa`` path is the math kernel with ``[b, heads, s, s]`` scores), it
    does too, and the output is unchanged. CUDA is stood in for by forcing ``sdpa_repeats_kv_heads``."""
    import torch.nn.functional as F

    from lightning_4d.adapters import hf_llama
    from lightning_4d.models import attention_backends

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    module = torch.nn.Module()
    reference, _ = hf_llama.attention(module, q, k, v, None)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, **kwargs):
        calls.append((k.shape[1], kwargs.get("enable_gqa")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_backends, "sdpa_repeats_kv_heads", lambda q, k: True)
    monkeypatch.setattr(attention_backends.F, "scaled_dot_product_attention", record)
    out, _ = hf_llama.attention(module, q, k, v, None)
    assert calls == [(4, False)]  # kv heads repeated to the 4 query heads, no enable_gqa
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
