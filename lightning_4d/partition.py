"""How the strategy cuts tensors into pieces, defined once for the strategy and the memory model.

- gradient buckets (ZeRO 0/1, ``parallel/grad_buffers.py``): :func:`gradient_buckets_needed` (whether the gradients
  live in buckets at all), :data:`GRADIENT_BUCKET_BYTES`, :func:`bucket_lengths` (which consecutive parameters share
  a bucket) and :func:`bucket_shard` (a rank's range of a bucket);
- loss chunks (``parallel/loss.py``): :data:`LOSS_CHUNK_BYTES` and :func:`loss_chunk_tokens` (tokens per chunk of
  the cross-entropy);
- PowerSGD's rule (``parallel/compression.py``): :func:`powersgd_compressible` (which gradients it factors).

(The MoE feature's own rule, the dimension ZeRO 2/3 shards a stacked MoE weight on, is in its terms:
``lightning_4d/features/moe/costs.py``.)

``lightning_4d/planning/`` counts the bytes these pieces take by the same definitions, so this module is pure Python:
it imports no torch and nothing of ``lightning_4d``. (Which sequence chunks a cp rank holds is a fact of the layout:
:func:`lightning_4d.config.zigzag_chunks`.)
"""

from __future__ import annotations

import math
from typing import Sequence

#: ZeRO 0/1 gradient buckets: about this many bytes of parameters each (as set up, before a cast to the compute
#: dtype), PyTorch DDP's default ``bucket_cap_mb=25``
GRADIENT_BUCKET_BYTES = 25 * 2**20
#: bytes of one chunk's float32 temporary in the cross-entropy (parallel/loss.py; :func:`loss_chunk_tokens`)
LOSS_CHUNK_BYTES = 64 * 2**20


def powersgd_compressible(shape: Sequence[int], rank: int) -> bool:
    """Whether PowerSGD compresses a gradient of ``shape`` at rank ``rank``: a matrix whose rank-r factors are
    smaller than it, ``r·(m + n) < m·n`` (``parallel/compression.py``; the memory model counts its state by the same
    rule)."""
    return len(shape) == 2 and rank * (shape[0] + shape[1]) < shape[0] * shape[1]


def gradient_buckets_needed(
    reducing_ranks: int, master_weights: bool, pipelined: bool, tensor_parallel: bool, optimizer_offload: bool = False
) -> bool:
    """Whether the ZeRO 0/1 gradients live in flat buckets (``parallel/grad_buffers.py``'s ``GradientBuckets``):
    when a bucket is reduced over more than one rank (``reducing_ranks``: dp·cp, or a gradient group's ranks), the
    optimizer steps float32 master weights from float32 gradient buckets (``master_weights``: ``bf16-mixed`` with
    our Llama), a pipeline schedule accumulates its micro-batches and ties embeddings through them (``pipelined``),
    or a tensor-parallel gradient must be redistributed to its parameter's placement (``tensor_parallel``), or the
    optimizer steps host copies of the owned slices (``optimizer_offload``: the gradients are copied from the buckets'
    owned slices). Otherwise
    (one rank, nothing to reduce: ``benchmarks/step_overhead.py``'s case) each gradient stays the ``.grad`` autograd
    made, with no bucket, no copy into it and no backward hook (as under Lightning's single-device strategy),
    and the strategy drops it after each optimizer step as it drops the buckets. The memory model counts the same
    rule (``lightning_4d/planning/buffers.py``)."""
    return reducing_ranks > 1 or master_weights or pipelined or tensor_parallel or optimizer_offload


def bucket_lengths(nbytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """How many consecutive items each gradient bucket takes (ZeRO 0/1, ``parallel/grad_buffers.py``; the memory model
    simulates the same): items of ``nbytes`` bytes, in order, fill a bucket while it stays within ``bucket_bytes``;
    an item that does not fit starts the next bucket (an item larger than ``bucket_bytes`` has a bucket of its own).
    The lengths sum to ``len(nbytes)``."""
    lengths: list[int] = []
    count = size = 0
    for n in nbytes:
        if count and size + n > bucket_bytes:
            lengths.append(count)
            count = size = 0
        count, size = count + 1, size + n
    return lengths + ([count] if count else [])


def bucket_shard(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s range of a bucket of ``numel`` elements padded to a multiple of ``world``
    and cut in ``world`` equal ranges (ZeRO 1's reduce-scatter and ownership); ``end`` may pass ``numel`` (padding)."""
    shard = math.ceil(numel / world)
    return rank * shard, (rank + 1) * shard


def loss_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk of the cross-entropy (:mod:`lightning_4d.parallel.loss`) over ``local_vocab`` logits per token
    (V/t under tensor parallelism): ``max(1, LOSS_CHUNK_BYTES // (4·local_vocab))``, so one chunk's float32
    ``[tokens, local_vocab]`` temporary holds at most :data:`LOSS_CHUNK_BYTES` bytes (64 MiB), or one token's row.
    Shared by the loss and the memory model."""
    return max(1, LOSS_CHUNK_BYTES // (4 * max(1, local_vocab)))
