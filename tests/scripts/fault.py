"""Fault injection for checkpoints (tests/test_checkpoint_faults.py): train the tiny-test model on dp=2 ZeRO 1 with
a ``ModelCheckpoint(save_last=True)`` after every step, and optionally kill rank 0 with SIGKILL

- ``--kill save``: inside the K-th save of ``last.ckpt``, after DCP wrote the shard files into ``last.ckpt.tmp``,
  before Lightning's metadata and the rename;
- ``--kill rename``: inside the K-th save of ``last.ckpt``, between ``last.ckpt -> last.ckpt.old`` and
  ``last.ckpt.tmp -> last.ckpt`` (the worst moment);
- ``--kill step``: at the start of training step K+1 (``last.ckpt`` holds step K).

Each rank appends ``[global_step, train_loss]`` per step to ``OUT/<tag>_rank<r>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_4d.checkpoint as ckpt_module  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def __init__(self, file: Path, kill_step: int | None) -> None:
        self.file, self.kill_step = file, kill_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_step is not None and trainer.global_step == self.kill_step and RANK == 0:
            _die()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.file.open("a") as f:
            f.write(json.dumps([trainer.global_step, float(trainer.callback_metrics["train_loss"])]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill", choices=["none", "save", "rename", "step"], default="none")
    parser.add_argument("--at", type=int, default=3, help="K (module docstring)")
    parser.add_argument("--ckpt-path", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    saves = {"n": 0}
    if args.kill in ("save", "rename") and RANK == 0:
        if args.kill == "save":
            import torch.distributed.checkpoint as dcp

            real_save = dcp.save

            def save(state, checkpoint_id=None, **kwargs):
                result = real_save(state, checkpoint_id=checkpoint_id, **kwargs)
                if Path(checkpoint_id).name == "last.ckpt.tmp":
                    saves["n"] += 1
                    if saves["n"] == args.at:
                        _die()
                return result

            dcp.save = save
        else:
            real_rename = ckpt_module._rename_into_place

            def rename(tmp: Path, path: Path) -> None:
                if path.name == "last.ckpt":
                    saves["n"] += 1
                    if saves["n"] == args.at:
                        path.rename(ckpt_module._old(path))
                        _die()
                real_rename(tmp, path)

            ckpt_module._rename_into_place = rename
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny-test", learning_rate=1e-3, warmup_steps=2, max_steps=args.steps, init_seed=7)
    dm = LMDataModule(
        seq_length=32, micro_batch_size=4, global_batch_size=8, train_samples=8 * args.steps, val_samples=8, seed=1234
    )
    strategy = FourDStrategy(
        data_parallel_size=2, zero_stage=1, process_group_backend="gloo", timeout=timedelta(seconds=60)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[
            Record(out / f"{args.tag}_rank{RANK}.jsonl", args.at if args.kill == "step" else None),
            ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=1),
        ],
    )
    trainer.fit(module, dm, ckpt_path=args.ckpt_path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
