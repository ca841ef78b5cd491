"""The strategy's process groups on 4 ranks (dp2 x tp2, ``timeout`` 5 s).

1. A second mesh of the same layout (``build_mesh`` again) gets its own groups for its DTensors: a Shard(0) @
   Replicate matmul on each mesh's tp dim, the product's tp group recorded (DTensor's caches once handed the second
   mesh's product the first mesh's group).
2. ``FourDStrategy(timeout=...)`` limits every group it makes, not only the default group: tp rank 1 of the first tp
   group sleeps ``--sleep`` seconds before a tp all-reduce; the peer waiting for it fails after ~5 s (gloo's "Timed
   out"), not after torch's 30-minute default of a new group.

Usage: ``torchrun --nproc-per-node 4 tests/scripts/process_groups.py --out DIR [--sleep 15]``. Writes
``rank<r>.json``: the tp group names (each mesh's, each product's), the seconds the all-reduce took and the error it
raised (``null``: it completed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.mesh import build_mesh  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.parallel._compat.process import exit_distributed_process  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

#: the strategy's timeout (s): long enough for the ranks to make their groups on a loaded machine (each waits on its
#: peers there under this limit too)
TIMEOUT_S = 5


def tp_product_group(tp) -> dict[str, str]:
    """The name of ``tp``'s group and of the group the product of two DTensors on ``tp`` carries."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    a = distribute_tensor(torch.arange(16.0).reshape(4, 4), tp, [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), tp, [Replicate()])
    product = a @ b
    return {"mesh": tp.get_group().group_name, "product": product.device_mesh.get_group().group_name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sleep", type=float, default=15.0)
    args = parser.parse_args()
    strategy = FourDStrategy(
        data_parallel_size=2,
        tensor_parallel_size=2,
        process_group_backend="gloo",
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    strategy._lightning_module = CausalLMModule(LlamaConfig.from_preset("tiny-test"))
    strategy.setup_environment()  # the default group and the mesh's groups
    tp = strategy.mesh.tp
    groups = {"first": tp_product_group(tp)}
    again = build_mesh(strategy.parallel_config, "cpu", timedelta(seconds=TIMEOUT_S)).tp
    groups["second"] = tp_product_group(again)
    torch.distributed.barrier()  # on the default group: every rank has made every group
    sleeper = tp.get_local_rank() == 1 and strategy.mesh.dp_rank == 0
    if sleeper:
        time.sleep(args.sleep)
    start, error = time.monotonic(), None
    try:
        torch.distributed.all_reduce(torch.ones(1), group=tp.get_group())
    except RuntimeError as e:
        error = str(e)
    record = {"seconds": time.monotonic() - start, "error": error, "sleeper": sleeper, "groups": groups}
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    exit_distributed_process(0)  # a timed-out group's peers stay broken: no collective on the way out
