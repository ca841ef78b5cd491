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


# ------------------------------------------------------------------------------------------------ the planning models
def _ring_backward_bytes(b: int, s: int, heads: int, kv_heads: int, d: int, n: int) -> int:
    """The most bytes one cp2 ``"ring"`` attention backward (rank 0, ``sdpa`` on CPU, float32) holds beyond what
    exists when it starts, for windows of ``n``-token documents: measured with ``LiveTensorBytes`` on a fake process
    group (its exchanges carry no data: memory is real)."""
    import torch.distributed as dist

    from lightning_4d.features.context_parallel import runtime
    from lightning_4d.measure import LiveTensorBytes
    from lightning_4d.parallel._compat.fake import init_fake_process_group

    init_fake_process_group(0, 2)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, s // 2, heads, d, generator=g, requires_grad=True)
        k = torch.randn(b, s // 2, kv_heads, d, generator=g, requires_grad=True)
        v = torch.randn(b, s // 2, kv_heads, d, generator=g, requires_grad=True)
        ids = (torch.arange(s) // n).expand(b, s).contiguous()
        seen: list[int] = []
        backward = runtime._ring_backward

        def measured(*args, **kwargs):
            start, tracker.peak = tracker.current, tracker.current
            out = backward(*args, **kwargs)
            seen.append(tracker.peak - start)
            return out

        runtime._ring_backward = measured
        try:
            with LiveTensorBytes() as tracker:
                out = runtime.context_parallel_attention(q, k, v, dist.group.WORLD, "ring", "sdpa", ids)
                out.sum().backward()
        finally:
            runtime._ring_backward = backward
    finally:
        dist.destroy_process_group()
    return seen[0]


@pytest.mark.parametrize("b,s", [(2, 256), (1, 512)])
def test_ring_masked_backward_is_what_the_memory_model_counts(b, s):
    """The ring's backward with its block masks (the own block's boolean and additive masks beside the ring's
    buffers) holds what :func:`ring_masked_backward` counts, byte for byte (``sdpa`` on CPU, float32)."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.features.context_parallel.costs import ring_masked_backward
    from lightning_4d.planning.tensors import Dtypes

    config = LlamaConfig.from_name("tiny-test")
    pc = ParallelConfig(context_parallel_size=2, zero_stage=0).resolve(2)
    measured = _ring_backward_bytes(b, s, config.num_heads, config.num_kv_heads, config.head_dim, 32)
    assert measured == ring_masked_backward(config, pc, Dtypes.of("32-true"), b, s, eager=False)


def test_masked_ring_phase_is_in_the_estimate_only_with_masking():
    """Document masking under the cp ring adds the phase of its masked backward (``planning/buffers.py``'s
    ``masked_ring_phase``); the same layout without masking has no such phase and its estimate is unchanged by it;
    at b=2 s=2048 (tiny-test cp2, the case ``measure --document-tokens 128`` measured 29,799,640 B at) the phase is
    the peak and the estimate within 5% above the measured peak."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.planning.hardware import OverheadAllowance
    from lightning_4d.planning.model import estimate_memory
    from lightning_4d.planning.workload import Workload

    config = LlamaConfig.from_name("tiny-test")
    pc = ParallelConfig(context_parallel_size=2, zero_stage=0).resolve(2)
    kw = dict(device_type="cpu", overhead=OverheadAllowance(0, 0.0, "none"))
    masked = estimate_memory(Workload(config, 2, 2048, "32-true", document_masking=True), pc, **kw)
    plain = estimate_memory(Workload(config, 2, 2048, "32-true"), pc, **kw)
    assert (
        "phase_masked_cp_attention_backward" in masked.details
        and "phase_masked_cp_attention_backward" not in plain.details
    )
    assert masked.peak_phase == "masked cp attention backward"
    assert 29_799_640 <= masked.total <= 1.05 * 29_799_640
    allgather = ParallelConfig(context_parallel_size=2, zero_stage=0, context_parallel_method="allgather").resolve(2)
    assert (
        "phase_masked_cp_attention_backward"
        not in estimate_memory(Workload(config, 2, 2048, "32-true", document_masking=True), allgather, **kw).details
    )


@pytest.mark.parametrize(
    "layout,measured",
    [
        ({"activation_checkpointing": "full"}, 22_410_456),
        ({"context_parallel_method": "alltoall"}, 65_975_512),
    ],
)
def test_masked_cp_phase_under_checkpointing_and_alltoall(layout, measured):
    """The masked phase at the peaks ``measure --document-tokens 128`` measured (tiny-test cp2 b=2 s=2048
    ``32-true``; ``tests/test_measure.py`` measures them again): the ring under full checkpointing (its recomputed
    set without the layer's input counted twice: 1.070 of the peak with it) and all-to-all (the whole sequence's
    mask, its negation and additive copy: 0.406 of the peak without the phase), each the estimate's peak within 5%
    above the measured one."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.planning.hardware import OverheadAllowance
    from lightning_4d.planning.model import estimate_memory
    from lightning_4d.planning.workload import Workload

    pc = ParallelConfig(context_parallel_size=2, zero_stage=0, **layout).resolve(2)
    kw = dict(device_type="cpu", overhead=OverheadAllowance(0, 0.0, "none"))
    masked = estimate_memory(
        Workload(LlamaConfig.from_name("tiny-test"), 2, 2048, "32-true", document_masking=True), pc, **kw
    )
    assert masked.peak_phase == "masked cp attention backward"
    assert measured <= masked.total <= 1.05 * measured


def test_document_attention_context_by_hand():
    """Windows of 10 tokens in documents of 4: lengths 4, 4, 2, context (16 + 16 + 4) / 10 = 3.6, what
    :func:`~lightning_4d.models.document_mask.attention_context` reads from such ids; the whole window for documents
    of the window's length or longer, and without masking."""
    from lightning_4d.planning.workload import document_attention_context

    assert document_attention_context(10, 4) == pytest.approx(3.6)
    assert document_attention_context(10, 4) == pytest.approx(attention_context_of((torch.arange(10) // 4)[None]))
    assert document_attention_context(10, 10) == document_attention_context(10, 64) == 10
    assert document_attention_context(10, None) == 10


def test_attention_work_by_hand():
    """The attention work of the masked kernels over causal attention's: without cp one masked call over the whole
    square, 2.0 whatever the documents; the cp2 ring with documents of one chunk (s=16, chunks of 4 tokens) computes
    its own blocks whole (``8 × 8`` pairs, the causal ring's 2 steps of ``2·4²``) and skips step 1's on both ranks:
    64/64 = 1.0; the all-gather method's query chunks against their own chunk only (documents start at every chunk:
    2 chunks a rank of 4 queries x 4 keys, 32 pairs of the causal 64), 0.5; one document per window (documents of
    s tokens or more) is still masked: the ring computes every block, ``(2 + 1)/2``. The ring's blocks are those the
    runtime computes."""
    from lightning_4d.features.context_parallel.costs import allgather_masked_keys, ring_computed_blocks
    from lightning_4d.planning.step_time import attention_work

    assert attention_work(8, 2, 1, "ring") == attention_work(8, 8, 1, "ring") == 2.0
    assert attention_work(16, 4, 2, "alltoall") == 2.0
    assert attention_work(16, 4, 2, "ring") == 1.0
    assert ring_computed_blocks(16, 2, 4) == ((True, False), (True, False))
    assert allgather_masked_keys(16, 2, 4) == (8, 8)
    assert attention_work(16, 4, 2, "allgather") == 0.5
    assert attention_work(16, 16, 2, "ring") == attention_work(16, 64, 2, "ring") == 1.5
    assert attention_work(16, None, 2, "ring") == 1.0
    for s, cp, n in [(64, 2, 8), (128, 4, 12), (256, 4, 40), (96, 3, 10), (64, 2, 100)]:
        ids = (torch.arange(s) // n).expand(2, s)
        assert sum(map(sum, ring_computed_blocks(s, cp, n))) == ring_blocks(ids, cp)[0]


@pytest.mark.parametrize(
    "layout,sign",
    [
        ({}, 1),
        ({"context_parallel_size": 4}, -1),
        ({"context_parallel_size": 4, "context_parallel_method": "allgather"}, -1),
        ({"context_parallel_size": 4, "context_parallel_method": "alltoall"}, 1),
        ({"context_parallel_size": 2, "tensor_parallel_size": 2}, 0),
    ],
)
def test_step_time_with_masking_charges_what_the_kernels_do(layout, sign):
    """Document masking's step time with documents of 1,024 tokens in windows of 32,768: below causal attention's
    under the ring and the all-gather method, which skip the blocks no document spans; above it without cp and under
    all-to-all, whose masked kernels compute the whole square; equal under the cp2 ring (its own block computed whole,
    twice the causal one, the other step's skipped: ``(2 + 0)/2``); documents of the window's length still masked
    (the ring's own block whole: slower than causal), ``None`` the causal step itself."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.step_time import predict_step_time

    config, gpu, s = LlamaConfig.from_name("llama3-8b"), GPU_PRESETS["H100-80GB"], 32768
    pc = ParallelConfig(data_parallel_size=2, zero_stage=1, **layout)
    plain = predict_step_time(config, pc, 1, 4, s, gpu, 8)
    masked = predict_step_time(config, pc, 1, 4, s, gpu, 8, document_tokens=1024).total
    assert (masked > plain.total) - (masked < plain.total) == sign
    assert predict_step_time(config, pc, 1, 4, s, gpu, 8, document_tokens=s).total > plain.total
    assert predict_step_time(config, pc, 1, 4, s, gpu, 8, document_tokens=None) == plain


def test_plan_takes_document_tokens():
    """``plan --document-tokens N``: every layout's step time with the attention work its masked kernels do, and its
    memory with the masks; at s=32,768 with documents of 2,048 tokens the fastest layout (a cp ring skipping the
    blocks no document spans) is faster than without masking."""
    from lightning_4d.planning.commands import _plan, command_parser

    argv = ["--model", "llama3-8b", "--num-gpus", "16", "--seq-length", "32768", "--global-batch-size", "16",
            "--top", "1", "--json"]  # fmt: skip
    plain = _plan(command_parser("plan").parse_args(argv))["layouts"][0]
    masked = _plan(command_parser("plan").parse_args([*argv, "--document-tokens", "2048"]))["layouts"][0]
    assert masked["step_time"] < plain["step_time"]


def _masked_forward_flops(s: int, cp: int, n: int, method: str) -> float:
    """The attention FLOPs one masked forward does on its slowest rank, over causal attention's ``4·b·h·d·s²/(2·cp)``
    per rank, counted by torch's ``FlopCounterMode`` on the real kernel calls of the ``"eager"`` backend (the
    explicit matmuls every masked block runs on CUDA) on a fake process group, each rank in turn: the ring's steps
    each as long as their slowest rank's block, the other methods a rank's whole forward."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_4d.features.context_parallel import runtime
    from lightning_4d.parallel._compat.fake import init_fake_process_group

    b, heads, kv_heads, d = 1, 4, 2, 8
    ids = (torch.arange(s) // n).expand(b, s).contiguous()
    q, k, v = (torch.randn(b, s // cp, h, d) for h in (heads, kv_heads, kv_heads))
    if cp == 1:
        with FlopCounterMode(display=False) as counter:
            attention(q, k, v, "eager", window_mask(ids))
        return counter.get_total_flops() / (4 * b * heads * d * s * s / 2)
    per_step: list[list[int]] = []  # [rank][step] FLOPs
    step_block, forward = runtime._ring_step_block, runtime._Kernel.forward

    def record_step(rank, source, *args):
        per_step[-1].append(0)  # one ring step of this rank (skipped or not)
        return step_block(rank, source, *args)

    def counted(self, *args):
        with FlopCounterMode(display=False) as counter:
            out = forward(self, *args)
        per_step[-1][-1] += counter.get_total_flops()
        return out

    runtime._ring_step_block, runtime._Kernel.forward = record_step, counted
    try:
        for rank in range(cp):
            init_fake_process_group(rank, cp)
            per_step.append([0])
            try:
                runtime.context_parallel_attention(q, k, v, dist.group.WORLD, method, "eager", ids)
            finally:
                dist.destroy_process_group()
    finally:
        runtime._ring_step_block, runtime._Kernel.forward = step_block, forward
    if method == "ring":
        done = sum(max(rank[step + 1] for rank in per_step) for step in range(cp))
    else:
        done = max(map(sum, per_step))
    return done / (4 * b * heads * d * s * s / (2 * cp))


@pytest.mark.parametrize(
    "method,cp,n",
    [("ring", 1, 8)]
    + [
        (m, cp, n) for m in ("ring", "allgather", "alltoall") for cp, n in [(2, 8), (2, 12), (2, 64), (4, 12), (4, 100)]
    ],
)
def test_attention_work_is_what_the_masked_kernels_compute(method, cp, n):
    """The step-time model's attention work with document masking (:func:`attention_work`) equals the FLOPs the real
    masked kernel calls of one forward do (``torch.utils.flop_counter``), windows of 64 tokens: without cp and
    under all-to-all the whole ``s × s`` square (2x causal), under the ring and all-gather the blocks they do not
    skip, each computed whole. The backward runs the same blocks."""
    from lightning_4d.planning.step_time import attention_work

    assert _masked_forward_flops(64, cp, n, method) == pytest.approx(attention_work(64, n, cp, method), rel=1e-12)
