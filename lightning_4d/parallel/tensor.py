"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053) with sequence parallelism
(Korthikanti et al. 2022, arXiv 2205.05198) for ``lightning_4d`` Llama models, with DTensor ``parallelize_module``.

Per transformer block, over a tp group of size t:

- ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` are split by output features (column parallel): each rank holds a/t query
  heads, k/t kv heads and f/t FFN columns, so attention and SwiGLU run locally on the rank's heads/columns;
- ``wo`` and ``w2`` are split by input features (row parallel); their partial outputs are summed across the group
  (all-reduce; with sequence parallelism a reduce-scatter over the sequence instead);
- with sequence parallelism the RMSNorms and residual stream hold ``s/t`` tokens per rank (``Shard(1)`` of
  ``[b, s, h]``) and the sequence is all-gathered before ``wq/wk/wv`` and ``w1/w3``, once per group of projections
  (:class:`_SequenceParallelProjection`): only the rank's sequence shard is saved for backward, which all-gathers
  it again for the weight gradients (Korthikanti et al. 2022, §4.2.2; Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication``), so these inputs cost ``1/t`` of the gathered tensor;
- the embedding is split by vocabulary rows, the LM head by vocabulary columns; its logits stay vocabulary-sharded
  (``Shard(-1)``) as a DTensor, for the vocabulary-parallel cross-entropy of :mod:`lightning_4d.parallel.loss` (no
  full-vocabulary logits on any rank).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_4d.parallel._compat import all_gather_single, reduce_scatter_single


class _SequenceParallelProjection(torch.autograd.Function):
    """``outs[i] = all_gather_seq(x) @ weights[i].T`` for the column-parallel projections that share one input
    under sequence parallelism, saving for backward only ``x`` (this rank's sequence shard) and the weights.

    Forward: ``x`` ``[b, s/t, h]`` is all-gathered over the tp group along the sequence (rank order, as DTensor's
    ``Shard(1)``) to ``[b, s, h]``, each local weight ``[o_i/t, h]`` gives ``[b, s, o_i/t]``. Backward: the sequence
    is all-gathered again (one more all-gather per group of projections, Megatron-LM's trade), ``dW_i = g_i^T x_full``,
    ``dx_full = sum_i g_i W_i``, reduce-scattered along the sequence to ``[b, s/t, h]``. Under autocast the inputs
    are cast to the autocast dtype first, as autocast would; gradients come back in each input's own dtype.
    """

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:  # noqa: D102
        ctx.group, ctx.dtypes = group, (x.dtype, *(w.dtype for w in weights))
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), tuple(w.to(dtype) for w in weights)
        with torch.autocast(x.device.type, enabled=False):
            full = _all_gather_sequence_shards(x, group)
            outs = tuple(full @ w.t() for w in weights)
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:  # noqa: D102
        x, *weights = ctx.saved_tensors
        full = _all_gather_sequence_shards(x, ctx.group)
        flat = full.reshape(-1, full.shape[-1])
        grad_full = sum(g.to(w.dtype) @ w for g, w in zip(grads, weights))
        grad_weights = [(g.reshape(-1, g.shape[-1]).to(flat.dtype).t() @ flat).to(dt)
                        for g, dt in zip(grads, ctx.dtypes[1:])]
        grad_x = _reduce_scatter_sequence_shards(grad_full, ctx.group).to(ctx.dtypes[0])
        return (None, grad_x, *grad_weights)


def _all_gather_sequence_shards(x: Tensor, group: Any) -> Tensor:
    """``[b, s/t, h]`` of every tp rank -> ``[b, s, h]`` (rank order along the sequence)."""
    t = dist.get_world_size(group)
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    return out.view(t, *x.shape).permute(1, 0, *range(2, x.ndim + 1)).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])


def _reduce_scatter_sequence_shards(x: Tensor, group: Any) -> Tensor:
    """``[b, s, h]`` summed over the tp ranks, this rank's ``[b, s/t, h]`` sequence shard kept."""
    t = dist.get_world_size(group)
    parts = x.reshape(x.shape[0], t, x.shape[1] // t, *x.shape[2:]).transpose(0, 1)
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, parts.reshape(-1, *parts.shape[2:]), group=group)
    return out


def sequence_parallel_projection(x: Tensor, linears: tuple[nn.Linear, ...], group: Any) -> tuple[Tensor, ...]:
    """The column-parallel projections ``linears`` (weights ``Shard(0)`` DTensors over tp) of the sequence-sharded
    ``x`` (a ``Shard(1)`` DTensor, or its local ``[b, s/t, h]``): the local outputs ``[b, s, o_i/t]`` (as
    ``ColwiseParallel`` returns them), saving only the shard of ``x`` (:class:`_SequenceParallelProjection`;
    Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2). ``group``: the tp process group.

    Raises:
        RuntimeError: from the collectives, when the ranks of ``group`` pass shards of different shapes.
    """
    local = x.to_local() if isinstance(x, DTensor) else x
    weights = [lin.weight.to_local() if isinstance(lin.weight, DTensor) else lin.weight for lin in linears]
    return _SequenceParallelProjection.apply(group, local, *weights)


def _sequence_parallel_head(x: Tensor, output: nn.Linear, mesh: DeviceMesh) -> Tensor:
    """The LM head on the sequence-sharded final hidden states ``x`` (``[b, s/t, h]``): logits ``[b, s, V]`` as a
    vocabulary-sharded DTensor (``Shard(-1)``, local ``[b, s, V/t]``), as ``ColwiseParallel(input_layouts=Shard(1),
    output_layouts=Shard(-1))`` gives them, saving only ``x`` (:func:`sequence_parallel_projection`)."""
    (local,) = sequence_parallel_projection(x, (output,), mesh.get_group())
    return DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard a ``LlamaModel`` (or a pipeline stage of one) in place over ``tp_mesh``.

    Args:
        model: a :class:`lightning_4d.models.LlamaModel`, usually still on the meta device.
        tp_mesh: the 1D ``"tp"`` mesh.
        sequence_parallel: shard norms and the residual stream over the sequence (requires s % t == 0).

    Tied embeddings: the embedding and the head both shard the ``[V, h]`` matrix by rows (``Shard(0)``); they are
    re-tied to one DTensor after parallelization.
    """
    if tp_mesh.size() == 1:
        return
    seq = Shard(1) if sequence_parallel else Replicate()
    tied = (
        getattr(model, "tok_embeddings", None) is not None
        and getattr(model, "output", None) is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if tied:
        # distribute the shared matrix once (through the embedding), then re-tie below
        model.output.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())
    parallelize_module(model, tp_mesh, top)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    if getattr(model, "output", None) is not None and sequence_parallel:
        # the head gathers the sequence itself and saves only the shard (its plan above only shards its weight)
        model.head_projection = partial(_sequence_parallel_head, mesh=tp_mesh)

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # the projections gather the sequence themselves (the linears' plans only shard their weights)
            del plan["attention"], plan["feed_forward"]
            projection = partial(sequence_parallel_projection, group=tp_mesh.get_group())
            block.attention.input_projection = projection
            block.feed_forward.input_projection = projection
        parallelize_module(block, tp_mesh, plan)
