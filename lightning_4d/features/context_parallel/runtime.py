"""Context parallelism (cp): the sequence of every sample split over the ranks of the ``cp`` group, with causal
attention exchanging K/V so that every token still attends to all earlier tokens of the full sequence.

**Load-balanced ("zigzag") sharding.** With ``c`` ranks the sequence of ``s`` tokens is cut into ``2c`` chunks of
``C = s / 2c`` tokens and rank ``i`` keeps chunks ``i`` and ``2c - 1 - i`` (the "head-tail" split of Megatron-LM's
context parallelism and of Llama 3, Dubey et al. 2024, arXiv 2407.21783, §3.3.2): under a causal mask chunk ``j``
attends to ``j + 1`` chunks, so every rank does the same ``2c + 1`` chunk-pairs of work. The strategy shards
``input_ids`` and ``labels`` of every batch (:func:`shard_batch`); the model computes the rotary positions of its
local tokens itself (:func:`lightning_4d.models.rope.context_parallel_positions`), so the user's data does not
change.

**Attention.** Two exact methods, selected with ``context_parallel_method``:

- ``"ring"`` (ring attention, Liu et al. 2023, arXiv 2310.01889; the zigzag ring of Brandon et al. 2023, "Striped
  attention", arXiv 2311.09431 and of ``ring-flash-attention``): each rank's K/V block travels around the cp ring
  (``c - 1`` point-to-point send/receive steps, the next block's transfer launched before the current block is
  computed, so on CUDA/NCCL the exchange overlaps the attention kernel). Rank ``i`` holding the block of rank ``r``
  computes: ``r == i``: causal attention over its two local chunks; ``r < i``: both local query chunks against the
  block's first chunk (no mask); ``r > i``: the second local query chunk against the whole block (no mask). Partial
  results are merged with the log-sum-exp rule (Milakov & Gimelshein 2018, arXiv 1805.02867; FlashAttention, Dao et
  al. 2022, arXiv 2205.14135)::

      lse = logaddexp(lse_a, lse_b);  out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

  Backward runs the ring again: dq accumulates locally, and the dK/dV of each block travels with the block from the
  first rank after its owner round the ring back to the owner (``c − 1`` sends, a reduce-scatter's volume); the
  owner keeps its own contribution, computed first, and adds the arriving sum last. Only the local q, k, v, the
  output and the log-sum-exp are saved.
- ``"allgather"`` (Llama 3's method, arXiv 2407.21783 §3.3.2): K and V of the whole sequence are all-gathered
  (kv heads only, so cheap for GQA models), each local query chunk ``a`` attends fully to chunks ``0 .. a-1`` and
  causally to chunk ``a`` (two kernel calls merged by log-sum-exp). Backward reduce-scatters dK/dV to their owners
  (all-reduce + slice on gloo, which has no reduce-scatter). Saves the gathered K/V (``s`` tokens, not ``s / c``)
  instead of the local K/V; its output, ``[b, heads, s/c, d]``-contiguous, is copied when its heads are merged.

- ``"alltoall"`` (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509): one all-to-all turns every rank's
  sequence shard of q, k, v ``[b, s/c, heads, d]`` (packed into one message) into the whole sequence of ``heads/c``
  of them, ``[b, s, heads/c, d]``; each rank runs plain causal attention (one kernel call) over the whole sequence
  for its heads, and a second all-to-all turns the output back into the rank's sequence shard of all heads.
  Backward is the same two exchanges in reverse (the output gradient forward-wise, then dq, dk, dv packed). The
  shards keep the zigzag order of the other methods: the all-to-all's receiver puts rank ``r``'s two chunks at
  positions ``r`` and ``2c − 1 − r`` of the sequence, and the return trip takes them from there. Heads split over
  cp after tp: ``a/tp`` divisible by c; kv heads too, or, when a tp rank has fewer kv heads than c (and c is a
  multiple of them), each kv head is replicated ``c·tp/k`` times before the exchange so that every rank receives
  the kv head its query heads share (its gradient summed back by autograd);
  :func:`~lightning_4d.features.context_parallel.alltoall_heads`. Saves q, k, v, the output and the log-sum-exp of the
  whole sequence for its heads: the bytes of the local ones, except replicated kv heads.

**Kernels** (each returns the output and the log-sum-exp the merge needs, and has a backward taking the *final*
output and log-sum-exp): ``"sdpa"`` uses ATen's fused flash kernels (``_scaled_dot_product_flash_attention_for_cpu``
on CPU, any float dtype; ``_scaled_dot_product_flash_attention`` on CUDA for float16/bfloat16, explicit matmuls for
float32 on CUDA); ``"flash"`` uses flash-attn 2.7-2.8 (CUDA); ``"eager"`` uses explicit matmuls (the reference,
any device). The private kernels are reached through :mod:`lightning_4d.parallel._compat.kernels`. Grouped-query
attention: only the kv heads are exchanged; the kernels see K/V repeated to the query heads (``repeat_interleave``,
Meta's ``repeat_kv``) and dK/dV are summed back.

**Document masking** (``document_ids``, :mod:`lightning_4d.models.document_mask`): every cp rank holds the
document ids of the whole sequence (``[b, s]``, a few bytes per token, kept whole by :func:`shard_batch`), so it can
mask any block from the tokens' positions in the whole sequence: causal and within one document. The ring computes
the blocks it would without masking, masked, and skips a block no document spans (no compute, forward or backward;
the K/V and dK/dV still travel, the exchange is unchanged, and so is the zigzag load balance of the causal work);
the all-gather method attends each query chunk to its own chunk and to the keys from the start of the document its
first token belongs to, nothing earlier; all-to-all masks the whole sequence of its heads with one mask. Masked
blocks save nothing beyond the unmasked kernels' inputs and outputs; they run ATen's CPU flash kernel with the
block's mask under ``"sdpa"`` on CPU, the explicit matmuls otherwise (``"eager"``, and on CUDA, whose fused flash
kernels take no mask; they hold a block's scores while they run).

Shapes: ``q`` ``[b, s/c, n_q_heads, head_dim]``, ``k``, ``v`` ``[b, s/c, n_kv_heads, head_dim]`` (local tokens in
zigzag order); output like ``q``. Softmax scale ``1 / sqrt(head_dim)``, no dropout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.config import CONTEXT_PARALLEL_METHODS, zigzag_chunks
from lightning_4d.features.context_parallel import alltoall_heads
from lightning_4d.models.document_mask import document_mask, window_mask
from lightning_4d.models.rope import context_parallel_positions
from lightning_4d.parallel._compat.collectives import reduce_scatter_single
from lightning_4d.parallel._compat.kernels import (
    aten_flash_backward,
    aten_flash_forward,
    aten_flash_takes,
    flash_attn_backward,
    flash_attn_forward,
)

__all__ = [
    "CONTEXT_PARALLEL_METHODS",
    "ContextParallelAttention",
    "context_parallel_attention",
    "gather_sequence",
    "shard_batch",
    "shard_sequence",
]


# ---------------------------------------------------------------------------------------------------- sharding
def _check_divisible(seq_length: int, cp_size: int) -> None:
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_length} is not a multiple of 2*context_parallel_size = {2 * cp_size} (the "
            f"load-balanced causal split cuts it into 2*cp chunks); use e.g. seq_length="
            f"{(seq_length // (2 * cp_size) + 1) * 2 * cp_size}."
        )


def _take_zigzag(chunks: Sequence[Tensor], cp_rank: int, cp_size: int, dim: int) -> Tensor:
    """Cp rank ``cp_rank``'s two chunks of the ``2·cp_size`` ``chunks`` (:func:`~lightning_4d.config.zigzag_chunks`),
    concatenated along ``dim``."""
    return torch.cat([chunks[i] for i in zigzag_chunks(cp_rank, cp_size)], dim=dim)


def _unzigzag(parts: list[Tensor], dim: int) -> list[Tensor]:
    """The ``2c`` chunks of the full sequence in natural order from every cp rank's shard (``parts[r]``: rank
    ``r``'s two chunks along ``dim``, as :func:`_take_zigzag` made them)."""
    size = len(parts)
    chunks: list[Tensor] = [parts[0]] * (2 * size)
    for r, part in enumerate(parts):
        for index, chunk in zip(zigzag_chunks(r, size), part.chunk(2, dim=dim)):
            chunks[index] = chunk
    return chunks


def shard_sequence(x: Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> Tensor:
    """This cp rank's tokens of ``x``: chunks ``cp_rank`` and ``2c - 1 - cp_rank`` of ``2c`` along ``dim``.

    Args:
        x: a tensor whose ``dim`` is the full sequence ``s`` (e.g. ``input_ids`` ``[b, s]``).
        cp_rank: rank in the cp group, ``0 <= cp_rank < cp_size``.
        cp_size: c.

    Returns:
        ``x`` with ``dim`` of length ``s / c`` (a new contiguous tensor; ``x`` itself when c = 1).

    Raises:
        ValueError: ``s`` not divisible by ``2c``.
    """
    if cp_size == 1:
        return x
    _check_divisible(x.shape[dim], cp_size)
    return _take_zigzag(x.chunk(2 * cp_size, dim=dim), cp_rank, cp_size, dim).contiguous()


def gather_sequence(x: Tensor, cp_group: Optional[dist.ProcessGroup], dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_sequence` over the cp group: the full sequence, in natural order, on every cp rank.

    Args:
        x: this rank's ``s / c`` tokens along ``dim`` (zigzag order).
        cp_group: the cp process group (``None`` or size 1: ``x`` is returned).

    Returns:
        ``[..., s, ...]`` (not differentiable: for predictions and generation).
    """
    size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=cp_group)
    return torch.cat(_unzigzag(parts, dim), dim=dim)


#: batch keys sharded over the sequence (dim 1) by :func:`shard_batch`
SEQUENCE_KEYS = ("input_ids", "labels", "positions")


def shard_batch(batch: Any, cp_rank: int, cp_size: int) -> Any:
    """Shard a batch for context parallelism: the tensors under :data:`SEQUENCE_KEYS` of a dict (``[b, s]``; a
    ``positions`` tensor of shape ``[s]`` along dim 0), or a ``[b, s]`` tensor batch. Other entries are kept, the
    document ids (``"document_ids"``, ``[b, s]``) among them: every cp rank masks its blocks with the whole sequence's.

    Raises:
        ValueError: a sequence length not divisible by ``2c``.
    """
    if cp_size == 1:
        return batch
    if isinstance(batch, Tensor):
        return shard_sequence(batch, cp_rank, cp_size, dim=1)
    if isinstance(batch, dict):
        out = dict(batch)
        for key in SEQUENCE_KEYS:
            value = out.get(key)
            if isinstance(value, Tensor):
                out[key] = shard_sequence(value, cp_rank, cp_size, dim=0 if value.ndim == 1 else 1)
        return out
    return batch


# ---------------------------------------------------------------------------------------------------- kernels
def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``[b, h_kv, s, d]`` -> ``[b, h_kv·n_rep, s, d]`` (each kv head repeated ``n_rep`` times consecutively)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_kv(x: Tensor, n_rep: int) -> Tensor:
    """Gradient of :func:`_repeat_kv`: ``[b, h_kv·n_rep, s, d]`` -> ``[b, h_kv, s, d]``."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(dim=2)


class _Kernel:
    """One attention block: ``forward(q, k, v, causal) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse,
    causal) -> (dq, dk, dv)`` on ``[b, heads, s, d]`` tensors (k, v with kv heads; ``causal`` = top-left causal mask
    on square blocks). ``lse`` ``[b, heads, s_q]`` in float32 (float64 for float64 inputs); ``out`` and ``lse`` given
    to ``backward`` are the *final* (merged) ones of those query rows, as in FlashAttention's backward."""

    def __init__(self, backend: str, scale: float) -> None:
        self.backend, self.scale = backend, scale

    # -- forward
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        if mask is not None:  # document masking (module docstring)
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
            if not self._masked_aten(q):
                return self._eager_forward(q, k, v, causal, mask)
            out, lse = aten_flash_forward(q, k, v, False, self.scale, _additive(mask, q.dtype))
            # a query row the block refuses entirely: lse -inf (the kernel gives 0), so that the merge skips it
            return out, lse.masked_fill(~mask.any(dim=-1), float("-inf"))
        if self.backend == "flash":
            return self._flash_forward(q, k, v, causal)
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        if self._use_eager(q):
            return self._eager_forward(q, k, v, causal)
        return aten_flash_forward(q, k, v, causal, self.scale)

    def _masked_aten(self, q: Tensor) -> bool:
        """A masked block runs ATen's CPU flash kernel with the mask (``"sdpa"`` on CPU); else the explicit
        matmuls (``"eager"``, and every backend on CUDA, whose flash kernels take no mask)."""
        return self.backend == "sdpa" and q.device.type == "cpu"

    def _use_eager(self, q: Tensor) -> bool:
        # ATen's CUDA flash kernel takes float16/bfloat16 and head dims the public SDPA lets through to it
        # (aten_flash_takes); otherwise (float32, an odd head dim) the explicit matmuls, on the block only
        return self.backend == "eager" or (q.device.type != "cpu" and not aten_flash_takes(q.dtype, q.shape[-1]))

    def _scores(self, q: Tensor, k: Tensor, causal: bool, mask: Optional[Tensor] = None) -> Tensor:
        """``q k^T · scale`` in float32 (float64 for float64), future keys at ``-inf`` when ``causal``; with ``mask``
        (``BoolTensor [b, 1, s_q, s_k]``, which holds the causal mask) the keys it refuses at ``-inf`` instead."""
        compute = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif causal:
            sq, sk = scores.shape[-2], scores.shape[-1]
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return scores

    def _eager_forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        compute = torch.promote_types(q.dtype, torch.float32)
        scores = self._scores(q, k, causal, mask)
        lse = torch.logsumexp(scores, dim=-1)
        if mask is not None:  # a query row with no allowed key in this block: output 0, lse -inf (the merge skips it)
            probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        else:
            probs = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.matmul(probs, v.to(compute))
        return out.to(q.dtype), lse

    def _flash_forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        # flash-attn: [b, s, heads, d] in, softmax_lse [b, heads, s]; GQA native
        out, lse = flash_attn_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, self.scale)
        return out.transpose(1, 2), lse

    # -- backward
    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rep = q.shape[1] // k.shape[1]
        # the ring's and the all-gather's row slices of lse are strided views; the CUDA flash backwards (ATen's
        # mha_bwd, flash-attn's) read the log-sum-exp as a dense [b, heads, s_q] array (CPU kernels read strides)
        lse = lse.contiguous()
        if mask is not None:
            kr, vr = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
            if self._masked_aten(q):
                dq, dk, dv = aten_flash_backward(
                    dout, (q, kr, vr), out, lse, False, self.scale, _additive(mask, q.dtype)
                )
            else:
                dq, dk, dv = self._eager_backward(dout, (q, kr, vr), out, lse, causal, mask)
            return dq, _sum_kv(dk, n_rep), _sum_kv(dv, n_rep)
        if self.backend == "flash":
            return self._flash_backward(dout, q, k, v, out, lse, causal)
        kr, vr = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        if self._use_eager(q):
            dq, dk, dv = self._eager_backward(dout, (q, kr, vr), out, lse, causal)
        else:
            dq, dk, dv = aten_flash_backward(dout, (q, kr, vr), out, lse, causal, self.scale)
        return dq, _sum_kv(dk, n_rep), _sum_kv(dv, n_rep)

    def _eager_backward(
        self,
        dout: Tensor,
        qkv: tuple[Tensor, Tensor, Tensor],
        out: Tensor,
        lse: Tensor,
        causal: bool,
        mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The explicit matmuls' backward; ``qkv`` (k, v with every query head's copy) passed as to ATen's and
        flash-attn's backwards."""
        q, k, v = qkv
        # FlashAttention's backward (Dao et al. 2022, Algorithm 4): P = exp(S - lse), dV = P^T dO, dP = dO V^T,
        # D = rowsum(dO * O), dS = P * (dP - D), dQ = dS K * scale, dK = dS^T Q * scale (lse the final one, finite:
        # every query attends to itself, so a refused key's exp(-inf - lse) is 0)
        compute = torch.promote_types(q.dtype, torch.float32)
        qc, kc, vc, doc = (t.to(compute) for t in (q, k, v, dout))
        scores = self._scores(q, k, causal, mask)
        p = torch.exp(scores - lse.to(compute).unsqueeze(-1))
        dv = torch.matmul(p.transpose(-2, -1), doc)
        dp = torch.matmul(doc, vc.transpose(-2, -1))
        delta = (doc * out.to(compute)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kc) * self.scale
        dk = torch.matmul(ds.transpose(-2, -1), qc) * self.scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _flash_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        dout_t, out_t = dout.transpose(1, 2).contiguous(), out.transpose(1, 2).contiguous()
        flash_attn_backward(dout_t, (qt, kt, vt), out_t, lse, (dq, dk, dv), causal, self.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask ``[b, 1, s_q, s_k]`` as the additive one ATen's CPU flash kernel takes (0 / ``-inf``)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _merge(acc_out: Optional[Tensor], acc_lse: Optional[Tensor], out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attention results over disjoint key sets by the log-sum-exp rule (module docstring).
    ``acc_out`` float32/64 ``[b, h, s, d]``, ``acc_lse`` ``[b, h, s]``; returns the merged pair. Without an
    accumulator the pair returned is a copy, never the kernel's own tensors: the ring updates its accumulators in
    place (:func:`_merge_rows`), and selective activation checkpointing keeps the kernel's outputs for the
    recomputation and refuses them mutated."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    if acc_out is None or acc_lse is None:
        return out.to(dtype, copy=True), lse.to(dtype, copy=True)
    out, lse = out.to(dtype), lse.to(dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    merged = acc_out * torch.exp(acc_lse - new_lse).unsqueeze(-1) + out * torch.exp(lse - new_lse).unsqueeze(-1)
    return merged, new_lse


def _merge_rows(acc_out: Tensor, acc_lse: Tensor, rows: slice, out: Tensor, lse: Tensor) -> None:
    """:func:`_merge` into the query rows ``rows`` of the accumulators, in place."""
    merged, new_lse = _merge(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)
    acc_out[:, :, rows] = merged
    acc_lse[:, :, rows] = new_lse


def _without_autocast(fn: Callable) -> Callable:
    """Run an autograd.Function's forward/backward with autocast off: the inputs already have their compute dtype
    (bf16 under ``bf16-mixed``), and the log-sum-exp merge and the eager kernel must stay in float32."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        device = next(a.device.type for a in args if isinstance(a, Tensor))
        with torch.autocast(device_type=device, enabled=False):
            return fn(ctx, *args)

    return wrapper


# ---------------------------------------------------------------------------------------------------- documents
class _Documents:
    """Document masking under cp: the document ids ``[b, s]`` of the whole sequence (on every cp rank), and the
    mask of any block of (query, key) pairs between two ranks' zigzag shards, from the tokens' positions in the whole
    sequence (:func:`lightning_4d.models.document_mask.document_mask`: causal and within one document)."""

    def __init__(self, document_ids: Tensor, size: int) -> None:
        self.ids, self.size = document_ids, size
        self.chunk = document_ids.shape[-1] // (2 * size)

    def shard(self, rank: int) -> tuple[Tensor, Tensor]:
        """Rank ``rank``'s tokens: their positions ``[s/c]`` and document ids ``[b, s/c]``."""
        local = 2 * self.chunk
        positions = context_parallel_positions(local, rank, self.size, device=self.ids.device)
        return positions, self.ids[:, positions]

    def mask(self, q_rank: int, rows: slice, k_rank: int, cols: slice) -> Optional[Tensor]:
        """The mask ``[b, 1, rows, cols]`` of rank ``q_rank``'s query rows against rank ``k_rank``'s key columns (of
        their local tokens), or ``None`` when it allows no pair (the block is skipped)."""
        q_pos, q_ids = self.shard(q_rank)
        k_pos, k_ids = self.shard(k_rank)
        mask = document_mask(q_pos[rows], k_pos[cols], q_ids[:, rows], k_ids[:, cols])
        return mask if bool(mask.any()) else None


def ring_blocks(document_ids: Tensor, size: int) -> tuple[int, int]:
    """``(computed, total)`` (query, key) blocks of the zigzag ring with document masking over ``size`` cp ranks
    (every rank, every step; a block no document spans is skipped): what :class:`_RingAttention` computes of
    ``document_ids`` ``[b, s]``. Pure arithmetic on the ids (``benchmarks/cp_document_masking.py``)."""
    docs, computed = _Documents(document_ids, size), 0
    for rank in range(size):
        for step in range(size):
            rows, cols = _ring_block(rank, (rank - step) % size, 2 * docs.chunk)
            computed += docs.mask(rank, rows, (rank - step) % size, cols) is not None
    return computed, size * size


def _ring_block(rank: int, source: int, local: int) -> tuple[slice, slice]:
    """The query rows and key columns (of the local tokens) rank ``rank`` computes against rank ``source``'s K/V in
    the zigzag ring (module docstring): all against all for its own block, all rows against the first chunk of an
    earlier rank's, the second chunk's rows against all of a later rank's."""
    half = local // 2
    if source == rank:
        return slice(0, local), slice(0, local)
    if source < rank:
        return slice(0, local), slice(0, half)
    return slice(half, local), slice(0, local)


# ---------------------------------------------------------------------------------------------------- ring
class _RingExchange:
    """Send a tensor to the next rank of the cp ring and receive the previous rank's (asynchronous)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.send_to = dist.get_global_rank(group, (rank + 1) % size)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % size)
        self._reqs: list[Any] = []
        self._buffer: Optional[Tensor] = None
        self._sent: Optional[Tensor] = None

    def start(self, x: Tensor) -> None:
        x = x.contiguous()
        self._sent = x  # alive until the send completes
        self._buffer = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.send_to, group=self.group),
            dist.P2POp(dist.irecv, self._buffer, self.recv_from, group=self.group),
        ]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> Tensor:
        for req in self._reqs:
            req.wait()
        self._reqs, self._sent = [], None
        assert self._buffer is not None
        out, self._buffer = self._buffer, None
        return out


@dataclasses.dataclass(frozen=True)
class _CPRun:
    """What the autograd functions of cp attention below take beside their tensors (q, k, v and the document ids,
    which they save for backward): the cp process group and the kernel of their blocks."""

    group: dist.ProcessGroup
    kernel: _Kernel


class _RingAttention(torch.autograd.Function):
    """Zigzag ring attention (module docstring). Inputs/outputs in ``[b, heads, s_local, d]``; ``document_ids``
    ``[b, s]`` of the whole sequence, or ``None`` (causal)."""

    @staticmethod
    @_without_autocast
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], run: _CPRun) -> Tensor:
        group, kernel = run.group, run.kernel
        out, lse = _ring_forward(q, k, v, group, kernel, document_ids)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.run = run
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, (q, k, v, out, lse), ctx.run.group, ctx.run.kernel, document_ids)
        return dq, dk, dv, None, None


def _ring_step_block(
    rank: int, source: int, local: int, docs: Optional[_Documents]
) -> tuple[slice, slice, bool, Optional[Tensor], bool]:
    """What rank ``rank`` computes against rank ``source``'s K/V: ``(rows, cols, causal, mask, skip)``: the block
    of :func:`_ring_block`; causal on its own block without document masking; with it (``docs``) the block's mask,
    and ``skip`` when no document spans the block."""
    rows, cols = _ring_block(rank, source, local)
    if docs is None:
        return rows, cols, source == rank, None, False
    mask = docs.mask(rank, rows, source, cols)
    return rows, cols, False, mask, mask is None


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, kernel: _Kernel, document_ids: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """The ring's forward (``[b, heads, s_local, d]``): each step's block (:func:`_ring_step_block`) merged into the
    accumulators by the log-sum-exp rule while the next K/V block travels (one message per step, ``[2, b, h_kv,
    s_local, d]``). Returns the output in ``q``'s dtype and the log-sum-exp."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    docs = _Documents(document_ids, size) if document_ids is not None else None
    kv = torch.stack([k, v])
    comm = _RingExchange(group) if size > 1 else None
    acc_out: Optional[Tensor] = None
    acc_lse: Optional[Tensor] = None
    for step in range(size):
        if comm is not None and step + 1 < size:
            comm.start(kv)  # the next block travels while this one is computed
        rows, cols, causal, mask, skip = _ring_step_block(rank, (rank - step) % size, q.shape[2], docs)
        if not skip:
            out, lse = kernel.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, mask)
            if acc_out is None or acc_lse is None:  # step 0: every row (each query attends to itself)
                acc_out, acc_lse = _merge(None, None, out, lse)
            else:
                _merge_rows(acc_out, acc_lse, rows, out, lse)
        if comm is not None and step + 1 < size:
            kv = comm.wait()
    assert acc_out is not None and acc_lse is not None
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(
    dout: Tensor,
    saved: tuple[Tensor, ...],
    group: dist.ProcessGroup,
    kernel: _Kernel,
    document_ids: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """The ring's backward: the forward's blocks again (skipped ones too). dq accumulates locally; the dK/dV of
    each block travels with it from the first rank after its owner round the ring back to the owner (``c - 1``
    sends), which keeps its own contribution (step 0) and adds the arriving sum last. Returns ``(dq, dk, dv)`` in
    the inputs' dtypes."""
    q, k, v, out, lse = saved
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    docs = _Documents(document_ids, size) if document_ids is not None else None
    dout = dout.contiguous()
    grad_dtype = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=grad_dtype, device=q.device)
    kv = torch.stack([k, v])
    kv_comm = _RingExchange(group) if size > 1 else None
    dkv_comm = _RingExchange(group) if size > 1 else None
    own: Optional[Tensor] = None  # this rank's contribution to its own block's dK/dV (step 0), kept to the end
    for step in range(size):
        if kv_comm is not None and step + 1 < size:
            kv_comm.start(kv)
        rows, cols, causal, mask, skip = _ring_step_block(rank, (rank - step) % size, q.shape[2], docs)
        block = torch.zeros((2, *kv[0].shape), dtype=grad_dtype, device=q.device)
        if not skip:
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                lse[:, :, rows], causal, mask,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            block[0][:, :, cols] += dk_b
            block[1][:, :, cols] += dv_b
        if step == 0:
            own = block  # not sent: the other ranks' sum comes back to it after the loop
        else:
            assert dkv_comm is not None
            if step > 1:
                block += dkv_comm.wait()  # the partial dK/dV of this block from the ranks it visited before
            dkv_comm.start(block)  # travels with its block; the send at step c - 1 reaches the owner
        if kv_comm is not None and step + 1 < size:
            kv = kv_comm.wait()
    assert own is not None
    dkv = own + dkv_comm.wait() if dkv_comm is not None else own
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# ---------------------------------------------------------------------------------------------------- all-gather
def _gather_kv(kv: Tensor, group: dist.ProcessGroup, size: int) -> list[Tensor]:
    """All-gather ``[2, b, h_kv, s_local, d]`` blocks; returns the ``2c`` chunks of the full sequence in natural
    order, each ``[2, b, h_kv, C, d]``."""
    parts = [torch.empty_like(kv) for _ in range(size)]
    dist.all_gather(parts, kv, group=group)
    return _unzigzag(parts, dim=3)


class _AllGatherAttention(torch.autograd.Function):
    """All-gather-K/V context-parallel attention (module docstring). Inputs/outputs in ``[b, heads, s_local, d]``."""

    @staticmethod
    @_without_autocast
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], run: _CPRun) -> Tensor:
        group, kernel = run.group, run.kernel
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        full = torch.cat(_gather_kv(torch.stack([k, v]).contiguous(), group, size), dim=3)  # [2, b, h_kv, s, d]
        chunk = q.shape[2] // 2
        outs, lses = [], []
        for local, index in enumerate(zigzag_chunks(rank, size)):
            qa = q[:, :, local * chunk : (local + 1) * chunk]
            acc_out = acc_lse = None
            for keys, causal, mask in _allgather_blocks(index, chunk, document_ids):
                out, lse = kernel.forward(qa, full[0][:, :, keys], full[1][:, :, keys], causal, mask)
                acc_out, acc_lse = _merge(acc_out, acc_lse, out, lse)
            outs.append(acc_out)
            lses.append(acc_lse)
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, full, out, lse, document_ids)
        ctx.run = run
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, full, out, lse, document_ids = ctx.saved_tensors
        group, kernel = ctx.run.group, ctx.run.kernel
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk = q.shape[2] // 2
        dout = dout.contiguous()
        grad_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=grad_dtype, device=q.device)
        dfull = torch.zeros(full.shape, dtype=grad_dtype, device=q.device)
        for local, index in enumerate(zigzag_chunks(rank, size)):
            rows = slice(local * chunk, (local + 1) * chunk)
            args = (dout[:, :, rows], q[:, :, rows])
            tail = (out[:, :, rows], lse[:, :, rows])
            for keys, causal, mask in _allgather_blocks(index, chunk, document_ids):
                dq_b, dk_b, dv_b = kernel.backward(*args, full[0][:, :, keys], full[1][:, :, keys], *tail, causal, mask)
                dq[:, :, rows] += dq_b
                dfull[0][:, :, keys] += dk_b
                dfull[1][:, :, keys] += dv_b
        # every rank's dK/dV of the whole sequence, summed, and this rank's chunks kept
        blocks = dfull.chunk(2 * size, dim=3)
        if dist.get_backend(group) == "nccl":
            send = torch.stack([_take_zigzag(blocks, r, size, dim=3) for r in range(size)])
            mine = torch.empty_like(send[0])  # [2, b, h_kv, s_local, d]
            reduce_scatter_single(mine, send, group=group)
        else:  # gloo has no reduce-scatter
            dist.all_reduce(dfull, group=group)
            mine = _take_zigzag(blocks, rank, size, dim=3)
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None


def _allgather_blocks(
    index: int, chunk: int, document_ids: Optional[Tensor]
) -> list[tuple[slice, bool, Optional[Tensor]]]:
    """The kernel calls of query chunk ``index`` (``chunk`` tokens) against the gathered keys: ``(keys, causal,
    mask)``. Causal: its own chunk (causal), then the chunks before it (unmasked). With document masking: its own
    chunk masked, then the keys from the start of the document its first token belongs to (the earliest over the
    batch) up to the chunk, masked; nothing before (no document spans it)."""
    own = slice(index * chunk, (index + 1) * chunk)
    if document_ids is None:
        return [(own, True, None)] + ([(slice(0, index * chunk), False, None)] if index > 0 else [])
    positions = torch.arange(document_ids.shape[-1], device=document_ids.device)
    ids = document_ids

    def masked(keys: slice) -> tuple[slice, bool, Optional[Tensor]]:
        return keys, False, document_mask(positions[own], positions[keys], ids[:, own], ids[:, keys])

    blocks = [masked(own)]
    start = index * chunk
    if start > 0:
        same = ids[:, :start] == ids[:, start : start + 1]  # [b, start]: keys of the first query's document
        first = torch.where(
            same.any(dim=1), same.long().argmax(dim=1), torch.full_like(same[:, 0], start, dtype=torch.long)
        )
        if int(first.min()) < start:
            blocks.append(masked(slice(int(first.min()), start)))
    return blocks


# ---------------------------------------------------------------------------------------------------- all-to-all
def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """All-to-all ``[b, s/c, heads, d]`` (this rank's zigzag shard, heads a multiple of c) into ``[b, s, heads/c,
    d]`` (the whole sequence in natural order, head group ``rank`` of c)."""
    b, local, heads, d = x.shape
    send = x.reshape(b, local, size, heads // size, d).permute(2, 0, 1, 3, 4).contiguous()  # [c, b, s/c, h/c, d]
    recv = torch.empty_like(send)  # recv[r]: rank r's shard of my heads
    dist.all_to_all_single(recv, send, group=group)
    del send
    return torch.cat(_unzigzag(list(recv.unbind(0)), dim=1), dim=1)


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """Inverse of :func:`_sequence_to_heads`: ``[b, s, heads/c, d]`` into this rank's zigzag shard of all heads,
    ``[b, s/c, heads, d]`` (head group ``r`` from rank ``r``)."""
    chunks = x.chunk(2 * size, dim=1)
    send = torch.stack([_take_zigzag(chunks, r, size, dim=1) for r in range(size)])  # [c, b, s/c, h/c, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    del send
    c, b, local, heads, d = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(b, local, c * heads, d)


class _AllToAllAttention(torch.autograd.Function):
    """Ulysses all-to-all context-parallel attention (module docstring). Inputs/outputs in ``[b, s_local, heads, d]``;
    ``k``, ``v`` with their kv heads already a multiple of c (replicated by the caller where needed)."""

    @staticmethod
    @_without_autocast
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, document_ids: Optional[Tensor], run: _CPRun) -> Tensor:
        group, kernel = run.group, run.kernel
        size = dist.get_world_size(group)
        nq, nkv = q.shape[2] // size, k.shape[2] // size
        b, local, _, d = q.shape
        # one message: per destination rank its q, k, v head groups side by side
        packed = torch.cat([t.reshape(b, local, size, -1, d) for t in (q, k, v)], dim=3).flatten(2, 3)
        full = _sequence_to_heads(packed, group, size)  # [b, s, nq + 2·nkv, d]
        del packed
        qf, kf, vf = (t.transpose(1, 2) for t in full.split([nq, nkv, nkv], dim=2))
        mask = window_mask(document_ids)  # the whole sequence in natural order: one mask (None: causal)
        out, lse = kernel.forward(qf, kf, vf, True, mask)  # [b, nq, s, d]
        ctx.save_for_backward(qf, kf, vf, out, lse, document_ids)  # the ids, shared by every layer: the mask is rebuilt
        ctx.run = run
        return _heads_to_sequence(out.transpose(1, 2), group, size)

    @staticmethod
    @_without_autocast
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        qf, kf, vf, out, lse, document_ids = ctx.saved_tensors
        group, kernel = ctx.run.group, ctx.run.kernel
        size = dist.get_world_size(group)
        dout_full = _sequence_to_heads(dout.contiguous(), group, size).transpose(1, 2)
        dq, dk, dv = kernel.backward(dout_full, qf, kf, vf, out, lse, True, window_mask(document_ids))
        del dout_full
        nq, nkv = dq.shape[1], dk.shape[1]
        grads = torch.cat([t.transpose(1, 2).to(qf.dtype) for t in (dq, dk, dv)], dim=2)  # [b, s, nq + 2·nkv, d]
        del dq, dk, dv
        b, s, _, d = grads.shape
        local = s // size
        # per source rank r (head group r): its q, k, v head groups side by side
        back = _heads_to_sequence(grads, group, size).view(b, local, size, nq + 2 * nkv, d)
        dq, dk, dv = (t.reshape(b, local, size * t.shape[3], d) for t in back.split([nq, nkv, nkv], dim=3))
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------------- public
def _check_method(method: str) -> None:
    if method not in CONTEXT_PARALLEL_METHODS:
        raise ValueError(
            f"context_parallel_method={method!r} is not valid: expected one of {list(CONTEXT_PARALLEL_METHODS)}."
        )


# compile=True: runs eagerly between the compiled parts of a layer (Dynamo does not trace the ring's P2P ops: measured
# on torch 2.13, "P2P compilation is disabled" broke the layer's graph and nothing of it compiled)
@torch.compiler.disable
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    method: str = "ring",
    backend: str = "sdpa",
    document_ids: Optional[Tensor] = None,
) -> Tensor:
    """Causal self-attention over the full sequence when each cp rank holds its zigzag shard of it.

    Args:
        q: queries ``[b, s/c, n_q_heads, head_dim]`` (this rank's chunks ``i`` and ``2c-1-i``, in that order).
        k, v: ``[b, s/c, n_kv_heads, head_dim]``; ``n_q_heads`` a multiple of ``n_kv_heads`` (GQA).
        group: the cp process group (c ranks; c = 1 gives plain causal attention).
        method: ``"ring"``, ``"allgather"`` or ``"alltoall"`` (module docstring).
        backend: kernel, ``"sdpa"`` (ATen's fused kernels), ``"flash"`` (flash-attn 2, CUDA) or ``"eager"``.
        document_ids: ``None`` (causal attention), or the document ids ``LongTensor [b, s]`` of the whole sequence
            (the same on every cp rank): attention also stays within each document, and blocks no document spans
            are skipped (module docstring, "Document masking").

    Returns:
        ``[b, s/c, n_q_heads, head_dim]`` in ``q``'s dtype; output and q/k/v gradients equal those of full causal
        attention on the unsharded sequence (tested to 1e-6 in float64).

    Raises:
        ValueError: an unknown method or backend; q, k, v shapes that do not fit (odd local length, heads not a
            multiple of kv heads; under ``"alltoall"`` heads that do not split over c,
            :func:`~lightning_4d.features.context_parallel.alltoall_heads`).
    """
    _check_method(method)
    if backend not in ("sdpa", "flash", "eager"):
        raise ValueError(f"attention backend={backend!r} is not valid: expected one of ['sdpa', 'flash', 'eager'].")
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [b, s/c, heads, d] "
            "with k and v of one shape."
        )
    if q.shape[1] % 2 != 0:
        raise ValueError(f"local sequence length {q.shape[1]} is odd: a cp shard holds two equal chunks.")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}).")
    kernel = _Kernel(backend, 1.0 / math.sqrt(q.shape[-1]))
    if method == "alltoall":
        size = dist.get_world_size(group)
        alltoall_heads(q.shape[2], k.shape[2], 1, size)  # the local heads split over c (or refused)
        if k.shape[2] < size:  # too few kv heads: each replicated, so that every rank receives the one it needs
            k, v = (t.repeat_interleave(size // t.shape[2], dim=2) for t in (k, v))
        return _AllToAllAttention.apply(q, k, v, document_ids, _CPRun(group, kernel))
    fn = _RingAttention if method == "ring" else _AllGatherAttention
    out = fn.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids, _CPRun(group, kernel))
    return out.transpose(1, 2)


class ContextParallelAttention:
    """The attention function a ``lightning_4d`` ``Attention`` module calls instead of plain causal attention under
    cp (set by the model family's ``apply_context_parallel``, :mod:`lightning_4d.families.native_llama`):
    ``__call__(q, k, v, backend) -> out`` with the shapes of
    :func:`context_parallel_attention`."""

    def __init__(self, group: dist.ProcessGroup, method: str) -> None:
        _check_method(method)
        self.group, self.method = group, method

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, backend: str, document_ids: Optional[Tensor] = None) -> Tensor:
        return context_parallel_attention(q, k, v, self.group, self.method, backend, document_ids)
