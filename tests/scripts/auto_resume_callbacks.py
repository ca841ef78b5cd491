"""Callbacks for ``tests/test_auto_resume.py``'s ``lightning-4d fit`` under ``torchrun --max-restarts 1`` (named in
its YAML by class path; ``tests/`` is on ``PYTHONPATH``): record each step's loss with the restart it ran in, and
kill one rank once, mid-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L


class RecordLosses(L.Callback):
    """Append ``[restart, global_step, train_loss]`` per training step to ``<out>/losses_rank<r>.jsonl``
    (``restart``: torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        record = [restart, trainer.global_step, float(trainer.callback_metrics["train_loss"])]
        with (self.out / f"losses_rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


class KillOnce(L.Callback):
    """Global rank ``rank`` leaves with ``os._exit(1)`` (no cleanup, as a crashed process) at the start of the step
    after ``step`` optimizer steps, the first time only (``marker``: the file that says it happened); ``step`` < 0:
    never."""

    def __init__(self, marker: str, rank: int = 1, step: int = -1) -> None:
        self.marker, self.rank, self.step = Path(marker), rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not self.marker.exists():
            self.marker.write_text(str(self.step))
            os._exit(1)
