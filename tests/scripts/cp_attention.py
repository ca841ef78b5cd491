"""Context-parallel attention alone against full causal attention (float64, CPU, gloo).

Every rank builds the same full q, k, v ``[b, s, heads, d]`` and output gradient, computes full causal attention and
its q/k/v gradients with autograd (the eager reference of ``lightning_4d.models.attention_backends``), then runs
``context_parallel_attention`` on its zigzag shard and compares the output and the gradients with the shard of the
reference. Cases: c in {2 (two groups of 2 ranks), 4}, several sequence lengths and GQA ratios (kv heads fewer
than c: replicated under alltoall), the three methods (alltoall where the heads split over c), the ``sdpa`` (ATen's
fused CPU kernel) and ``eager`` kernels. Each case also runs with document masking: the reference is then every
document of every sample run alone through causal attention (documents of random lengths that straddle the cp
chunks; a sample that is one document; documents of one token). Writes ``<out>/attention_rank<r>.json`` with the
largest errors per case.

Usage: ``torchrun --nproc-per-node 4 tests/scripts/cp_attention.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from lightning_4d.features.context_parallel.runtime import context_parallel_attention, gather_sequence, shard_sequence  # noqa: E402
from lightning_4d.models.attention_backends import attention  # noqa: E402

# (sequence length, query heads, kv heads): GQA ratios 1, 2, 4 and MQA
CASES = [(16, 4, 4), (32, 4, 2), (64, 8, 2), (48, 6, 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    records = []
    for c, group in groups.items():
        cp_rank = dist.get_rank(group)
        for s, hq, hkv in CASES:
            if s % (2 * c):
                continue
            g = torch.Generator().manual_seed(s * 100 + hq * 10 + hkv)
            b, d = 2, 8
            q = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
            k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
            v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
            dout = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
            for masked in (False, True):
                docs = _document_ids(b, s, g) if masked else None
                ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = attention(*ref_in, backend="eager") if docs is None else _per_document(*ref_in, docs)
                ref.backward(dout)
                records += _methods(c, group, cp_rank, (s, hq, hkv), (q, k, v, dout), ref, ref_in, docs)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"attention_rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


def _document_ids(b: int, s: int, g: torch.Generator) -> torch.Tensor:
    """Sample 0: documents of random lengths 1 .. s/2 (they straddle the cp chunks); sample 1: one document."""
    ids = torch.zeros(b, s, dtype=torch.long)
    cuts = sorted({1, *torch.randint(2, s, (max(2, s // 6),), generator=g).tolist()})  # a one-token document first
    for cut in cuts:
        ids[0, cut:] += 1
    return ids


def _per_document(q, k, v, docs):
    """The independent reference: each document of each sample alone through causal attention, concatenated."""
    rows = []
    for i in range(q.shape[0]):
        pieces = []
        for d in docs[i].unique_consecutive().tolist():
            span = (docs[i] == d).nonzero().flatten()
            lo, hi = int(span[0]), int(span[-1]) + 1
            pieces.append(attention(q[i : i + 1, lo:hi], k[i : i + 1, lo:hi], v[i : i + 1, lo:hi], backend="eager"))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _methods(c, group, cp_rank, case, tensors, ref, ref_in, docs) -> list[dict]:
    s, hq, hkv = case
    q, k, v, dout = tensors
    records = []
    for method in ("ring", "allgather", "alltoall"):
        if method == "alltoall" and hq % c:  # heads must split over c (refused: tests/test_context_parallel)
            continue
        for backend in ("sdpa", "eager"):
            local = [shard_sequence(t, cp_rank, c).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*local, group, method=method, backend=backend, document_ids=docs)
            out.backward(shard_sequence(dout, cp_rank, c))
            errors = {"out": (out - shard_sequence(ref, cp_rank, c)).abs().max().item()}
            for name, t, r in zip("qkv", local, ref_in):
                errors["d" + name] = (t.grad - shard_sequence(r.grad, cp_rank, c)).abs().max().item()
            full = gather_sequence(out.detach(), group)
            errors["gathered"] = (full - ref.detach()).abs().max().item()
            records.append(
                {
                    "c": c,
                    "s": s,
                    "heads": hq,
                    "kv_heads": hkv,
                    "method": method,
                    "backend": backend,
                    "masked": docs is not None,
                    "errors": errors,
                }
            )
    return records


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
