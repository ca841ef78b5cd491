"""Pipeline parallelism against the single-process run (CPU, gloo, float32, tiny Llama with 4 layers, STEPS AdamW
steps): per-step ``train_loss`` to 1e-5 relative and final weights, for every schedule and with tp, dp/ZeRO,
gradient clipping and a checkpoint resume; plus the ValueErrors raised before any process group."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_4d import ParallelConfig
from lightning_4d.models import LlamaConfig
from tests._launch import FLOAT32_STEPS, SCRIPTS, run_layouts, torchrun, trained
from tests.test_parity import LOSS_RTOL, WEIGHT_ATOL, _check_offloaded, _layout_id

LAYERS = 4
#: AdamW steps of every run here (float32 only): largest weight difference measured 6.1e-6 at 5 steps (here and in
#: tests/test_context_parallel.py's float32 rows), under WEIGHT_ATOL
STEPS = FLOAT32_STEPS
#: the single-process runs (plain Lightning, no FourDStrategy) of tiny-test with LAYERS layers: plain and clipped
REFERENCES = [{"reference": True}, {"reference": True, "clip": 0.1}]
WORLD2 = [
    # activation offload under GPipe (every forward before any backward: the most saves held at once) and DualPipeV;
    # both schedules also run without it (WORLD4's pp4 GPipe, tests/test_tied_pipeline.py's DualPipeV)
    {"pp": 2, "schedule": "gpipe", "m": 2, "offload": 1},
    {"pp": 2, "schedule": "1f1b", "m": 4},
    {"pp": 2, "schedule": "interleaved_1f1b", "v": 2, "m": 2},
    {"pp": 2, "schedule": "zbv", "m": 4},
    {"pp": 2, "schedule": "dualpipev", "m": 4, "offload": 1},
    {"pp": 2, "schedule": "1f1b", "m": 2, "split": [3, 1]},  # fewer layers on the last stage (head + loss)
    {"pp": 2, "schedule": "1f1b", "m": 2, "clip": 0.1},
    {"pp": 2, "schedule": "1f1b", "m": 2, "ac": "full"},
    {"pp": 2, "schedule": "interleaved_1f1b", "v": 2, "m": 2, "ac": "selective"},
    # activation offload: the first layer of each stage (zbv: its saves unpacked by the input and the weight pass;
    # interleaved: one layer per stage, every stage offloaded whole)
    {"pp": 2, "schedule": "zbv", "m": 4, "offload": 1},
    {"pp": 2, "schedule": "interleaved_1f1b", "v": 2, "m": 2, "offload": 1},
]
WORLD4 = [
    {"pp": 4, "schedule": "gpipe", "m": 4},
    {"pp": 4, "schedule": "1f1b", "m": 4},
    {"pp": 2, "tp": 2, "schedule": "1f1b", "m": 2},
    {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b", "m": 2},
    {"pp": 2, "dp": 2, "zero": 3, "schedule": "1f1b", "m": 2},
    {"pp": 2, "dp": 2, "zero": 2, "schedule": "interleaved_1f1b", "m": 2},
    {"pp": 2, "dp": 2, "zero": 3, "schedule": "zbv", "m": 2, "clip": 0.1},
    # DualPipeV (rank 0 holds stages 0 and 3) with dp at every ZeRO stage and with tp
    {"pp": 2, "dp": 2, "zero": 1, "schedule": "dualpipev", "m": 4},
    {"pp": 2, "dp": 2, "zero": 2, "schedule": "dualpipev", "m": 4, "clip": 0.1},
    {"pp": 2, "dp": 2, "zero": 3, "schedule": "dualpipev", "m": 4},
    {"pp": 2, "tp": 2, "schedule": "dualpipev", "m": 4},
]
WORLD8 = [
    {"pp": 2, "dp": 2, "tp": 2, "zero": 1, "schedule": "1f1b", "m": 2},
    {"pp": 2, "dp": 2, "tp": 2, "zero": 3, "schedule": "interleaved_1f1b", "m": 2, "clip": 0.1},
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return trained(tmp_path_factory, "pp_reference", 1, REFERENCES, layers=LAYERS, steps=STEPS)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return trained(tmp_path_factory, "pp_world2", 2, WORLD2, layers=LAYERS, steps=STEPS)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return trained(tmp_path_factory, "pp_world4", 4, WORLD4, layers=LAYERS, steps=STEPS)


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return trained(tmp_path_factory, "pp_world8", 8, WORLD8, layers=LAYERS, steps=STEPS)


def _check(references, result, steps: int = STEPS):
    """``result`` (a launch's layout, ranks' records, weights) equals its reference, both trained ``steps`` steps."""
    layout, ranks, weights = result
    _, ref_ranks, ref_weights = references[1] if layout.get("clip") else references[0]
    ref_losses = ref_ranks[0]["losses"]
    assert len(ranks) >= 2 and len(ref_losses) == steps
    for r in ranks:  # the same logged loss on every rank, whatever its pipeline stage
        assert r["losses"] == ranks[0]["losses"], (layout, r["rank"])
    losses = ranks[0]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert set(weights) == set(ref_weights)  # every parameter of the unsplit model, under its own name
    werr = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    print(f"\n{_layout_id(layout)}: max rel loss diff {rel:.2e}, max abs weight diff {werr:.2e}")
    assert len(losses) == steps
    assert rel <= LOSS_RTOL
    assert werr <= WEIGHT_ATOL
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_pipeline_world2(references, world2, index):
    _check(references, world2[index])
    _check_offloaded(world2[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_pipeline_world4(references, world4, index):
    _check(references, world4[index])
    _check_offloaded(world4[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD8)), ids=[_layout_id(x) for x in WORLD8])
def test_pipeline_world8(references, world8, index):
    _check(references, world8[index])


@pytest.mark.slow
def test_pipeline_checkpoint_resume(tmp_path_factory):
    """A ModelCheckpoint saved at pp=2 (1F1B, and DualPipeV: rank 0 saves stages 0 and 3) loads back on the same
    layout and training continues with the same losses."""
    layouts = [{"pp": 2, "schedule": "1f1b", "m": 2, "zero": 1}, {"pp": 2, "schedule": "dualpipev", "m": 4, "zero": 1}]
    _check_resume(
        run_layouts(tmp_path_factory.mktemp("pp_resume"), 2, layouts, "--resume-check", layers=LAYERS, steps=STEPS),
        ranks=2,
        layouts=len(layouts),
    )


def _check_resume(out, ranks: int, layouts: int = 1, steps: int = STEPS) -> None:
    """Each rank's resumed losses (second half) equal the straight run's (run_layouts.py --resume-check), for each of
    the ``layouts`` layouts of the launch (trained ``steps`` steps)."""
    paths = [p for i in range(layouts) for p in sorted(out.glob(f"resume{i}_rank*.json"))]
    assert len(paths) == ranks * layouts
    for path in paths:
        record = json.loads(path.read_text())
        half = steps // 2
        assert record["first"] == record["straight"][:half]
        assert len(record["resumed"]) == steps - half
        rel = max(abs(a - b) / abs(b) for a, b in zip(record["resumed"], record["straight"][half:]))
        assert rel <= LOSS_RTOL, (record["resumed"], record["straight"][half:])


# ---------------------------------------------------------------------------------------------------- bad input
def _config(**kw) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=1, **kw)


def test_layers_not_divisible_into_stages():
    cfg = LlamaConfig.from_preset("tiny-test", num_layers=6)
    with pytest.raises(ValueError, match=r"num_layers=6 cannot be split into pp\*v = 4\*1 = 4"):
        _config(pipeline_parallel_size=4).validate_model(cfg)
    with pytest.raises(ValueError, match=r"pp\*v = 2\*2 = 4"):
        _config(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b").validate_model(cfg)
    _config(pipeline_parallel_size=2).validate_model(cfg)  # 3 + 3
    _config(pipeline_parallel_size=4, pipeline_layer_split=[2, 2, 1, 1]).validate_model(cfg)


def test_layer_split_must_sum_to_layers():
    cfg = LlamaConfig.from_preset("tiny-test", num_layers=6)
    with pytest.raises(ValueError, match=r"pipeline_layer_split=\[3, 2\].*summing to num_layers=6"):
        _config(pipeline_parallel_size=2, pipeline_layer_split=[3, 2]).validate_model(cfg)
    with pytest.raises(ValueError, match=r"expected 4 layer counts"):
        _config(pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_layer_split=[3, 3]).validate_model(cfg)
    with pytest.raises(ValueError, match="pipeline_layer_split"):
        _config(pipeline_parallel_size=2, pipeline_layer_split=[6, "a"])


def test_microbatch_rules():
    with pytest.raises(ValueError, match=r"num_microbatches=2 is too small for pipeline_schedule='1f1b'"):
        _config(pipeline_parallel_size=4).validate_microbatches(2)
    with pytest.raises(ValueError, match=r"num_microbatches=6 is not a multiple of pipeline_parallel_size=4"):
        _config(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b").validate_microbatches(6)
    _config(pipeline_parallel_size=4, pipeline_schedule="gpipe").validate_microbatches(1)
    _config(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b").validate_microbatches(8)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        _config(pipeline_parallel_size=2, num_microbatches=0)


def test_schedule_names_and_stages_per_rank():
    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1f' is not valid: expected one of \['gpipe'"):
        _config(pipeline_schedule="1f1f")
    with pytest.raises(ValueError, match=r"virtual_pipeline_stages=2 is not supported by pipeline_schedule='gpipe'"):
        _config(pipeline_parallel_size=2, pipeline_schedule="gpipe", virtual_pipeline_stages=2)
    with pytest.raises(ValueError, match=r"virtual_pipeline_stages=3 is not supported by pipeline_schedule='zbv'"):
        _config(pipeline_parallel_size=2, pipeline_schedule="zbv", virtual_pipeline_stages=3)
    cfg = _config(pipeline_parallel_size=4, pipeline_schedule="zbv")
    assert cfg.v == 2 and cfg.stage_indices(0) == [0, 7] and cfg.stage_indices(3) == [3, 4]
    cfg = _config(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=3)
    assert cfg.num_stages == 12 and cfg.stage_indices(1) == [1, 5, 9]


def test_num_microbatches_resolution():
    """m: given, else global batch / (micro-batch size x dp), else the schedule's default (2p for dualpipev, once
    in config.py: the strategy, the DataModule and the memory model read the same value). The DataModule's sizes come
    in through the one protocol (``TrainingInputs``), and resolving changes no config (issue 33: it used to fill in
    ``config.num_microbatches``; the strategy now writes m into its resolved config once)."""
    from lightning_4d.contract import TrainingInputs
    from lightning_4d.features.pipeline.runtime import resolve_num_microbatches

    config = ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="dualpipev")
    assert config.microbatches == config.default_num_microbatches == 4
    assert resolve_num_microbatches(config, TrainingInputs()) == 4 and config.num_microbatches is None
    config = ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2)
    assert config.default_num_microbatches == 2
    data = TrainingInputs(global_batch_size=24, micro_batch_size=3)
    assert resolve_num_microbatches(config, data) == 4 and config.num_microbatches is None
    with pytest.raises(ValueError, match=r"global_batch_size=20 is not a multiple of micro_batch_size x dp = 3 x 2"):
        resolve_num_microbatches(
            ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2),
            TrainingInputs(global_batch_size=20, micro_batch_size=3),
        )
    assert ParallelConfig(data_parallel_size=1).microbatches == 1


def test_stage_layers_once_in_config():
    """Layer ranges per stage and per pp rank come from ParallelConfig (the split and the memory model use them)."""
    config = _config(pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_layer_split=[2, 1, 1, 2])
    assert config.stage_layer_ranges(6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert config.rank_stages(6, 0) == [(0, range(0, 2)), (3, range(4, 6))]
    assert config.rank_stages(6, 1) == [(1, range(2, 3)), (2, range(3, 4))]
    assert _config().rank_stages(6, 0) == [(0, range(0, 6))]


def test_full_file_checkpoint_refused_with_pp_says_what_is_true():
    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match="not supported with pipeline_parallel_size > 1") as err:
        FourDStrategy(pipeline_parallel_size=2, zero_stage=0, save_distributed_checkpoint=False)
    assert "any layout" not in str(err.value)


def test_strategy_rejects_bad_pipeline_before_process_group(tmp_path):
    """The Trainer fails in setup_environment (before any process group) with the ValueError."""
    import lightning as L

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    with pytest.raises(ValueError, match="pipeline_schedule='looped' is not valid"):
        FourDStrategy(pipeline_parallel_size=2, pipeline_schedule="looped")
    strategy = FourDStrategy(pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1)
    assert strategy.num_microbatches == 1
    cases = [
        (dict(pipeline_parallel_size=2, num_microbatches=1), {}, r"num_microbatches=1 is too small"),
        (
            dict(pipeline_parallel_size=2, num_microbatches=2),
            {"accumulate_grad_batches": 2},
            r"accumulate_grad_batches=2 is not supported with pipeline_parallel_size=2",
        ),
        (dict(pipeline_parallel_size=2, pipeline_layer_split=[2, 1]), {}, r"summing to num_layers=2"),
    ]
    for kwargs, trainer_kwargs, match in cases:
        strategy = FourDStrategy(process_group_backend="gloo", **kwargs)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            **trainer_kwargs,
        )
        module = CausalLMModule("tiny-test")
        dm = LMDataModule(seq_length=32, micro_batch_size=2)
        strategy._lightning_module = module
        module.trainer = trainer
        trainer.datamodule = dm
        with pytest.raises(ValueError, match=match):
            validate_against_module(strategy.parallel_config, module)
        assert not torch.distributed.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_validate_and_predict(tmp_path, schedule):
    """trainer.validate and trainer.predict run forward-only through the pipeline: the same val_loss on every rank as
    one process, and the logits (on the rank holding the last stage: rank 1 for 1f1b, rank 0 for the V of zbv)."""
    ref, pp = tmp_path / "ref", tmp_path / "pp"
    torchrun(1, SCRIPTS / "pp_eval.py", "--out", str(ref))
    torchrun(2, SCRIPTS / "pp_eval.py", "--out", str(pp), "--pp", "2", "--schedule", schedule)
    expected = json.loads((ref / "eval_rank0.json").read_text())["val_loss"]
    for rank in (0, 1):
        got = json.loads((pp / f"eval_rank{rank}.json").read_text())["val_loss"]
        assert abs(got - expected) <= 1e-5 * abs(expected), (rank, got, expected)
    last = 1 if schedule == "1f1b" else 0
    assert sorted(p.name for p in pp.glob("logits_rank*.pt")) == [f"logits_rank{last}.pt"]
    logits, ref_logits = torch.load(pp / f"logits_rank{last}.pt"), torch.load(ref / "logits_rank0.pt")
    assert logits.shape == ref_logits.shape == (8, 32, 256)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
