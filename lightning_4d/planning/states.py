"""Model states (ZeRO): one rank's parameters, gradients and optimizer states at rest (:func:`model_state_bytes`),
and the ZeRO sharding rules they follow (module docstring of :mod:`lightning_4d.planning.model`, **Model states**):

- ZeRO 0/1 (``GradientBuckets`` + ``ShardedOptimizer``): the parameters, in reverse order, fill gradient buckets of
  ``GRADIENT_BUCKET_BYTES``, each padded to a multiple of its group's ranks; at ZeRO 1 rank r owns range r of every
  bucket (:func:`bucket_owned`, :func:`zero1_owned`);
- ZeRO 2/3 (FSDP2 ``fully_shard``): ``ceil(rows/D)`` rows of dim 0 per rank, as ``torch.chunk``
  (:func:`fsdp_shard_numel`), a stacked weight maybe on dim 1
  (:func:`lightning_4d.features.moe.costs.fsdp_shard_dim`).

A parameter's data-parallel group is ``dp·cp`` unless its :attr:`~lightning_4d.planning.tensors.Param.group` says
otherwise (:func:`reduction_group`).

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.partition import GRADIENT_BUCKET_BYTES, bucket_lengths, bucket_shard
from lightning_4d.planning.compression_costs import powersgd_state_bytes
from lightning_4d.planning.params import (
    Sizes,
    StageKey,
    as_held,
    rank_layers,
    rank_layout,
    stage_params,
    weighted_params,
)
from lightning_4d.planning.tensors import Dtypes, Param, chunk, normalize_precision

__all__ = [
    "ModelStates",
    "bucket_owned",
    "first_bucket_elements",
    "fsdp_group",
    "fsdp_padded_numel",
    "fsdp_shard_numel",
    "model_state_bytes",
    "reduction_group",
    "zero1_owned",
]


def _group_key(p: Param, tp: int, ep: int) -> tuple[str, ...]:
    """The dims of ``p``'s :attr:`~lightning_4d.planning.tensors.Param.group` larger than 1 in this layout (``()``:
    ``dp·cp``): the parameters of one key fill gradient buckets of their own (``parallel/grad_buffers.py``)."""
    return tuple(d for d in p.group if (tp if d == "tp" else ep) > 1)


def reduction_group(key: tuple[str, ...], world: int, rank: int, tp: int, tp_rank: int, ep: int) -> tuple[int, int]:
    """``(size, rank)`` of the ZeRO 0/1 data-parallel group of the parameters of group key ``key`` (:func:`_group_key`)
    for the rank ``rank`` of ``world`` = dp·cp ranks at tp rank ``tp_rank``: ``"tp"`` the token-parallel group
    ``dp·cp·tp`` (this rank ``rank·tp + tp_rank``, tp innermost: ``dp_cp_tp``), ``"ep"`` the ep data-parallel
    group of the ep-split parameters, that group over ep (this rank its index over ep: ep groups are blocks of ep
    consecutive ranks of it, folded over tp first; ``ParallelConfig.ep_coordinates``, ``features/moe/runtime.py``'s
    ``edp``)."""
    size, index = world, rank
    if "tp" in key:
        size, index = size * tp, index * tp + tp_rank
    if "ep" in key:
        size, index = size // ep, index // ep
    return size, index


@functools.lru_cache(maxsize=4096)
def zero1_owned(
    sizes: Sizes, stage: StageKey, elem_bytes: int, world: int, rank: int, bucket_bytes: int, tp_rank: int = 0
) -> int:
    """:func:`bucket_owned` of the parameters of ``stage`` (its layers + embedding / head), cached: the planner asks
    for the same stage under many micro-batch sizes. The parameters of each group key (:func:`_group_key`) fill
    buckets of their own, sharded over their group (:func:`reduction_group`; ``parallel/grad_buffers.py``)."""
    tp, ep = stage.tp, stage.ep
    groups: dict[tuple[str, ...], list[int]] = {}
    for p in stage_params(sizes, tp, stage.layers, stage.first, stage.last, ep):
        groups.setdefault(_group_key(p, tp, ep), []).append(p.numel)
    owned = 0
    for key, numels in groups.items():
        size, index = reduction_group(key, world, rank, tp, tp_rank, ep)
        owned += bucket_owned(numels, elem_bytes, size, index, bucket_bytes)
    return owned


@functools.lru_cache(maxsize=4096)
def first_bucket_elements(sizes: Sizes, stage: StageKey, elem_bytes: int, bucket_bytes: int, world: int) -> int:
    """Elements of the first ZeRO 0/1 gradient bucket of a rank holding ``stage`` (its layers + embedding / head):
    ``GradientBuckets`` fills buckets with the parameters in reverse order, of ``elem_bytes`` each, at most
    ``bucket_bytes`` per bucket, the parameters of a group other than ``dp·cp`` in buckets of their own
    (:func:`lightning_4d.partition.bucket_lengths`), each padded to a multiple of ``world`` (its group's ranks); the
    first holds the head's weight, the first gradient of backward."""
    tp, ep = stage.tp, stage.ep
    params = stage_params(sizes, tp, stage.layers, stage.first, stage.last, ep)
    dense = [p.numel for p in params if not _group_key(p, tp, ep)][::-1]
    lengths = bucket_lengths([n * elem_bytes for n in dense], bucket_bytes)
    return bucket_shard(sum(dense[: lengths[0]]), world, world - 1)[1] if lengths else 0


def bucket_owned(numels: list[int], elem_bytes: int, world: int, rank: int, bucket_bytes: int) -> int:
    """Elements rank ``rank`` of ``world`` owns at ZeRO 1 (``GradientBuckets`` + ``ShardedOptimizer``): the
    parameters, in reverse order, fill buckets of at most ``bucket_bytes`` (a bucket's first parameter may exceed it);
    each bucket is padded to a multiple of ``world`` elements and cut in ``world`` equal ranges, rank r owning range r
    (its real elements only): :func:`lightning_4d.partition.bucket_lengths` and
    :func:`lightning_4d.partition.bucket_shard`, the rules ``parallel/grad_buffers.py`` builds its buckets with."""
    order = numels[::-1]
    total = start = 0
    for length in bucket_lengths([n * elem_bytes for n in order], bucket_bytes):
        n = sum(order[start : start + length])
        lo, hi = bucket_shard(n, world, rank)
        total += max(0, min(n, hi) - min(n, lo))
        start += length
    return total


def fsdp_padded_numel(p: Param, world: int, ep: int, tp: int) -> int:
    """Elements of ``p`` in FSDP2's all-gather output: dim 0 padded to a multiple of its group's size
    (:func:`fsdp_group`), or a stacked weight sharded on dim 1, which FSDP2 shards evenly only (no padding)."""
    group, _ = fsdp_group(p, world, 0, ep, tp, 0)  # the size only: the same for every rank
    if moe_costs.fsdp_shard_dim(p, group) == 1:
        return p.numel
    return math.ceil(p.rows / group) * group * p.cols


def fsdp_shard_numel(p: Param, world: int, dp_cp_rank: int, ep: int, tp: int, tp_rank: int) -> int:
    """Elements of ``p`` rank ``dp_cp_rank`` (tp rank ``tp_rank``) holds at ZeRO 2/3 (FSDP2's ``torch.chunk`` of dim
    0 over its group, :func:`fsdp_group`; a stacked weight sharded on dim 1: ``rows · (dim1 / G) · dim 2``, even)."""
    group, rank = fsdp_group(p, world, dp_cp_rank, ep, tp, tp_rank)
    if moe_costs.fsdp_shard_dim(p, group) == 1:
        return p.rows * chunk(p.dim1, group, rank) * (p.cols // p.dim1)
    return chunk(p.rows, group, rank) * p.cols


def fsdp_group(p: Param, world: int, dp_cp_rank: int, ep: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``(size, rank)`` of the group FSDP2 shards ``p`` over at ZeRO 2/3: the group its gradients are reduced over
    (:func:`reduction_group`, ``parallel/fsdp.py``'s ``apply_fsdp``): an MoE layer's parameters under tp (group
    ``"tp"``) over ``dp_cp_tp``, a parameter split over ep (``"ep"``) over the ep data-parallel group ``edp``
    (``dp·cp·tp/ep`` ranks under tp, else ``dp·cp/ep``: ``ParallelConfig.ep_coordinates``), every other tensor over
    ``dp_cp``."""
    return reduction_group(_group_key(p, tp, ep), world, dp_cp_rank, tp, tp_rank, ep)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's parameters, gradients (at the optimizer step) and optimizer states: Adam's m and v plus
    the float32 master weights where they are separate from the parameters (``master_weights``, included in
    ``optimizer_states``, as Megatron-LM counts them: ``bf16-mixed`` at ZeRO 1 is 2 + 4 + 12/D bytes per
    parameter) and PowerSGD's state (``compression``, included too: float32 error feedback ``m·n`` and warm start
    ``n·r`` per compressed matrix, ``parallel/compression.py``). With ``optimizer_offload`` what lives on the host
    is ``host`` and not in the other fields (:func:`offloaded_states`): those are the device's bytes."""

    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int = 0
    compression: int = 0
    #: bytes of model states in host memory (``optimizer_offload``; 0 without)
    host: int = 0

    @property
    def resident(self) -> int:
        """Bytes held on the device in every phase of a step: the parameters and the optimizer states (the
        gradients come and go with backward and the step: each phase of the estimate counts them)."""
        return self.parameters + self.optimizer_states


def model_state_bytes(
    model_config: Any,
    parallel_config: ParallelConfig,
    precision: str = "bf16-mixed",
    *,
    pp_rank: int = 0,
    dp_cp_rank: int = 0,
    bucket_bytes: int = GRADIENT_BUCKET_BYTES,
    tp_rank: int = 0,
) -> ModelStates:
    """Exact bytes of the model states held at rest by one rank (see the module docstring for the rules).

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig` (duck-typed: sizes, ``padded_vocab_size``,
            ``head_dim``, ``tie_word_embeddings``).
        parallel_config: the layout (``data_parallel_size`` resolved; its ``pipeline_layer_split``: layers per
            pipeline stage, ``pp·v`` counts, else equal).
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``.
        pp_rank: the pp rank (0 .. pp−1); it holds the ``v`` pipeline stages of
            :meth:`~lightning_4d.config.ParallelConfig.rank_stages` (schedule and v from ``parallel_config``).
        dp_cp_rank: the rank's index in the ``dp_cp`` group (rank 0 holds the largest shards); under ep its
            ep rank is ``dp_cp_rank % ep`` and its rank in the group of the ep-split parameters ``dp_cp_rank // ep``;
            under HSDP its rank in the ZeRO shard group ``dp_cp_rank % zero_shard``.
        bucket_bytes: the ZeRO 0/1 gradient bucket size (``GRADIENT_BUCKET_BYTES`` of ``lightning_4d.partition``);
            at ZeRO 1 a rank owns its 1/D of every bucket.
        tp_rank: the tp rank: under tp the parameters replicated over tp (an MoE layer's,
            :mod:`lightning_4d.features.moe.costs`) are ZeRO 1-sharded over ``dp·cp·tp`` ranks (those split over ep
            over ``dp·cp·tp/ep``), where the tp rank picks the range.

    Returns:
        :class:`ModelStates`.

    Raises:
        ValueError: an unknown precision, a pp rank, dp_cp rank or tp rank out of range.
    """
    dt, pc = Dtypes.of(normalize_precision(precision)), parallel_config
    ranks = {"tp_rank": (tp_rank, pc.tp), "pp_rank": (pp_rank, pc.pp), "dp_cp_rank": (dp_cp_rank, pc.dp_cp)}
    for name, (value, size) in ranks.items():
        if not 0 <= value < size:
            raise ValueError(f"{name}={value} is not valid: expected 0 .. {size - 1}.")
    model_config = as_held(model_config, pc)
    layers = rank_layers(model_config.num_layers, pc, pp_rank)
    _, first, last = rank_layout(model_config.num_layers, pc, pp_rank)
    weighted = weighted_params(model_config, pc.tp, layers, first, last, pc.ep)
    # the ZeRO shard group: dp_cp, under HSDP its shard group (consecutive dp_cp ranks) of zero_shard ranks
    shards, shard_rank = pc.zero_shard, dp_cp_rank % pc.zero_shard
    if pc.zero_stage >= 2:
        n = sum(count * fsdp_shard_numel(p, shards, shard_rank, pc.ep, pc.tp, tp_rank) for p, count in weighted)
        return _fsdp_states(n, dt, pc)
    n = n_opt = sum(count * p.numel for p, count in weighted)
    if pc.zero_stage == 1 and shards > 1:
        sizes = Sizes.of(model_config, model_config.num_layers)
        stage = StageKey(pc.tp, tuple(layers), first, last, pc.ep)
        n_opt = zero1_owned(sizes, stage, dt.setup, shards, shard_rank, bucket_bytes, tp_rank)
    master = n_opt * dt.master
    compression = powersgd_state_bytes(pc, weighted, pc.dp_cp)  # every rank's own E and Q, whole local matrices
    if pc.optimizer_offload:  # the owned slices' host copies and host gradients, m and v (offloaded_states)
        copy = dt.master or dt.param
        return ModelStates(n * dt.param, n * dt.grad, compression, 0, compression, n_opt * (2 * copy + 2 * dt.moment))
    return ModelStates(n * dt.param, n * dt.grad, 2 * n_opt * dt.moment + master + compression, master, compression)


def _fsdp_states(n: int, dt: Dtypes, pc: ParallelConfig) -> ModelStates:
    """The model states of a rank holding ``n`` elements of FSDP2 shards (ZeRO 2/3: rows ``[r·chunk, (r+1)·chunk)``
    of dim 0 of every tensor, maybe dim 1: :func:`fsdp_group`): under ``MixedPrecisionPolicy`` the float32 shard is
    the master weight; with ``optimizer_offload`` on the host (:func:`offloaded_states`)."""
    if dt.master:
        return offloaded_states(ModelStates(4 * n, 4 * n, 8 * n), pc)
    return offloaded_states(ModelStates(n * dt.param, n * dt.param, 2 * n * dt.param), pc)


def offloaded_states(states: ModelStates, pc: ParallelConfig) -> ModelStates:
    """``states`` as ``optimizer_offload`` splits them between the device and the host
    (``lightning_4d/parallel/optimizer_offload.py``). ZeRO 2/3 (FSDP2's ``CPUOffloadPolicy``): everything at rest is
    on the host, the sharded parameters (the masters under ``bf16-mixed``), their gradients and Adam's m and v; the
    device holds only what FSDP2 gathers for compute (``planning/buffers.py``). ZeRO 1 is built in
    :func:`model_state_bytes`: the device keeps the parameters and the gradient buckets (and PowerSGD's state), the
    host the owned slices' copies (float32 masters, else the parameters' dtype), their gradients and Adam's m, v."""
    if not pc.optimizer_offload or pc.zero_stage < 2:
        return states
    return ModelStates(0, 0, 0, 0, 0, states.parameters + states.gradients + states.optimizer_states)
