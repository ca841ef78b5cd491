"""Any LightningModule, unchanged, under FourDStrategy: Lightning's own demo Transformer (``lightning.pytorch.demos``)
trained with data parallelism at a ZeRO stage of your choice, on random tokens (no download).

    python examples/any_module.py                      # 2 CPU processes, ZeRO 3 (FSDP2 per encoder/decoder layer)
    python examples/any_module.py --zero-stage 1       # optimizer states sharded
    python examples/any_module.py --fsdp-blocks torch.nn.TransformerEncoderLayer,torch.nn.TransformerDecoderLayer

Nothing in the module mentions the strategy: swap ``strategy="ddp"`` for ``FourDStrategy(zero_stage=...)``.
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy


class DemoLM(L.LightningModule):
    def __init__(self, vocab_size: int = 1000) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=64, nhead=2, nhid=128, nlayers=2, dropout=0.1)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = torch.nn.functional.nll_loss(self.model(inputs, target), target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--fsdp-blocks", default=None, help="comma-separated classes (default: ModuleList children)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0)
    ids = torch.randint(0, 1000, (512, 33))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8, shuffle=True)
    strategy = FourDStrategy(
        zero_stage=args.zero_stage, fsdp_blocks=args.fsdp_blocks.split(",") if args.fsdp_blocks else None
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(DemoLM(), loader)


if __name__ == "__main__":
    main()
