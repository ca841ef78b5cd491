"""The vocabulary-parallel cross-entropy on 2 ranks (CPU, gloo) against ``F.cross_entropy`` on the full logits.

Every rank builds the same full logits ``[b, s, V]`` and labels, computes the single-process reference loss and
logits gradient with ``F.cross_entropy(logits.float(), labels)``, then splits the logits over the vocabulary as the
LM head does (a leaf DTensor, ``Shard(-1)`` on the 1-D tp mesh) and runs ``causal_lm_loss`` on it; and runs
``vocab_parallel_cross_entropy`` on the local shard with explicit chunkings. Cases: float32 and bfloat16 logits, with
and without ignored labels (-100), V even and odd (DTensor's uneven shards: ceil(V/2) and the rest). Writes
``<out>/loss_rank<r>.json``: per case the loss's and the gradient's largest errors (relative to the reference's
largest magnitude), whether the loss is a plain tensor equal to the peer rank's bit for bit, the gradient's type,
placement and dtype, and whether the saved logits are the local shard's storage.

Usage: ``torchrun --nproc-per-node 2 tests/scripts/vocab_parallel_loss.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from torch.autograd.graph import saved_tensors_hooks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from lightning_4d.parallel.loss import causal_lm_loss, vocab_parallel_cross_entropy  # noqa: E402

# (b, s, V, dtype, ignore every k-th label (0: none), chunk_tokens for the direct call)
CASES = [
    (2, 7, 64, torch.float32, 0, 3),
    (2, 7, 64, torch.float32, 3, 5),
    (3, 5, 51, torch.float32, 4, 1),
    (2, 7, 64, torch.bfloat16, 0, 4),
    (2, 7, 64, torch.bfloat16, 2, 14),
]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    records = []
    for b, s, vocab, dtype, every, chunk in CASES:
        g = torch.Generator().manual_seed(vocab * 10 + every)
        full = (3 * torch.randn(b, s, vocab, generator=g)).to(dtype)
        labels = torch.randint(0, vocab, (b, s), generator=g)
        if every:
            labels.view(-1)[::every] = -100
        ref_in = full.float().clone().requires_grad_()  # a copy also for float32
        ref = F.cross_entropy(ref_in.flatten(0, 1), labels.flatten())
        ref.backward()

        # as the model: a vocabulary-sharded DTensor, the loss through causal_lm_loss
        logits = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
        columns = logits.to_local().shape[-1]
        start = rank * -(-vocab // 2)
        saved = []
        with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = causal_lm_loss(logits, labels)
        loss.backward()
        grad = logits.grad
        peer = [torch.zeros(()) for _ in range(2)]
        dist.all_gather(peer, loss.detach())
        ref_shard = ref_in.grad[..., start : start + columns]
        shard_ptr = logits.to_local().untyped_storage().data_ptr()
        record = {
            "case": [b, s, vocab, str(dtype), every, chunk],
            "rank": rank,
            "loss": _rel(loss.detach(), ref.detach()),
            "grad": _rel(grad.to_local().float(), ref_shard),
            # bfloat16: the float32 reference gradient cast once, as the function casts its own
            "grad_cast": _rel(grad.to_local().float(), ref_shard.to(dtype).float()),
            "plain_loss": type(loss) is torch.Tensor and loss.dtype == torch.float32,
            "same_on_ranks": bool(torch.equal(peer[0], peer[1])),
            "grad_is_shard": isinstance(grad, DTensor)
            and grad.placements[0].is_shard()
            and grad.placements[0].dim % 3 == 2,
            "grad_dtype": str(grad.dtype),
            "saved_logits_no_copy": any(
                t.untyped_storage().data_ptr() == shard_ptr and t.dtype == dtype for t in saved
            ),
        }
        # the function itself on the local shard, other chunkings
        local = full[..., start : start + columns].clone().requires_grad_()
        direct = vocab_parallel_cross_entropy(local, labels, mesh.get_group(), start, chunk_tokens=chunk)
        direct.backward()
        record["direct_loss"] = _rel(direct.detach(), ref.detach())
        record["direct_grad"] = _rel(local.grad.float(), ref_shard)
        record["direct_grad_cast"] = _rel(local.grad.float(), ref_shard.to(dtype).float())
        records.append(record)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"loss_rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
