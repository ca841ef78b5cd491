"""Fit a Llama under FourDStrategy with a MemoryEstimatorCallback against a given device memory.

Each rank writes ``<out>/rank<r>.json``: whether ``configure_model`` was called, the exception (type and message)
that ``fit`` raised, if any, the estimate, the module's parameter count after ``fit`` and this process's peak RSS
(``ru_maxrss``, bytes) just before ``fit`` and after it. Usage: ``torchrun --nproc-per-node N memory_check.py --out DIR
--device-memory 1MiB [--dp 2 --tp 1 --zero 0]``; ``--model llama3-70b --data plain --dp 1 --seq-length 4096
--micro-batch-size 1 --max-data-gib 4`` is a new user's fit: a plain DataLoader of ``{"input_ids", "labels"}`` batches
(no DataModule, no shape arguments), with the data segment capped (RLIMIT_DATA) so that a check that lets the model
through fails with an allocation error instead of filling the machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_4d import FourDStrategy, MemoryEstimatorCallback  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


class Module(CausalLMModule):
    configure_model_called = False

    def configure_model(self) -> None:
        Module.configure_model_called = True
        super().configure_model()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device-memory", required=True)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--model", default="tiny-test")
    parser.add_argument("--data", choices=("lm", "plain"), default="lm")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--max-data-gib", type=float, default=None)
    args = parser.parse_args()
    if args.max_data_gib is not None:
        limit = int(args.max_data_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    b, s = args.micro_batch_size, args.seq_length
    if args.data == "lm":
        data = dict(
            datamodule=LMDataModule(
                seq_length=s, micro_batch_size=b, global_batch_size=b * args.dp, train_samples=32, val_samples=4
            )
        )
    else:
        samples = [{"input_ids": torch.randint(0, 256, (s,)), "labels": torch.randint(0, 256, (s,))} for _ in range(4)]
        data = dict(train_dataloaders=DataLoader(samples, batch_size=b))
    module = Module(args.model, learning_rate=1e-3, warmup_steps=1, max_steps=2)
    callback = MemoryEstimatorCallback(device_memory=args.device_memory, budget=0.8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        strategy=FourDStrategy(
            data_parallel_size=args.dp,
            tensor_parallel_size=args.tp,
            zero_stage=args.zero,
            process_group_backend="gloo",
            timeout=timedelta(seconds=60),
        ),
        callbacks=[callback],
    )
    before = peak_rss()
    error = None
    try:
        trainer.fit(module, **data)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = {"type": type(exc).__name__, "message": str(exc), "is_runtime_error": isinstance(exc, RuntimeError)}
    rank = int(os.environ.get("RANK", "0"))
    estimate = callback.estimate.to_dict() if callback.estimate is not None else None
    record = {
        "configure_model_called": Module.configure_model_called,
        "error": error,
        "estimate": estimate,
        "parameters": sum(p.numel() for p in module.parameters()),
        "peak_rss_before": before,
        "peak_rss_after": peak_rss(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
