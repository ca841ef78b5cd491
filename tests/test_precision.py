"""``lightning_4d.precision``: the Trainer's precision plugin with FourDStrategy's overrides (a ShardedOptimizer's
step, global-norm clipping), nothing of Lightning's patched."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_4d.precision import FourDPrecision, four_d_precision


@pytest.mark.parametrize(
    "plugin",
    [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true")],
    ids=lambda p: type(p).__name__,
)
def test_four_d_precision_is_the_plugin_class_with_our_overrides(plugin):
    ours = four_d_precision(plugin, None)
    assert isinstance(ours, FourDPrecision) and isinstance(ours, type(plugin))
    assert type(ours).__mro__[1:3] == (FourDPrecision, type(plugin))
    assert vars(ours) is vars(plugin)  # one state
    assert getattr(ours, "precision", None) == getattr(plugin, "precision", None)
    assert "clip_grad_by_norm" not in vars(plugin) and "optimizer_step" not in vars(plugin)  # nothing patched
    group = object()
    assert four_d_precision(ours, group) is ours and ours.pp_group is group  # a second setup


def test_sharded_optimizer_steps_through_the_plugin_without_lr_scheduler_warnings(tmp_path, monkeypatch):
    """bf16-mixed ZeRO 1 on one CPU process with a LambdaLR and clipping: the ShardedOptimizer steps, clips its
    buckets, the scheduler counts every step (no warning), the hooks receive the torch optimizer."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer
    from lightning_4d.tasks import CausalLMModule

    class Module(CausalLMModule):
        def train_dataloader(self):
            data = torch.randint(0, 100, (8, 17), generator=torch.Generator().manual_seed(0))
            return DataLoader([{"input_ids": x[:-1], "labels": x[1:]} for x in data], batch_size=2)

        def on_before_optimizer_step(self, optimizer):
            self.hook_optimizer = optimizer

    import lightning_4d.precision as precision

    clipped = []  # the ShardedOptimizer each clipping got (its buckets are clipped)
    clip = precision.clip_grad_norm_
    monkeypatch.setattr(precision, "clip_grad_norm_", lambda *a, **k: clipped.append(k.get("sharded")) or clip(*a, **k))
    module = Module("tiny", warmup_steps=2, max_steps=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=3,
        gradient_clip_val=0.5,
        strategy=FourDStrategy(zero_stage=1, memory_check=False),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not [w for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step" in str(w.message)]
    optimizer = trainer.optimizers[0]
    assert ShardedOptimizer.of(optimizer) is not None and isinstance(trainer.precision_plugin, FourDPrecision)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3 and len(clipped) == 3
    assert all(sharded is ShardedOptimizer.of(optimizer) for sharded in clipped)
    assert module.hook_optimizer is optimizer
