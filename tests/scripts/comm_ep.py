"""Meter one MoE layer's forward + backward under expert parallelism and record what each rank sent and routed.

Usage (from tests/test_comm.py): ``torchrun --nproc-per-node 4 tests/scripts/comm_ep.py --out DIR``. For ep in 2 and
4 (dp 4, so ep 4 shares its group with ``dp_cp``): the ``tiny-moe`` layer with random weights (seed 0) and each rank's
own random tokens, its experts sharded over the ep mesh; writes ``ep{ep}_rank{r}.json`` with the meter's bytes per
dimension and kind and the routed counts ``[ep source rank, expert]`` of the ep group (gathered outside the meter),
from which the test computes the exact bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from lightning_4d.config import ParallelConfig  # noqa: E402
from lightning_4d.features.moe.expert import shard_experts  # noqa: E402
from lightning_4d.features.moe.layer import MoEFeedForward  # noqa: E402
from lightning_4d.mesh import build_mesh  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.parallel.comm import CommMeter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig.from_preset("tiny-moe")
    for ep in (2, 4):
        mesh = build_mesh(ParallelConfig(data_parallel_size=world, expert_parallel_size=ep).resolve(world), "cpu")
        torch.manual_seed(0)
        layer = MoEFeedForward(cfg)
        for p in layer.experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        shard_experts(layer.experts, mesh.ep)
        x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
        with torch.no_grad():
            _, experts, _ = layer.route(layer.router(x.reshape(-1, cfg.hidden_size)))
            counts = torch.bincount(experts.reshape(-1), minlength=cfg.num_experts)
        gathered = [torch.empty_like(counts) for _ in range(ep)]
        dist.all_gather(gathered, counts, group=mesh.ep.get_group())
        with CommMeter.for_mesh(mesh) as meter:
            layer(x).square().sum().backward()
        record = {
            "ep": ep,
            "ep_rank": mesh.ep.get_local_rank(),
            "num_experts": cfg.num_experts,
            "hidden_size": cfg.hidden_size,
            "row_bytes": cfg.hidden_size * x.element_size(),
            "counts": torch.stack(gathered).tolist(),
            "sent": {d: dict(kinds) for d, kinds in meter.sent.items()},
            "calls": {d: dict(kinds) for d, kinds in meter.calls.items()},
        }
        (out / f"ep{ep}_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
