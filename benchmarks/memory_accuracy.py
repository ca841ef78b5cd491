"""Memory estimate vs ``torch.cuda.max_memory_allocated`` for real training steps on one CUDA GPU.

For each row of a grid of single-GPU layouts (model, micro-batch b, sequence s, ZeRO 0, activation checkpointing,
precision) it runs ``--steps`` optimizer steps of FourDStrategy (world size 1, NCCL) in this process, reads the peak
of PyTorch's allocator and prints it beside ``estimate_memory(...)`` *without* the overhead allowance (the allocator
does not see the CUDA context), with the error in percent (goal: within 5%, required: within 10%).

It also measures the overhead allowance: ``fixed`` = memory the process holds beyond PyTorch's reserved pool
(``total − free − max_memory_reserved``, the CUDA context, cuBLAS and NCCL workspaces) and ``fraction`` = the largest
``max_memory_reserved / max_memory_allocated − 1`` of the grid (allocator fragmentation). With ``--write`` they are
stored under the GPU's name in ``lightning_4d/planning/overhead.json``, which the estimator reads.

Usage (on a CUDA machine)::

    python benchmarks/memory_accuracy.py             # print the table
    python benchmarks/memory_accuracy.py --write     # and record the overhead allowance for this GPU

Without CUDA it says so and exits 0 (it is a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys

import torch

from lightning_4d.planning.workload import Workload

GRID = [
    # (preset, b, s, activation_checkpointing, precision)
    ("llama3.2-1b", 1, 2048, "none", "bf16-mixed"),
    ("llama3.2-1b", 2, 2048, "none", "bf16-mixed"),
    ("llama3.2-1b", 1, 4096, "full", "bf16-mixed"),
    ("llama3.2-1b", 4, 4096, "full", "bf16-mixed"),
    ("llama3.2-1b", 2, 2048, "none", "bf16-true"),
    ("llama3.2-1b", 1, 1024, "none", "32-true"),
    ("small", 8, 2048, "none", "bf16-mixed"),
    ("small", 8, 2048, "full", "32-true"),
]


def run_row(preset: str, b: int, s: int, ac: str, precision: str, steps: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_4d import FourDStrategy, ParallelConfig, estimate_memory
    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.hardware import OverheadAllowance
    from lightning_4d.tasks import CausalLMModule

    cfg = LlamaConfig.from_preset(preset, attention_backend="sdpa")

    class Random(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(steps):
                ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
                yield {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    module = CausalLMModule(cfg, learning_rate=1e-4, warmup_steps=1, max_steps=steps)
    strategy = FourDStrategy(data_parallel_size=1, zero_stage=0, activation_checkpointing=ac, memory_check=False)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(Random(), batch_size=None))
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    fixed = total - free - torch.cuda.memory_reserved()
    est = estimate_memory(
        Workload(cfg, b, s, precision),
        ParallelConfig(data_parallel_size=1, zero_stage=0, activation_checkpointing=ac),
        overhead=OverheadAllowance(0, 0.0, "none"),
    )
    del trainer, module
    gc.collect()
    return {
        "model": preset,
        "b": b,
        "s": s,
        "ac": ac,
        "precision": precision,
        "estimate": est.total,
        "max_allocated": allocated,
        "max_reserved": reserved,
        "fixed": fixed,
        "error_pct": 100 * (est.total / allocated - 1),
        "peak_phase": est.peak_phase,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record the overhead allowance for this GPU")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # internal: run GRID[row], print its JSON
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/memory_accuracy.py needs a CUDA GPU; none is available here. Nothing measured.")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.row is not None:
        print(json.dumps(run_row(*GRID[args.row], steps=args.steps)))
        return 0
    name = torch.cuda.get_device_name()
    rows = []
    print(f"{name}: estimate (without overhead) vs torch.cuda.max_memory_allocated, {args.steps} steps per row")
    print(
        f"{'model':<12}{'b':>3}{'s':>6} {'ckpt':<5}{'precision':<11}{'estimate GiB':>13}{'measured GiB':>13}"
        f"{'error %':>9}  peak phase"
    )
    for i in range(len(GRID)):
        # one process per row: a Trainer leaves tensors behind (measured on an H200: each row in one process
        # measured the rows before it too, 25 -> 49 -> 53 -> 64 GiB), and the CUDA context is each row's own
        proc = subprocess.run(
            [sys.executable, __file__, "--row", str(i), "--steps", str(args.steps)], capture_output=True, text=True
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"row {GRID[i]} failed:\n{proc.stderr[-2000:]}")
            return 1
        r = json.loads(lines[-1])
        rows.append(r)
        print(
            f"{r['model']:<12}{r['b']:>3}{r['s']:>6} {r['ac']:<5}{r['precision']:<11}{r['estimate'] / 2**30:>13.3f}"
            f"{r['max_allocated'] / 2**30:>13.3f}{r['error_pct']:>+9.2f}  {r['peak_phase']}"
        )
        sys.stdout.flush()
    worst = max(abs(r["error_pct"]) for r in rows)
    # fragmentation from the rows of real size only: on an H200 the ~1 GiB rows of the `small` model showed 11.7%
    # (a few MiB of allocator blocks against little allocated) while ranks of 28-92 GiB showed 0.6-7.9%
    large = [r for r in rows if r["max_allocated"] >= 8 * 2**30] or rows
    fraction = max(r["max_reserved"] / r["max_allocated"] - 1 for r in large)
    fixed = max(r["fixed"] for r in rows)
    print(
        f"largest |error| {worst:.2f}% (goal 5%, required 10%); overhead: fixed {fixed / 2**30:.2f} GiB, "
        f"fragmentation {100 * fraction:.1f}%"
    )
    if args.write:
        from lightning_4d.planning.hardware import OVERHEAD_FILE
        from lightning_4d.provenance import code_record

        code = code_record("cuda")  # which code measured it
        table = json.loads(OVERHEAD_FILE.read_text())
        table[name] = {
            "fixed_bytes": int(fixed),
            "fraction": round(fraction, 4),
            "source": f"measured by benchmarks/memory_accuracy.py on {name}, torch {code['torch']}, "
            f"driver {code['driver']}, {datetime.date.today().isoformat()}, commit {code['commit'] or 'not recorded'}"
            f"{'' if code['clean'] is not False else ' with uncommitted changes'}; largest estimate error {worst:.2f}%",
        }
        OVERHEAD_FILE.write_text(json.dumps(table, indent=2) + "\n")
        print(f"recorded in {OVERHEAD_FILE}")
    return 0 if worst <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
