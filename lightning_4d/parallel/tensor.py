"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053) with sequence parallelism
(Korthikanti et al. 2022, arXiv 2205.05198) for ``lightning_4d`` Llama models, with DTensor ``parallelize_module``.

Per transformer block, over a tp group of size t:

- ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` are split by output features (column parallel): each rank holds a/t query
  heads, k/t kv heads and f/t FFN columns, so attention and SwiGLU run locally on the rank's heads/columns;
- ``wo`` and ``w2`` are split by input features (row parallel); their partial outputs are summed across the group
  (all-reduce; with sequence parallelism a reduce-scatter over the sequence instead);
- with sequence parallelism the RMSNorms and residual stream hold ``s/t`` tokens per rank (``Shard(1)`` of
  ``[b, s, h]``) and the sequence is all-gathered before ``wq/wk/wv`` and ``w1/w3``;
- the embedding is split by vocabulary rows, the LM head by vocabulary columns; its logits stay vocabulary-sharded
  (``Shard(-1)``) as a DTensor, for ``torch.distributed.tensor.parallel.loss_parallel`` (no full-vocabulary logits
  on any rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn
import torch.nn.functional as F
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
        parallelize_module(block, tp_mesh, plan)


_loss_parallel_depth = 0


@contextmanager
def vocab_parallel_loss(enabled: bool = True) -> Iterator[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``enabled`` (the logits are vocabulary-sharded
    DTensors, tp > 1), else nothing; may be nested.

    The cross-entropy's forward AND its backward must run inside it: :func:`causal_lm_loss` enters it for the
    forward, the strategy's ``backward`` and the pipeline schedule (whose backward runs after the loss function
    returned) for the backward. ``loss_parallel`` switches DTensor's custom cross-entropy handlers on at entry and
    off at exit, so an inner use would switch them off for an outer one: only the outermost entry here enters
    ``loss_parallel``.
    """
    global _loss_parallel_depth
    if not enabled:
        yield
        return
    if _loss_parallel_depth > 0:
        _loss_parallel_depth += 1
        try:
            yield
        finally:
            _loss_parallel_depth -= 1
        return
    from torch.distributed.tensor.parallel import loss_parallel

    _loss_parallel_depth += 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_depth -= 1


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats per token, computed in float32.

    Args:
        logits: ``[b, s, V]`` (a DTensor sharded over the vocabulary, ``Shard(-1)``, under tensor parallelism).
        labels: ``[b, s]`` token ids (the inputs shifted by one).

    Returns:
        A float32 scalar (a replicated DTensor under tp).

    Under tensor parallelism the loss is computed on the vocabulary-sharded logits inside
    :func:`vocab_parallel_loss` (``torch.distributed.tensor.parallel.loss_parallel``: no full-vocabulary logits are
    gathered); its backward must run inside :func:`vocab_parallel_loss` too.
    """
    with vocab_parallel_loss(isinstance(logits, DTensor)):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
