"""The main job (configs/tiny.yaml: dp=2 x tp=2, ZeRO 1, 450 steps) with each gradient compression, side by side.

    python benchmarks/compression.py [--steps 450] [--modes none bf16 powersgd] [--seed 0]
        [--powersgd-rank 4] [--powersgd-start-step 0] [--powersgd-comm-dtype bfloat16]

For each ``gradient_compression`` ("none", "bf16", "powersgd" with the ``--powersgd-*`` options) it trains the main
job from the same seed (4 CPU processes, one run after another), measures the bytes rank 0 sends over each mesh
dimension in one step of 50 (CommMeterCallback) and prints, next to "none": the data-parallel gradient bytes per
step (ZeRO 1's reduce-scatter, bf16's, PowerSGD's all-reduces of P and Q) per compressed step and over the whole run
(PowerSGD's start steps are uncompressed), their ratios, the all-gather of the updated parameters (ZeRO 1, not
compressed), the final validation loss and its relative difference. Not a timed test: bytes are exact, losses are
one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def _train(mode: str, out: Path, args: argparse.Namespace) -> None:
    """One run (every launched process runs this; rank 0 writes ``out/<mode>.json``)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.comm import CommMeterCallback
    from lightning_4d.tasks import CausalLMModule

    cli_args = [
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        f"--trainer.max_steps={args.steps}",
        f"--trainer.val_check_interval={min(150, args.steps)}",
        f"--trainer.strategy.gradient_compression={mode}",
        "--trainer.enable_progress_bar=false",
        f"--seed_everything={args.seed}",
        f"--model.init_seed={args.seed}",
    ]
    if mode == "powersgd":
        cli_args += [
            f"--trainer.strategy.powersgd_rank={args.powersgd_rank}",
            f"--trainer.strategy.powersgd_start_step={args.powersgd_start_step}",
        ]
        if args.powersgd_comm_dtype:
            cli_args.append(f"--trainer.strategy.powersgd_comm_dtype={args.powersgd_comm_dtype}")
    cli = LightningCLI(CausalLMModule, LMDataModule, args=cli_args, run=False, save_config_kwargs={"overwrite": True})
    meter = CommMeterCallback(per_kind=True, every_n_steps=50)
    cli.trainer.callbacks.append(meter)
    cli.trainer.fit(cli.model, cli.datamodule)
    if cli.trainer.global_rank == 0:
        val = float(cli.trainer.callback_metrics["val_loss"])
        (out / f"{mode}.json").write_text(json.dumps({"val_loss": val, "history": meter.history}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--modes", nargs="+", default=["none", "bf16", "powersgd"])
    parser.add_argument(
        "--seed", type=int, default=0, help="seed_everything and the model's init_seed (default 0, the config's)"
    )
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--powersgd-start-step", type=int, default=0)
    parser.add_argument("--powersgd-comm-dtype", choices=["bfloat16"], default=None)
    parser.add_argument("--train", help=argparse.SUPPRESS)  # internal: one run in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        _train(args.train, Path(args.out), args)
        return
    options = ["--powersgd-rank", str(args.powersgd_rank), "--powersgd-start-step", str(args.powersgd_start_step)]
    options += ["--powersgd-comm-dtype", args.powersgd_comm_dtype] if args.powersgd_comm_dtype else []
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            run_dir = Path(tmp) / mode  # the config's relative logger and checkpoint folders land here
            run_dir.mkdir()
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--train",
                    mode,
                    "--out",
                    tmp,
                    "--steps",
                    str(args.steps),
                    "--seed",
                    str(args.seed),
                    *options,
                ],
                check=True,
                env=env,
                cwd=run_dir,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        results = {mode: json.loads((Path(tmp) / f"{mode}.json").read_text()) for mode in args.modes}
    base = results.get("none")

    def mean(result: dict, *keys: str, rows: Optional[list[dict]] = None) -> float:
        rows = result["history"] if rows is None else rows
        return sum(sum(r.get(k, 0) for k in keys) for r in rows) / len(rows)

    def gradient_bytes(result: dict, compressed: bool = True) -> float:
        """The gradients' reduction per step (ZeRO 1: reduce-scatter; PowerSGD: the all-reduces of P, Q and the
        vectors), the mean over the sampled steps that PowerSGD compressed (``compressed``; they have no
        reduce-scatter) or over the others (its uncompressed start steps)."""
        rows = [
            r
            for r in result["history"]
            if (r.get("comm_bytes/dp_cp/reduce_scatter", 0) == 0) == compressed or result["mode"] != "powersgd"
        ]
        return mean(result, "comm_bytes/dp_cp/all_reduce", "comm_bytes/dp_cp/reduce_scatter", rows=rows)

    def run_bytes(result: dict) -> float:  # per step over the whole run: the start steps are uncompressed
        if result["mode"] != "powersgd" or not args.powersgd_start_step:
            return gradient_bytes(result)
        start = min(args.powersgd_start_step, args.steps)
        return (start * gradient_bytes(result, False) + (args.steps - start) * gradient_bytes(result)) / args.steps

    for mode, result in results.items():
        result["mode"] = mode
    factors = args.powersgd_comm_dtype or "float32"
    print(
        f"main job (configs/tiny.yaml, dp=2 x tp=2, ZeRO 1, {args.steps} steps, seed {args.seed}): gradient "
        "compression side by side"
    )
    print(
        "| gradient_compression | dp gradient bytes/step | vs none | over the run | vs none "
        "| dp parameter all-gather "
        "| tp bytes/step | final val_loss | vs none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, result in results.items():
        ratio = f"{gradient_bytes(result) / gradient_bytes(base):.3f}" if base else "-"
        run_ratio = f"{run_bytes(result) / gradient_bytes(base):.3f}" if base else "-"
        loss = f"{(result['val_loss'] - base['val_loss']) / base['val_loss']:+.2%}" if base else "-"
        name = (
            f"powersgd (rank {args.powersgd_rank}, {factors} factors, start step {args.powersgd_start_step})"
            if mode == "powersgd"
            else mode
        )
        print(
            f"| {name} | {gradient_bytes(result):,.0f} | {ratio} | {run_bytes(result):,.0f} | {run_ratio} "
            f"| {mean(result, 'comm_bytes/dp_cp/all_gather'):,.0f} | {mean(result, 'comm_bytes/tp'):,.0f} "
            f"| {result['val_loss']:.4f} | {loss} |"
        )
    print(
        "Bytes rank 0 sends, the mean of one step in 50 (CommMeter): per compressed step, and over the run "
        "(PowerSGD's "
        "start steps reduce exactly). ZeRO 1 all-gathers the updated float32 parameters whatever the gradients' "
        "compression."
    )


if __name__ == "__main__":
    main()
