"""Fit the tiny Llama under FourDStrategy with a MemoryEstimatorCallback against a given device memory.

Each rank writes ``<out>/rank<r>.json``: whether ``configure_model`` was called, and the exception (type and
message) that ``fit`` raised, if any. Usage: ``torchrun --nproc-per-node N memory_check.py --out DIR
--device-memory 1MiB [--dp 2 --tp 1 --zero 0]``.
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

from lightning_4d import FourDStrategy, MemoryEstimatorCallback  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


class Module(CausalLMModule):
    configure_model_called = False

    def configure_model(self) -> None:
        Module.configure_model_called = True
        super().configure_model()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device-memory", required=True)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dm = LMDataModule(seq_length=64, micro_batch_size=2, global_batch_size=2 * args.dp, train_samples=32,
                      val_samples=4)
    module = Module("tiny-test", learning_rate=1e-3, warmup_steps=1, max_steps=2)
    callback = MemoryEstimatorCallback(device_memory=args.device_memory, budget=0.8)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=FourDStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp, zero_stage=args.zero,
                               process_group_backend="gloo", timeout=timedelta(seconds=60)),
        callbacks=[callback],
    )
    error = None
    try:
        trainer.fit(module, dm)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = {"type": type(exc).__name__, "message": str(exc), "is_runtime_error": isinstance(exc, RuntimeError)}
    rank = int(os.environ.get("RANK", "0"))
    estimate = callback.estimate.to_dict() if callback.estimate is not None else None
    record = {"configure_model_called": Module.configure_model_called, "error": error, "estimate": estimate}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
