"""FourDStrategy against the strategies Lightning users train with today, side by side on CPU: step time, peak bytes
of live tensors per rank and the loss, per ZeRO stage.

The ``small`` Llama preset (6 layers, hidden 256, 8 heads / 4 kv heads, vocabulary 256) trains ``--steps`` AdamW steps
on the embedded corpus (``LMDataModule``: s=256, micro-batch 4 per rank, global batch 8, the same windows in the same
order, the same ``init_seed`` weights and ``seed_everything(0)``) in 2 CPU processes (``torchrun``, gloo,
``OMP_NUM_THREADS=1``) under

- ZeRO 0: Lightning's ``DDPStrategy`` (``DistributedDataParallel``) and ``FourDStrategy(zero_stage=0)``;
- ZeRO 1 / 2 / 3: Lightning's ``DeepSpeedStrategy(stage=N)`` (Lightning's defaults: ``overlap_comm``,
  ``contiguous_gradients``, 2e8-element buckets) and ``FourDStrategy(zero_stage=N)``;
- ZeRO 3, also: Lightning's ``ModelParallelStrategy(data_parallel_size=2)`` with FSDP2 applied in
  ``configure_model`` as Lightning's docs show (``fully_shard`` on every transformer layer, then on the model).

DeepSpeed on CPU: ``DS_ACCELERATOR=cpu`` (its CPU accelerator; gloo when oneCCL's bindings are absent) and Lightning's
``DeepSpeedStrategy`` with its CUDA-only check in ``setup_environment`` skipped (:class:`_CPUDeepSpeedStrategy`, the
only change); the ZeRO 3 model is built whole and partitioned by ``deepspeed.initialize`` (under ``zero.Init`` the
parameters are empty placeholders that ``CausalLMModule``'s initialization cannot draw into). Without DeepSpeed
(``pip install 'lightning-4d[peers]'``) or where it cannot run, its rows print why and are skipped.

Every configuration first runs once for memory (:class:`lightning_4d.measure.LiveTensorBytes` entered around the
module's construction and the fit, as ``lightning_4d.measure.fit_and_measure`` does: the largest sum of bytes of CPU
storages alive at once, per rank; a separate run because the dispatch mode slows every op), then ``--rounds`` timed
runs, alternating over all configurations in each round so that a slow phase of the machine hits all of them. The
step time of a run is the median over its steps after ``--warmup``; the table gives the median over the rounds and
the ratio FourDStrategy / peer at the same ZeRO stage (below 1: ours faster; the goal is <= 1 against the fastest
peer of the stage).

Usage::

    python benchmarks/peers.py [--rounds 3] [--steps 12] [--warmup 2] [--precision 32-true] [--only ddp,fourd]
        [--zero 0,3] [--no-memory]
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
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]

#: (peer, ZeRO stage) in the order of the table: each stage's peers, then ours
CONFIGS = [
    ("ddp", 0),
    ("fourd", 0),
    ("deepspeed", 1),
    ("fourd", 1),
    ("deepspeed", 2),
    ("fourd", 2),
    ("deepspeed", 3),
    ("fsdp2", 3),
    ("fourd", 3),
]
LABELS = {
    "ddp": "Lightning DDPStrategy",
    "deepspeed": "Lightning DeepSpeedStrategy",
    "fsdp2": "Lightning ModelParallelStrategy + FSDP2",
    "fourd": "FourDStrategy",
}
SEQ_LENGTH, MICRO_BATCH, WORLD = 256, 4, 2


# ---------------------------------------------------------------------------------------------------- worker side
def _strategy(peer: str, zero: int, ds_bucket: Optional[int] = None) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_4d import FourDStrategy

    if peer == "fourd":
        return FourDStrategy(data_parallel_size=WORLD, zero_stage=zero, process_group_backend="gloo")
    if peer == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if peer == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    if peer == "deepspeed":
        buckets = {} if ds_bucket is None else {"allgather_bucket_size": ds_bucket, "reduce_bucket_size": ds_bucket}
        return _cpu_deepspeed_strategy()(stage=zero, process_group_backend="gloo", **buckets)
    raise ValueError(f"unknown peer {peer!r}")


def _cpu_deepspeed_strategy() -> type:
    import logging
    from contextlib import nullcontext

    import deepspeed  # the `peers` extra; imported here so that a missing one fails this run only
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class _CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy with its CUDA-only check skipped (DeepSpeed itself runs on its CPU
        accelerator, ``DS_ACCELERATOR=cpu``)."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(logging_level=logging.ERROR, **kwargs)

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's raises "only supported on CUDA GPUs"

        def setup_distributed(self) -> None:
            # DeepSpeedStrategy's, without _validate_device_index_selection (CPU devices have no index)
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            # DeepSpeedStrategy's, with DeepSpeed's device_rank the local rank (Lightning passes the device's index,
            # None on CPU: DeepSpeed's engine then fails comparing None >= 0)
            import argparse

            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, ds_optimizer

        def model_sharded_context(self) -> Any:
            # ZeRO 3: build the model whole (CausalLMModule initializes it), deepspeed.initialize partitions it
            self._init_config_if_needed()
            return nullcontext()

    return _CPUDeepSpeedStrategy


def _module_class(peer: str) -> type:
    from lightning_4d.tasks import CausalLMModule

    if peer != "fsdp2":
        return CausalLMModule

    class FSDP2Module(CausalLMModule):
        """FSDP2 applied in ``configure_model`` as Lightning's ModelParallelStrategy docs show: each transformer
        layer its own unit, then the model."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.model is not None:
                return
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDP2Module


def worker(
    peer: str, zero: int, steps: int, precision: str, memory: bool, out: str, ds_bucket: Optional[int] = None
) -> None:
    """One fit on this rank (under ``torchrun --nproc-per-node 2``); writes ``out.<rank>.json``: per-step times and
    ``train_loss``, and with ``memory`` the peak live tensor bytes."""
    import contextlib

    import lightning as L
    import torch

    from lightning_4d.data import LMDataModule
    from lightning_4d.measure import LiveTensorBytes
    from lightning_4d.models import LlamaConfig

    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []

    class Record(L.Callback):
        t0 = c0 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            times.append(time.perf_counter() - self.t0)
            cpu_times.append(time.process_time() - self.c0)
            losses.append(float(trainer.callback_metrics["train_loss"]))

    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    tracker = LiveTensorBytes("cpu") if memory else contextlib.nullcontext()
    dm = LMDataModule(
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH * WORLD,
        train_samples=MICRO_BATCH * WORLD * steps,
        val_samples=8,
        seed=1234,
    )
    with tracker:
        module = _module_class(peer)(
            LlamaConfig.from_preset("small"), learning_rate=1e-3, warmup_steps=2, max_steps=steps
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            num_nodes=1,
            precision=precision,
            max_steps=steps,
            strategy=_strategy(peer, zero, ds_bucket),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[Record()],
        )
        trainer.fit(module, dm)
    result = {"times": times, "cpu_times": cpu_times, "losses": losses, "peak": tracker.peak if memory else None}
    with open(f"{out}.{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------------- driver side
def deepspeed_unavailable() -> Optional[str]:
    """Why DeepSpeed's rows cannot run here (``None``: they can), checked in a subprocess with ``DS_ACCELERATOR=cpu``:
    DeepSpeed importable, its accelerator the CPU one and its communication backend one that torch has."""
    probe = (
        "import deepspeed, torch.distributed as d; from deepspeed.accelerator import get_accelerator as g; "
        "a = g(); print(a.device_name(), a.communication_backend_name(), deepspeed.__version__)"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        if "No module named 'deepspeed'" in p.stderr:
            return "deepspeed is not installed (pip install 'lightning-4d[peers]')"
        return f"import deepspeed failed: {last}"
    device, backend, _version = p.stdout.split()[-3:]
    if device != "cpu":
        return f"DeepSpeed's accelerator is {device!r}, not its CPU accelerator (DS_ACCELERATOR=cpu)"
    if backend not in ("gloo", "ccl"):
        return f"DeepSpeed's CPU accelerator asks for the {backend!r} backend"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    peer: str,
    zero: int,
    steps: int,
    precision: str,
    memory: bool,
    workdir: Path,
    tag: str,
    ds_bucket: Optional[int] = None,
) -> dict:
    """One fit of ``peer`` at ``zero`` in 2 ``torchrun`` processes. Returns ``{"times", "losses", "peak"}`` (peak:
    the largest over the ranks) or ``{"error": the last lines of the output}``."""
    out = workdir / tag
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(WORLD),
            "--master-port",
            str(_free_port()),
            str(Path(__file__).resolve()),
            "--worker",
            peer,
            str(zero),
            "--steps",
            str(steps),
            "--precision",
            precision,
            "--out",
            str(out),
        ]
        + (["--memory"] if memory else [])
        + (["--ds-bucket", str(ds_bucket)] if ds_bucket else [])
    )
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    ranks = [out.with_name(f"{tag}.{r}.json") for r in range(WORLD)]
    if p.returncode != 0 or not all(f.exists() for f in ranks):
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return {"error": (errors or lines or ["(no output)"])[-1].strip()[:300]}
    results = [json.loads(f.read_text()) for f in ranks]
    peaks = [r["peak"] for r in results if r["peak"] is not None]
    return {
        "times": results[0]["times"],
        "cpu_times": results[0]["cpu_times"],
        "losses": results[0]["losses"],
        "peak": max(peaks) if peaks else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of every timed run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--memory-steps", type=int, default=3, help="optimizer steps of the memory run")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision flag, the same for all")
    parser.add_argument("--only", default=None, help="comma-separated peers to run (ddp, deepspeed, fsdp2, fourd)")
    parser.add_argument("--zero", default=None, help="comma-separated ZeRO stages to run (default all: 0,1,2,3)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument(
        "--ds-bucket",
        type=int,
        default=None,
        metavar="ELEMENTS",
        help="DeepSpeed's reduce and all-gather bucket sizes (default Lightning's: 2e8 elements)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("PEER", "ZERO"), help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.steps, args.precision, args.memory, args.out, args.ds_bucket)
        return

    import lightning
    import torch

    configs = [
        c
        for c in CONFIGS
        if (args.only is None or c[0] in args.only.split(","))
        and (args.zero is None or str(c[1]) in args.zero.split(","))
    ]
    skipped: dict[tuple[str, int], str] = {}
    if any(peer == "deepspeed" for peer, _ in configs):
        reason = deepspeed_unavailable()
        if reason is not None:
            print(f"DeepSpeedStrategy rows skipped: {reason}")
            skipped.update({c: reason for c in configs if c[0] == "deepspeed"})
    configs = [c for c in configs if c not in skipped]
    print(
        f"small preset, {WORLD} CPU processes (gloo, OMP_NUM_THREADS=1), s={SEQ_LENGTH}, micro-batch {MICRO_BATCH}, "
        f"{args.precision}; torch {torch.__version__}, lightning {lightning.__version__}, {os.cpu_count()} CPUs"
    )
    walls: dict[tuple[str, int], list[float]] = {c: [] for c in configs}  # per round: median s/step
    cpus: dict[tuple[str, int], list[float]] = {c: [] for c in configs}  # per round: median CPU s/step, rank 0
    peaks: dict[tuple[str, int], Optional[int]] = {}
    losses: dict[tuple[str, int], list[float]] = {}
    failed: dict[tuple[str, int], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for peer, zero in [] if args.no_memory else configs:
            t = time.perf_counter()
            got = run(peer, zero, args.memory_steps, args.precision, True, work, f"mem-{peer}{zero}", args.ds_bucket)
            if "error" in got:
                failed[(peer, zero)] = got["error"]
                print(f"memory run {LABELS[peer]} ZeRO {zero}: FAILED: {got['error']}", flush=True)
                continue
            peaks[(peer, zero)] = got["peak"]
            print(
                f"memory run {LABELS[peer]} ZeRO {zero}: peak {got['peak'] / 2**20:.1f} MiB "
                f"({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
        for r in range(args.rounds):
            for c in configs:
                if c in failed:
                    continue
                got = run(*c, args.steps, args.precision, False, work, f"r{r}-{c[0]}{c[1]}", args.ds_bucket)
                if "error" in got:
                    failed[c] = got["error"]
                    print(f"round {r} {LABELS[c[0]]} ZeRO {c[1]}: FAILED: {got['error']}", flush=True)
                    continue
                walls[c].append(statistics.median(got["times"][args.warmup :]))
                cpus[c].append(statistics.median(got["cpu_times"][args.warmup :]))
                losses[c] = got["losses"]
                print(
                    f"round {r} {LABELS[c[0]]} ZeRO {c[1]}: {walls[c][-1]:.3f} s/step, CPU {cpus[c][-1]:.3f} s/step",
                    flush=True,
                )
    _table(configs, walls, cpus, peaks, losses, failed, skipped)


def _paired(ours: list[float], peer: list[float]) -> Optional[float]:
    """The median over the rounds of ours / peer in the same round (a slow phase of the machine hits both)."""
    pairs = [a / b for a, b in zip(ours, peer)]
    return statistics.median(pairs) if pairs and len(ours) == len(peer) else None


def _table(configs: list, walls: dict, cpus: dict, peaks: dict, losses: dict, failed: dict, skipped: dict) -> None:
    ok = {c for c, v in walls.items() if v and c not in failed}
    wall = {c: statistics.median(walls[c]) for c in ok}
    cpu = {c: statistics.median(cpus[c]) for c in ok}
    print()
    print(
        "| ZeRO | strategy | s/step, median (per round) | ours / this (paired) | CPU s/step rank 0 | ours / this | "
        "peak live MiB per rank | ours / this | first loss | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in sorted(set(configs) | set(skipped), key=CONFIGS.index):
        peer, zero = c
        if c in skipped or c in failed:
            why = skipped.get(c) or f"failed: {failed[c]}"
            print(f"| {zero} | {LABELS[peer]} | not run: {why} | | | | | | | |")
            continue
        if c not in ok:
            continue
        ours = ("fourd", zero)
        versus = peer != "fourd" and ours in ok
        rounds = ", ".join(f"{m:.3f}" for m in walls[c])
        paired = _paired(walls[ours], walls[c]) if versus else None
        w_ratio = f"{wall[ours] / wall[c]:.2f} ({paired:.2f})" if versus and paired else ""
        c_ratio = f"{cpu[ours] / cpu[c]:.2f}" if versus else ""
        p_ratio = f"{peaks[ours] / peaks[c]:.2f}" if peer != "fourd" and peaks.get(ours) and peaks.get(c) else ""
        peak = f"{peaks[c] / 2**20:.1f}" if peaks.get(c) else "-"
        print(
            f"| {zero} | {LABELS[peer]} | {wall[c]:.3f} ({rounds}) | {w_ratio} | {cpu[c]:.3f} | {c_ratio} | {peak} | "
            f"{p_ratio} | {losses[c][0]:.4f} | {losses[c][-1]:.4f} |"
        )
    print(
        "\nours / this: FourDStrategy's value over this row's, at the same ZeRO stage (below 1: ours faster or "
        "smaller); (paired): the median over rounds of the same round's ratio."
    )
    for zero in sorted({z for _, z in configs}):
        ours = ("fourd", zero)
        peers = {c: wall[c] for c in ok if c[1] == zero and c[0] != "fourd"}
        if ours in ok and peers:
            fastest = min(peers, key=peers.get)
            ratio = wall[ours] / peers[fastest]
            print(
                f"ZeRO {zero}: FourDStrategy / fastest peer ({LABELS[fastest[0]]}) = {ratio:.2f}"
                f"{'' if ratio <= 1.0 else '  (goal <= 1.00 not met)'}"
            )


if __name__ == "__main__":
    main()
