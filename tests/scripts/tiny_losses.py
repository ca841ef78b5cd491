"""The main job's first steps in one process (``configs/tiny.yaml``'s model, data and optimizer, world size 1,
FourDStrategy), on ``--device`` in ``--precision``: writes the per-step training losses to ``--out`` (JSON).

``tests/cuda/test_numerics.py`` runs it on CUDA and on the CPU and compares the losses (issue 32: 20 steps of the
tiny job on CUDA against CPU, 32-true within 1e-4, bf16-mixed within 1e-2). Both runs start from the same weights:
``--write-init PATH`` draws them once on the CPU (``init_seed`` 0) into a checkpoint file that ``--init-from PATH``
reads (CPU and CUDA generators draw different streams, so the same seed alone gives each device other weights; the
first GPU run compared two differently initialized models and saw 3.1e-2)."""

import argparse
import json
import os

import lightning as L
import torch

from lightning_4d import FourDStrategy
from lightning_4d.data import LMDataModule
from lightning_4d.parallel._compat.process import exit_distributed_process
from lightning_4d.tasks import CausalLMModule

torch.set_num_threads(1)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--init-from", help="start from this checkpoint file (written by --write-init)")
    parser.add_argument("--write-init", help="write the tiny model's initial weights (CPU, init_seed 0) here and exit")
    args = parser.parse_args()
    if args.write_init:
        module = CausalLMModule("tiny", init_seed=0)
        module.configure_model()  # no trainer: built and initialized on the CPU
        torch.save({"state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()}}, args.write_init)
        return
    if not args.out:
        parser.error("--out is required unless --write-init is given")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    L.seed_everything(0)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        strategy=FourDStrategy(process_group_backend="nccl" if args.device == "cuda" else "gloo"),
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    module = CausalLMModule(
        "tiny",
        learning_rate=3.0e-3,
        min_lr_ratio=0.1,
        warmup_steps=30,
        weight_decay=0.1,
        init_seed=0,
        init_from=args.init_from,
    )
    data = LMDataModule(tokenizer="byte", seq_length=256, micro_batch_size=8, val_samples=64, seed=1234)
    trainer.fit(module, datamodule=data)
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "precision": args.precision, "losses": losses.values}, f)
    exit_distributed_process(0)


if __name__ == "__main__":
    main()
