"""One training step of the tiny Llama with document masking under several layouts; every rank records the logged
loss and the full gradient (averaged over dp x cp, before the optimizer step) of every parameter it holds (under pp
its stage's) per layout.

The global batch is fixed (:func:`packed_batch`, shared with the test's one-process reference): documents of
several lengths packed into windows, ended by EOS, straddling every cp chunk and dp shard. ZeRO 0, float32.

Usage: ``torchrun --nproc-per-node N tests/scripts/document_masking.py --out DIR --layouts JSON`` with layouts
``{"dp": 2}``, ``{"tp": 2}``, ``{"cp": 2, "method": "ring"}``, ``{"pp": 2}`` (1F1B, 2 micro-batches), ... (dp, tp,
pp, cp, method, sp). Writes
``DIR/layout<i>_rank<r>.pt``: ``{"loss": float, "grads": {canonical name: full gradient}}``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.models.llama import canonical_name  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

EOS = 0
SEQ = 32
GLOBAL_BATCH = 4
MODEL = "tiny-test"
INIT_SEED = 7


def packed_batch() -> torch.Tensor:
    """``LongTensor [GLOBAL_BATCH, SEQ + 1]``: windows of packed documents (EOS = 0 ends each): documents of 1 to 20
    tokens, one window that is a single document, one whose first token is an EOS (a document's end)."""
    g = torch.Generator().manual_seed(11)
    windows = torch.randint(1, 250, (GLOBAL_BATCH, SEQ + 1), generator=g)
    for i, ends in enumerate([(2, 3, 9, 17, 30), (), (0, 13, 14, 27), (6, 15, 16, 24, 32)]):
        for e in ends:
            windows[i, e] = EOS
    return windows


class _Windows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.windows = packed_batch()

    def __len__(self) -> int:
        return GLOBAL_BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i, :-1], "labels": self.windows[i, 1:]}


class _Record(L.Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.loss = float("nan")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for name, p in pl_module.named_parameters():  # under pp: this rank's stage's
            g = p.grad
            if g is not None:
                self.grads[canonical_name(name)] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(trainer.callback_metrics["train_loss"])


def run(layout: dict, out: Path, index: int, world: int) -> None:
    dp = layout.get("dp", 1)
    strategy = FourDStrategy(
        tensor_parallel_size=layout.get("tp", 1),
        pipeline_parallel_size=layout.get("pp", 1),
        pipeline_schedule="1f1b",
        num_microbatches=2 if layout.get("pp", 1) > 1 else None,
        context_parallel_size=layout.get("cp", 1),
        context_parallel_method=layout.get("method", "ring"),
        sequence_parallel=layout.get("sp"),
        zero_stage=0,
        memory_check=False,
    )
    module = CausalLMModule(MODEL, learning_rate=1e-3, warmup_steps=0, init_seed=INIT_SEED, document_masking=True,
                            eos_token_id=EOS)  # fmt: skip
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=1,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=DataLoader(_Windows(), batch_size=GLOBAL_BATCH // dp))
    torch.save({"loss": record.loss, "grads": record.grads}, out / f"layout{index}_rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for index, layout in enumerate(json.loads(args.layouts)):
        run(layout, out, index, world)


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
