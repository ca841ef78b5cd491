"""Document masking: a packed window's documents attend only within themselves.

The independent reference is every document run alone through a plain one-process model (no strategy, no mask),
its losses summed: the masked packed batch must give the same loss and the same gradient of every parameter, in one
process (float64, both CPU kernels) and under dp2, tp2 (sp), cp2 and cp4 with each of ring, all-gather and
all-to-all, cp2 x tp2, dp2 x cp2, pp2 (1F1B, 2 micro-batches, each stage masking the micro-batch it runs) and
pp2 x cp2 (float32, 1e-5 relative; measured below 5e-7).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_4d.features.context_parallel.runtime import ring_blocks, shard_batch
from lightning_4d.models.attention_backends import MASK_BACKEND_ERROR, attention
from lightning_4d.models.document_mask import (
    attention_context as attention_context_of,
    check_document_ids,
    document_ids_from_eos,
    document_positions,
    window_mask,
)
from lightning_4d.models.llama import LlamaModel, canonical_name
from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.tasks import CausalLMModule
from lightning_4d.tasks.documents import DocumentMasking
from tests._launch import SCRIPTS, torchrun

sys.path.insert(0, str(SCRIPTS))
from document_masking import EOS, INIT_SEED, MODEL, packed_batch  # noqa: E402

#: relative bound on the loss and on each parameter's gradient (its norm) against the per-document reference in
#: float32: measured at most 5.1e-8 (loss) and 4.7e-7 (gradients) over every layout
REL = 1e-5


# ---------------------------------------------------------------------------------------------------- pieces
def test_document_ids_and_positions_from_eos():
    x = torch.tensor([[5, 0, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids_from_eos(x, eos_id=0)
    assert ids.tolist() == [[0, 0, 1, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6]]
    mask = window_mask(ids)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]  # token 4 sees 3 and itself
    assert mask.diagonal().all()


def test_attention_context_counts_the_documents_flops():
    config = LlamaConfig.from_name("llama3-8b")
    ids = torch.tensor([[0] * 2 + [1] * 6, [0] * 8])  # contexts: (4 + 36) / 8 = 5 and 64 / 8 = 8
    assert attention_context_of(ids) == (5 + 8) / 2
    assert config.flops_per_token(
        8, attention_context_of(torch.zeros(1, 8, dtype=torch.long))
    ) == config.flops_per_token(8)
    saved = config.flops_per_token(8192) - config.flops_per_token(8192, 512.0)
    assert saved == 12 * config.num_layers * config.hidden_size * (8192 - 512)


def test_bad_document_ids_are_one_line_errors():
    with pytest.raises(ValueError, match="decrease along a sequence"):
        check_document_ids(torch.tensor([[0, 1, 0]]), (1, 3))
    with pytest.raises(ValueError, match=r"expected integer ids of the batch's input_ids shape \(1, 4\)"):
        check_document_ids(torch.tensor([[0, 1, 1]]), (1, 4))
    masking = DocumentMasking.of(True, None, None, None, "sdpa")
    with pytest.raises(ValueError, match="no end-of-document token is known"):
        masking.prepare({"input_ids": torch.ones(1, 4, dtype=torch.long)})


def test_module_arguments_are_checked_before_any_process_group():
    with pytest.raises(ValueError, match="applies to document masking only"):
        CausalLMModule("tiny-test", reset_position_ids=False)
    with pytest.raises(ValueError, match=r"eos_token_id=-1 is not valid"):
        CausalLMModule("tiny-test", document_masking=True, eos_token_id=-1)
    flash = LlamaConfig.from_name("tiny-test")
    flash.attention_backend = "flash"
    with pytest.raises(ValueError) as err:
        CausalLMModule(flash, document_masking=True)
    assert str(err.value) == MASK_BACKEND_ERROR


def test_prepare_masks_the_labels_that_cross_documents_and_keeps_ids_whole_under_cp():
    x = torch.tensor([[3, 4, 0, 5, 6, 0, 7, 8]])
    batch = DocumentMasking.of(True, 0, None, None, "sdpa").prepare({"input_ids": x, "labels": x + 1})
    assert (batch["labels"] == -100).nonzero()[:, 1].tolist() == [2, 5]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    given = {"input_ids": x, "labels": x + 1, "document_ids": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])}
    batch = DocumentMasking.of(True, None, False, None, "sdpa").prepare(given)
    assert (batch["labels"] == -100).nonzero()[:, 1].tolist() == [3]
    assert batch["positions"].tolist() == [list(range(8))]  # reset_position_ids=False: the window's positions
    sharded = shard_batch(batch, 1, 2)
    assert sharded["input_ids"].shape == (1, 4) and sharded["document_ids"].shape == (1, 8)


def test_ring_skips_the_blocks_no_document_spans():
    s, c = 64, 4  # chunks of 8 tokens
    one_document = torch.zeros(1, s, dtype=torch.long)
    assert ring_blocks(one_document, c) == (16, 16)  # causal: every block has work
    per_chunk = torch.arange(s).div(8, rounding_mode="floor").unsqueeze(0)  # one document per chunk
    assert ring_blocks(per_chunk, c) == (4, 16)  # only each rank's own block
    straddling = (torch.arange(s) + 4).div(8, rounding_mode="floor").unsqueeze(0)  # documents across chunk pairs
    computed, total = ring_blocks(straddling, c)
    assert 4 < computed < total


# ---------------------------------------------------------------------------------------------------- one process
def _per_document_reference(model: LlamaModel, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    """Loss (mean over trained tokens) and gradients of every document of ``x`` run alone through ``model``."""
    model.zero_grad()
    n = int((y != -100).sum())
    total = 0.0
    for i in range(x.shape[0]):
        ids = document_ids_from_eos(x[i], EOS)
        for d in ids.unique_consecutive().tolist():
            span = (ids == d).nonzero().flatten()
            lo, hi = int(span[0]), int(span[-1]) + 1
            logits = model(x[i : i + 1, lo:hi])
            loss = F.cross_entropy(logits.flatten(0, 1).to(torch.float64), y[i, lo:hi], reduction="sum") / n
            loss.backward()
            total += float(loss.detach())
    return total, {canonical_name(k): p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_batch_equals_each_document_alone(backend):
    config = LlamaConfig.from_name(MODEL)
    config.attention_backend = backend
    model = LlamaModel(config, init_seed=INIT_SEED).double()
    model.init_weights()
    window = packed_batch()
    batch = DocumentMasking.of(True, EOS, None, None, backend).prepare(
        {"input_ids": window[:, :-1], "labels": window[:, 1:]}
    )
    ref_loss, ref = _per_document_reference(model, batch["input_ids"], batch["labels"])
    model.zero_grad()
    logits = model(batch["input_ids"], batch["positions"], batch["document_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    assert abs(float(loss.detach()) - ref_loss) <= 1e-12 * ref_loss
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[canonical_name(name)], rtol=1e-10, atol=1e-13), name
    causal = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert abs(float(causal) - ref_loss) > 1e-3  # the mask changes the loss: the comparison can fail


def test_masked_attention_backends_agree():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 24])
    mask = window_mask(ids)
    torch.testing.assert_close(attention(q, k, v, "sdpa", mask), attention(q, k, v, "eager", mask))
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        attention(q, k, v, "flash", mask)


# ---------------------------------------------------------------------------------------------------- layouts
WORLD2 = [{"dp": 2}, {"tp": 2}, {"cp": 2, "method": "ring"}, {"cp": 2, "method": "allgather"},
          {"cp": 2, "method": "alltoall"}, {"pp": 2}]  # fmt: skip
WORLD4 = [{"cp": 4, "method": "ring"}, {"cp": 4, "method": "allgather"}, {"cp": 2, "tp": 2, "method": "ring"},
          {"cp": 2, "tp": 2, "method": "alltoall"}, {"dp": 2, "cp": 2, "method": "allgather"},
          {"pp": 2, "cp": 2, "method": "ring"}]  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    model = LlamaModel(LlamaConfig.from_name(MODEL), init_seed=INIT_SEED)
    model.init_weights()
    window = packed_batch()
    x, y = window[:, :-1], window[:, 1:].masked_fill(window[:, :-1] == EOS, -100)
    return _per_document_reference(model, x, y)


def _launch(tmp_path_factory, nproc: int, layouts: list[dict]) -> list[dict]:
    out = tmp_path_factory.mktemp(f"document_masking_world{nproc}")
    torchrun(nproc, SCRIPTS / "document_masking.py", "--out", str(out), "--layouts", json.dumps(layouts))
    results = []
    for i in range(len(layouts)):  # every rank's gradients (under pp each stage's), the loss of rank 0
        ranks = [torch.load(out / f"layout{i}_rank{r}.pt") for r in range(nproc)]
        grads = {name: g for rank in reversed(ranks) for name, g in rank["grads"].items()}
        results.append({"loss": ranks[0]["loss"], "grads": grads})
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, WORLD4)


def _check(result: dict, reference: tuple[float, dict]) -> None:
    ref_loss, ref = reference
    assert abs(result["loss"] - ref_loss) <= REL * ref_loss
    for name, g in ref.items():
        got = result["grads"]["model." + name]
        assert float((got - g).norm()) <= REL * float(g.norm()), name


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[json.dumps(x) for x in WORLD2])
def test_layouts_world2_equal_each_document_alone(reference, world2, index):
    _check(world2[index], reference)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[json.dumps(x) for x in WORLD4])
def test_layouts_world4_equal_each_document_alone(reference, world4, index):
    _check(world4[index], reference)


# ---------------------------------------------------------------------------------------------------- memory
def _saved_bytes(model: LlamaModel, x: torch.Tensor, document_ids, autocast: bool) -> int:
    """Bytes a forward saves for backward (``saved_tensors_hooks``, each storage once) and the weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    masking = DocumentMasking.of(
        document_ids is not None, EOS if document_ids is not None else None, None, None, "sdpa"
    )
    batch = masking.prepare({"input_ids": x}) if masking is not None else {"input_ids": x}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(batch["input_ids"], batch.get("positions"), batch.get("document_ids"))
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_masking_saves_what_the_memory_model_adds(precision):
    """The bytes document masking adds to a forward's saved set (the per-sample cos/sin and the one additive mask
    every layer's SDPA saves), measured with ``saved_tensors_hooks``, equal what the memory model adds, exactly."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.planning.model import saved_activation_bytes
    from lightning_4d.planning.workload import Workload

    config = LlamaConfig.from_name(MODEL)
    model = LlamaModel(config, init_seed=INIT_SEED)
    model.init_weights()
    b, s = 2, 32
    x = packed_batch()[:b, :s].contiguous()
    autocast = precision == "bf16-mixed"
    measured = _saved_bytes(model, x, True, autocast) - _saved_bytes(model, x, None, autocast)
    pc = ParallelConfig(zero_stage=0).resolve(1)
    with_masks = saved_activation_bytes(Workload(config, b, s, precision, document_masking=True), pc)
    without = saved_activation_bytes(Workload(config, b, s, precision), pc)
    estimated = sum(with_masks.values()) - sum(without.values())
    assert measured == estimated > (2 if autocast else 4) * b * s * s


def test_estimate_and_measure_take_document_tokens():
    """``estimate --document-tokens N`` counts document masking's mask (one ``[b, 1, s, s]`` additive mask in the
    compute dtype per micro-batch in flight, and per-sample cos/sin); ``measure`` accepts the same option (it packs
    its synthetic windows with documents of N tokens: the support matrix's document-masking rows run through it)."""
    from lightning_4d.planning.commands import _estimate, command_parser

    argv = ["--model", "tiny-test", "--dp", "1", "--micro-batch-size", "2", "--seq-length", "256", "--zero-stage", "0",
            "--precision", "32-true"]  # fmt: skip
    plain = _estimate(command_parser("estimate").parse_args(argv))
    masked = _estimate(command_parser("estimate").parse_args([*argv, "--document-tokens", "64"]))
    b, s, half = 2, 256, LlamaConfig.from_name("tiny-test").head_dim // 2
    assert masked["total"] - plain["total"] >= 4 * b * s * s + 2 * 4 * (b - 1) * s * half
    assert command_parser("measure").parse_args([*argv, "--document-tokens", "64"]).document_tokens == 64
