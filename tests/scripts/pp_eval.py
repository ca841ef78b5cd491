"""Validation, prediction (and, without pp, greedy generation) through a pipeline or under context parallelism:
``trainer.validate`` and ``trainer.predict`` of an untrained tiny
Llama (same init seed, so the same weights on every layout) with the layout given, writing ``val_loss`` and the
logits (on the ranks that hold the last stage) to ``--out``.

Usage: ``torchrun --nproc-per-node 2 tests/scripts/pp_eval.py --out DIR --pp 2`` (or ``--cp 2 --method ring``) or
``python ... --pp 1`` (plain
Lightning, one process: the reference). ``--tp``, ``--dp`` set those sizes (default dp: the rest of the world);
``--validate-only`` skips prediction and generation (``val_loss`` / ``val_ppl`` only, ``tests/test_val_metrics.py``).
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
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--method", default="ring")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--validate-only", action="store_true")
    parser.add_argument("--val-samples", type=int, default=8)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    m = 2
    cfg = LlamaConfig.from_preset("tiny-test", num_layers=4)
    module = CausalLMModule(cfg, init_seed=7)
    if world > 1:
        dp = args.dp if args.dp is not None else world // (args.pp * args.cp * args.tp)
        strategy = FourDStrategy(
            pipeline_parallel_size=args.pp,
            context_parallel_size=args.cp,
            context_parallel_method=args.method,
            data_parallel_size=dp,
            tensor_parallel_size=args.tp,
            zero_stage=0,
            pipeline_schedule=args.schedule,
            num_microbatches=m if args.pp > 1 else None,
            process_group_backend="gloo",
            timeout=timedelta(seconds=120),
        )
        micro = 2 if args.pp > 1 else 2 * m
    else:
        strategy, micro = "auto", 2 * m  # the same sequences per batch as the pipeline's m micro-batches
    dm = LMDataModule(seq_length=32, micro_batch_size=micro, val_samples=args.val_samples, seed=1234)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world if strategy != "auto" else 1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (result,) = trainer.validate(module, dm)
    rank = trainer.global_rank
    if args.validate_only:
        record = {"val_loss": result["val_loss"], "val_ppl": result["val_ppl"], "rank": rank}
        (out / f"eval_rank{rank}.json").write_text(json.dumps(record))
        if torch.distributed.is_initialized():
            # every rank done with its collectives before any tears its group down (one CI run: rank 1 of cp2 x dp2
            # aborted in gloo's teardown, "terminate called without an active exception", after a correct result)
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        return
    ids = torch.randint(0, cfg.vocab_size, (8, 32), generator=torch.Generator().manual_seed(3))
    loader = DataLoader([{"input_ids": ids[i]} for i in range(8)], batch_size=2 * m)
    predictions = trainer.predict(module, loader)
    record = {"val_loss": result["val_loss"], "rank": rank}
    if args.pp == 1:
        divisor = strategy.parallel_config.sequence_divisor if strategy != "auto" else 1
        record["generated"] = module.generate(list(b"def main("), 6, pad_to_multiple_of=divisor)
    (out / f"eval_rank{rank}.json").write_text(json.dumps(record))
    if predictions and predictions[0] is not None:
        torch.save(torch.cat(predictions), out / f"logits_rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
