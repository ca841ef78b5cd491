"""Context-parallel ring attention with document masking against without, side by side in one run on CPU (gloo):
forward + backward seconds per step of one cp rank, and the fraction of (query, key) blocks the ring skips because no
document spans them (``lightning_4d.features.context_parallel.runtime.ring_blocks``).

Documents of about ``--document-tokens`` tokens (lengths drawn uniformly from half to one and a half times that)
are packed into one window of ``--seq-length`` tokens. Four runs on the same q, k, v: causal attention and document
masking with ATen's fused CPU kernel (``sdpa``, the default; masked blocks pass it the block's mask), and the same
two with the explicit-matmul kernel (``eager``). Each ratio masked / causal is what masking costs or saves on that
kernel: the skipped blocks against the cost of masking the computed ones.

Usage::

    torchrun --nproc-per-node 4 benchmarks/cp_document_masking.py [--seq-length 8192] [--document-tokens 512]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _document_ids(s: int, mean: int, g: torch.Generator) -> torch.Tensor:
    ids, start, doc = torch.empty(1, s, dtype=torch.long), 0, 0
    while start < s:
        length = int(torch.randint(mean // 2, mean + mean // 2 + 1, (1,), generator=g))
        ids[0, start : start + length] = doc
        start, doc = start + length, doc + 1
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    from lightning_4d.features.context_parallel.runtime import context_parallel_attention, ring_blocks, shard_sequence

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, c = dist.get_rank(), dist.get_world_size()
    s, g = args.seq_length, torch.Generator().manual_seed(0)
    q = torch.randn(1, s, args.heads, args.head_dim, generator=g)
    k, v = (torch.randn(1, s, args.kv_heads, args.head_dim, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    ids = _document_ids(s, args.document_tokens, g)
    local = [shard_sequence(t, rank, c) for t in (q, k, v, dout)]

    def seconds(backend: str, documents: torch.Tensor | None) -> float:
        xs = [t.clone().requires_grad_() for t in local[:3]]
        context_parallel_attention(*xs, dist.group.WORLD, "ring", backend, documents).backward(local[3])  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            context_parallel_attention(*xs, dist.group.WORLD, "ring", backend, documents).backward(local[3])
        dist.barrier()
        return (time.perf_counter() - start) / args.iters

    times = {(backend, masked): seconds(backend, ids if masked else None) for backend in ("sdpa", "eager")
             for masked in (False, True)}  # fmt: skip
    computed, total = ring_blocks(ids, c)
    if rank == 0:
        documents = int(ids.max()) + 1
        print(f"s={s}, cp={c}, {documents} documents of ~{args.document_tokens} tokens, {args.heads} heads")
        print(f"ring blocks computed with masking: {computed} of {total} ({1 - computed / total:.0%} skipped)")
        for backend in ("sdpa", "eager"):
            causal, masked = times[(backend, False)], times[(backend, True)]
            print(f"{backend:5s} kernel: causal {causal:.3f} s, masked {masked:.3f} s per forward + backward "
                  f"(ratio masked / causal: {masked / causal:.2f})")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
