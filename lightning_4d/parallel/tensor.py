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
  (``Shard(-1)``) as a DTensor, for the vocabulary-parallel cross-entropy of :mod:`lightning_4d.parallel.loss` (no
  full-vocabulary logits on any rank).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
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
