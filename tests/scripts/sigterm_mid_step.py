"""SIGTERM to every rank in the middle of a training step (tests/test_preemption.py), as ``srun`` signals each task
of a preempted job: pp2 on 2 gloo ranks, the tiny-test Llama, the last stage sleeping 1 s before each stage forward
(so when the signal lands, the first stage waits in a pipeline receive and the last one sleeps in Python). At the
start of training batch 3 each rank signals itself 0.5 s later (a timer thread).

Usage: ``torchrun --nproc-per-node 2 tests/scripts/sigterm_mid_step.py --out DIR [--layout pp|dp]``; each rank
writes ``rank<r>.json``: the type of what ``trainer.fit`` raised and the seconds from its SIGTERM to then.
``--layout dp``: dp2 ZeRO 1 instead, rank 1 sleeping before its forward (rank 0 waits in the gradient reduction).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
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

#: each rank's process group timeout (s): a deadlock ends on gloo's timeout after it
TIMEOUT_S = 30
SIGNALLED: list[float] = []


def _sleep(*_):
    time.sleep(1.0)


class SignalMidStep(L.Callback):
    def __init__(self, layout: str):
        self.layout = layout

    def on_train_start(self, trainer, pl_module):
        if self.layout == "pp" and trainer.strategy.mesh.pp.get_local_rank() == 1:
            trainer.strategy.pipeline.stages[0].submod.register_forward_pre_hook(_sleep)
        if self.layout == "dp" and trainer.global_rank == 1:
            pl_module.register_forward_pre_hook(_sleep)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 3:

            def signal_self():
                SIGNALLED.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGTERM)

            threading.Timer(0.5, signal_self).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", choices=["pp", "dp"], default="pp")
    args = parser.parse_args()
    sizes = {"pp": {"pipeline_parallel_size": 2, "num_microbatches": 2}, "dp": {"zero_stage": 1}}[args.layout]
    strategy = FourDStrategy(**sizes, process_group_backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=50,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[SignalMidStep(args.layout)],
    )
    module = CausalLMModule(LlamaConfig.from_preset("tiny-test"), init_seed=7)
    dm = LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, train_samples=400, seed=1234)
    record = {"raised": None}
    try:
        trainer.fit(module, dm)
    except BaseException as error:  # SIGTERMException is a SystemExit
        record = {"raised": type(error).__name__, "message": str(error)[:500]}
    record["after_signal_s"] = time.monotonic() - SIGNALLED[0] if SIGNALLED else None
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    exit_distributed_process(0)
