"""Your own plans in ``configure_model``, as with Lightning's ``ModelParallelStrategy``: a small MLP language model
whose LightningModule applies tensor parallelism (torch's ``ColwiseParallel`` / ``RowwiseParallel``) on
``self.device_mesh["tp"]`` and FSDP2 on ``self.device_mesh["dp_cp"]`` itself; FourDStrategy builds the mesh, averages
what FSDP does not own over dp and runs the rest of the Lightning loop.

    python examples/own_plans.py             # 4 CPU processes: dp=2 x tp=2, ZeRO 3 applied by the module
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy
from lightning_4d.parallel.fsdp import apply_fsdp


class MLP(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.down(torch.relu(self.up(h))))


class MLPLM(L.LightningModule):
    def __init__(self, vocab: int = 256, width: int = 128) -> None:
        super().__init__()
        self.vocab, self.width = vocab, width
        self.net = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = MLP(self.vocab, self.width)
        mesh = self.device_mesh  # dims ("pp", "dp", "cp", "tp"); "dp_cp" is the flattened dp x cp
        parallelize_module(self.net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        apply_fsdp(self.net, mesh["dp_cp"], zero_stage=3, blocks=[])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0)
    ids = torch.randint(0, 256, (256, 17))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)
    strategy = FourDStrategy(tensor_parallel_size=2, zero_stage=3)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False
    )
    trainer.fit(MLPLM(), loader)


if __name__ == "__main__":
    main()
