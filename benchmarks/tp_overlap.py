"""``tensor_parallel_overlap`` on CPU: step time of tp2 and tp4 (sequence parallel) with the tp projections as rings
of send/recv steps overlapped with the matmuls, against the all-gather / reduce-scatter projections, side by side.

The model is the ``small`` preset (6 layers, hidden 256, 8 heads / 4 kv heads, FFN 688, vocabulary 256), trained
``--steps`` AdamW steps on the embedded corpus (``LMDataModule``: s=256, global batch 4, the same windows in the
same order, ``init_seed=7`` weights) in ``tp`` CPU processes (one ``torchrun`` per tp size, gloo,
``OMP_NUM_THREADS=1``, 32-true) under ``FourDStrategy(tensor_parallel_size=tp, zero_stage=0)`` (sp on, the default)
with ``tensor_parallel_overlap`` False and True, several fits in the one process group. Each round runs both,
alternating which goes first, so that a slow phase of the machine hits both; a fit's step time is the median of its
steps after ``--warmup`` (rank 0's wall clock from ``on_train_batch_start`` to ``on_train_batch_end``: forward,
backward and the optimizer step); the table gives the median over rounds and the paired ratio (median over rounds
of on / off of the same round). The losses of the two must agree (the ring computes the same sums in another order).

What to expect on CPU: gloo's send/recv run on the CPU cores that also do the matmuls, so there is little to overlap
with, and the ring issues ``t`` smaller matmuls and ``2(t-1)`` point-to-point messages per projection instead of one
collective; on a GPU (NCCL on its own stream or torch's symmetric-memory fused operators) the transfers run beside the
matmuls (torchtitan's async TP: llama3 8B on 64 H100, 4,378 -> 4,809 tokens/s/GPU).

Beside the CPU timings, the table gives what the planner's step-time model predicts for the same shapes (the
``small`` model, s=256, b=4, tp, ZeRO 0; bf16 on an H100-80GB, tp inside one node):
the exposed-communication fraction of the step (:class:`~lightning_4d.planning.step_time.StepTime`'s
``exposed_communication / total``, the planner's ``communication_fraction``) with the overlap off and on, and the
predicted on / off step time (``lightning_4d/planning/step_time.py``, **Tensor parallel**).

Usage::

    python benchmarks/tp_overlap.py [--rounds 3] [--steps 8] [--warmup 2] [--tp 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ_LENGTH, GLOBAL_BATCH = 256, 4


# ---------------------------------------------------------------------------------------------------- worker side
def _fit(tp: int, overlap: bool, steps: int) -> dict[str, Any]:
    """One fit on this rank: per-step wall times and losses."""
    import lightning as L

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.models import LlamaConfig
    from lightning_4d.tasks import CausalLMModule

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    L.seed_everything(0, verbose=False)
    dm = LMDataModule(
        seq_length=SEQ_LENGTH,
        micro_batch_size=GLOBAL_BATCH,
        global_batch_size=GLOBAL_BATCH,
        train_samples=GLOBAL_BATCH * steps,
        val_samples=GLOBAL_BATCH,
        seed=1234,
    )
    module = CausalLMModule(LlamaConfig.from_preset("small"), warmup_steps=2, max_steps=steps, init_seed=7)
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=tp,
        strategy=FourDStrategy(
            tensor_parallel_size=tp, zero_stage=0, tensor_parallel_overlap=overlap, process_group_backend="gloo"
        ),
        max_steps=steps,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(module, dm)
    return {"times": timer.times, "losses": timer.losses}


def worker(tp: int, rounds: int, steps: int, out: Path) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    results: dict[str, list] = {"off": [], "on": []}
    for r in range(rounds):
        for overlap in (False, True) if r % 2 == 0 else (True, False):
            results["on" if overlap else "off"].append(_fit(tp, overlap, steps))
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- parent side
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker", nargs=2, metavar=("TP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.rounds, args.steps, Path(args.worker[1]))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            out = Path(tmp) / f"tp{tp}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={tp}",
                "--standalone",
                __file__,
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
                "--worker",
                str(tp),
                str(out),
            ]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            results[tp] = json.loads(out.read_text())
    _table(results, args, time.perf_counter() - t0)


def predicted(tp: int) -> dict[str, float]:
    """The step-time model's prediction for the benchmark's shapes on an H100-80GB: ``{"off": exposed-communication
    fraction with the overlap off, "on": with it on, "ratio": predicted step time on / off}``."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.hardware import GPU_PRESETS
    from lightning_4d.planning.step_time import predict_step_time

    cfg, gpu = LlamaConfig.from_preset("small"), GPU_PRESETS["H100-80GB"]
    times = {}
    for overlap in (False, True):
        pc = ParallelConfig(
            data_parallel_size=1, tensor_parallel_size=tp, zero_stage=0, tensor_parallel_overlap=overlap
        )
        times["on" if overlap else "off"] = predict_step_time(cfg, pc, GLOBAL_BATCH, 1, SEQ_LENGTH, gpu, 8)
    out = {k: t.exposed_communication / t.total for k, t in times.items()}
    out["ratio"] = times["on"].total / times["off"].total
    return out


def _table(results: dict[int, dict[str, list]], args: argparse.Namespace, wall: float) -> None:
    import torch

    print(
        f"small (6 layers, h 256), s={SEQ_LENGTH}, batch {GLOBAL_BATCH}, tp CPU processes (gloo), 32-true, sp on, "
        f"ZeRO 0, {args.rounds} rounds x {args.steps} steps (median after {args.warmup} warm-up steps); "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {wall:.0f} s in all"
    )
    print()
    print(
        "| tp | overlap off: s/step (per round) | overlap on: s/step (per round) | on / off (paired) "
        "| max rel loss diff | H100 predicted: exposed comm. off / on | H100 predicted on / off |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tp, res in results.items():
        per_round = {k: [statistics.median(f["times"][args.warmup :]) for f in fits] for k, fits in res.items()}
        paired = statistics.median(b / a for a, b in zip(per_round["off"], per_round["on"]))
        cells = {k: f"{statistics.median(v):.3f} ({', '.join(f'{t:.3f}' for t in v)})" for k, v in per_round.items()}
        ref = res["off"][0]["losses"]
        diff = max(abs(a - b) / abs(a) for f in res["on"] for a, b in zip(ref, f["losses"]))
        pred = predicted(tp)
        print(
            f"| {tp} | {cells['off']} | {cells['on']} | {paired:.3f} | {diff:.1e} "
            f"| {100 * pred['off']:.1f}% / {100 * pred['on']:.1f}% | {pred['ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
