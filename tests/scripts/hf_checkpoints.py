"""Hugging Face weights in and out under parallel layouts (tests/test_hf_checkpoints.py).

``--mode import --hf DIR``: for each layout, ``CausalLMModule(model_config=DIR, init_from=DIR)`` under
``FourDStrategy`` predicts the logits of the ids in ``--ids`` (a ``torch.save``d LongTensor ``[n, s]``); each rank
saves ``(ids, logits)`` pairs it produced to ``OUT/import<i>_rank<r>.pt``.
``--mode export``: for each layout, train 3 steps of the tiny-test model (4 heads, 2 kv heads; ``--model tiny-moe``:
the tiny Mixture-of-Experts model, exported as a Mixtral), save a checkpoint,
predict the logits of ``--ids``, and on rank 0 ``export_hf`` the checkpoint to ``OUT/export<i>``; pairs go to
``OUT/export<i>_rank<r>.pt``.
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
from torch.utils.data import DataLoader  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.export_hf import export_hf  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


class Pairs(L.Callback):
    def __init__(self) -> None:
        self.pairs: list = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is not None:  # under cp the batch arrives as this rank's zigzag shard: the full sequence back
            self.pairs.append((pl_module._gather_sequence(batch).cpu(), outputs.float().cpu()))


def strategy(layout: dict) -> FourDStrategy:
    return FourDStrategy(
        data_parallel_size=layout.get("dp", 1),
        tensor_parallel_size=layout.get("tp", 1),
        pipeline_parallel_size=layout.get("pp", 1),
        context_parallel_size=layout.get("cp", 1),
        context_parallel_method=layout.get("method", "ring"),
        zero_stage=layout.get("zero", 1),
        num_microbatches=layout.get("m"),
        expert_parallel_size=layout.get("ep", 1),
        process_group_backend="gloo",
        timeout=timedelta(seconds=120),
    )


def predict(module: L.LightningModule, layout: dict, ids: torch.Tensor, world: int) -> list:
    pairs = Pairs()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy(layout),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pairs],
    )
    trainer.predict(module, dataloaders=DataLoader(ids, batch_size=layout.get("b", 2)), return_predictions=False)
    return pairs.pairs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["import", "export"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--hf", default=None)
    parser.add_argument("--model", default="tiny-test", help="--mode export: the preset trained (tiny-moe: Mixtral)")
    args = parser.parse_args()
    out, ids = Path(args.out), torch.load(args.ids)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for i, layout in enumerate(json.loads(args.layouts)):
        L.seed_everything(0, verbose=False)
        if args.mode == "import":
            module = CausalLMModule(model_config=args.hf, init_from=args.hf)
            torch.save(predict(module, layout, ids, world), out / f"import{i}_rank{rank}.pt")
            continue
        from lightning.pytorch.callbacks import ModelCheckpoint

        config = LlamaConfig.from_preset(args.model, norm_eps=1e-6)
        module = CausalLMModule(config, learning_rate=1e-2, warmup_steps=1, max_steps=3, init_seed=3)
        dm = LMDataModule(
            seq_length=32,
            micro_batch_size=8 // (layout.get("dp", 1) * layout.get("m", 1)),
            global_batch_size=8,
            train_samples=24,
            val_samples=8,
            seed=1,
        )
        ckpt_dir = out / f"ckpt{i}"
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy(layout),
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
        )
        trainer.fit(module, dm)
        torch.save(predict(module, layout, ids, world), out / f"export{i}_rank{rank}.pt")
        if rank == 0:
            export_hf(ckpt_dir / "last.ckpt", out / f"export{i}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
