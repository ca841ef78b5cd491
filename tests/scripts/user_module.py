"""A LightningModule of the user's own (an MLP regressor), parallelized in ``configure_model`` with the mesh the
strategy exposes, trained 5 steps; writes the per-step losses (rank 0) to ``--out``.

``--zero 0|1``: the user applies nothing; the strategy averages gradients over dp (and shards Adam's states).
``--zero 3``: the user applies ``apply_fsdp`` over ``self.device_mesh["dp_cp"]`` themselves.
"""

import argparse
import json
import os

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_4d import FourDStrategy
from lightning_4d.parallel.fsdp import apply_fsdp

torch.set_num_threads(1)


class Regressor(L.LightningModule):
    def __init__(self, zero: int):
        super().__init__()
        self.zero = zero
        self.net = None

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        if self.zero >= 2 and self._device_mesh is not None:
            apply_fsdp(self.net, self.device_mesh["dp_cp"], self.zero, blocks=[self.net[0], self.net[2]])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        mean = loss.detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mean)
            mean /= torch.distributed.get_world_size()
        self.log("loss", mean)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["loss"]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    sampler_kwargs = {"num_replicas": world, "rank": int(os.environ.get("RANK", "0"))}
    loader = DataLoader(TensorDataset(x, y), batch_size=8 // world)
    if world > 1:
        from torch.utils.data import DistributedSampler

        loader = DataLoader(
            TensorDataset(x, y),
            batch_size=8 // world,
            sampler=DistributedSampler(TensorDataset(x, y), shuffle=False, **sampler_kwargs),
        )
    strategy = FourDStrategy(zero_stage=args.zero, process_group_backend="gloo") if world > 1 else "auto"
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(Regressor(args.zero), loader)
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(losses.values, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears gloo down while another still uses it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
