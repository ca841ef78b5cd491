"""Loss parity and model-state bytes of parallel layouts against the single-process run (CPU, gloo, float32).

Every layout trains the tiny Llama (GQA: 4 heads, 2 kv heads) for 10 AdamW steps on the same global batches of the
embedded corpus. Each layout's logged per-step ``train_loss`` (the mean over the global batch) must equal the
single-process run's to 1e-5 relative, and its final weights must match. Each rank also reports the bytes of its
local parameter, gradient and optimizer-state shards, checked against what the ZeRO stage promises.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_4d import ParallelConfig
from lightning_4d.memory.model import model_state_bytes
from lightning_4d.models import LlamaConfig
from tests._launch import SCRIPTS, torchrun

STEPS = 10
WORLD2 = (
    [{"dp": 2, "zero": z} for z in range(4)]
    + [{"tp": 2, "zero": 0}, {"dp": 2, "zero": 3, "compile": True}]
    # selective checkpointing under tp without sp: the row-parallel outputs are all-reduced (and kept)
    + [{"tp": 2, "sp": False, "zero": 0, "ac": "selective"}]
)
WORLD4 = (
    [{"dp": 2, "tp": 2, "zero": z} for z in range(4)]
    + [{"dp": 4, "zero": z} for z in range(4)]
    + [{"dp": 2, "tp": 2, "zero": 2, "ac": "full"}, {"dp": 2, "tp": 2, "zero": 3, "sp": False}]
    # selective checkpointing under tp with sp (reduce-scatters kept, all-gathers recomputed) and FSDP2
    + [{"dp": 2, "tp": 2, "zero": 3, "ac": "selective"}]
    + [
        {"dp": 2, "tp": 2, "zero": 1, "clip": 0.1},
        {"dp": 2, "tp": 2, "zero": 3, "clip": 0.1},
        {"dp": 4, "zero": 0, "clip": 0.1},
    ]
    # clipping with tp-replicated plain parameters (norm weights without sp): counted once in the global norm
    + [{"dp": 2, "tp": 2, "zero": 1, "sp": False, "clip": 0.1}]
    # several gradient buckets (all-reduces launched during backward); gradient accumulation over 2 micro-batches
    + [{"dp": 2, "tp": 2, "zero": 1, "bucket": 8192}, {"dp": 4, "zero": 0, "bucket": 8192}]
    + [{"dp": 2, "tp": 2, "zero": 1, "accum": 2}, {"dp": 2, "tp": 2, "zero": 3, "accum": 2}]
    # tied embedding / LM head: one vocabulary-sharded matrix used by both ends
    + [{"dp": 2, "tp": 2, "zero": 1, "tied": True}, {"dp": 2, "tp": 2, "zero": 3, "tied": True}]
)
# bf16: compared with the float32 reference at bf16 tolerance (8 mantissa bits: ~4e-3 relative per rounding)
WORLD4_BF16 = [
    {"dp": 2, "tp": 2, "zero": 1, "precision": "bf16-mixed"},
    {"dp": 2, "tp": 2, "zero": 3, "precision": "bf16-true"},
]
BF16_LOSS_RTOL = 1e-2
# bf16-mixed (bf16 weights, fp32 master weights and gradients) against the single-process bf16-mixed run of the
# same code (FourDStrategy on one process), to 1e-2 relative: every layout dimension under mixed precision
BF16_MIXED_WORLD2 = [{"dp": 2, "zero": z, "precision": "bf16-mixed"} for z in (0, 1, 3)]
BF16_MIXED_WORLD4 = [
    {"dp": 2, "tp": 2, "zero": 1, "precision": "bf16-mixed", "clip": 0.1},
    {"pp": 2, "dp": 2, "zero": 1, "m": 2, "precision": "bf16-mixed"},
    {"pp": 2, "dp": 2, "zero": 3, "m": 2, "precision": "bf16-mixed"},
    {"cp": 2, "tp": 2, "zero": 1, "precision": "bf16-mixed"},
]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def _run(tmp_path_factory, name: str, nproc: int, layouts: list[dict]):
    out = tmp_path_factory.mktemp(name)
    torchrun(
        nproc,
        SCRIPTS / "run_layouts.py",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--layouts",
        json.dumps(layouts),
        timeout=900,
    )
    results = []
    for i, layout in enumerate(layouts):
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"layout{i}_rank*.json"))]
        weights: dict[str, torch.Tensor] = {}
        # pipelines: each stage's rank saved its own layers
        for path in sorted(out.glob(f"layout{i}_weights_rank*.pt")) or [out / f"layout{i}_weights.pt"]:
            weights.update(torch.load(path))
        results.append((layout, ranks, weights))
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs (plain Lightning, no FourDStrategy): plain, with gradient clipping, tied head."""
    return _run(
        tmp_path_factory,
        "reference",
        1,
        [{"reference": True}, {"reference": True, "clip": 0.1}, {"reference": True, "tied": True}],
    )


def _reference_for(references, layout):
    return references[1] if layout.get("clip") else references[2] if layout.get("tied") else references[0]


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    """The single-process bf16-mixed runs of FourDStrategy (bf16 weights, fp32 masters): plain and clipped."""
    return _run(
        tmp_path_factory, "bf16_reference", 1, [{"precision": "bf16-mixed"}, {"precision": "bf16-mixed", "clip": 0.1}]
    )


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _run(tmp_path_factory, "world2", 2, WORLD2 + BF16_MIXED_WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _run(tmp_path_factory, "world4", 4, WORLD4 + WORLD4_BF16 + BF16_MIXED_WORLD4)


def _layout_id(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in layout.items())


def _check_offloaded(result) -> None:
    """A layout with activation offload (``"offload"``) really held activations in host memory on every rank."""
    layout, ranks, _ = result
    if layout.get("offload"):
        assert all(r["bytes"]["host_offloaded"] > 0 for r in ranks), [r["bytes"].get("host_offloaded") for r in ranks]


def _check_parity(reference, result, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL):
    _, ref_ranks, ref_weights = reference
    layout, ranks, weights = result
    ref_losses = ref_ranks[0]["losses"]
    assert len(ref_losses) == STEPS
    for r in ranks:  # identical on every rank, whatever its tp coordinate
        assert r["losses"] == ranks[0]["losses"]
    losses = ranks[0]["losses"]
    accum = layout.get("accum", 1)  # one logged loss per micro-batch: the step's loss is their mean
    losses = [sum(losses[i : i + accum]) / accum for i in range(0, len(losses), accum)]
    assert len(losses) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    werr = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    print(
        f"\n{_layout_id(layout)}: max rel loss diff {rel:.2e}, max abs weight diff {werr:.2e}; "
        f"losses {[round(x, 5) for x in losses]}"
    )
    assert set(weights) == set(ref_weights)
    assert rel <= loss_rtol
    assert werr <= weight_atol
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_parity_world2(references, world2, index):
    _check_parity(_reference_for(references, world2[index][0]), world2[index])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_parity_world4(references, world4, index):
    _check_parity(_reference_for(references, world4[index][0]), world4[index])


def test_gradient_clipping_is_active(references):
    """The clipped reference differs from the unclipped one, so the clipped layouts' parity tests clipping."""
    assert references[0][1][0]["losses"][1] != references[1][1][0]["losses"][1]


@pytest.mark.parametrize("index", range(len(WORLD4_BF16)), ids=[_layout_id(x) for x in WORLD4_BF16])
def test_bf16_close_to_float32(references, world4, index):
    # bf16 weights (bf16-true) are rounded to 2^-8 relative: 0.02-scale weights differ by up to ~1e-4 per step
    _check_parity(references[0], world4[len(WORLD4) + index], loss_rtol=BF16_LOSS_RTOL, weight_atol=2e-2)


@pytest.mark.parametrize("index", range(len(BF16_MIXED_WORLD2)), ids=[_layout_id(x) for x in BF16_MIXED_WORLD2])
def test_bf16_mixed_parity_world2(bf16_reference, world2, index):
    _check_parity(bf16_reference[0], world2[len(WORLD2) + index], loss_rtol=BF16_LOSS_RTOL, weight_atol=2e-2)


@pytest.mark.parametrize("index", range(len(BF16_MIXED_WORLD4)), ids=[_layout_id(x) for x in BF16_MIXED_WORLD4])
def test_bf16_mixed_parity_world4(bf16_reference, world4, index):
    layout = BF16_MIXED_WORLD4[index]
    result = world4[len(WORLD4) + len(WORLD4_BF16) + index]
    _check_parity(bf16_reference[1 if layout.get("clip") else 0], result, loss_rtol=BF16_LOSS_RTOL, weight_atol=2e-2)


@pytest.mark.parametrize("index", range(len(BF16_MIXED_WORLD4)), ids=[_layout_id(x) for x in BF16_MIXED_WORLD4])
def test_bf16_mixed_gradients_go_to_the_buckets_during_backward(world4, index):
    """Under bf16-mixed at ZeRO 0/1 every gradient is added to its fp32 bucket by the backward hook (tensor-parallel
    DTensor parameters included, whose hooks the bf16 cast would drop): no .grad is left after backward."""
    layout, ranks, _ = world4[len(WORLD4) + len(WORLD4_BF16) + index]
    if layout.get("zero", 0) > 1:
        return
    for r in ranks:
        assert r["bytes"]["grads_left_after_backward"] == 0, (layout, r["rank"])


def test_bf16_mixed_reference_keeps_fp32_master_weights(bf16_reference, references):
    """The bf16-mixed reference trains (its loss follows the float32 run's to bf16 tolerance) and its weights are
    bf16 values: the run really computed with bfloat16 weights."""
    _check_parity(references[0], bf16_reference[0], loss_rtol=BF16_LOSS_RTOL, weight_atol=2e-2)
    weights = bf16_reference[0][2]
    assert all(torch.equal(w, w.to(torch.bfloat16).float()) for w in weights.values())


def _check_bytes(result):
    layout, ranks, _ = result
    zero, dp, tp = layout.get("zero", 0), layout.get("dp", 1), layout.get("tp", 1)
    by_tp: dict[int, list[dict]] = {}
    for r in ranks:  # mesh (pp, dp, cp, tp): tp innermost
        by_tp.setdefault(r["rank"] % tp, []).append(r["bytes"])
    # the memory model's figure for each rank equals what that rank really holds, exactly
    pc = ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp, zero_stage=zero)
    model_config = LlamaConfig.from_preset("tiny-test", tie_word_embeddings=layout.get("tied", False))
    for r in ranks:
        est = model_state_bytes(
            model_config,
            pc,
            layout.get("precision", "32-true"),
            dp_cp_rank=r["rank"] // tp % dp,
            bucket_bytes=layout.get("bucket", 25 * 2**20),
        )
        real = r["bytes"]
        assert (real["params"], real["grads"], real["optimizer_states"]) == (
            est.parameters,
            est.gradients,
            est.optimizer_states,
        ), (layout, r["rank"])
    if layout.get("precision") in ("bf16-true", "bf16-mixed"):
        return
    for tp_rank, group in by_tp.items():
        assert len(group) == dp
        full = group[0]["tp_local_params"]  # fp32: bytes of one unsharded tp-local copy
        assert all(g["tp_local_params"] == full for g in group)
        total = {k: sum(g[k] for g in group) for k in ("params", "grads", "optimizer_states")}
        worst = {k: max(g[k] for g in group) for k in ("params", "grads", "optimizer_states")}
        print(
            f"\n{_layout_id(layout)} tp_rank {tp_rank}: unsharded {full} B; per rank (max) params {worst['params']} "
            f"grads {worst['grads']} optimizer {worst['optimizer_states']} B; sums over dp {total}"
        )
        # bound for a 1/dp shard: every parameter split in dp chunks of ceil(n/dp) elements (4 bytes each)
        slack = 4 * group[0]["num_params"]
        sharded = {"params": zero >= 2, "grads": zero >= 2, "optimizer_states": zero >= 1}
        for key, is_sharded in sharded.items():
            expected_full = 2 * full if key == "optimizer_states" else full  # AdamW: exp_avg + exp_avg_sq
            if is_sharded:
                assert total[key] == expected_full, key  # the shards partition one copy exactly
                per_rank_bound = expected_full / dp + (2 if key == "optimizer_states" else 1) * slack
                assert worst[key] <= per_rank_bound, key
            else:
                assert all(g[key] == expected_full for g in group), key


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_model_state_bytes_world2(world2, index):
    _check_bytes(world2[index])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_model_state_bytes_world4(world4, index):
    _check_bytes(world4[index])
