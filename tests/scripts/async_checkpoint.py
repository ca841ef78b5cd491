"""Asynchronous checkpoints (tests/test_async_checkpoint.py): train the tiny-test model on 2 CPU ranks (gloo) with a
``ModelCheckpoint`` after every step, once with synchronous saves and once with ``async_checkpoint=True``, per
layout, in one launch; then a run whose background write fails on rank 1.

- ``--write-delay S``: every shard write sleeps S seconds first (in the writer's thread), so that training has
  changed the parameters and optimizer states before an asynchronous save writes them.
- Per run, rank 0 writes ``OUT/<name>.json``: the losses by step, and (async runs) the events of rank 0 in
  ``time.perf_counter`` seconds: ``staged`` (a save's staging began, after waiting for the previous one: its path),
  ``renamed`` (a folder renamed into place), ``step_end`` (a training step ended), and each save's blocking seconds.
- The failing run (``fail``, the first layout): the 4th save's write (``last.ckpt`` of step 2) raises on rank 1; the
  run is expected to fail at the next save with the RuntimeError of ``AsyncSaves.wait``, recorded as ``error``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402

import lightning_4d.checkpoint as ckpt_module  # noqa: E402
from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
EVENTS: list[list] = []
WRITES = {"n": 0, "fail_at": None, "delay": 0.0}

_real_write = FileSystemWriter.write_data
_real_rename = ckpt_module._rename_into_place
_real_start = ckpt_module.AsyncSaves.start


def _write_data(self, plan, planner):  # the writer's thread
    WRITES["n"] += 1
    if WRITES["fail_at"] is not None and WRITES["n"] == WRITES["fail_at"] and RANK == 1:
        raise OSError("injected write failure (tests/scripts/async_checkpoint.py)")
    time.sleep(WRITES["delay"])
    return _real_write(self, plan, planner)


def _rename(tmp: Path, path: Path) -> None:
    _real_rename(tmp, path)
    EVENTS.append(["renamed", time.perf_counter(), path.name])


def _start(self, state, tmp, path, global_rank):
    self.wait()  # as start does first: the event marks the staging, after the previous save completed
    EVENTS.append(["staged", time.perf_counter(), path.name])
    _real_start(self, state, tmp, path, global_rank)
    EVENTS.append(["blocking", self.last_blocking_s, path.name])


FileSystemWriter.write_data = _write_data
ckpt_module._rename_into_place = _rename
ckpt_module.AsyncSaves.start = _start


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        EVENTS.append(["step_end", time.perf_counter(), trainer.global_step])


def fit(out: Path, name: str, layout: dict, asynchronous: bool, steps: int) -> None:
    EVENTS.clear()
    WRITES["n"] = 0
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny-test", learning_rate=1e-3, warmup_steps=2, max_steps=steps, init_seed=7)
    dm = LMDataModule(seq_length=32, micro_batch_size=4, global_batch_size=4 * layout.get("dp", 1), seed=1234)
    strategy = FourDStrategy(
        data_parallel_size=layout.get("dp", 1),
        tensor_parallel_size=layout.get("tp", 1),
        zero_stage=layout["zero"],
        async_checkpoint=asynchronous,
        process_group_backend="gloo",
        timeout=timedelta(seconds=120),
    )
    record = Record()
    # every step: step=<k>.ckpt, then last.ckpt (two saves, the second waiting for the first when asynchronous)
    every = ModelCheckpoint(dirpath=out / name, filename="{step}", save_top_k=-1, every_n_train_steps=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[record, every],
    )
    error = None
    try:
        trainer.fit(module, dm)
    except RuntimeError as e:
        error = str(e)
    if RANK == 0:
        result = {"losses": record.losses, "events": EVENTS, "error": error}
        (out / f"{name}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--write-delay", type=float, default=0.0)
    parser.add_argument("--layouts", default='[{"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"tp": 2, "zero": 1}]')
    args = parser.parse_args()
    out = Path(args.out)
    for i, layout in enumerate(json.loads(args.layouts)):
        fit(out, f"sync{i}", layout, False, args.steps)
        WRITES["delay"] = args.write_delay
        fit(out, f"async{i}", layout, True, args.steps)
        WRITES["delay"] = 0.0
    WRITES["fail_at"] = 4
    fit(out, "fail", json.loads(args.layouts)[0], True, args.steps)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
