"""Lightning's demo Transformer (``lightning.pytorch.demos.Transformer``), unchanged, in a LightningModule trained
with ``nll_loss`` and AdamW: 5 steps under ``--strategy ddp`` or ``fourd`` with ``--zero Z`` (2 processes, gloo).
Rank 0 writes the per-step ``train_loss`` it logged to ``--out``. (issue 13)"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


class DemoLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = torch.nn.functional.nll_loss(self.model(inputs, target), target.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class StackLM(L.LightningModule):
    """Blocks in a top-level ``nn.ModuleList`` (no forward of its own) next to a top-level embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(32, 64)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        h = self.embed(inputs)
        for block in self.blocks:
            h = h + block(h)
        loss = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), target.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="fourd")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--blocks", default=None, help="fsdp_blocks, comma-separated")
    parser.add_argument("--module", default="demo", choices=["demo", "stack"])
    parser.add_argument("--compress", default="none", help="gradient_compression")
    parser.add_argument("--comm", action="store_true", help="record the bytes sent over dp_cp per step (FourDStrategy)")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (40, 17), generator=g)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    if args.strategy == "ddp":
        strategy = "ddp"
    else:
        from lightning_4d import FourDStrategy

        strategy = FourDStrategy(
            zero_stage=args.zero,
            process_group_backend="gloo",
            timeout=timedelta(seconds=60),
            fsdp_blocks=args.blocks.split(",") if args.blocks else None,
            gradient_compression=args.compress,
        )
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    meter = None
    if args.comm:  # bytes on the wire per step (lightning_4d.parallel.comm)
        from lightning_4d.parallel.comm import CommMeterCallback

        meter = CommMeterCallback(per_kind=True)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(), *([meter] if meter else [])],
    )
    module = DemoLM() if args.module == "demo" else StackLM()
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
    if trainer.global_rank == 0:
        units = sum(type(m).__name__.startswith("FSDP") for m in module.modules())
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "fsdp_units": units, "comm": meter.history if meter else []}, f)


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
