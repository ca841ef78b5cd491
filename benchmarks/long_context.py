"""Long-context memory on CPU: the tiny Llama at a long sequence, cp=1 against cp=c, measured side by side.

For each layout the script launches a ``torchrun`` job (gloo) that trains the ``tiny`` preset (4 layers, hidden 128,
8 heads / 4 kv heads) for two steps of one ``--seq-length``-token sequence with ``FourDStrategy(
context_parallel_size=c)`` and records, per rank, on the second step:

- the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
  excluded) next to our memory model's ``saved_activation_bytes`` for the same layout;
- the process's peak resident memory (``resource.getrusage(...).ru_maxrss``) minus its resident memory before
  ``fit`` (what training added, allocator caching included);
- the step time (rough on a 2-core machine running c processes).

It prints one table with the cp=1 row, the cp=c rows and the ratios. Not a test: run it by hand::

    python benchmarks/long_context.py --seq-length 16384 --cp 4 [--method ring]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_4d.planning.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.autograd.graph import saved_tensors_hooks
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_4d import FourDStrategy, ParallelConfig
    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.model import saved_activation_bytes
    from lightning_4d.tasks import CausalLMModule

    class Batches(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(2):
                ids = torch.randint(0, 256, (1, args.seq_length + 1), generator=g)
                yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    class Measured(CausalLMModule):
        saved: list[int] = []
        times: list[float] = []

        def training_step(self, batch, batch_idx):
            params = {p.untyped_storage().data_ptr() for p in self.parameters()}
            seen: dict[int, int] = {}

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in params and not isinstance(t, torch.nn.Parameter):
                    seen.setdefault(st.data_ptr(), st.nbytes())
                return t

            start = time.perf_counter()
            with saved_tensors_hooks(pack, lambda t: t):
                loss = super().training_step(batch, batch_idx)
            self.saved.append(sum(seen.values()))
            self._start = start
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._start)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = LlamaConfig.from_preset("tiny", max_seq_length=args.seq_length)
    module = Measured(cfg, warmup_steps=1, max_steps=2)
    strategy = FourDStrategy(
        context_parallel_size=world, context_parallel_method=args.method, zero_stage=0, process_group_backend="gloo"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.fit(module, DataLoader(Batches(), batch_size=None))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pc = ParallelConfig(data_parallel_size=1, context_parallel_size=world, context_parallel_method=args.method)
    est = saved_activation_bytes(Workload(cfg, 1, args.seq_length, "32-true"), pc)
    record = {
        "rank": trainer.global_rank,
        "cp": world,
        "saved": module.saved[-1],
        "estimated": sum(est.values()) - est["recompute"],
        "rss_added": peak - before,
        "step_s": module.times[-1],
    }
    Path(args.out, f"cp{world}_rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _launch(nproc: int, args: argparse.Namespace, out: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--worker",
        "--out",
        out,
        "--seq-length",
        str(args.seq_length),
        "--method",
        args.method,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--method", default="ring", choices=["ring", "allgather"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory() as out:
        for c in (1, args.cp):
            _launch(c, args, out)
        rows = [json.loads(p.read_text()) for p in sorted(Path(out).glob("cp*_rank*.json"))]
    base = next(r for r in rows if r["cp"] == 1)
    mib = 2**20
    print(f"tiny Llama, one sequence of {args.seq_length} tokens, method {args.method}, float32, CPU/gloo")
    print(
        f"{'layout':>12} {'rank':>4} {'saved MiB':>10} {'model MiB':>10} {'RSS added MiB':>14} {'step s':>7} "
        f"{'saved vs cp=1':>14}"
    )
    for r in sorted(rows, key=lambda r: (r["cp"], r["rank"])):
        print(
            f"{'cp=' + str(r['cp']):>12} {r['rank']:>4} {r['saved'] / mib:>10.1f} {r['estimated'] / mib:>10.1f} "
            f"{r['rss_added'] / mib:>14.1f} {r['step_s']:>7.2f} {r['saved'] / base['saved']:>14.3f}"
        )


if __name__ == "__main__":
    main()
