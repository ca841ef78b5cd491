"""The bytes one rank of a layout holds in a real multi-process run (gloo), measured the way ``lightning-4d measure``
measures one rank on the fake process group (``lightning_4d.measure.fit_and_measure``: live CPU tensor bytes,
model states on the real tensors). Each rank writes ``<out>/rank<r>.json``.

Usage: ``torchrun --nproc-per-node N tests/scripts/measure_peak.py --out DIR --layout JSON`` (``ParallelConfig``
keyword arguments) ``--seq-length S --micro-batch-size B --precision P``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from lightning_4d.config import ParallelConfig  # noqa: E402
from lightning_4d.measure import fit_and_measure  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.planning.workload import Workload  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--layout", required=True)
p.add_argument("--model", default="tiny-test")
p.add_argument("--seq-length", type=int, default=64)
p.add_argument("--micro-batch-size", type=int, default=1)
p.add_argument("--precision", default="32-true")
args = p.parse_args()
world = int(os.environ["WORLD_SIZE"])
pc = ParallelConfig(**json.loads(args.layout)).resolve(world)
cfg = LlamaConfig.from_preset(args.model)
got = fit_and_measure(
    Workload(cfg, args.micro_batch_size, args.seq_length, args.precision),
    pc,
    steps=2,
    device="cpu",
    trainer_kwargs={"devices": world, "num_nodes": 1},
)
rank = int(os.environ["RANK"])
Path(args.out, f"rank{rank}.json").write_text(json.dumps(got))
