"""The one protocol between the strategy and the task / data / Trainer (``lightning_4d/contract.py``, issue 33): read
once, before any process group, never changed later; the parallel code reads no LightningModule, DataModule or
Trainer itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from lightning_4d import FourDStrategy, ParallelConfig
from lightning_4d.contract import MicroBatchingStrategy, TrainingInputs


def _attached(strategy, module, datamodule, **trainer_kwargs):  # noqa: ANN001, ANN202
    import lightning as L

    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, **quiet, **trainer_kwargs)
    strategy._lightning_module = module
    module.trainer = trainer
    trainer.datamodule = datamodule
    datamodule.trainer = trainer
    return trainer


def test_training_inputs_read_once_from_module_data_and_trainer():
    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.loss import causal_lm_loss
    from lightning_4d.tasks import CausalLMModule

    class WithLoss(CausalLMModule):
        def pipeline_loss(self, logits, labels):  # noqa: ANN001, ANN201
            return causal_lm_loss(logits, labels)

    module = WithLoss("tiny-test")
    strategy = FourDStrategy(pipeline_parallel_size=2, process_group_backend="gloo")
    trainer = _attached(strategy, module, LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=16))
    inputs = TrainingInputs.of(module, trainer)
    assert inputs.model_config is module.model_config and inputs.init_from is None
    assert inputs.pipeline_loss == module.pipeline_loss and inputs.applies_own_plans  # configure_model overridden
    assert (inputs.seq_length, inputs.micro_batch_size, inputs.global_batch_size) == (32, 2, 16)
    assert inputs.accumulate_grad_batches == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.seq_length = 64  # type: ignore[misc]
    assert TrainingInputs.of(None) == TrainingInputs()


def test_the_strategy_resolves_m_once_and_the_datamodule_reads_it_back():
    """m from the DataModule's batch sizes: 16 / (2 x dp 1) = 8, written into the strategy's resolved config in one
    place (``_resolve_inputs``, run by ``setup_environment`` before the process group); the config it started from is
    unchanged, and ``LMDataModule`` reads m through ``MicroBatchingStrategy``."""
    from lightning_4d.data import LMDataModule
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule("tiny-test")
    strategy = FourDStrategy(pipeline_parallel_size=2, process_group_backend="gloo")
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=16)
    _attached(strategy, module, dm)
    before = strategy.parallel_config
    strategy._resolve_inputs()
    assert before.num_microbatches is None and strategy.parallel_config.num_microbatches == 8
    assert strategy.num_microbatches == 8 and strategy.training_inputs.global_batch_size == 16
    assert isinstance(strategy, MicroBatchingStrategy) and dm._num_microbatches() == 8
    assert not dist.is_initialized()


def test_validation_changes_no_config():
    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule("tiny-test")
    strategy = FourDStrategy(pipeline_parallel_size=2, process_group_backend="gloo")
    _attached(strategy, module, LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=16))
    config = strategy.parallel_config
    copy = dataclasses.replace(config)
    validate_against_module(config, module)
    assert config == copy and config.num_microbatches is None


def test_a_strategy_without_micro_batches_gives_the_datamodule_one():
    from lightning_4d.data import LMDataModule

    class Plain:
        pass

    assert not isinstance(Plain(), MicroBatchingStrategy)
    assert LMDataModule(seq_length=32, micro_batch_size=2)._num_microbatches() == 1
    assert ParallelConfig().microbatches == 1


def test_is_this_four_d_strategy_has_one_answer():
    """``layout_strategy``: ``FourDStrategy`` (a ``LayoutStrategy``, instantiable: it implements every abstract
    member) is one; Lightning's own strategies, ``None`` and a look-alike with the same attributes are not."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from lightning_4d.contract import LayoutStrategy, layout_strategy

    strategy = FourDStrategy()
    assert isinstance(strategy, LayoutStrategy) and layout_strategy(strategy) is strategy
    assert strategy.gradient_buckets is None and strategy.initializes_llama_models
    for other in (DDPStrategy(), ModelParallelStrategy(), SingleDeviceStrategy("cpu"), None):
        assert layout_strategy(other) is None
    assert layout_strategy(SimpleNamespace(parallel_config=ParallelConfig(), initializes_llama_models=True)) is None


def test_optional_members_are_declared_in_the_contract():
    """``optional_member`` reads only what the contract's protocols declare, with a default where it is missing."""
    from types import SimpleNamespace

    from lightning_4d.contract import OPTIONAL_MEMBERS, grad_accumulation, optional_member

    assert {"model_config", "seq_length", "vocab_size", "datamodule", "accumulate_grad_batches"} <= OPTIONAL_MEMBERS
    assert optional_member(SimpleNamespace(seq_length=8), "seq_length") == 8
    assert optional_member(SimpleNamespace(), "seq_length") is None and optional_member(None, "tokenizer", 3) == 3
    with pytest.raises(KeyError, match="not an optional member"):
        optional_member(SimpleNamespace(secret=1), "secret")
    assert grad_accumulation(None) == 1 and grad_accumulation(SimpleNamespace(accumulate_grad_batches=4)) == 4
    assert grad_accumulation(SimpleNamespace()) == 1


def test_nothing_is_stamped_on_modules_and_no_private_name_is_read_across_modules():
    """No ``lightning_4d`` module writes an attribute named ``_lightning_4d...`` onto another object, nor reads one
    of this package's private members through ``getattr(obj, "_name")`` (the strategy's buckets have the public
    ``gradient_buckets``)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lightning_4d"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_lightning_4d"):
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith(("_lightning_4d", "_buckets"))
            ):
                bad.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not bad, bad
