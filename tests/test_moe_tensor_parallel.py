"""Mixture-of-Experts models under tensor parallelism (with and without sequence parallelism) and context
parallelism, composed with expert parallelism (issue 23; ``docs/moe_design.md``, "Tensor and context parallelism").

Under tp an MoE layer runs token parallel (expert tensor parallelism 1): each tp rank runs the whole layer on its own
``s/t`` tokens, its parameters' gradients summed over tp by the ``dp_cp_tp`` buckets (ZeRO 2/3: FSDP2 units over
``dp_cp_tp``), ep folded over tp (issue 34: ep groups are consecutive ranks of ``dp_cp_tp``, ep divides dp·cp·tp).
Checked here: the refusals that remain, before any process group; FLOAT32_STEPS (5) AdamW steps in float32 against one
process (the loss, the load-balancing loss and the global gradient norm before clipping within 1e-5 relative, the
busiest expert's tokens identical) for tp2 with sp, tp2 without sp, tp2 ZeRO 2, cp2 x ep2, dp2 x tp2 x ep2 (ZeRO 0 and
1, shared expert on and off, MoE on every layer and every other layer, clipping, full activation checkpointing), and
folded: dp2 x tp2 x ep4 (ZeRO 1 and 3), cp2 x tp2 x ep2; a tp2 ep2 checkpoint resumed at dp2 ep1; ``bf16-mixed`` dp2 x
tp2 x ep2 (10 steps) within 1e-2 of one-process ``bf16-mixed``; model-state bytes of every rank equal to the memory
model's; and the memory model's states (exact) and saved activations (within 5%) against what dp2 x tp2 x ep2 ranks
hold. Five torchrun launches for parity (1, 2 and 4 processes in float32, 1 and 4 in bf16-mixed; the 1-process ones
tests/test_expert_parallel.py's) and one for memory (4 processes).
"""

from __future__ import annotations

import json

import pytest

from lightning_4d import ParallelConfig
from lightning_4d.models import LlamaConfig
from lightning_4d.planning.model import model_state_bytes
from tests._launch import (
    BF16_STEPS,
    FLOAT32_STEPS,
    SCRIPTS,
    check_final_weights,
    initial_weights,
    max_relative,
    resume_on_layouts,
    torchrun,
)
from tests.test_expert_parallel import REF, VARIANT, moe_runs

#: the AdamW steps of the bf16-mixed parity launch and of the checkpoint test; the float32 parity launches train
#: FLOAT32_STEPS (tests/_launch.launched_by_precision)
STEPS = BF16_STEPS
LOSS_RTOL = 1e-5
# bf16-mixed dp2 tp2 ep2 against one-process bf16-mixed (plain Lightning: autocast over float32 weights): measured
# 2026-11-27 (`pytest -s tests/test_moe_tensor_parallel.py -k under_tp_and_cp`) loss 2.6e-4, aux loss 7.0e-4
# relative; ~4x the larger (was issue 23's 1e-2)
BF16_RTOL = 3e-3
# Final weights against the one-process run's, per parameter ‖w − w_ref‖ / ‖w_ref − w0‖ (tests/_launch.py's
# update_errors: 1 for a parameter that never trained). Measured 2026-11-27 in float32 (`pytest -s` of
# test_moe.py -k dp2_zero, test_expert_parallel.py -k ep_losses, test_moe_tensor_parallel.py -k under_tp_and_cp):
# at most 2.24e-5 (dp2, layers.0.attention.wo: one element whose near-zero gradient AdamW's m/sqrt(v) amplifies;
# every other parameter <= 6.3e-6); the bound ~4.5x that.
# At FLOAT32_STEPS (5, the float32 launches): at most 8.33e-6 (cp2 tp2 ep2, layers.1.feed_forward.experts.w2),
# 7.28e-6 (tp2 ZeRO 2).
UPDATE_RTOL = 1e-4
# bf16-mixed (both rounded to bf16) against plain Lightning's bf16-mixed (autocast over float32 weights: another
# recipe): matrices measured 9.3e-2 (dp2 ep2, experts.w1) and 1.05e-1 (dp2 tp2 ep2), norm weights 0.21 / 0.10 (their
# bf16 spacing near 1.0 is the size of 10 steps' update: tests/test_parity.py's NORM_UPDATE_RTOL); bounds ~3x
BF16_UPDATE_RTOL = 0.3
BF16_NORM_UPDATE_RTOL = 0.6


# ---------------------------------------------------------------------------------------------------- bad input
def test_what_stays_refused_for_moe_names_the_value_before_any_process_group():
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    moe = CausalLMModule("tiny-moe")
    for kw in (
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, sequence_parallel=False),
        dict(context_parallel_size=2),
        dict(tensor_parallel_size=2, expert_parallel_size=2, data_parallel_size=2),
        dict(context_parallel_size=2, expert_parallel_size=2),
    ):
        validate_against_module(ParallelConfig(zero_stage=1, **kw).resolve(4 if "data_parallel_size" in kw else 2), moe)
    for stage in (2, 3):  # ZeRO 2/3 under tp: the MoE layers' FSDP2 units over dp_cp_tp (issue 34)
        validate_against_module(ParallelConfig(tensor_parallel_size=2, zero_stage=stage).resolve(2), moe)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide dp\*cp\*tp = 1\*1\*2 = 2.*\[1, 2\]"):
        ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4).resolve(2)
    validate_against_module(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2).resolve(2), moe)  # folded
    validate_against_module(ParallelConfig(context_parallel_size=2, zero_stage=3).resolve(2), moe)  # cp is dp-like
    with pytest.raises(ValueError, match="gradient_compression='powersgd'.*tensor_parallel_size=2"):
        validate_against_module(ParallelConfig(tensor_parallel_size=2, gradient_compression="powersgd").resolve(2), moe)
    validate_against_module(ParallelConfig(pipeline_parallel_size=2).resolve(2), moe)  # pp: tests/test_moe_pipeline.py


def test_moe_without_sp_needs_a_sequence_divisible_by_tp_before_any_process_group():
    import lightning as L
    import torch.distributed as dist

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    strategy = FourDStrategy(tensor_parallel_size=2, sequence_parallel=False, process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, max_steps=1)
    module = CausalLMModule("tiny-moe")
    strategy._lightning_module = module
    module.trainer = trainer
    trainer.datamodule = LMDataModule(seq_length=31, micro_batch_size=1)
    with pytest.raises(
        ValueError, match=r"seq_length=31 \(per cp rank 31\) is not divisible by tensor_parallel_size=2"
    ):
        validate_against_module(strategy.parallel_config, module)
    trainer.datamodule = LMDataModule(seq_length=32, micro_batch_size=1)
    validate_against_module(strategy.parallel_config, module)
    module_dense = CausalLMModule("tiny-test")  # a dense model takes any length without sp
    strategy._lightning_module = module_dense
    module_dense.trainer = trainer
    trainer.datamodule = LMDataModule(seq_length=31, micro_batch_size=1)
    validate_against_module(strategy.parallel_config, module_dense)
    assert not dist.is_initialized()


def test_memory_model_does_not_split_moe_parameters_over_tp_and_shards_their_states_over_dp_cp_tp():
    cfg = LlamaConfig.from_preset("tiny-moe", num_shared_experts=1)
    one = model_state_bytes(cfg, ParallelConfig(data_parallel_size=1, zero_stage=0), "32-true")
    tp2 = model_state_bytes(cfg, ParallelConfig(data_parallel_size=1, tensor_parallel_size=2, zero_stage=0), "32-true")
    h, v = cfg.hidden_size, cfg.padded_vocab_size
    # tp splits only attention's four projections and the embedding / head (untied): the MoE layers stay whole
    split = cfg.num_layers * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * h + 2 * v * h
    assert one.parameters - tp2.parameters == 4 * split // 2
    # ZeRO 1 at dp2 tp2: dense states over 2 ranks, the MoE layers' over 4 (their bucket group is dp_cp_tp)
    pc = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, zero_stage=1)
    owned = [model_state_bytes(cfg, pc, "32-true", dp_cp_rank=d, tp_rank=t) for d in (0, 1) for t in (0, 1)]
    moe = sum(p.numel() for p in _moe_params(cfg))
    dense_tp = tp2.parameters // 4 - moe
    assert sum(o.optimizer_states for o in owned) == 8 * (2 * dense_tp + moe)  # each element's m, v held once
    with pytest.raises(ValueError, match="tp_rank=2 is not valid: expected 0 .. 1"):
        model_state_bytes(cfg, pc, "32-true", tp_rank=2)


def test_each_tp_rank_holds_its_own_uneven_shard_of_the_moe_states():
    """The MoE layers' states, replicated over tp, are sharded over ``dp·cp·tp`` ranks (index ``dp_cp_rank·tp +
    tp_rank``), so two tp ranks of one dp rank hold different bytes where the shard is uneven; the expected bytes come
    from ``torch.chunk`` of the real module's tensors (FSDP2's dim-0 rule, ZeRO 1's equal ranges of a padded bucket).

    ZeRO 3, dp2 tp2, 6 experts: the router ``[6, h]`` in 4 chunks of rows 2, 2, 2, 0 (the stacked expert weights
    split evenly on dim 1: 6 experts over 4 ranks, ``f_e`` and h multiples of 4): tp ranks 0 and 1 of dp rank 1
    (indices 2 and 3) differ by the router's two rows, 16 B per element (float32 parameter, gradient, m, v).
    ZeRO 1, dp3 tp2, 8 experts, one bucket: the MoE parameters' elements, in 6 equal ranges of the bucket padded to
    a multiple of 6 (its last range short), Adam's m and v 8 B per element owned."""
    import torch

    cfg = LlamaConfig.from_preset("tiny-moe", num_experts=6)
    moe = _moe_params(cfg)
    routers = [p for p in moe if p.dim() == 2 and p.shape[0] == cfg.num_experts]
    assert routers and all(p.shape[0] % 4 for p in routers)
    pc3 = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3)
    states = {(d, t): model_state_bytes(cfg, pc3, "32-true", dp_cp_rank=d, tp_rank=t) for d in (0, 1) for t in (0, 1)}

    def total(s):
        return s.parameters + s.gradients + s.optimizer_states

    def rows(p, index, world):
        chunks = torch.empty(p.shape[0], 0).chunk(world)
        return chunks[index].shape[0] if index < len(chunks) else 0

    for d in (0, 1):
        expected = sum(16 * (rows(p, 2 * d + 1, 4) - rows(p, 2 * d, 4)) * p.shape[1] for p in routers)
        assert total(states[d, 1]) - total(states[d, 0]) == expected
    assert total(states[1, 1]) != total(states[1, 0])
    pc1 = ParallelConfig(data_parallel_size=3, tensor_parallel_size=2, zero_stage=1)
    cfg = LlamaConfig.from_preset("tiny-moe")
    n = sum(p.numel() for p in _moe_params(cfg))
    owned = [c.numel() for c in torch.empty(n, device="meta").chunk(6)] + [0] * 6
    assert n % 6
    for d in range(3):
        one, two = (model_state_bytes(cfg, pc1, "32-true", dp_cp_rank=d, tp_rank=t, bucket_bytes=2**40) for t in (0, 1))
        assert two.optimizer_states - one.optimizer_states == 8 * (owned[2 * d + 1] - owned[2 * d])
    assert owned[5] != owned[4]


def _moe_params(cfg):
    import torch

    from lightning_4d.features.moe.layer import MoEFeedForward
    from lightning_4d.models import LlamaModel

    with torch.device("meta"):
        model = LlamaModel(cfg)
    return [p for m in model.modules() if isinstance(m, MoEFeedForward) for p in m.parameters()]


# ---------------------------------------------------------------------------------------------------- parity
# one process: test_expert_parallel's runs (plain, the variant clipped, bf16-mixed, 6 experts), one launch for both
# files (tests/_launch.launched_by_precision)
assert REF[:3] == [
    {"reference": True, "norm": True},
    {"reference": True, "config": VARIANT, "clip": 0.1, "norm": True},
    {"reference": True, "precision": "bf16-mixed"},
]
TWO = [
    {"tp": 2, "zero": 1, "norm": True},
    {"tp": 2, "zero": 0, "config": VARIANT, "clip": 0.1, "norm": True},
    {"tp": 2, "sp": False, "zero": 1, "norm": True},
    {"tp": 2, "zero": 2, "norm": True},  # ZeRO 2 under tp: the MoE layers' FSDP2 units over dp_cp_tp
    {"cp": 2, "ep": 2, "zero": 1, "norm": True},
    {"cp": 2, "ep": 2, "zero": 0, "config": VARIANT, "clip": 0.1, "ac": "full", "norm": True},
]
FOUR = [
    {"dp": 2, "tp": 2, "ep": 2, "zero": 1, "norm": True},
    {"dp": 2, "tp": 2, "ep": 4, "zero": 1, "norm": True},  # ep folded over tp (issue 34): every rank 2 of 8 experts
    {"cp": 2, "tp": 2, "ep": 2, "zero": 1, "norm": True},  # folded: ep2 is the tp pair of each cp rank
    {"dp": 2, "tp": 2, "ep": 4, "zero": 3, "norm": True},  # folded, ZeRO 3: expert units over edp (1 rank)
    {"dp": 2, "tp": 2, "ep": 2, "zero": 0, "sp": False, "config": VARIANT, "clip": 0.1, "norm": True},
    {"dp": 2, "tp": 2, "ep": 2, "zero": 1, "precision": "bf16-mixed"},
]
CASES = [("two", i) for i in range(len(TWO))] + [("four", i) for i in range(len(FOUR))]


def _records(out, index):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"layout{index}_rank*.json"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return moe_runs(tmp_path_factory, (("ref", 1, REF), ("two", 2, TWO), ("four", 4, FOUR)))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{w}-{json.dumps((TWO if w == 'two' else FOUR)[i])}" for w, i in CASES])
def test_moe_under_tp_and_cp_equals_one_process(runs, case):
    """Per step: the loss, the aux loss (logged: the global batch's) and the global gradient norm before clipping
    within 1e-5 relative of one process (BF16_RTOL under bf16-mixed), the busiest expert's tokens identical (fp32);
    parameter, gradient and optimizer-state bytes of every rank equal to the memory model's; the final weights (tp
    shards and ep experts gathered) equal to one process's (UPDATE_RTOL; bf16: BF16_UPDATE_RTOL,
    BF16_NORM_UPDATE_RTOL)."""
    which, index = case
    layout = (TWO if which == "two" else FOUR)[index]
    bf16 = layout.get("precision") == "bf16-mixed"
    ref_dir, ref_index = runs["ref"][2 if bf16 else 1 if "config" in layout else 0]
    out, index = runs[which][index]
    steps = STEPS if bf16 else FLOAT32_STEPS
    ref = _records(ref_dir, ref_index)[0]
    ranks = _records(out, index)
    tp, dp, cp = layout.get("tp", 1), layout.get("dp", 1), layout.get("cp", 1)
    assert len(ranks) == tp * dp * cp
    for r in ranks:
        b = r["bytes"]
        rel = max_relative(r["losses"], ref["losses"], steps)
        aux = max_relative(b["aux_losses"], ref["bytes"]["aux_losses"], steps)
        norm = max_relative(b["grad_norms"], ref["bytes"]["grad_norms"], steps) if "norm" in layout else 0.0
        print(f"\n{which} {layout} rank {r['rank']}: loss rel {rel:.1e}, aux rel {aux:.1e}, grad norm rel {norm:.1e}")
        assert max(rel, aux, norm) <= (BF16_RTOL if bf16 else LOSS_RTOL)
        if not bf16:  # bf16 rounding may flip a near tie of the router
            assert b["tokens_per_expert_max"] == ref["bytes"]["tokens_per_expert_max"]
        cfg = LlamaConfig.from_preset("tiny-moe", **layout.get("config", {}))
        pc = ParallelConfig(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            context_parallel_size=cp,
            sequence_parallel=layout.get("sp"),
            zero_stage=layout["zero"],
            expert_parallel_size=layout.get("ep", 1),
        )
        est = model_state_bytes(
            cfg, pc, layout.get("precision", "32-true"), dp_cp_rank=r["rank"] // tp, tp_rank=r["rank"] % tp
        )
        assert (b["params"], b["grads"], b["optimizer_states"]) == (est.parameters, est.gradients, est.optimizer_states)
    initial = initial_weights("tiny-moe", layout.get("config"))
    bounds = (BF16_UPDATE_RTOL, BF16_NORM_UPDATE_RTOL) if bf16 else (UPDATE_RTOL,)
    check_final_weights(out, index, ref_dir, ref_index, initial, *bounds)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


# ---------------------------------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_memory_model_matches_measured_moe_under_ep2_tp2(tmp_path):
    """dp2 x tp2 x ep2 ZeRO 1 (sp; and no sp with a shared expert and MoE on every other layer), one step at b=2,
    s=64 and s=128: parameter, gradient and Adam-state bytes of all four ranks exact; saved activations within 1%
    (the issue's bar is 5%; measured since ep is folded over tp, its ep2 groups the tp pairs: 1,288 bytes (0.18%)
    over with sp, 8 bytes short without sp, on every rank and shape) when the estimate takes the rank's load of the
    routing that occurred (``expert_load_imbalance`` = the rows its experts received over the rows it routed, summed
    over its MoE layers, from ``ExpertDispatch``); at balanced load (1.0) the same estimate is off by the routing
    (measured -2.5% .. +2.7% at s=64), so the measured load must bring it closer. Every row sent in an ep group is
    received there."""
    layouts = [
        {"dp": 2, "tp": 2, "ep": 2, "zero": 1},
        {
            "dp": 2,
            "tp": 2,
            "ep": 2,
            "zero": 1,
            "sp": False,
            "config": {"num_shared_experts": 1, "num_layers": 4, "moe_layer_interval": 2},
        },
    ]
    torchrun(
        4,
        SCRIPTS / "measure_memory.py",
        "--out",
        str(tmp_path),
        "--model",
        "tiny-moe",
        "--layouts",
        json.dumps(layouts),
        "--shapes",
        "[[2, 64], [2, 128]]",
        timeout=900,
    )
    for i, layout in enumerate(layouts):
        ranks = _records(tmp_path, i)
        assert len(ranks) == 4
        for r in ranks:
            for key in ("parameters", "gradients", "optimizer_states"):
                assert r["states"][key] == r["estimated_states"][key], (layout, key)
            for row in r["activations"]:
                ratio = row["estimated"] / row["measured"] - 1
                balanced = row["estimated_balanced"] / row["measured"] - 1
                print(
                    f"\n{layout} rank {r['rank']} b={row['b']} s={row['s']}: measured {row['measured']}, load "
                    f"{row['expert_load']:.4f} (received {row['received_rows']}, sent {row['sent_rows']}): "
                    f"{ratio:+.2%} ({row['estimated'] - row['measured']:+d} bytes; balanced {balanced:+.2%})"
                )
                assert abs(ratio) <= 0.01 and abs(ratio) <= abs(balanced) + 1e-4
        # every row sent in an ep group (global ranks 2d and 2d + 1: the tp pair of dp rank d, ep folded over tp)
        # is received there
        by_rank = {r["rank"]: r["activations"] for r in ranks}
        for d in (0, 1):
            for a, b in zip(by_rank[2 * d], by_rank[2 * d + 1]):
                sent = [x + y for x, y in zip(a["sent_rows"], b["sent_rows"])]
                assert sent == [x + y for x, y in zip(a["received_rows"], b["received_rows"])]


# ---------------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
def test_checkpoint_at_tp2_ep2_resumes_at_tp2_ep2_and_at_dp2_ep1(tmp_path):
    """Train 10 steps straight at tp2 ep2 ZeRO 1 (ep folded over tp: dp·cp = 1, each tp rank 4 of the 8 experts;
    the router's states sharded over dp_cp_tp), and 5 steps with a sharded checkpoint; resume it at tp2 ep2 and at
    dp2 ep1 (experts saved with their global shapes, the ZeRO 1 states gathered, layout-free): steps 6-10 equal the
    straight run's."""
    saved = {"name": "a", "tp": 2, "ep": 2, "zero": 1}
    rows = resume_on_layouts(tmp_path, saved, {"name": "b", "dp": 2, "zero": 1}, "tiny-moe", STEPS)
    for layout, rank, curve, tail in rows:
        rel = max(abs(x - y) / abs(y) for x, y in zip(curve[-len(tail) :], tail))
        print(f"\nresume {layout} rank {rank}: {len(curve)} steps, rel {rel:.1e}")
        assert len(curve) == STEPS - STEPS // 2 and rel <= LOSS_RTOL
