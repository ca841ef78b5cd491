"""Hybrid sharding (HSDP, ``data_parallel_replicate_size``): ZeRO shards within a shard group of ``dp/r · cp`` ranks
and the reduced shards are all-reduced across its r replicas (``lightning_4d/mesh.py``'s ``ParallelMesh.zero``).

- training (``tests/scripts/run_layouts.py``, key ``replicate``), float32, 5 AdamW steps on CPU with gloo: per-step
  losses within 1e-5 relative of the single-process plain-Lightning run and final weights within
  ``tests/test_parity.py``'s measured bound, for replicate2 x shard2 at ZeRO 1, 2 and 3 (clipped: the global gradient
  norm against torch's, each replica's pieces counted once), replicate4 x shard1 (nothing sharded, the replicas
  all-reduce), replicate2 x (shard1 x cp2), replicate2 x shard2 with the optimizer states on the host (ZeRO 1 and
  3), and on 8 ranks replicate2 x shard2 x tp2 (ZeRO 1 and 3) and with pp2;
- the model states each rank holds: the memory model's figure exactly (``planning/states.py``: sharded over the
  shard group, ``zero_shard`` ranks), half the states of flat ZeRO over dp4;
- checkpoints: a sharded checkpoint of HSDP resumes on flat ZeRO 3 and one of flat ZeRO 3 on HSDP, the resumed
  steps equal to the straight run's;
- the option's validation: one line naming the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_4d import FourDStrategy, ParallelConfig
from lightning_4d.models import LlamaConfig
from lightning_4d.planning.model import model_state_bytes
from tests._launch import FLOAT32_STEPS, resume_on_layouts, trained
from tests.test_parity import LOSS_RTOL, _check_parity, _layout_id, _reference_for, shared

CLIP = {"clip": 0.1, "norm": True}
WORLD4 = [
    {"dp": 4, "replicate": 2, "zero": 1, **CLIP},
    {"dp": 4, "replicate": 2, "zero": 2},
    {"dp": 4, "replicate": 2, "zero": 3, **CLIP},
    {"dp": 4, "replicate": 4, "zero": 1},
    {"dp": 2, "cp": 2, "replicate": 2, "zero": 3},
    # with the optimizer states on the host (optimizer_offload)
    {"dp": 4, "replicate": 2, "zero": 1, "optoffload": True, **CLIP},
    {"dp": 4, "replicate": 2, "zero": 3, "optoffload": True},
]
WORLD8 = [
    {"dp": 4, "tp": 2, "replicate": 2, "zero": 1, **CLIP},
    {"dp": 4, "tp": 2, "replicate": 2, "zero": 3, **CLIP},
    {"pp": 2, "dp": 4, "replicate": 2, "zero": 1, "m": 2},
    {"pp": 2, "dp": 4, "replicate": 2, "zero": 3, "m": 2},
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    # float32 only: FLOAT32_STEPS; largest weight difference measured 1.79e-5 at 5 steps (WEIGHT_ATOL 3e-5);
    # test_parity's references (plain, clipped, ...): one launch for every file
    return shared(tmp_path_factory, "reference")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return trained(tmp_path_factory, "hsdp_world4", 4, WORLD4, steps=FLOAT32_STEPS)


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return trained(tmp_path_factory, "hsdp_world8", 8, WORLD8, steps=FLOAT32_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_hsdp_parity_world4(references, world4, index):
    _check_parity(_reference_for(references, WORLD4[index]), world4[index])
    _check_states(world4[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD8)), ids=[_layout_id(x) for x in WORLD8])
def test_hsdp_parity_world8(references, world8, index):
    _check_parity(_reference_for(references, WORLD8[index]), world8[index])
    _check_states(world8[index])


def _check_states(result) -> None:
    """Every rank holds the parameter, gradient and optimizer-state bytes the memory model gives for its place
    (``dp_cp`` rank, pp rank, tp rank), and those of ZeRO are sharded over the shard group only: at ZeRO >= 1 the
    optimizer states of the replicas' ranks of one shard coordinate are equal."""
    layout, ranks, _ = result
    dp, tp, pp, cp = (layout.get(k, 1) for k in ("dp", "tp", "pp", "cp"))
    pc = ParallelConfig(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=cp,
        zero_stage=layout["zero"],
        data_parallel_replicate_size=layout["replicate"],
        num_microbatches=layout.get("m"),
        optimizer_offload=layout.get("optoffload", False),
    )
    model_config = LlamaConfig.from_preset("tiny-test")
    per_replica: dict[tuple, set] = {}
    for r in ranks:  # mesh (pp, dp, cp, tp): tp innermost, pp outermost
        rank = r["rank"]
        tp_rank, dp_cp_rank, pp_rank = rank % tp, rank // tp % (dp * cp), rank // (tp * dp * cp)
        est = model_state_bytes(model_config, pc, "32-true", pp_rank=pp_rank, dp_cp_rank=dp_cp_rank, tp_rank=tp_rank)
        real = r["bytes"]
        if pc.optimizer_offload:  # the host's bytes (FSDP2: the sharded parameters and gradients too) are the model's
            offload = real["offload"]
            host = offload["host_bytes"] + (real["params"] + real["grads"] if pc.zero_stage >= 2 else 0)
            assert offload["shared_storages"] == 0 and host == est.host, (layout, rank, offload, est)
        else:
            assert (real["params"], real["grads"], real["optimizer_states"]) == (
                est.parameters,
                est.gradients,
                est.optimizer_states,
            ), (layout, rank)
        shard_coordinate = (pp_rank, tp_rank, dp_cp_rank % pc.zero_shard)
        per_replica.setdefault(shard_coordinate, set()).add(real["optimizer_states"])
    assert all(len(v) == 1 for v in per_replica.values()), per_replica


def test_hsdp_shards_states_over_the_shard_group_only():
    """The memory model: ZeRO 3 over replicate2 x shard2 holds what flat ZeRO 3 over dp2 holds per rank (the shard
    group is 2 ranks), twice what flat ZeRO 3 over dp4 holds."""
    cfg = LlamaConfig.from_preset("tiny-test")
    hsdp = model_state_bytes(cfg, ParallelConfig(data_parallel_size=4, zero_stage=3, data_parallel_replicate_size=2))
    dp2 = model_state_bytes(cfg, ParallelConfig(data_parallel_size=2, zero_stage=3))
    dp4 = model_state_bytes(cfg, ParallelConfig(data_parallel_size=4, zero_stage=3))
    assert hsdp == dp2
    assert hsdp.optimizer_states > dp4.optimizer_states


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_on_flat_zero3_and_back(tmp_path):
    """Saved at replicate2 x shard2 ZeRO 3 (DTensors on the 2D (dp_replicate, dp_shard_cp) mesh), resumed at flat dp4
    ZeRO 3 and at HSDP itself; saved at flat dp4 ZeRO 3, resumed at replicate2 x shard2 ZeRO 1 and 3: the resumed
    steps equal the straight run's to 1e-5 relative."""
    hsdp = {"name": "a", "dp": 4, "zero": 3, "replicate": 2}
    flat = {"name": "b", "dp": 4, "zero": 3}
    rows = resume_on_layouts(tmp_path / "from_hsdp", hsdp, flat, "tiny-test", 6, nproc=4)
    hsdp1 = {"name": "c", "dp": 4, "zero": 1, "replicate": 2}
    rows += resume_on_layouts(tmp_path / "to_hsdp", flat, [hsdp, hsdp1], "tiny-test", 6, nproc=4, resume_saved=False)
    assert len(rows) == 4 * 4
    for layout, rank, curve, tail in rows:
        rel = max(abs(x - y) / abs(y) for x, y in zip(curve, tail))
        print(f"\nresume {layout} rank {rank}: {len(curve)} steps, rel {rel:.1e}")
        assert len(curve) == len(tail) == 3 and rel <= LOSS_RTOL


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(data_parallel_size=4, zero_stage=0, data_parallel_replicate_size=2), "zero_stage=0"),
        (dict(data_parallel_size=4, zero_stage=1, data_parallel_replicate_size=3), r"Valid .* \[1, 2, 4\]"),
        (dict(data_parallel_size=4, gradient_compression="powersgd", data_parallel_replicate_size=2), "powersgd"),
        (dict(data_parallel_size=4, expert_parallel_size=2, data_parallel_replicate_size=2), "expert_parallel_size"),
        (dict(data_parallel_replicate_size=0), "positive integer"),
    ],
)
def test_hsdp_bad_input_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ParallelConfig(**kwargs)
    assert "data_parallel_replicate_size" in str(info.value) and "\n" not in str(info.value)


def test_hsdp_auto_dp_is_checked_once_resolved():
    with pytest.raises(ValueError, match="does not divide data_parallel_size=3"):
        ParallelConfig(zero_stage=3, data_parallel_replicate_size=2).resolve(3)
    assert ParallelConfig(zero_stage=3, data_parallel_replicate_size=2).resolve(8).zero_shard == 4


def test_hsdp_moe_model_is_refused_before_any_group():
    cfg = LlamaConfig.from_preset("tiny-moe")
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        ParallelConfig(data_parallel_size=4, zero_stage=1, data_parallel_replicate_size=2).validate_model(cfg)


def test_hsdp_is_a_strategy_argument():
    strategy = FourDStrategy(data_parallel_replicate_size=2, zero_stage=3)
    assert strategy.parallel_config.data_parallel_replicate_size == 2


def test_step_time_charges_the_shard_group_on_its_links():
    """llama3-8b, tp1 cp2 dp32 ZeRO 3 on 8-GPU H100 nodes: with 8 replicas the shard group is one node's 8 ranks
    (NVLink) and only the shards' all-reduce crosses nodes; flat ZeRO 3 rings over all 64 ranks on the inter-node
    links. The model's exposed data-parallel time is far lower with HSDP, and the rank steps 8x the elements."""
    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.step_time import Layout, model_dims, step_time_of

    dims, gpu = model_dims(LlamaConfig.from_preset("llama3-8b")), GPU_PRESETS["H100-80GB"]
    base = dict(tp=1, pp=1, cp=2, dp=32, zero_stage=3, micro_batch_size=1, num_microbatches=16)
    flat, hsdp = (
        step_time_of(dims, Layout(**base, data_parallel_replicate_size=r), seq_length=8192, gpu=gpu, gpus_per_node=8)
        for r in (1, 8)
    )
    assert hsdp.compute == flat.compute
    assert hsdp.dp < flat.dp / 10
    assert hsdp.optimizer == pytest.approx(8 * flat.optimizer)
    assert hsdp.total < flat.total


def test_plan_proposes_hsdp_where_dp_spans_nodes():
    """The planner tries HSDP for dense models whose ZeRO group spans nodes, not where all of dp*cp*tp fits in one
    node: the fewest replicas whose shard group fits in a node, else the latency-balanced count (the divisor of dp
    nearest sqrt(dp*cp/2)); ``every`` (estimate's) lists every count up to the in-node one. llama3-8b on 64 H100s
    ranks an HSDP layout first."""
    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.planner import hsdp_replicas, plan
    from lightning_4d.planning.workload import Job, Search

    assert hsdp_replicas(1, 2, 32, 8) == (8,)  # shard groups of 8 ranks (4 dp x 2 cp): one node each
    assert hsdp_replicas(1, 2, 32, 8, every=True) == (2, 4, 8)
    assert hsdp_replicas(2, 1, 4, 8) == hsdp_replicas(2, 1, 4, 8, every=True) == ()  # 8 GPUs: one node
    # tp8 fills a node: no shard group of more than one rank fits in it; sqrt(16/2) = 2.83: 2 and 4 tie in log
    # scale, the smaller is taken (8 replicas of 2 ranks across 2 nodes, ...)
    assert hsdp_replicas(8, 1, 16, 8) == (2,)
    assert hsdp_replicas(8, 1, 16, 8, every=True) == (2, 4, 8)
    assert hsdp_replicas(8, 1, 128, 8) == (8,)  # sqrt(128/2) = 8: 8 replicas of 16 ranks
    assert hsdp_replicas(8, 1, 6, 8) == (2,)  # 6 replicas would shard over one rank; sqrt(6/2) = 1.73: 2
    assert hsdp_replicas(8, 1, 9, 8) == (3,)  # 2 does not divide dp9; sqrt(9/2) = 2.12: 3
    assert hsdp_replicas(8, 2, 6, 8) == (2,)  # sqrt(12/2) = 2.45: 2 and 3 tie in log scale
    assert hsdp_replicas(8, 4, 1, 8) == hsdp_replicas(8, 4, 1, 8, every=True) == ()  # dp1: the flat layout
    job = Job(LlamaConfig.from_preset("llama3-8b"), 64, 8, 8192, 512, GPU_PRESETS["H100-80GB"])
    best = plan(job, Search(), top=3)
    assert best[0].data_parallel_replicate_size > 1, best[0]
    rows = plan(job, Search(fixed={"tp": 8, "dp": 1}), top=6)
    assert len({dataclasses.astuple(c) for c in rows}) == len(rows) == 6  # no layout twice
    assert plan(job, Search(fixed={"zero_stage": 0}), top=1)[0].data_parallel_replicate_size == 1


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_measure_equals_the_estimate_for_one_hsdp_rank(zero):
    """``lightning-4d measure`` of rank 1 (shard coordinate 1 of replica 0) of dp4 = 2 replicas x shard 2: the model
    states equal the estimate exactly (``measure_json`` checks them) and the peak within 5%."""
    from tests._launch import measure_json

    args = ["--model", "tiny-test", "--dp", "4", "--dp-replicate", "2", "--zero-stage", str(zero)]
    out, rows = measure_json(*args, "--micro-batch-size", "2", "--seq-length", "256", "--rank", "1")
    assert out["layout"]["data_parallel_replicate_size"] == 2
    total = rows["total (peak)"]
    ratio = total["estimated"] / total["measured"]
    print(f"\nHSDP ZeRO {zero} rank 1: estimate / measured peak {ratio:.3f}")
    assert abs(ratio - 1) <= 0.05


def test_estimate_proposes_hsdp_where_the_step_time_model_predicts_a_gain(capsys):
    """``lightning-4d estimate`` of llama3-8b on 64 H100s (8 nodes), dp64 ZeRO 3, 4 micro-batches of 2k tokens: the
    flat ZeRO 3 all-gathers cross the nodes and outlast the short compute; it proposes the HSDP replica count the
    step-time model predicts fastest (8: a shard group of 8 ranks, one node), whose step is shorter than flat ZeRO 3's
    on the same layout by more than HSDP_MIN_GAIN and which fits the 80 GB budget; the figures equal the step-time
    model's of the two layouts and the memory model's of the HSDP one. No proposal for one node's job, nor for
    llama3.1-405b tp8 dp128 ZeRO 3 on 1,024 GPUs, where the shard group spans nodes whatever its size and HSDP's
    predicted gain (0.03%) is below HSDP_MIN_GAIN."""
    from lightning_4d.planning.commands import HSDP_MIN_GAIN, main
    from lightning_4d.planning.hardware import GIB, GPU_PRESETS
    from lightning_4d.planning.model import estimate_memory
    from lightning_4d.planning.step_time import Layout, model_dims, step_time_of
    from lightning_4d.planning.workload import Workload

    argv = ["--model", "llama3-8b", "--seq-length", "2048", "--micro-batch-size", "1"]
    argv += ["--zero-stage", "3", "--num-microbatches", "4"]
    assert main("estimate", [*argv, "--num-gpus", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    proposal = out["hsdp_proposal"]
    r = proposal["data_parallel_replicate_size"]
    assert r == 8, proposal
    cfg, gpu = LlamaConfig.from_preset("llama3-8b"), GPU_PRESETS["H100-80GB"]
    pc = ParallelConfig(data_parallel_size=64, zero_stage=3, num_microbatches=4)
    times = [
        step_time_of(
            model_dims(cfg),
            Layout.of(dataclasses.replace(pc, data_parallel_replicate_size=n), 1, 4),
            seq_length=2048,
            gpu=gpu,
            gpus_per_node=8,
        ).total
        for n in (1, r)
    ]
    assert (proposal["flat_zero_step_time"], proposal["step_time"]) == pytest.approx(times, rel=1e-12)
    assert proposal["step_time"] < (1 - HSDP_MIN_GAIN) * proposal["flat_zero_step_time"]
    hybrid = dataclasses.replace(pc, data_parallel_replicate_size=r)
    total = estimate_memory(Workload(cfg, 1, 2048, "bf16-mixed", num_microbatches=4), hybrid, gpu_name=gpu.name).total
    assert proposal["total"] == total <= 0.8 * gpu.memory and proposal["total_gib"] == total / GIB
    assert main("estimate", [*argv, "--num-gpus", "64"]) == 0
    text = capsys.readouterr().out
    assert f"HSDP: --dp-replicate {r}" in text and f"{proposal['step_time']:.3f} s per step" in text
    assert main("estimate", [*argv, "--num-gpus", "8", "--json"]) in (0, 1)  # one node: nothing to propose
    assert json.loads(capsys.readouterr().out)["hsdp_proposal"] is None
    big = ["--model", "llama3.1-405b", "--seq-length", "8192", "--micro-batch-size", "1", "--tp", "8"]
    big += ["--zero-stage", "3", "--activation-checkpointing", "full", "--num-microbatches", "16"]
    assert main("estimate", [*big, "--num-gpus", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hsdp_proposal"] is None
