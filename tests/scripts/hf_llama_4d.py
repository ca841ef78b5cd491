"""A LightningModule holding a Hugging Face ``transformers.LlamaForCausalLM`` (tiny config, random init with a fixed
seed, no download), trained ``--steps`` AdamW steps under each layout of ``--layouts`` (``FourDStrategy``), or with
plain Lightning on one process (``--reference``). Per layout, rank 0 writes the per-step ``train_loss`` and the final
full weights to ``OUT/hf<i>.pt``. (lightning_4d/adapters/hf_llama.py)"""

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

from lightning_4d.contract import layout_strategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.parallel._compat.compile import compiled_graph_count  # noqa: E402
from tests import _collectives  # noqa: E402

_collectives.record()  # each rank's collectives, checked by the test (tests/_collectives.py)


def reference_model() -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).float()


class HFLlamaLM(L.LightningModule):
    """What a user writes: the model from transformers, its logits, our data's shifted labels, AdamW."""

    def __init__(self, init_from: str | None = None) -> None:
        super().__init__()
        self.init_from = init_from  # a Hugging Face directory: built on meta in configure_model, loaded by the strategy
        self.model = None
        if init_from is None:
            self.model = reference_model()

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.init_from)
            with torch.device("meta"):
                self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        layout = layout_strategy(self.trainer.strategy)
        pipeline = layout.pipeline if layout is not None else None
        if pipeline is not None:  # pp: the schedule runs forward and backward of every micro-batch here
            loss = pipeline.train_step(batch["input_ids"], batch["labels"])
        else:
            logits = self.model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", default="[]")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layouts = [{"reference": True}] if args.reference else json.loads(args.layouts)
    # each rank its own copy of the initial weights (no race), written before any process group exists
    # (transformers' save_pretrained writes config.json on the main process only once one does)
    init = Path(args.out) / f"init_rank{os.environ.get('RANK', '0')}"
    if any(layout.get("meta") for layout in layouts):
        reference_model().save_pretrained(init, max_shard_size="400KB")  # two safetensors files + index
    for i, layout in enumerate(layouts):
        L.seed_everything(0, verbose=False)
        dp, m = layout.get("dp", 1), layout.get("m", 1)
        dm = LMDataModule(
            seq_length=32,
            micro_batch_size=8 // (dp * m),
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
                tensor_parallel_size=layout.get("tp", 1),
                zero_stage=layout.get("zero", 1),
                context_parallel_size=layout.get("cp", 1),
                context_parallel_method=layout.get("method", "ring"),
                pipeline_parallel_size=layout.get("pp", 1),
                pipeline_schedule=layout.get("schedule", "1f1b"),
                sequence_parallel=layout.get("sp"),
                gradient_compression=layout.get("compress", "none"),
                activation_offload_layers=layout.get("offload", 0),
                compile=layout.get("compile", False),
                process_group_backend="gloo",
                timeout=timedelta(seconds=_collectives.TIMEOUT_S),
            )
        losses: list[float] = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(trainer.callback_metrics["train_loss"]))

        meter = None
        if layout.get("comm"):  # bytes on the wire per step (lightning_4d.parallel.comm)
            from lightning_4d.parallel.comm import CommMeterCallback

            meter = CommMeterCallback(per_kind=True)

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
            callbacks=[Record(), *([meter] if meter else [])],
        )
        module = HFLlamaLM(str(init) if layout.get("meta") else None)
        graphs = compiled_graph_count()
        trainer.fit(module, dm)
        graphs = compiled_graph_count() - graphs  # graphs Dynamo compiled in this fit (0 if it fell back to eager)
        weights = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
            for n, p in module.model.named_parameters()
        }
        if layout.get("pp", 1) > 1:  # each pipeline rank holds its own layers: every rank saves, the test merges
            torch.save(weights, Path(args.out) / f"hf{i}_weights_rank{trainer.global_rank}.pt")
        if trainer.global_rank == 0:
            split = {
                "dtensor_params": sum(isinstance(p, DTensor) for p in module.model.parameters()),
                "attention": module.model.config._attn_implementation,
                # activation offload: the most host bytes held at once (0: it never ran)
                "host_offloaded": getattr(getattr(trainer.strategy, "offload_stats", None), "peak", 0),
                "compiled_graphs": graphs,
            }
            torch.save(
                {
                    "layout": layout,
                    "losses": losses,
                    "weights": weights,
                    "comm": meter.history if meter else [],
                    **split,
                },
                Path(args.out) / ("reference.pt" if args.reference else f"hf{i}.pt"),
            )


def _out() -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return Path(parser.parse_known_args()[0].out)


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    try:
        main()
    finally:  # a rank that raised writes what it issued too: the test names where the ranks parted
        _collectives.write(_out())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    exit_distributed_process(0)
