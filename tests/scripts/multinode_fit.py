"""A two-node fit: ``Trainer(num_nodes=2, devices=2)`` with ``FourDStrategy(tensor_parallel_size=2, zero_stage=1)``
(dp2 x tp2), CPU, gloo, float32. Run on each "node" as

    torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT \\
        tests/scripts/multinode_fit.py --out DIR

(``tests/test_multinode.py`` starts both on one machine). Each rank writes ``layout0_rank{rank}.json``: its logged
per-step ``train_loss`` (``Recorder`` of ``run_layouts.py``), the node rank Lightning read from the torchrun
environment, and the global ranks of its tp, dp and dp_cp groups; rank 0 also writes the final full weights
(``layout0_weights.pt``), in the format of ``run_layouts.py`` so that ``tests/test_parity.py``'s checks apply. Model,
data, seed and optimizer are those of ``run_layouts.py`` (the single-process reference is
``run_layouts.py --layouts '[{"reference": true}]'`` with the same ``--steps``/``--global-batch``/``--seq-length``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.models.llama import canonical_name  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_layouts import Recorder  # noqa: E402

NUM_NODES = 2
DEVICES = 2  # processes per node
TP = 2


def _ranks(mesh) -> list[int]:
    """Global ranks of this rank's group in a 1D (sub-)mesh."""
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--model", default="tiny-test")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, verbose=False)
    dp = NUM_NODES * DEVICES // TP
    micro = args.global_batch // dp
    dm = LMDataModule(
        seq_length=args.seq_length,
        micro_batch_size=micro,
        global_batch_size=args.global_batch,
        train_samples=args.global_batch * args.steps,
        val_samples=micro * dp,
        seed=1234,
    )
    model_config = LlamaConfig.from_preset(args.model, tie_word_embeddings=False)
    module = CausalLMModule(model_config, learning_rate=args.lr, warmup_steps=2, max_steps=args.steps, init_seed=7)
    recorder = Recorder()
    trainer = L.Trainer(
        num_nodes=NUM_NODES,
        devices=DEVICES,
        accelerator="cpu",
        strategy=FourDStrategy(
            tensor_parallel_size=TP, zero_stage=1, process_group_backend="gloo", timeout=timedelta(seconds=120)
        ),
        max_steps=args.steps,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(module, dm)

    mesh = trainer.strategy.mesh
    rank = trainer.global_rank
    record = {
        "layout": {"nodes": NUM_NODES, "dp": dp, "tp": TP, "zero": 1},
        "rank": rank,
        "losses": recorder.losses,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "num_devices": trainer.num_devices,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "env": {
            k: os.environ.get(k)
            for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        },
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "mesh_shape": list(mesh.world.mesh.shape),
        "tp_ranks": _ranks(mesh.tp),
        "dp_ranks": _ranks(mesh.dp),
        "dp_cp_ranks": _ranks(mesh.dp_cp),
    }
    weights = {}
    for name, p in module.model.named_parameters():  # full_tensor is a collective: every rank joins
        full = p.full_tensor() if isinstance(p, DTensor) else p
        weights[canonical_name(name)] = full.detach().float().cpu().clone()
    (out / f"layout0_rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(weights, out / "layout0_weights.pt")
    torch.distributed.barrier()  # no rank tears gloo down while another still uses it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
