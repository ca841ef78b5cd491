"""Resuming as README says (issue 27).

- A larger ``max_steps`` continues the learning-rate schedule the run was started with: the checkpoint records the
  schedule (``WarmupCosine`` in the LR scheduler's state), so the LR of every resumed step is the one the saving run
  would have had; ``CausalLMModule(max_steps=N)`` asks for a new schedule instead.
- ``last.ckpt`` is always the newest checkpoint: the shipped configs' ``ModelCheckpoint`` has
  ``enable_version_counter: false``, so a second run in the same folder replaces ``last.ckpt`` (atomically, for a
  sharded folder) instead of writing ``last-v1.ckpt``.

One process, CPU, Lightning's default strategy, the ``tiny-test`` model on random tokens: a few seconds."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from lightning_4d.tasks import CausalLMModule, lr_lambda
from tests._launch import ROOT

LR, WARMUP, RATIO = 1e-3, 2, 0.1


class _Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class _RecordLR(L.Callback):
    """The LR each optimizer step runs with, by global step."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def _fit(
    root, max_steps: int, ckpt_path=None, module_max_steps=None, save_every=None, checkpoint=None
) -> dict[int, float]:
    record = _RecordLR()
    callbacks = [record] + ([checkpoint] if checkpoint is not None else [])
    if save_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root / "ckpt", every_n_train_steps=save_every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    model = CausalLMModule(
        "tiny-test", learning_rate=LR, warmup_steps=WARMUP, min_lr_ratio=RATIO, max_steps=module_max_steps
    )
    trainer.fit(model, DataLoader(_Tokens(), batch_size=2), ckpt_path=ckpt_path)
    return record.lrs


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("lr")
    lrs = _fit(root, 6, save_every=3)
    assert (root / "ckpt" / "step=3.ckpt").exists()
    return root, lrs


def test_resume_with_more_steps_continues_the_schedule(straight, tmp_path):
    root, lrs = straight
    assert [lrs[k] for k in range(6)] == pytest.approx([LR * lr_lambda(k, WARMUP, 6, RATIO) for k in range(6)])
    resumed = _fit(tmp_path, 9, ckpt_path=root / "ckpt" / "step=3.ckpt")  # max_steps 6 -> 9, as README's resume
    assert sorted(resumed) == list(range(3, 9))
    for k in range(3, 6):  # the steps the saving run also took: exactly its LR
        assert resumed[k] == lrs[k], (k, resumed[k], lrs[k])
    # what the Trainer's new max_steps would give (the jump this test guards against) differs
    assert not math.isclose(resumed[3], LR * lr_lambda(3, WARMUP, 9, RATIO), rel_tol=1e-3)
    for k in range(6, 9):  # past the schedule's end: the final LR
        assert resumed[k] == pytest.approx(LR * RATIO)


@pytest.mark.slow
def test_resume_with_module_max_steps_follows_the_new_schedule(straight, tmp_path):
    root, lrs = straight
    resumed = _fit(tmp_path, 9, ckpt_path=root / "ckpt" / "step=3.ckpt", module_max_steps=9)
    assert sorted(resumed) == list(range(3, 9))
    for k in range(3, 9):  # the new 9-step schedule from the resumed step on, its first step included
        assert resumed[k] == pytest.approx(LR * lr_lambda(k, WARMUP, 9, RATIO), rel=1e-6), k
    assert not math.isclose(resumed[3], lrs[3], rel_tol=1e-3)


def _checkpoint_args(config: Path) -> dict:
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    (args,) = [c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
    return args


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_keep_one_last_ckpt(config):
    args = _checkpoint_args(config)
    assert args.get("save_last") is True and args.get("enable_version_counter") is False, args


def test_second_run_in_the_same_folder_replaces_last_ckpt(tmp_path):
    """Two fresh runs with configs/tiny.yaml's ModelCheckpoint (every 2 steps) in one folder: one ``last.ckpt``,
    holding the second run's last step; no ``last-v1.ckpt``."""
    args = {
        **_checkpoint_args(ROOT / "configs" / "tiny.yaml"),
        "dirpath": str(tmp_path / "ckpt"),
        "every_n_train_steps": 2,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Checkpoint directory ... exists and is not empty"
        _fit(tmp_path, 4, checkpoint=L.pytorch.callbacks.ModelCheckpoint(**args))
        _fit(tmp_path, 2, checkpoint=L.pytorch.callbacks.ModelCheckpoint(**args))
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "last.ckpt" in names and not [n for n in names if n.startswith("last-v")], names
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 2  # the second run's


def test_sharded_save_replaces_an_existing_folder(tmp_path):
    """What ``FourDStrategy`` does when ``last.ckpt`` exists (``save_sharded``): the new folder replaces it whole,
    and no ``.tmp`` / ``.old`` is left."""
    from lightning_4d.checkpoint import check_complete, save_sharded
    from lightning_4d.parallel._compat.lightning import LIGHTNING_METADATA_FILENAME

    path = tmp_path / "last.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warning
        for step in (1, 2):
            save_sharded(
                {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, path, 0, lambda: None
            )
    check_complete(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    meta = torch.load(path / LIGHTNING_METADATA_FILENAME, weights_only=False)
    assert meta["global_step"] == 2
