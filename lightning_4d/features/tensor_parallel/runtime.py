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
  full-vocabulary logits on any rank);
- a Mixture-of-Experts feed-forward is not split (:class:`TokenParallel`, ``docs/moe_design.md``): each tp rank runs the
  whole layer (its router and feed-forwards, replicated over tp) on its own ``s/t`` tokens of the sequence, as
  one more data-parallel dimension for that layer (no tp inside the MoE layer: Megatron-core's "MoE parallel
  folding" recommends it, torchtitan supports it). Its parameters' gradients are then partial sums over tp, summed
  by the gradient buckets over the ``dp_cp_tp`` group (:mod:`lightning_4d.parallel.grad_buffers`);
- with the ring overlap (sp only) the all-gather→matmul and matmul→reduce-scatter projections run as rings
  of ``t`` send/recv steps overlapped with the matmuls (:class:`_RingAllGatherMatmul`,
  :class:`_RingMatmulReduceScatter`): the same bytes, no gathered sequence and no ``[b, s, h]`` partial sum held.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_4d.module_tree import find_submodel, layer_items
from lightning_4d.parallel._compat.collectives import all_gather_single, reduce_scatter_single
from lightning_4d.parallel.float8 import tensor_parallel_styles


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
        grad_weights = [
            (g.reshape(-1, g.shape[-1]).to(flat.dtype).t() @ flat).to(dt) for g, dt in zip(grads, ctx.dtypes[1:])
        ]
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


class _ScatterSequence(torch.autograd.Function):
    """``[b, s, h]`` replicated over tp -> this rank's ``[b, s/t, h]`` (a contiguous copy, so the full tensor is not
    kept alive by what the layer saves); backward all-gathers the shards' gradients along the sequence, the full
    gradient every tp rank holds in the replicated region (Megatron-LM's ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: D102
        ctx.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        n = x.shape[1] // t
        return x[:, r * n : (r + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None]:  # noqa: D102
        return _all_gather_sequence_shards(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """Every tp rank's ``[b, s/t, h]`` -> ``[b, s, h]`` replicated over tp; backward keeps this rank's shard of the
    (replicated, identical on every tp rank) gradient (Megatron-LM's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: D102
        ctx.group = group
        return _all_gather_sequence_shards(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None]:  # noqa: D102
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        n = grad.shape[1] // t
        return grad[:, r * n : (r + 1) * n].contiguous(), None


class _MeanOverGroup(torch.autograd.Function):
    """``mean_r x_r`` over the tp group (all-reduce), for a scalar the tp ranks then share as they share the
    language-model loss: backward is ``grad / t`` on the rank's own ``x_r`` with no communication (each tp rank's
    backward starts from the same replicated gradient; Megatron-LM's ``reduce_from_tensor_model_parallel_region``,
    scaled)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: D102
        ctx.t = dist.get_world_size(group)
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out / ctx.t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None]:  # noqa: D102
        return grad / ctx.t, None


class TokenParallel:
    """A module that tp does not split, run token parallel: each tp rank runs it whole on its own ``s/t`` tokens
    (its parameters replicated over tp; no tp inside Mixture-of-Experts layers, module docstring).

    ``__call__(x, run)``: ``x`` the module's input, a ``Shard(1)`` DTensor (local ``[b, s/t, h]``) under sequence
    parallelism, else ``[b, s, h]`` replicated over tp; ``run`` the module's computation on ``[b, n, h]`` tokens.
    Under sp ``run`` gets the local shard and its ``[b, s/t, h]`` output is returned as is (the residual stream's
    layout: the row-parallel projections return the local shard too). Without sp the rank's shard is cut out
    (backward: all-gather of the gradient shards) and the outputs are all-gathered along the sequence (backward: the
    rank's shard of the gradient), so the module returns ``[b, s, h]`` replicated like a dense feed-forward.

    ``mean(x)``: the mean of ``x`` over the tp ranks (differentiable: :class:`_MeanOverGroup`), for the
    load-balancing loss' mean router probabilities of the tp group's tokens (:mod:`lightning_4d.features.moe.layer`).

    The gradient a rank computes for the module's parameters comes from its own tokens only: the true gradient is
    their sum over tp. The gradient buckets sum them over the ``dp_cp_tp`` group
    (:func:`token_parallel_parameters`, :class:`lightning_4d.parallel.grad_buffers.GradientBuckets`): one bucketed
    collective with the data-parallel reduction, rather than a DTensor ``Partial`` gradient all-reduced over tp per
    parameter first, and ZeRO 1 then shards their optimizer states over all ``D·t`` ranks.

    Raises:
        ValueError: (forward, without sp) a sequence length not divisible by t (``validate_against_module`` says it
            first when the DataModule has a ``seq_length``).
    """

    def __init__(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        self.group = tp_mesh.get_group()
        self.size = tp_mesh.size()
        self.sequence_parallel = sequence_parallel

    def __call__(self, x: Tensor, run: Any) -> Tensor:
        if self.sequence_parallel:
            return run(x.to_local() if isinstance(x, DTensor) else x)
        if isinstance(x, DTensor):  # replicated
            x = x.to_local()
        if x.shape[1] % self.size:
            raise ValueError(
                f"sequence length {x.shape[1]} is not divisible by tensor_parallel_size={self.size}: a "
                "Mixture-of-Experts layer under tp runs on s/t tokens per tp rank"
            )
        y = run(_ScatterSequence.apply(x, self.group))
        return _GatherSequence.apply(y, self.group)

    def mean(self, x: Tensor) -> Tensor:
        return _MeanOverGroup.apply(x, self.group)


def token_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s submodules that run token parallel (a :class:`TokenParallel` set as their
    ``token_parallel`` by :func:`apply_tensor_parallel`): their gradients are partial sums over tp."""
    params: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if isinstance(getattr(m, "token_parallel", None), TokenParallel):
            params.update({id(p): p for p in m.parameters()})
    return list(params.values())


# ---------------------------------------------------------------------------------------------------- ring (overlap)
def _ring_start(sends: list[Tensor], recvs: list[Tensor], group: Any) -> list[Any]:
    """Post ``isend`` of each of ``sends`` to the next rank of the tp ring and ``irecv`` of each of ``recvs`` from
    the previous one (``dist.batch_isend_irecv`` on ``group``; tag ``i`` pairs the i-th send with the i-th receive).
    Returns the requests to ``wait()`` on."""
    rank, t = group.rank(), group.size()
    ops = [dist.P2POp(dist.isend, s, group=group, group_peer=(rank + 1) % t, tag=i) for i, s in enumerate(sends)]
    ops += [dist.P2POp(dist.irecv, r, group=group, group_peer=(rank - 1) % t, tag=i) for i, r in enumerate(recvs)]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _autocast_inputs(x: Tensor, weights: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Under autocast, ``x`` and ``weights`` cast to the autocast dtype (what autocast does to a matmul's inputs)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype), tuple(w.to(dtype) for w in weights)
    return x, weights


class _RingAllGatherMatmul(torch.autograd.Function):
    """``outs[i] = all_gather_seq(x) @ weights[i].T`` (as :class:`_SequenceParallelProjection`) computed in ``t``
    steps of a ring over the tp group, never gathering the sequence (Wang et al. 2024, "Tessel / spatial-temporal
    tensor partitioning", ASPLOS, DOI 10.1145/3620666.3651357; Megatron-LM's ``--tp-comm-overlap`` ring exchange).

    Forward, rank ``r`` of ``t``: at step ``k`` it holds the sequence shard of rank ``j = (r - k) mod t``
    (``[b, s/t, h]``), posts its send to rank ``r + 1`` and the receive of the next shard from rank ``r - 1``, then
    writes ``x_j @ W_i^T`` into rows ``j·s/t .. (j+1)·s/t`` of each output ``[b, s, o_i/t]``; at most two shards are
    held. Backward, one ring carrying two streams: the input shards again (``dW_i += g_i[rows j]^T x_j``) and the
    input-gradient accumulator of the reduce-scatter side (at step ``k`` rank ``r`` adds ``Σ_i g_i[rows c] W_i``
    for chunk ``c = (r - k - 1) mod t`` to what it received and passes it on; at step ``t - 1``, ``c = r``: its own
    shard's gradient summed over the ranks). Bytes sent per rank: ``(t - 1)`` shards per ring pass, what the
    all-gather and the reduce-scatter send (Thakur et al. 2005). Saved: ``x`` (the rank's shard) and the weights.

    On CUDA, torch's symmetric-memory ``torch.ops.symm_mem.fused_all_gather_matmul`` is the fused route (torchtitan's
    async TP); not used yet (tested on CPU / gloo only).
    """

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:  # noqa: D102
        ctx.group, ctx.dtypes = group, (x.dtype, *(w.dtype for w in weights))
        x, weights = _autocast_inputs(x, weights)
        t, rank, n = group.size(), group.rank(), x.shape[1]
        with torch.autocast(x.device.type, enabled=False):
            outs = tuple(x.new_empty(x.shape[0], t * n, w.shape[0]) for w in weights)
            cur = x.contiguous()
            for k in range(t):
                nxt = torch.empty_like(cur) if k < t - 1 else None
                works = _ring_start([cur], [nxt], group) if nxt is not None else []
                j = (rank - k) % t
                for out, w in zip(outs, weights):
                    out[:, j * n : (j + 1) * n] = cur @ w.t()
                _wait(works)
                cur = nxt
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:  # noqa: D102
        x, *weights = ctx.saved_tensors
        group = ctx.group
        t, rank, n = group.size(), group.rank(), x.shape[1]
        grads = tuple(g.to(w.dtype) for g, w in zip(grads, weights))
        # accumulated over the t steps in the parameters' own dtype (float32 under bf16-mixed)
        grad_weights = [torch.zeros(w.shape, dtype=dt, device=x.device) for w, dt in zip(weights, ctx.dtypes[1:])]
        cur, acc_works, acc_in = x.contiguous(), [], None
        for k in range(t):
            nxt = torch.empty_like(cur) if k < t - 1 else None
            works = _ring_start([cur], [nxt], group) if nxt is not None else []
            j, c = (rank - k) % t, (rank - k - 1) % t
            flat = cur.reshape(-1, cur.shape[-1])
            for dw, g in zip(grad_weights, grads):
                dw += (g[:, j * n : (j + 1) * n].reshape(-1, g.shape[-1]).to(flat.dtype).t() @ flat).to(dw.dtype)
            partial = sum(g[:, c * n : (c + 1) * n] @ w for g, w in zip(grads, weights))
            _wait(acc_works)
            if acc_in is not None:
                partial = partial + acc_in
            if k < t - 1:
                sending = partial.contiguous()  # referenced until its send completes (next step's wait)
                acc_in = torch.empty_like(sending)
                acc_works = _ring_start([sending], [acc_in], group)
            _wait(works)
            cur = nxt
        grad_x = partial.to(ctx.dtypes[0])
        return (None, grad_x, *grad_weights)


class _RingMatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter_seq(y @ W^T)`` for a row-parallel projection (``wo``, ``w2``) under sequence parallelism,
    computed in ``t`` steps of a ring over the tp group, never holding the full ``[b, s, h]`` partial sum (Wang et
    al. 2024, ASPLOS, DOI 10.1145/3620666.3651357; Megatron-LM's ``--tp-comm-overlap``).

    ``y``: ``[b, s, f/t]`` (the full sequence, this rank's input features), ``W``: ``[h, f/t]`` (the local shard of
    the ``Shard(1)`` weight). Forward, rank ``r`` of ``t``: at step ``k`` it computes the partial product of chunk
    ``c = (r - k - 1) mod t`` (``y[:, rows c] @ W^T``, ``[b, s/t, h]``), adds the accumulator received from rank
    ``r - 1`` and sends the sum on to rank ``r + 1`` (the send overlaps the next step's matmul); at step ``t - 1``,
    ``c = r``: the result is this rank's shard ``[b, s/t, h]`` summed over the tp ranks. Backward: the output-gradient
    shards travel around the ring (the all-gather-matmul pattern of :class:`_RingAllGatherMatmul`): ``dy[:, rows j] =
    g_j @ W`` and ``dW += g_j^T y[:, rows j]``. Saved: ``y`` and ``W`` (what ``RowwiseParallel``'s linear saves).

    On CUDA, torch's symmetric-memory ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` is the fused route; not used
    yet (tested on CPU / gloo only).
    """

    @staticmethod
    def forward(ctx: Any, group: Any, y: Tensor, weight: Tensor) -> Tensor:  # noqa: D102
        ctx.group, ctx.dtypes = group, (y.dtype, weight.dtype)
        y, (weight,) = _autocast_inputs(y, (weight,))
        t, rank = group.size(), group.rank()
        n = y.shape[1] // t
        works: list[Any] = []
        acc_in = None
        with torch.autocast(y.device.type, enabled=False):
            for k in range(t):
                c = (rank - k - 1) % t
                partial = y[:, c * n : (c + 1) * n] @ weight.t()
                _wait(works)
                if acc_in is not None:
                    partial = partial + acc_in
                if k < t - 1:
                    sending = partial  # referenced until its send completes (next step's wait)
                    acc_in = torch.empty_like(sending)
                    works = _ring_start([sending], [acc_in], group)
        ctx.save_for_backward(y, weight)
        return partial

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # noqa: D102
        y, weight = ctx.saved_tensors
        group = ctx.group
        t, rank = group.size(), group.rank()
        n = y.shape[1] // t
        cur = grad.to(weight.dtype).contiguous()
        grad_y = torch.empty_like(y)
        grad_w = torch.zeros(weight.shape, dtype=ctx.dtypes[1], device=y.device)  # accumulated in the param's dtype
        for k in range(t):
            nxt = torch.empty_like(cur) if k < t - 1 else None
            works = _ring_start([cur], [nxt], group) if nxt is not None else []
            j = (rank - k) % t
            rows = y[:, j * n : (j + 1) * n]
            grad_y[:, j * n : (j + 1) * n] = cur @ weight
            grad_w += (cur.reshape(-1, cur.shape[-1]).t() @ rows.reshape(-1, rows.shape[-1])).to(grad_w.dtype)
            _wait(works)
            cur = nxt
        return None, grad_y.to(ctx.dtypes[0]), grad_w


def ring_projection(x: Tensor, linears: tuple[nn.Linear, ...], group: Any) -> tuple[Tensor, ...]:
    """:func:`sequence_parallel_projection` computed as a ring over the tp group, the shard exchange overlapped with
    the matmuls (:class:`_RingAllGatherMatmul`; the layout's ring overlap): same arguments, same outputs
    ``[b, s, o_i/t]``, never more than two input shards ``[b, s/t, h]`` held instead of the gathered ``[b, s, h]``."""
    local = x.to_local() if isinstance(x, DTensor) else x
    weights = [lin.weight.to_local() if isinstance(lin.weight, DTensor) else lin.weight for lin in linears]
    return _RingAllGatherMatmul.apply(group, local, *weights)


def ring_output_projection(y: Tensor, linear: nn.Linear, group: Any) -> Tensor:
    """The row-parallel projection ``linear`` (weight a ``Shard(1)`` DTensor over tp) of ``y`` (``[b, s, f/t]``,
    local, or a ``Shard(-1)`` DTensor) under sequence parallelism, reduce-scattered over the sequence by the ring of
    :class:`_RingMatmulReduceScatter` (the layout's ring overlap): this rank's ``[b, s/t, h]`` local shard, as
    ``RowwiseParallel(output_layouts=Shard(1))`` returns it."""
    local = y.to_local() if isinstance(y, DTensor) else y
    weight = linear.weight.to_local() if isinstance(linear.weight, DTensor) else linear.weight
    return _RingMatmulReduceScatter.apply(group, local, weight)


def _sequence_parallel_head(x: Tensor, output: nn.Linear, mesh: DeviceMesh, overlap: bool = False) -> Tensor:
    """The LM head on the sequence-sharded final hidden states ``x`` (``[b, s/t, h]``): logits ``[b, s, V]`` as a
    vocabulary-sharded DTensor (``Shard(-1)``, local ``[b, s, V/t]``), as ``ColwiseParallel(input_layouts=Shard(1),
    output_layouts=Shard(-1))`` gives them, saving only ``x`` (:func:`sequence_parallel_projection`, or
    :func:`ring_projection` with ``overlap``)."""
    project = ring_projection if overlap else sequence_parallel_projection
    (local,) = project(x, (output,), mesh.get_group())
    return DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)


@dataclass(frozen=True)
class TensorParallelPlan:
    """A model family's tensor-parallel plan (:meth:`lightning_4d.families.base.ModelFamily.tensor_parallel_plan`),
    applied
    by :func:`apply_tensor_parallel` (the module docstring's split, Megatron-LM's).

    Paths are dotted attribute paths on the model (a part may be ``None`` or absent: a pipeline stage);
    per-layer names are relative to one decoder layer.

    Attributes:
        embedding, layers, norm, head: the token embedding (split by vocabulary rows), the decoder-layer container
            (``nn.ModuleDict`` or ``nn.ModuleList``; pruned entries, modules without parameters, are skipped), the
            final norm (sequence parallel under sp) and the LM head (split by vocabulary columns).
        colwise: per-layer projections split by output features (``wq``, ``wk``, ``wv``, ``w1``, ``w3``).
        rowwise: per-layer projections split by input features (``wo``, ``w2``): partial sums reduced (all-reduce, or
            reduce-scatter over the sequence under sp).
        layer_norms: per-layer norms (sequence parallel under sp).
        gathered_inputs: per-layer modules whose input is the full sequence (attention, MLP), each with where that
            input is: ``("args", n)`` (the first of ``n`` positional arguments) or ``("kwarg", name)``. A module with
            an ``input_projection`` attribute (our Llama's) gets the fused sequence-parallel projection under sp
            (:func:`sequence_parallel_projection`: only the shard is saved); any other gets DTensor's
            ``PrepareModuleInput`` (the input gathered before the module).
        vocab_parallel_logits: the head returns the logits sharded over the vocabulary (``Shard(-1)`` DTensor, for the
            vocabulary-parallel cross-entropy of :mod:`lightning_4d.parallel.loss`); ``False``: gathered to
            ``[b, s, V]`` on every tp rank (a foreign model's own loss works unchanged). With vocabulary-parallel
            logits, sp and a model attribute ``head_projection``, the head saves only the sequence shard of its input.
        token_parallel: per-layer modules that tp does not split when they have a ``token_parallel`` attribute
            (our ``MoEFeedForward``): each tp rank runs them whole on its ``s/t`` tokens (:class:`TokenParallel`);
            the ``colwise`` / ``rowwise`` / ``gathered_inputs`` entries inside such a module are skipped for that
            layer. A module without the attribute (a dense feed-forward) is split as usual.
    """

    embedding: str
    layers: str
    norm: str
    head: str
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    layer_norms: tuple[str, ...]
    gathered_inputs: tuple[tuple[str, tuple[str, Any]], ...]
    vocab_parallel_logits: bool = True
    token_parallel: tuple[str, ...] = ()


def _inside(name: str, modules: list[str]) -> bool:
    """Whether the dotted path ``name`` is one of ``modules`` or inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _gathered_inputs(
    layer: nn.Module,
    gathered: list[tuple[str, tuple[str, Any]]],
    seq: Any,
    prepare: type,
    projection: Any,
    overlap: bool,
    float8: Optional[str],
    group: Any,
) -> dict[str, object]:
    """For the modules ``gathered`` of ``layer`` (``TensorParallelPlan.gathered_inputs``, those not run token
    parallel) whose input is the sequence-sharded residual stream (``seq``: ``Shard(1)`` under sp, else
    ``Replicate()``): set the ring output projection under ``overlap`` and, under sp without float8, the
    ``input_projection`` (``projection``: the module gathers the sequence itself); return the ``prepare`` style
    (name relative to ``layer``) that redistributes the input of every other one to ``Replicate()``
    (:func:`apply_tensor_parallel`'s docstring)."""
    sequence_parallel = isinstance(seq, Shard)
    styles: dict[str, object] = {}
    for name, (kind, where) in gathered:
        module = find_submodel(layer, name)
        if overlap and sequence_parallel and hasattr(module, "output_projection"):
            module.output_projection = partial(ring_output_projection, group=group)
        if sequence_parallel and hasattr(module, "input_projection") and float8 is None:
            module.input_projection = projection  # it gathers the sequence itself (the linears shard weights only)
        elif kind == "kwarg":
            styles[name] = prepare(input_kwarg_layouts={where: seq}, desired_input_kwarg_layouts={where: Replicate()})
        else:
            styles[name] = prepare(
                input_layouts=(seq,) + (None,) * (where - 1),
                desired_input_layouts=(Replicate(),) + (None,) * (where - 1),
            )
    return styles


def apply_tensor_parallel(
    model: nn.Module,
    plan: TensorParallelPlan,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    overlap: bool = False,
    float8: Optional[str] = None,
) -> None:
    """Shard ``model`` (any family's, or the part of it a pipeline rank holds) in place over ``tp_mesh`` following
    ``plan`` (module docstring).

    Args:
        model: the model, usually still on the meta device.
        plan: the family's :class:`TensorParallelPlan`.
        tp_mesh: the 1D ``"tp"`` mesh (size 1: nothing changes).
        sequence_parallel: shard norms and the residual stream over the sequence (requires s % t == 0).
        overlap: the ring overlap (with ``sequence_parallel``): the modules of ``plan.gathered_inputs``
            get :func:`ring_projection` as ``input_projection`` and :func:`ring_output_projection` as
            ``output_projection`` (their row-parallel linears' weights are still sharded by ``RowwiseParallel``, which
            then is not called), the head :func:`ring_projection`. A module without these hooks (a Mixture-of-Experts
            feed-forward) keeps the gathered path; families without them refuse the option (``validate``:
            :func:`refuse_rings`).
        float8: the float8 recipe (``None``: off), the decoder layers' linears already torchao's ``Float8Linear``
            (:func:`lightning_4d.parallel.float8.apply_float8` first): their styles are
            :func:`~lightning_4d.parallel.float8.tensor_parallel_styles`' and no ``input_projection`` is set (it
            multiplies the weights outside ``Float8Linear``): under sp the modules of ``plan.gathered_inputs`` get
            the input all-gathered before them (in float8 with ``"tensorwise"``), which each linear saves for
            backward (``lightning_4d/parallel/float8.py``). Not with ``overlap``.

    Tied embeddings: the embedding and the head both shard the ``[V, h]`` matrix by rows (``Shard(0)``); they are
    re-tied to one DTensor after parallelization.
    """
    if tp_mesh.size() == 1:
        return
    seq = Shard(1) if sequence_parallel else Replicate()
    embedding, norm, head = (find_submodel(model, path) for path in (plan.embedding, plan.norm, plan.head))
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    styles = _outer_styles(plan, embedding, norm, head, seq)
    styles.update(_decoder_layer_styles(model, plan, tp_mesh, seq, overlap, float8))
    if tied:  # distribute the shared matrix once (through the embedding), then re-tie below
        head.weight = nn.Parameter(embedding.weight.detach().clone())
    parallelize_module(model, tp_mesh, styles)
    if tied:
        head.weight = embedding.weight
    if head is not None and sequence_parallel and plan.vocab_parallel_logits and hasattr(model, "head_projection"):
        # the head gathers the sequence itself and saves only the shard (its plan above only shards its weight)
        model.head_projection = partial(_sequence_parallel_head, mesh=tp_mesh, overlap=overlap)


def _outer_styles(
    plan: TensorParallelPlan,
    embedding: Optional[nn.Module],
    norm: Optional[nn.Module],
    head: Optional[nn.Module],
    seq: Any,
) -> dict[str, object]:
    """The styles of the parts around the decoder layers that this rank holds (``None``: another pipeline rank's):
    the embedding (rows, its output laid out as ``seq``), the final norm (under sp) and the head (its output the
    vocabulary shards, or gathered)."""
    styles: dict[str, object] = {}
    if embedding is not None:
        styles[plan.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if norm is not None and isinstance(seq, Shard):
        styles[plan.norm] = SequenceParallel()
    if head is not None and plan.vocab_parallel_logits:
        styles[plan.head] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    elif head is not None:
        styles[plan.head] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return styles


def _decoder_layer_styles(
    model: nn.Module, plan: TensorParallelPlan, tp_mesh: DeviceMesh, seq: Any, overlap: bool, float8: Optional[str]
) -> dict[str, object]:
    """The styles of the decoder layers this rank holds (names relative to ``model``): the column- and row-parallel
    projections, the layer norms under sp, the gathered inputs (:func:`_gathered_inputs`); the modules of
    ``plan.token_parallel`` that can (a Mixture-of-Experts feed-forward) run token parallel instead, whole."""
    sequence_parallel = isinstance(seq, Shard)
    colwise, rowwise, prepare = tensor_parallel_styles(float8)
    group = tp_mesh.get_group()
    projection = partial(ring_projection if overlap else sequence_parallel_projection, group=group)
    container = find_submodel(model, plan.layers)
    layers = layer_items(container) if container is not None else []
    styles: dict[str, object] = {}
    # layers without parameters: the placeholders of layers another pipeline rank holds
    for key, layer in [(k, m) for k, m in layers if any(True for _ in m.parameters())]:
        prefix = f"{plan.layers}.{key}."
        whole = [n for n in plan.token_parallel if hasattr(find_submodel(layer, n), "token_parallel")]
        for name in whole:  # run token parallel, not split (a Mixture-of-Experts feed-forward)
            find_submodel(layer, name).token_parallel = TokenParallel(tp_mesh, sequence_parallel)
        styles.update({prefix + name: colwise() for name in plan.colwise if not _inside(name, whole)})
        styles.update({prefix + n: rowwise(output_layouts=seq) for n in plan.rowwise if not _inside(n, whole)})
        if sequence_parallel:
            styles.update({prefix + name: SequenceParallel() for name in plan.layer_norms})
        gathered = [(n, w) for n, w in plan.gathered_inputs if not _inside(n, whole)]
        for name, style in _gathered_inputs(layer, gathered, seq, prepare, projection, overlap, float8, group).items():
            styles[prefix + name] = style
    return styles


def apply(family: Any, model: nn.Module, mesh: Any, config: Any) -> None:
    """The tp step of :func:`~lightning_4d.parallel.parallelize.parallelize_model` (after float8, before cp):
    :func:`apply_tensor_parallel` of the family's plan over the ``tp`` mesh with the layout's sp, ring overlap and
    float8 recipe; nothing without tp."""
    if config.tp > 1:
        apply_tensor_parallel(
            model,
            family.tensor_parallel_plan(model),
            mesh.tp,
            sequence_parallel=config.sp,
            overlap=config.tensor_parallel_overlap,
            float8=config.float8,
        )


def refuse_rings(config: Any, model_name: str) -> None:
    """The refusal of the ring overlap by a family whose modules the rings cannot hook into (its ``validate``;
    ``model_name``: ``"a transformers LlamaForCausalLM"``).

    Raises:
        ValueError: the overlap is on, naming the option and the fix.
    """
    if config.tensor_parallel_overlap:
        raise ValueError(
            f"tensor_parallel_overlap=True is not supported for {model_name} yet (the ring "
            "projections hook into lightning_4d's own Llama modules): use tensor_parallel_overlap=False"
        )
