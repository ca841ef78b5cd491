"""Clipping by the global gradient norm: one :func:`clip_grad_norm_` for every layout (ZeRO 0-3, tp, cp, pp, ep), as
torchtitan's ``distributed/utils.py::clip_grad_norm_`` (with its ``pp_mesh``) and Megatron-LM's
``clip_grad_norm_fp32``: the norms of each rank's local pieces of the gradients, all-reduced over the ranks that hold
the other pieces, the pipeline stages included; then every local piece scaled by the same coefficient.

The strategy's precision plugin calls it (:meth:`lightning_4d.precision.FourDPrecision.clip_grad_by_norm`) for the
Trainer's ``gradient_clip_val`` wherever torch's own clipping would not see the whole gradient: an optimizer with a
:class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` (its gradients live in buckets), a pipeline (each
stage holds other parameters), parameters reduced over other groups than ``dp_cp`` (gradient groups: parameters held by
other ranks).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_4d.parallel._compat.dtensor import local_tensor
from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: Optional[dist.ProcessGroup] = None,
    sharded: Optional[ShardedOptimizer] = None,
    exclude: Iterable[Tensor] = (),
) -> Tensor:
    """Clip gradients by their global norm over all dp/cp, tp and ep shards and all pipeline stages, in place.

    1. Each rank takes the q-th power sums (``max`` for ``q = inf``) of its local pieces of the gradients, one sum per
       group of pieces that reduce alike (:func:`_bucket_sums` with ``sharded``, else :func:`_layout_sums`).
    2. The sums are all-reduced over the ranks that hold the other pieces: the whole world for the buckets (the
       pipeline stages among them), ``pp_group`` for the layout's gradients (their DTensor meshes are reduced in
       step 1); a sum whose pieces every rank of a group holds whole is divided by that group's size.
    3. The norm ``(sum)^(1/q)`` gives the coefficient ``min(1, max_norm / (norm + 1e-6))``
       (:func:`clip_coefficient`, ``torch.nn.utils.clip_grad_norm_``'s), by which every local piece is scaled.

    Args:
        parameters: the parameters whose ``.grad`` is clipped (ignored with ``sharded``: its parameters).
        max_norm: the largest norm left (``inf``: measure only, the coefficient is 1).
        norm_type: q of the q-norm (``inf``: the largest element).
        pp_group: the pipeline's process group (pp > 1), else ``None``.
        sharded: the :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` of the optimizer (ZeRO 1,
            master weights, ZeRO 0/1 with gradient groups): its averaged gradients in their buckets are clipped.
        exclude: parameters whose gradients are scaled but left out of the norm: a copy of a weight another rank
            counts (the LM head's copy of tied embeddings under pp, :class:`~lightning_4d.features.pipeline.runtime
            .TiedEmbedding`).

    Returns:
        The total norm (float32 scalar tensor, the same on every rank).
    """
    inf = math.isinf(norm_type)
    excluded = {id(p) for p in exclude}
    if sharded is not None:
        grads, sums, divisors = _bucket_sums(sharded, norm_type, excluded)
        group: Any = dist.group.WORLD if dist.is_initialized() else None
    else:
        grads, sums, divisors = _layout_sums(parameters, norm_type, excluded)
        group = pp_group
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if inf:
        total = sums.max()
    else:
        for i, divisor in enumerate(divisors):
            if divisor > 1:  # every rank of a group counted the whole gradient
                sums[i] = sums[i] / divisor
        total = sums.sum() ** (1.0 / norm_type)
    coef = clip_coefficient(max_norm, total)
    for g in grads:
        local_tensor(g).mul_(coef.to(g.dtype))
    return total


def _bucket_sums(
    sharded: ShardedOptimizer, norm_type: float, excluded: Optional[set[int]] = None
) -> tuple[list[Tensor], Tensor, list[int]]:
    """The pieces of a :class:`ShardedOptimizer`'s gradients: the owned slices of its buckets (ZeRO 1: a partition of
    each bucket over its group; ZeRO 0: the whole bucket on every rank of the group), a parameter replicated over tp
    counted on tp rank 0 only (:func:`_tp_duplicate`) unless its gradient group is tp-partial; at ZeRO 0 (every
    rank of a group holds its whole bucket) each piece's power sum divided by its group's size before the sum over
    the world (the same total as dividing each group's sum after it: the division is linear), so one sum for every
    gradient group (:class:`~lightning_4d.parallel.grad_buffers.GradientGroup`) of any rank, the default group's also
    divided by HSDP's replicas (each holds the same pieces); parameters whose ids are in ``excluded`` are not
    counted."""
    buckets = sharded.buckets
    groups = buckets.gradient_groups
    sizes = [1 if sharded.sharded else dist.get_world_size(g.group) for g in groups]
    sizes[0] *= buckets.num_replicas  # HSDP: every replica of the shard group holds the same pieces
    grads = [(p, g) for p in sharded.parameters() if (g := sharded.owned_grad(p)) is not None]
    inf = math.isinf(norm_type)
    sums = torch.zeros(len(groups), dtype=torch.float32, device=buckets.buckets[0].device)  # one per gradient group
    for p, g in grads:
        i = buckets.bucket_of(p)[0].index
        duplicate = not groups[i].tp_partial and _tp_duplicate(p, sharded.tp_rank)
        if duplicate or g.numel() == 0 or id(p) in (excluded or ()):
            continue
        n = torch.linalg.vector_norm(g.float(), norm_type)
        sums[i] = torch.maximum(sums[i], n) if inf else sums[i] + n**norm_type
    if inf:
        return [g for _, g in grads], sums.max().reshape(1), [1]
    total = sum(sums[i] / size if size > 1 else sums[i] for i, size in enumerate(sizes))
    return [g for _, g in grads], total.reshape(1), [1]


def _layout_sums(
    parameters: Iterable[Tensor], norm_type: float, excluded: Optional[set[int]] = None
) -> tuple[list[Tensor], Tensor, list[int]]:
    """The pieces of plain ``.grad`` gradients (DTensors or tensors): grouped by DTensor layout (mesh and placements),
    each group's norm computed with ``torch.nn.utils.get_total_norm`` and made global over its mesh
    (``full_tensor``); one sum of the groups' ``norm^q`` (their ``max`` for ``q = inf``). Parameters whose ids are in
    ``excluded`` are scaled but not counted."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    groups: dict[Any, list[Tensor]] = {}
    for g in (p.grad for p in params if id(p) not in (excluded or ())):
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (g.device, None)
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    norms = []
    for members in groups.values():
        n = torch.nn.utils.get_total_norm(members, norm_type)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().to(device))
    if not norms:
        total = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n**norm_type for n in norms]).sum()
    return grads, total.reshape(1), [1]


def clip_coefficient(max_norm: float, total_norm: Tensor) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, the factor gradients are scaled by
    (``torch.nn.utils.clip_grad_norm_``'s coefficient; Megatron-LM's ``clip_grad_norm_fp32``)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def _tp_duplicate(p: Tensor, tp_rank: int) -> bool:
    """Whether ``p`` is replicated over the tensor-parallel group and this is not tp rank 0 (``tp_rank``): its
    gradient is counted once, on tp rank 0, in a global norm. A plain (non-DTensor) parameter of a tensor-parallel
    model is replicated (RMSNorm weights without sequence parallelism); a DTensor one is when all its placements are
    ``Replicate``."""
    if tp_rank == 0:
        return False
    if not isinstance(p, DTensor):
        return True
    return all(isinstance(pl, Replicate) for pl in p.placements)
