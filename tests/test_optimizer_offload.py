"""Optimizer-state offload (``optimizer_offload=True``): the optimizer's states on the host, its step on the CPU
(``lightning_4d/parallel/optimizer_offload.py``).

- training (``tests/scripts/run_layouts.py``, key ``optoffload``), float32, FLOAT32_STEPS (5) AdamW steps on CPU with
  gloo: per-step losses within 1e-5 relative of the single-process plain-Lightning run and final weights within
  ``tests/test_parity.py``'s measured bound, at ZeRO 1 (clipped: the global norm of the device buckets before the
  copy) and ZeRO 3 (FSDP2's ``CPUOffloadPolicy``) on dp2, with pp2 and with tp2 (clipped; world 4);
- the states are separate host tensors: no storage shared with the parameters or the gradient buckets, on the CPU,
  and their bytes are the memory model's host bytes of the rank exactly (``ModelStates.host``);
- ``lightning-4d measure`` of one offload rank: device and host bytes within 5% of the estimate;
- the option's validation: one line naming the value and what would be valid.
"""

from __future__ import annotations

import pytest

from lightning_4d import FourDStrategy, ParallelConfig
from lightning_4d.models import LlamaConfig, LlamaModel
from lightning_4d.planning.model import estimate_memory, model_state_bytes
from lightning_4d.planning.workload import Workload
from tests._launch import FLOAT32_STEPS, trained
from tests.test_parity import _check_parity, _layout_id, _reference_for, shared

CLIP = {"clip": 0.1}
WORLD2 = [
    {"dp": 2, "zero": 1, "optoffload": True, **CLIP},
    {"dp": 2, "zero": 3, "optoffload": True},
]
WORLD4 = [
    {"pp": 2, "dp": 2, "zero": 1, "m": 2, "optoffload": True},
    {"pp": 2, "dp": 2, "zero": 3, "m": 2, "optoffload": True},
    {"dp": 2, "tp": 2, "zero": 1, "optoffload": True, **CLIP},
    {"dp": 2, "tp": 2, "zero": 3, "optoffload": True, **CLIP},
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return shared(tmp_path_factory, "reference")  # test_parity's: one launch for every file


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return trained(tmp_path_factory, "optoffload_world2", 2, WORLD2, steps=FLOAT32_STEPS)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return trained(tmp_path_factory, "optoffload_world4", 4, WORLD4, steps=FLOAT32_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_optimizer_offload_parity_world2(references, world2, index):
    _check_parity(_reference_for(references, WORLD2[index]), world2[index])
    _check_host_states(world2[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_optimizer_offload_parity_world4(references, world4, index):
    _check_parity(_reference_for(references, WORLD4[index]), world4[index])
    _check_host_states(world4[index])


def _check_host_states(result) -> None:
    """Every rank's optimizer states (and at ZeRO 1 the host copies it steps and their host gradients) are CPU
    tensors sharing no storage with the parameters or the gradient buckets, and their bytes are the memory model's
    host bytes of that rank; the device-side model states are the model's too."""
    layout, ranks, _ = result
    dp, pp, tp = layout.get("dp", 1), layout.get("pp", 1), layout.get("tp", 1)
    pc = ParallelConfig(
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        zero_stage=layout["zero"],
        optimizer_offload=True,
        num_microbatches=layout.get("m"),
    )
    cfg = LlamaConfig.from_preset("tiny-test")
    for r in ranks:
        rank = r["rank"]
        tp_rank, dp_rank, pp_rank = rank % tp, rank // tp % dp, rank // (tp * dp)  # mesh (pp, dp, cp, tp)
        est = model_state_bytes(cfg, pc, "32-true", pp_rank=pp_rank, dp_cp_rank=dp_rank, tp_rank=tp_rank)
        offload = r["bytes"]["offload"]
        assert offload["shared_storages"] == 0, (layout, rank, offload)
        assert offload["state_devices"] == ["cpu"] and offload["num_states"] > 0, (layout, rank, offload)
        assert offload["sharded_optimizer"] == (layout["zero"] == 1), (layout, rank)
        host = offload["host_bytes"]
        if layout["zero"] >= 2:  # FSDP2: the sharded parameters and gradients are the host's too
            host += r["bytes"]["params"] + r["bytes"]["grads"]
        assert host == est.host, (layout, rank, host, est)
        if layout["zero"] == 1:
            assert (r["bytes"]["params"], r["bytes"]["grads"]) == (est.parameters, est.gradients), (layout, rank)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_measure_of_an_offload_rank_equals_the_estimate(zero, precision):
    """``lightning-4d measure`` of rank 0 of dp2 with ``--optimizer-offload`` (tiny-test, b=2 s=256, on CPU: host and
    device one memory, the host storages told apart, ``LiveTensorBytes.split_peaks``): the device's model states
    equal the estimate's, the device peak and the host bytes (its model states and its peak) within 5%. Measured:
    ZeRO 1 0.996 (32-true) and 0.994 (bf16-mixed), ZeRO 3 1.002 and 0.993; host 1.000 (the peak 0.9999)."""
    from tests.test_measure import _measure_cli, _states_exact_peak_ratio

    args = ["--dp", "2", "--zero-stage", str(zero), "--optimizer-offload", "--seq-length", "256"]
    out = _measure_cli([*args, "--micro-batch-size", "2"], 0, precision)
    ratio = _states_exact_peak_ratio(out)
    rows = {r["component"]: r for r in out["rows"]}
    host, host_peak = rows["host: model states"], rows["host: peak"]
    print(
        f"\nZeRO {zero} {precision}: device {ratio:.4f}, host {host['ratio']:.4f}, host peak {host_peak['ratio']:.4f}"
    )
    assert abs(ratio - 1) <= 0.05 and host["estimated"] == host["measured"] > 0
    assert abs(host_peak["ratio"] - 1) <= 0.05


def test_offload_moves_states_to_the_host_in_the_memory_model():
    """ZeRO 1: the device keeps the parameters and the gradient buckets, the host the float32 copy of the owned
    slice, its gradient and Adam's m, v (16 bytes per owned parameter in float32); ZeRO 3: every model state is on
    the host (FSDP2's CPUOffloadPolicy)."""
    cfg = LlamaConfig.from_preset("tiny-test")
    for zero, precision in [(z, p) for z in (1, 2, 3) for p in ("32-true", "bf16-mixed")]:
        on_pc = ParallelConfig(data_parallel_size=2, zero_stage=zero, optimizer_offload=True)
        on = model_state_bytes(cfg, on_pc, precision)
        off = model_state_bytes(cfg, ParallelConfig(data_parallel_size=2, zero_stage=zero), precision)
        assert on.optimizer_states == on.master_weights == 0 and off.host == 0
        if zero == 1 and precision == "32-true":
            assert (on.parameters, on.gradients) == (off.parameters, off.gradients)
            assert on.host == off.optimizer_states * 2  # m, v (8 B) -> m, v, copy, gradient (16 B)
        elif zero == 1:  # master, m, v (12 B) -> + the master's gradient on the host (16 B)
            assert on.host == off.optimizer_states + off.master_weights
        else:
            assert on.parameters == on.gradients == on.master_weights == on.compression == 0
            assert on.host == off.parameters + off.gradients + off.optimizer_states
            # by hand, against the real model's parameter count P (tiny-test's dims divide by dp 2: no FSDP2 padding):
            # the shard's parameters, gradients and Adam's m, v, float32 (16 B) or bf16-mixed's float32 masters
            numel = sum(p.numel() for p in LlamaModel(cfg).parameters())
            assert on.host * 2 == 16 * numel


def test_offload_estimate_reports_host_bytes_per_node():
    """The estimate's device total drops by the offloaded states; its host bytes per node are the ranks' host bytes
    times the ranks on a node."""
    work = Workload("llama3-8b", micro_batch_size=1, seq_length=4096)
    pc = ParallelConfig(data_parallel_size=8, zero_stage=1, activation_checkpointing="full")
    off = estimate_memory(work, pc)
    on = estimate_memory(work, ParallelConfig(**{**_kwargs(pc), "optimizer_offload": True}))
    assert on.total < off.total and off.host_per_node == 0
    assert on.host_per_node == on.host * 8 and on.host > off.optimizer_states


def _kwargs(pc: ParallelConfig) -> dict:
    from dataclasses import fields

    return {f.name: getattr(pc, f.name) for f in fields(pc)}


@pytest.mark.parametrize("host_memory, refused", [("64GiB", True), ("256GiB", False)])
def test_memory_check_refuses_offload_beyond_host_memory(monkeypatch, host_memory, refused):
    """The pre-fit check counts the host side of optimizer offload: llama3-8b dp8 ZeRO 1 ``bf16-mixed`` at 1 x 4096
    with full checkpointing holds the estimate's ``host`` per rank (14.96 GiB: the owned slices' masters, gradients
    and m, v), x 8 processes per node: refused against 64 GiB of host memory (budget 80%), accepted against 256 GiB;
    the device side fits either way."""
    from types import SimpleNamespace

    from lightning_4d.memory_check import MemoryBudgetExceeded, MemoryEstimatorCallback
    from tests._fakes import FakeLayoutStrategy

    job = ParallelConfig(data_parallel_size=8, activation_checkpointing="full", optimizer_offload=True)
    cfg = LlamaConfig.from_preset("llama3-8b")
    host = estimate_memory(Workload(cfg, 1, 4096), job).host
    assert host == model_state_bytes(cfg, job).host > 14 * 2**30
    callback = MemoryEstimatorCallback(device_memory="80GiB", host_memory=host_memory)
    monkeypatch.setattr(callback, "_device", lambda trainer: (80 * 2**30, "NVIDIA H100 80GB HBM3", "cuda"))
    trainer = SimpleNamespace(
        strategy=FakeLayoutStrategy(parallel_config=job),
        precision="bf16-mixed",
        datamodule=SimpleNamespace(micro_batch_size=1, seq_length=4096),
        accumulate_grad_batches=1,
        num_devices=8,
    )
    module = SimpleNamespace(model_config=cfg)
    if refused:
        expected = (
            rf"optimizer offload would hold {8 * host / 2**30:.2f} GiB of host memory per node "
            rf"\({host / 2**30:.2f} GiB per rank x 8 processes\).*optimizer_offload=True"
        )
        with pytest.raises(MemoryBudgetExceeded, match=expected) as info:
            callback.setup(trainer, module, "fit")
        assert "\n" not in str(info.value)
    else:
        callback.setup(trainer, module, "fit")
        assert callback.estimate.host == host


@pytest.mark.parametrize("zero", [1, 3])
def test_step_time_charges_the_host_step_and_the_copies(zero):
    """The optimizer term under offload: the device's AdamW step replaced by the host's (the owned parameters at
    ``CPU_ADAMW_BYTES_PER_SECOND`` x ``HOST_THREADS_PER_RANK``) plus the host-link copies (ZeRO 1: 8 bytes per owned
    parameter, exposed); every other term unchanged."""
    from dataclasses import replace

    from lightning_4d.planning import optimizer_offload_costs as costs
    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.rates import COLLECTIVE_EFFICIENCY
    from lightning_4d.planning.step_time import predict_step_time

    cfg, gpu = LlamaConfig.from_preset("llama3-8b"), GPU_PRESETS["H100-80GB"]
    pc = ParallelConfig(data_parallel_size=8, zero_stage=zero)
    off = predict_step_time(cfg, pc, 1, 4, 4096, gpu, 8)
    on = predict_step_time(cfg, replace(pc, optimizer_offload=True), 1, 4, 4096, gpu, 8)
    assert replace(on, optimizer=0.0) == replace(off, optimizer=0.0)
    owned = cfg.num_parameters() / 8  # the step-time model counts the layers' matrices and the vocabulary: ~1e-4 less
    host = costs.host_step_seconds(owned)
    assert host == owned * 28 / (costs.CPU_ADAMW_BYTES_PER_SECOND * costs.HOST_THREADS_PER_RANK)
    assert on.optimizer > host > off.optimizer
    if zero == 1:
        copies = owned * 8 / (COLLECTIVE_EFFICIENCY * gpu.host_bandwidth)
        assert on.optimizer == pytest.approx(host + copies, rel=1e-3)


def test_plan_proposes_optimizer_offload_when_nothing_else_fits():
    """llama3-8b on 4 A10s (24 GiB) at 2,048 tokens, global batch 8: no layout fits with the states on the GPUs; the
    plan lists layouts with optimizer offload, each with the host memory per node it needs (the 16 bytes per
    parameter of 8 B parameters over the node's 4 ranks: 119.7 GiB), and drops them against too little host
    memory."""
    from dataclasses import replace

    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.planner import plan
    from lightning_4d.planning.workload import Job

    job = Job(LlamaConfig.from_preset("llama3-8b"), 4, 4, 2048, 8, GPU_PRESETS["A10"], "bf16-mixed")
    assert job.host_memory is None  # not checked
    found = plan(job, top=3)
    assert found and all(c.optimizer_offload and c.fits and c.zero_stage >= 1 for c in found)
    assert all(119 * 2**30 < c.host_memory < 120 * 2**30 for c in found)
    assert found[0].parallel_config().optimizer_offload is True
    assert not plan(replace(job, host_memory=64 * 2**30), top=3)  # 80% of 64 GiB < 119.7 GiB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(zero_stage=0, optimizer_offload=True), r"zero_stage=0.*Use zero_stage 1, 2 or 3"),
        (dict(optimizer_offload="yes"), "expected True or False"),
    ],
)
def test_optimizer_offload_bad_input_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ParallelConfig(**kwargs)
    assert "optimizer_offload" in str(info.value) and "\n" not in str(info.value)


def test_optimizer_offload_is_a_strategy_argument():
    strategy = FourDStrategy(optimizer_offload=True, zero_stage=3)
    assert strategy.parallel_config.optimizer_offload is True
