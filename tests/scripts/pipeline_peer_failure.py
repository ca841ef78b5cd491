"""Pipeline ranks whose peer is gone (tests/test_pipeline_failures.py): pp2 x tp2 on 4 ranks, the tiny-test Llama.
At the second step, the last stage's tp rank 1 ends its process (``os._exit``, as a rank the kernel's OOM killer
ends: no traceback, its connections closed) as its first micro-batch forward begins; its tp peer, in the same
stage's forward, loses it at a tp collective (inside ``torch.distributed.pipelining``'s forward, which wraps the error
in a message that starts with a blank line), and the first stage's ranks lose their pp peers.

Usage: ``torchrun --nproc-per-node 4 tests/scripts/pipeline_peer_failure.py --out DIR``. Each rank that lives writes
``rank<r>.json``: its pp and tp ranks, the type, message and notes of the error ``trainer.fit`` raised, the type and
message of its cause.
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
from lightning_4d.parallel._compat.process import exit_distributed_process  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


def coordinates(strategy: FourDStrategy) -> tuple[int, int]:
    """This rank's (pp rank, tp rank)."""
    return strategy.mesh.pp.get_local_rank(), strategy.mesh.tp_rank


class EndOneRankInItsSecondStep(L.Callback):
    """The last stage's tp rank 1 ends its process as its first stage forward of step 1 begins."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1 and coordinates(trainer.strategy) == (1, 1):
            stage = trainer.strategy.pipeline.stages[0].submod
            stage.register_forward_pre_hook(lambda *_: os._exit(0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = FourDStrategy(
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        num_microbatches=2,
        zero_stage=0,
        process_group_backend="gloo",
        timeout=timedelta(seconds=60),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[EndOneRankInItsSecondStep()],
    )
    module = CausalLMModule(LlamaConfig.from_preset("tiny-test"), init_seed=7)
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, train_samples=12, seed=1234)
    record: dict = {}
    try:
        trainer.fit(module, dm)
    except Exception as error:  # a peer is gone
        cause = error.__cause__
        record = {
            "type": type(error).__name__,
            "message": str(error),
            "cause_type": type(cause).__name__ if cause is not None else None,
            "cause": str(cause) if cause is not None else None,
            "notes": getattr(error, "__notes__", []),
        }
    record["pp_rank"], record["tp_rank"] = coordinates(strategy)
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    exit_distributed_process(0)  # the peer is gone: no collective on the way out
