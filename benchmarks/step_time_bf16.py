"""CPU step time of the ``small`` preset under dp=2 ZeRO 1 ``bf16-mixed``: this checkout against a git revision, side
by side in one run.

Both trees run the same timing script (embedded below) as ``torchrun --nproc-per-node 2`` subprocesses with their
own ``PYTHONPATH``, alternating (baseline, ours, baseline, ours, ...) so that a slow phase of the machine hits both;
each run trains ``--steps`` optimizer steps (s=256, micro-batch 4, global batch 8, gloo) and reports the step times
after ``--warmup`` steps. The table gives the median step time of every round and the ratio ours / baseline of the
medians over all rounds (below 1: faster).

Usage::

    python benchmarks/step_time_bf16.py --baseline aa06e35 [--rounds 3] [--steps 12]

``aa06e35`` is the last revision with Lightning's autocast for our models (fp32 weights); the ratio is what issue 12
asks to be at most 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_TIMING_SCRIPT = r"""
import json, os, sys, time
import lightning as L
from lightning_4d import FourDStrategy
from lightning_4d.data import LMDataModule
from lightning_4d.models import LlamaConfig
from lightning_4d.tasks import CausalLMModule

steps, out = int(sys.argv[1]), sys.argv[2]


class Timer(L.Callback):
    def __init__(self):
        self.times, self.t0 = [], 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)


L.seed_everything(0, verbose=False)
dm = LMDataModule(seq_length=256, micro_batch_size=4, global_batch_size=8, train_samples=8 * steps, val_samples=8,
                  seed=1234)
module = CausalLMModule(LlamaConfig.from_preset("small"), learning_rate=1e-3, warmup_steps=2, max_steps=steps)
timer = Timer()
trainer = L.Trainer(accelerator="cpu", devices=2, precision="bf16-mixed", max_steps=steps, logger=False,
                    strategy=FourDStrategy(data_parallel_size=2, zero_stage=1, process_group_backend="gloo"),
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer])
trainer.fit(module, dm)
if trainer.global_rank == 0:
    with open(out, "w") as f:
        json.dump({"times": timer.times, "loss": float(trainer.callback_metrics["train_loss"])}, f)
"""


def run(tree: Path, steps: int, workdir: Path, tag: str) -> dict:
    """One timed run of the package in ``tree``; returns ``{"times": [s per step], "loss": last train_loss}``."""
    script = workdir / "timing.py"
    script.write_text(_TIMING_SCRIPT)
    out = workdir / f"{tag}.json"
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533"]
    subprocess.run(
        [*torchrun, str(script), str(steps), str(out)],
        env=env,
        check=True,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="REF", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "baseline"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(base), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            medians: dict[str, list[float]] = {"baseline": [], "ours": []}
            losses: dict[str, float] = {}
            print(f"{'round':>5} {'baseline s/step':>16} {'ours s/step':>12} {'ratio':>6}")
            for r in range(args.rounds):
                for name, tree in (("baseline", base), ("ours", root)):
                    result = run(tree, args.steps, work, f"{name}{r}")
                    medians[name].append(statistics.median(result["times"][args.warmup :]))
                    losses[name] = result["loss"]
                print(
                    f"{r:>5} {medians['baseline'][-1]:>16.3f} {medians['ours'][-1]:>12.3f} "
                    f"{medians['ours'][-1] / medians['baseline'][-1]:>6.2f}"
                )
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(base)], check=True, capture_output=True
            )
    ratio = statistics.median(medians["ours"]) / statistics.median(medians["baseline"])
    print(
        f"\nmedian step time: baseline {statistics.median(medians['baseline']):.3f} s, ours "
        f"{statistics.median(medians['ours']):.3f} s; ratio ours/baseline {ratio:.2f}"
    )
    print(f"last train_loss: baseline {losses['baseline']:.4f}, ours {losses['ours']:.4f}")


if __name__ == "__main__":
    main()
