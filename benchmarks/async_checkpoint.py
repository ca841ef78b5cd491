"""The training time a checkpoint blocks, synchronous vs asynchronous (``async_checkpoint=True``), side by side.

    python benchmarks/async_checkpoint.py [--steps 8] [--save-at 3 6] [--hidden 1024] [--layers 7] [--out DIR]

One launch of 4 CPU processes (torchrun, gloo) trains a Llama whose model states (float32 weights and Adam's two
moments, 12 bytes per parameter) take >= 1 GB for the whole job (default: hidden 1024, 7 layers, ~89M parameters,
1.07 GB), laid out as dp4 ZeRO 3, twice from the same seed: once with synchronous sharded saves, once with
``async_checkpoint=True``, each saving a sharded checkpoint after the steps ``--save-at`` (``trainer.save_checkpoint``,
what ``ModelCheckpoint`` calls). Per save it measures, on every rank, the wall time of ``trainer.save_checkpoint``
(Lightning's state dicts, our staging or our whole write: the time training is stopped), and takes the largest over
the ranks (the others wait for it at the next collective); per step the wall time of rank 0, so that the steps run
while a background write competes for the CPU show up too (on a CPU job the writer thread shares the cores with
training; on GPUs it does not compute). It prints both modes and the ratio: blocked seconds per save, the mean step
without a save nearby, and the extra seconds of the steps after a save (interference), and the seconds the end of
``fit`` waited for the last write. The asynchronous checkpoints are checked to hold the synchronous ones' bytes
(every tensor bitwise).
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

ROOT = Path(__file__).resolve().parents[1]


def _train(asynchronous: bool, out: Path, args: argparse.Namespace) -> None:
    """One run (every rank runs it; each rank writes ``out/<mode>_rank<r>.json``)."""
    from datetime import timedelta

    import lightning as L
    import torch

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.models import LlamaConfig
    from lightning_4d.tasks import CausalLMModule

    mode = "async" if asynchronous else "sync"
    saves: list[float] = []
    steps: dict[int, float] = {}

    class Timing(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.begin = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            steps[trainer.global_step] = time.perf_counter() - self.begin
            if trainer.global_step in args.save_at:
                trainer.strategy.barrier()  # every rank starts the save together
                begin = time.perf_counter()
                trainer.save_checkpoint(out / mode / f"step{trainer.global_step}.ckpt")
                saves.append(time.perf_counter() - begin)

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=8,
        max_seq_length=64,
    )
    L.seed_everything(0, verbose=False)
    module = CausalLMModule(config, learning_rate=1e-4, warmup_steps=1, max_steps=args.steps, init_seed=7)
    dm = LMDataModule(seq_length=16, micro_batch_size=1, global_batch_size=4, seed=1234)
    strategy = FourDStrategy(
        data_parallel_size=4,
        zero_stage=3,
        async_checkpoint=asynchronous,
        process_group_backend="gloo",
        timeout=timedelta(seconds=600),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Timing()],
    )
    begin = time.perf_counter()
    trainer.fit(module, dm)
    total = time.perf_counter() - begin
    n_params = config.num_parameters()
    record = {"saves": saves, "steps": steps, "fit_s": total, "params": n_params, "torch": torch.__version__}
    (out / f"{mode}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _worker(args: argparse.Namespace) -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out = Path(args.out)
    _train(False, out, args)
    _train(True, out, args)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _tensors(path: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.with_name(path.name + ".pt")
    dcp_to_torch_save(path, flat)
    out = torch.load(flat, weights_only=False)
    flat.unlink()
    return out


def _same(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _report(out: Path, args: argparse.Namespace) -> None:
    rows = {}
    for mode in ("sync", "async"):
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}_rank*.json"))]
        blocked = [max(r["saves"][i] for r in ranks) for i in range(len(args.save_at))]
        steps = {int(k): v for k, v in ranks[0]["steps"].items()}
        after = [s + 1 for s in args.save_at if s + 1 in steps] + [s + 2 for s in args.save_at if s + 2 in steps]
        quiet = [v for k, v in steps.items() if k not in after and k > 2]  # steps 1-2: warm-up
        base = statistics.median(quiet)
        interference = sum(steps[k] - base for k in after) / len(args.save_at)
        rows[mode] = {
            "blocked_s": blocked,
            "blocked_mean_s": statistics.mean(blocked),
            "step_s": base,
            "interference_s": interference,
            "fit_s": max(r["fit_s"] for r in ranks),
        }
        params = ranks[0]["params"]
    state_gb = params * 12 / 1e9
    same = all(
        _same(_tensors(out / "sync" / f"step{s}.ckpt"), _tensors(out / "async" / f"step{s}.ckpt")) for s in args.save_at
    )
    s, a = rows["sync"], rows["async"]
    print(
        f"model: {params:,} parameters, states {state_gb:.2f} GB (float32 weights + Adam m, v); dp4 ZeRO 3, 4 CPU ranks"
    )
    print(f"saves after steps {args.save_at}; asynchronous checkpoints bitwise equal to the synchronous ones: {same}")
    print(f"{'':38}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for label, key in (
        ("training blocked per save (s, mean)", "blocked_mean_s"),
        ("step without a save nearby (s)", "step_s"),
        ("extra step time after a save (s)", "interference_s"),
        ("whole fit incl. the last write (s)", "fit_s"),
    ):
        ratio = a[key] / s[key] if s[key] > 0 else float("nan")
        print(f"{label:38}{s[key]:>10.3f}{a[key]:>10.3f}{ratio:>12.3f}")
    print(
        "per save (s): sync "
        + ", ".join(f"{x:.3f}" for x in s["blocked_s"])
        + "; async "
        + ", ".join(f"{x:.3f}" for x in a["blocked_s"])
    )
    (out / "summary.json").write_text(
        json.dumps({"params": params, "state_gb": state_gb, "bitwise_equal": same, **rows})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--out", default=None, help="folder of the checkpoints and records (default: a temporary one)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization

        _worker(args)
        exit_distributed_process(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__]
        cmd += ["--worker", "--out", str(out), "--steps", str(args.steps), "--hidden", str(args.hidden)]
        cmd += ["--layers", str(args.layers), "--save-at", *map(str, args.save_at)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        _report(out, args)


if __name__ == "__main__":
    main()
