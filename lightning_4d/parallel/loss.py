"""The causal-LM loss: an exact cross-entropy, chunked over tokens and split over the vocabulary under tensor
parallelism, that never holds full-vocabulary float32 log-probabilities.

``F.cross_entropy(logits.float(), labels)`` saves float32 log-probabilities ``[N, V]`` for backward and makes, in
backward, their gradient, the float32 logits' gradient and the cast back to the compute dtype: 14 bytes per logit
with bfloat16 logits. :func:`vocab_parallel_cross_entropy` saves instead, for N tokens, V/t logits per token (t the
tensor-parallel size, 1 without tp) and c bytes per logit (the compute dtype):

- the logits as the LM head produced them (the same storage, no copy): ``c·N·V/t`` bytes;
- the float32 log-sum-exp of every token: ``4·N``; the labels (int64): ``8·N``.

Its forward takes the tokens ``loss_chunk_tokens(V/t)`` at a time (:func:`lightning_4d.partition.loss_chunk_tokens`:
at most ``LOSS_CHUNK_BYTES`` = 64 MiB of float32 per chunk, or one token), so beyond the saved tensors it holds one
chunk's float32 ``exp(x - max)``. Its backward recomputes the softmax of one chunk at a time from the logits and the
saved log-sum-exp (the way FlashAttention's backward recomputes attention from its saved log-sum-exp: Dao et al.
2022, arXiv 2205.14135, §3.1) and writes ``(softmax − one-hot) · dloss / n`` (n the tokens whose label is not
ignored; 0 for an ignored token) into one gradient of the logits' dtype (``c·N·V/t`` bytes); with float32 logits
the chunk is computed in place in the gradient, otherwise one chunk's float32 softmax is held besides.

Under tensor parallelism the logits are split over the vocabulary (the LM head is column parallel, ``Shard(-1)``:
rank r holds columns ``[r·V/t, (r+1)·V/t)``) and the loss is Megatron-LM's vocabulary-parallel cross-entropy
(Shoeybi et al. 2019, arXiv 1909.08053, §3: the vocabulary-parallel output embedding's output is fused with the
cross-entropy, so only b·s values are communicated; ``megatron/core/tensor_parallel/cross_entropy.py``): per token
the ranks all-reduce the MAX of their local maxima, then the SUM of their local sums of ``exp(x - max)`` and the SUM
of the target logit (picked by the one rank that holds the target's column; both sums in one all-reduce of
``[2, N]`` floats), so no rank holds full-vocabulary logits; the gradient of a local shard needs no communication.
Megatron-LM saves the float32 softmax (4 bytes per local logit); this function saves the log-sum-exp (4 bytes per
token) and the logits it already has.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from lightning_4d.partition import loss_chunk_tokens

__all__ = ["causal_lm_loss", "vocab_parallel_cross_entropy"]


def _targets(labels: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """(owned, index) of flat ``labels``: whether this rank holds the target's column (never for an ignored
    label: ``vocab_start >= 0``), and the target's local column (0 where not owned)."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    return owned, torch.where(owned, local, 0).long()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``[N, V/t]`` logits (any leading shape, flattened) against ``[N]`` labels; see the
    module docstring and :func:`vocab_parallel_cross_entropy`."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        group: Optional[dist.ProcessGroup],
        vocab_start: int,
        ignore_index: int,
        chunk_tokens: int,
    ) -> Tensor:
        x = logits.reshape(-1, logits.shape[-1])
        y = labels.reshape(-1)
        n, local_vocab = x.shape
        row_max = x.amax(dim=-1).float()  # a reduction: no [N, V/t] temporary
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        owned, index = _targets(y, vocab_start, local_vocab)
        sums = torch.empty(2, n, dtype=torch.float32, device=x.device)  # local sum of exp(x - max), target logit
        for i in range(0, n, chunk_tokens):
            j = min(n, i + chunk_tokens)
            # float32 by type promotion (a bfloat16 chunk minus float32 maxima): the chunk's one temporary
            sums[0, i:j] = torch.sub(x[i:j], row_max[i:j, None]).exp_().sum(dim=-1)
        sums[1] = torch.where(owned, x.gather(1, index[:, None]).squeeze(1).float(), 0.0)
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = row_max + sums[0].log()
        valid = y != ignore_index
        loss = torch.where(valid, lse - sums[1], 0.0).sum() / valid.sum()  # nan when every label is ignored
        ctx.save_for_backward(logits, lse, labels)
        ctx.vocab_start, ctx.ignore_index, ctx.chunk_tokens = vocab_start, ignore_index, chunk_tokens
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, lse, labels = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        y = labels.reshape(-1)
        n, local_vocab = x.shape
        owned, index = _targets(y, ctx.vocab_start, local_vocab)
        valid = y != ctx.ignore_index
        row_scale = torch.where(valid, grad_loss.float() / valid.sum(), 0.0)  # dloss/n, 0 for an ignored token
        work = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 logits: float64)
        minus_one_hot = -owned.to(work)[:, None]
        grad = torch.empty_like(x, memory_format=torch.contiguous_format)
        in_place = x.dtype == work
        step = ctx.chunk_tokens
        for i in range(0, n, step):
            j = min(n, i + step)
            # softmax = exp(x - lse) in float32: in the gradient itself for float32 logits, else one chunk's temporary
            p = torch.sub(x[i:j], lse[i:j, None], out=grad[i:j] if in_place else None).exp_()
            p.scatter_add_(1, index[i:j, None], minus_one_hot[i:j]).mul_(row_scale[i:j, None])
            if not in_place:
                grad[i:j].copy_(p)
            del p  # else the chunk's temporary lives on beside the next one's (two chunks, not the one modelled)
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: int = 0,
    *,
    ignore_index: int = -100,
    chunk_tokens: Optional[int] = None,
) -> Tensor:
    """Mean cross-entropy over the tokens whose label is not ``ignore_index``, in nats per token, computed in float32
    (``F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)``, reduction ``"mean"``), chunked over
    tokens and split over the vocabulary when ``group`` is given (module docstring: algorithm, saved bytes, sources).

    Args:
        logits: ``[..., V/t]`` plain tensor, any float dtype (the compute dtype; not copied): all V logits without
            tp, else this rank's columns ``[vocab_start, vocab_start + V/t)`` of them.
        labels: ``[...]`` integer token ids in ``[0, V)``, or ``ignore_index``; same leading shape as ``logits``.
        group: the tensor-parallel process group over which the vocabulary is split, ``None`` without tp.
        vocab_start: the first vocabulary column this rank holds (``rank · V/t``; 0 without tp).
        ignore_index: a label that contributes neither to the loss nor to the token count.
        chunk_tokens: tokens per chunk (default :func:`lightning_4d.partition.loss_chunk_tokens`, about 64 MiB of
            float32 per chunk).

    Returns:
        A float32 scalar (a plain tensor, the same on every rank of ``group``); ``nan`` when every label is ignored,
        as ``F.cross_entropy``. Its gradient with respect to ``logits`` has their dtype and shape.

    Raises:
        ValueError: ``labels``' shape is not ``logits``' without the last dimension, ``labels`` are not integers,
            ``chunk_tokens`` or ``vocab_start`` is negative, or ``chunk_tokens`` is 0.

    Labels outside ``[0, V)`` other than ``ignore_index`` are not checked (a check would stop the host for the
    device): without tp ``gather`` fails on them as ``F.cross_entropy`` does, with tp no rank owns them and their
    target logit counts as 0.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match logits of shape {tuple(logits.shape)}: "
            f"expected labels of shape {tuple(logits.shape[:-1])} (one label per token)."
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels have dtype {labels.dtype}: expected integer token ids (torch.long).")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} is not valid: expected a positive number of tokens per chunk.")
    if vocab_start < 0:
        raise ValueError(f"vocab_start={vocab_start} is not valid: expected this rank's first vocabulary column, >= 0.")
    step = chunk_tokens or loss_chunk_tokens(logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, ignore_index, step)


def _vocabulary_shard(logits: DTensor) -> tuple[Tensor, Optional[dist.ProcessGroup], int]:
    """(local logits, tp group or ``None``, first vocabulary column) of a DTensor's logits; ``to_local`` is
    differentiable, so the gradient reaches the DTensor with its placement."""
    mesh, placements = logits.device_mesh, logits.placements
    vocab_dim = logits.ndim - 1
    if mesh.ndim == 1 and placements[0].is_replicate():
        return logits.to_local(), None, 0
    if mesh.ndim != 1 or not (placements[0].is_shard() and placements[0].dim % logits.ndim == vocab_dim):
        raise ValueError(
            f"logits placed {placements} on a {mesh.ndim}-D mesh: causal_lm_loss expects logits split over the "
            "vocabulary (Shard(-1)) or replicated on the 1-D tensor-parallel mesh, as the LM head's "
            "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) makes them."
        )
    per_rank = -(-logits.shape[-1] // mesh.size())  # DTensor's Shard: ceil(V/t) columns per rank, in rank order
    return logits.to_local(), mesh.get_group(), mesh.get_local_rank() * per_rank


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats per token, computed in float32, over the tokens whose label is not
    -100 (``F.cross_entropy``'s ``ignore_index``; our data never produces it).

    Args:
        logits: ``[b, s, V]`` in the compute dtype: a plain tensor, or under tensor parallelism a DTensor split over
            the vocabulary on the tp mesh (``Shard(-1)``, local ``[b, s, V/t]``; its gradient comes back as one).
        labels: ``[b, s]`` token ids (the inputs shifted by one).

    Returns:
        A float32 scalar, a plain tensor (also under tp: the same value on every tp rank).

    Raises:
        ValueError: labels that do not match the logits; DTensor logits neither ``Shard(-1)`` nor replicated on a
            1-D mesh.

    The vocabulary-parallel, chunked cross-entropy of :func:`vocab_parallel_cross_entropy` (Megatron-LM's
    vocabulary-parallel cross-entropy, Shoeybi et al. 2019, arXiv 1909.08053, §3): no full-vocabulary logits are
    gathered, and only the logits (no copy), a float32 log-sum-exp per token and the labels are saved for backward.
    Its backward needs no context around it.
    """
    if isinstance(logits, DTensor):
        local, group, vocab_start = _vocabulary_shard(logits)
        return vocab_parallel_cross_entropy(local, labels, group, vocab_start)
    return vocab_parallel_cross_entropy(logits, labels)
