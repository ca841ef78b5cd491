"""Expert parallelism on CPU: step time of ep2 against ep1 (every rank holds all experts) on the same Mixture-of-Experts
model, the bytes each rank sends per step and dimension, and the tokens per expert.

The model is the ``small`` preset (6 layers, hidden 256, 8 heads / 4 kv heads, vocabulary 256) with every feed-forward
an MoE layer of 8 experts, top-2, expert width 344 (so the active feed-forward width, 2 x 344, is the dense ``small``'s
688). It trains ``--steps`` AdamW steps on the embedded corpus (``LMDataModule``: s=256, micro-batch 4 per rank, global
batch 8, the same windows in the same order, ``init_seed=7`` weights) in 2 CPU processes (one ``torchrun``, gloo,
``OMP_NUM_THREADS=1``, 32-true) under ``FourDStrategy(data_parallel_size=2, zero_stage=1)`` with
``expert_parallel_size`` 1 and 2, several fits in the one process group. Each round runs both, alternating which goes
first, so that a slow phase of the machine hits both; a fit's step time is the median of its steps after
``--warmup`` (rank 0's wall clock from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward and the
optimizer step), the table the median over rounds and the paired ratio (median over rounds of ep2 / ep1 of the same
round).

Bytes: the first step of every fit runs under :class:`~lightning_4d.parallel.comm.CommMeterCallback` (that step is
left out of the timing: the meter slows it), bytes rank 0 sends per dimension (``dp_cp``: the dense gradients and
the load-balancing counts; ``edp``: the expert gradients over the ranks holding the same experts, absent at ep2 with
dp2 where that group is one rank; ``ep``: the token all-to-alls). Tokens per expert: the ``moe_tokens_per_expert_max``
/ ``_mean`` the training task logs (the busiest expert of the most loaded layer, summed over the 2 ranks; the mean
``T·k/E``), over the timed steps.

Usage::

    python benchmarks/moe.py [--rounds 3] [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ_LENGTH, MICRO_BATCH, WORLD = 256, 4, 2
MODEL = dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=344)


# ---------------------------------------------------------------------------------------------------- worker side
def _fit(ep: int, steps: int) -> dict[str, Any]:
    """One fit at ``ep`` on this rank: per-step wall times, losses, tokens per expert, the metered first step."""
    import lightning as L
    import torch

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.models import LlamaConfig
    from lightning_4d.parallel.comm import CommMeterCallback
    from lightning_4d.tasks import CausalLMModule

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.tokens_max: list[float] = []
            self.tokens_mean: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.t0)
            m = trainer.callback_metrics
            self.losses.append(float(m["train_loss"]))
            self.tokens_max.append(float(m["moe_tokens_per_expert_max"]))
            self.tokens_mean.append(float(m["moe_tokens_per_expert_mean"]))

    L.seed_everything(0, verbose=False)
    global_batch = MICRO_BATCH * WORLD
    dm = LMDataModule(
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=global_batch,
        train_samples=global_batch * steps,
        val_samples=MICRO_BATCH * WORLD,
        seed=1234,
    )
    module = CausalLMModule(LlamaConfig.from_preset("small", **MODEL), warmup_steps=2, max_steps=steps, init_seed=7)
    timer, meter = Timer(), CommMeterCallback(every_n_steps=steps + 1)  # the first step only
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=FourDStrategy(
            data_parallel_size=WORLD, expert_parallel_size=ep, zero_stage=1, process_group_backend="gloo"
        ),
        max_steps=steps,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[meter, timer],
    )
    trainer.fit(module, dm)
    torch.distributed.barrier()
    bytes_first = {k.split("/", 1)[1]: v for k, v in meter.history[0].items() if k.startswith("comm_bytes/")}
    return {
        "times": timer.times[1:],  # the metered first step left out
        "losses": timer.losses,
        "tokens_max": timer.tokens_max,
        "tokens_mean": timer.tokens_mean,
        "bytes": bytes_first,
    }


def worker(rounds: int, steps: int, out: Path) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    results: dict[str, list] = {"1": [], "2": []}
    for r in range(rounds):
        for ep in (1, 2) if r % 2 == 0 else (2, 1):
            results[str(ep)].append(_fit(ep, steps))
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- parent side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per fit (the first is metered)")
    parser.add_argument("--warmup", type=int, default=2, help="timed steps left out of the median")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps, Path(args.worker))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={WORLD}",
            f"--master-port={_free_port()}",
            __file__,
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--worker",
            str(out),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        results = json.loads(out.read_text())
    _table(results, args.warmup, time.perf_counter() - t0, args)


def _table(results: dict[str, list], warmup: int, wall: float, args: argparse.Namespace) -> None:
    import torch

    per_round = {ep: [statistics.median(f["times"][warmup:]) for f in fits] for ep, fits in results.items()}
    paired = statistics.median(b / a for a, b in zip(per_round["1"], per_round["2"]))
    print(
        f"small + 8 experts top-2 (expert width 344), s={SEQ_LENGTH}, micro-batch {MICRO_BATCH} per rank, {WORLD} CPU "
        f"processes (gloo), 32-true, ZeRO 1, {args.rounds} rounds x {args.steps} steps (median after {warmup} "
        f"warm-up steps); torch {torch.__version__}, {os.cpu_count()} CPUs; {wall:.0f} s in all"
    )
    print()
    print(
        "| ep | s/step, median (per round) | ep2 / ep1 (paired) | bytes sent per step, rank 0 "
        "| tokens per expert max / mean |"
    )
    print("| --- | --- | --- | --- | --- |")
    for ep in ("1", "2"):
        fits = results[ep]
        rounds = ", ".join(f"{t:.3f}" for t in per_round[ep])
        nbytes = ", ".join(f"{d} {v:,.0f}" for d, v in sorted(fits[0]["bytes"].items()) if d != "total")
        tmax = statistics.median(x for f in fits for x in f["tokens_max"][1 + warmup :])
        tmean = statistics.median(x for f in fits for x in f["tokens_mean"][1 + warmup :])
        ratio = f"{paired:.3f}" if ep == "2" else "1"
        print(
            f"| {ep} | {statistics.median(per_round[ep]):.3f} ({rounds}) | {ratio} | {nbytes} "
            f"| {tmax:.0f} / {tmean:.0f} |"
        )
    same = all(f["losses"] == results["1"][0]["losses"] for f in results["1"])
    diff = max(abs(a - b) / abs(a) for f in results["2"] for a, b in zip(results["1"][0]["losses"], f["losses"]))
    print()
    print(f"losses: ep1 rounds identical: {same}; ep2 vs ep1, largest relative difference over the steps: {diff:.2e}")


if __name__ == "__main__":
    main()
