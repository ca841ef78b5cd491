"""One Trainer, three runs: ``fit``, ``validate``, then ``fit`` again (to more steps), under ``FourDStrategy`` with the
layout given: the strategy's process groups must be made once, on every rank, and reused by the second ``setup`` (a
group made again on some ranks only, the tied embedding group of a pipeline once did, hangs the second ``fit``).

Usage: ``torchrun --nproc-per-node 4 tests/scripts/refit.py --out DIR --pp 4 --schedule interleaved_1f1b --tied``.
Writes ``rank<r>.json``: the losses of both fits, the validation loss, whether the mesh object and the count of
process groups stayed the same across the runs, and the timeout of each group the strategy made (its mesh's and the
tied embedding group), in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.parallel._compat.process import process_group_count, process_group_timeout  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--schedule", default="interleaved_1f1b")
    parser.add_argument("--tied", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    cfg = LlamaConfig.from_preset("tiny-test", num_layers=8, tie_word_embeddings=args.tied)
    module = CausalLMModule(cfg, init_seed=7)
    strategy = FourDStrategy(
        pipeline_parallel_size=args.pp,
        data_parallel_size=world // args.pp,
        zero_stage=1,
        pipeline_schedule=args.schedule,
        num_microbatches=args.pp,
        process_group_backend="gloo",
        timeout=timedelta(seconds=60),
    )
    dm = LMDataModule(seq_length=32, micro_batch_size=1, global_batch_size=args.pp * (world // args.pp), seed=1234)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(module, dm)
    mesh, groups = strategy.mesh, process_group_count()
    made = [*mesh.groups(), *([strategy._tied.group] if strategy._tied and strategy._tied.group else [])]
    timeouts = {f"{g.group_desc}:{g.group_name}": process_group_timeout(g).total_seconds() for g in made}
    (result,) = trainer.validate(module, dm)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, dm)
    record = {
        "losses": losses.losses,
        "val_loss": float(result["val_loss"]),
        "same_mesh": strategy.mesh is mesh,
        "groups": [groups, process_group_count()],
        "timeouts": timeouts,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
