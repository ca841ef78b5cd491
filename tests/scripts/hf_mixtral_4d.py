"""A LightningModule holding a Hugging Face ``transformers.MixtralForCausalLM`` (tiny config, random init with a fixed
seed, no download), trained ``--steps`` AdamW steps under each layout of ``--layouts`` (``FourDStrategy``: dp, ZeRO,
ep), or with plain Lightning on one process (``--reference``). Per layout, rank 0 writes the per-step ``train_loss``,
the final full weights and the local shape of one expert weight to ``OUT/hf<i>.pt``
(lightning_4d/features/moe/hf_mixtral.py)."""

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
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_4d.data import LMDataModule  # noqa: E402

EXPERT = "model.layers.0.mlp.experts.gate_up_proj"


def reference_model(aux: bool) -> "transformers.MixtralForCausalLM":
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
    )
    return transformers.MixtralForCausalLM(config).float()


class HFMixtralLM(L.LightningModule):
    """What a user writes: the model from transformers, its loss on our data's shifted labels, AdamW."""

    def __init__(self, aux: bool) -> None:
        super().__init__()
        self.aux = aux
        self.model = reference_model(aux)

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"])
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten())
        self.log("train_loss", loss, sync_dist=True)
        if self.aux:  # transformers' load-balancing loss of this rank's tokens (as under DDP)
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", default="[]")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--aux", action="store_true", help="the reference with the model's load-balancing loss")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layouts = [{"reference": True, "aux": args.aux}] if args.reference else json.loads(args.layouts)
    for i, layout in enumerate(layouts):
        L.seed_everything(0, verbose=False)
        dp = layout.get("dp", 1)
        dm = LMDataModule(
            seq_length=32,
            micro_batch_size=8 // dp,
            global_batch_size=8,
            train_samples=8 * args.steps,
            val_samples=8,
            seed=1234,
        )
        if args.reference:
            strategy = "auto"
        else:
            from lightning_4d import FourDStrategy

            strategy = FourDStrategy(
                data_parallel_size=dp,
                zero_stage=layout.get("zero", 1),
                expert_parallel_size=layout.get("ep", 1),
                process_group_backend="gloo",
                timeout=timedelta(seconds=120),
            )
        losses: list[float] = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(trainer.callback_metrics["train_loss"]))

        trainer = L.Trainer(
            accelerator="cpu",
            devices=1 if args.reference else world,
            strategy=strategy,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[Record()],
        )
        module = HFMixtralLM(aux=bool(layout.get("aux")))
        trainer.fit(module, dm)
        params = dict(module.model.named_parameters())
        weights = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
            for n, p in params.items()
        }
        expert = params[EXPERT]
        if trainer.global_rank == 0:
            torch.save(
                {
                    "layout": layout,
                    "losses": losses,
                    "weights": weights,
                    "expert_local_shape": tuple((expert.to_local() if isinstance(expert, DTensor) else expert).shape),
                    "experts": type(module.model.model.layers[0].mlp.experts).__name__,
                },
                Path(args.out) / ("reference.pt" if args.reference else f"hf{i}.pt"),
            )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
