"""ZeRO stages 0-3 over the ``dp_cp`` group (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", arXiv 1910.02054), and mixed precision with master weights.

=====  ===========================================  ===============================================================
stage  what is sharded over dp_cp (size D)           how
=====  ===========================================  ===============================================================
0      nothing (plain data parallel)                 :class:`GradientBuckets`: gradients live in flat buckets,
                                                     each all-reduced (averaged over D) as soon as backward filled it
1      optimizer states (Adam m, v, step; master     stage 0 with ``reduce_scatter_tensor`` instead of all-reduce
       weights)                                      + :class:`ShardedOptimizer`: each rank steps its 1/D of every
                                                     bucket, then all-gathers the updated parameters (Megatron-LM's
                                                     distributed optimizer)
2      + gradients                                   FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients
                                                     reduce-scattered, parameters kept gathered between forward and
                                                     backward, sharded between steps
3      + parameters                                  FSDP2 ``fully_shard(reshard_after_forward=True)`` per layer
=====  ===========================================  ===============================================================

**Mixed precision** (``bf16-mixed`` for ``lightning_4d`` Llama models; Micikevicius et al. 2018, "Mixed Precision
Training", arXiv 1710.03740, as Megatron-LM and torchtitan do it): the weights the layers compute with are bfloat16,
the float32 master weights live with the optimizer states and are sharded like them, gradients are accumulated and
reduced in float32, the update runs in float32 and the bfloat16 weights are refreshed from the masters. Stages 0/1:
``setup_zero(master_dtype=torch.float32)`` (bf16 parameters, fp32 gradient buckets, fp32 masters in
:class:`ShardedOptimizer`: 2 + 4 + 12/D bytes per parameter at stage 1, 18 at stage 0); stages 2/3:
``apply_fsdp(param_dtype=torch.bfloat16)`` (FSDP2 ``MixedPrecisionPolicy``: the fp32 shard is the master, 16/D bytes
per parameter at rest plus the bf16 units gathered for compute).

Parameters are replicated across dp and cp, so the group is the flattened ``("dp", "cp")`` mesh. Gradients are
*averaged* over the group at every stage (the loss is a per-rank mean over equally many tokens); for FSDP2 the
divide factor is set explicitly so that the result does not depend on the backend's reduce op (on gloo FSDP2 has
been reported to sum instead of average, pytorch issue 162338; the parity tests check this).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_4d.config import check_training_precision
from lightning_4d.parallel._compat import (
    FULLY_SHARD_PLACEMENT_FN,
    all_gather_single,
    local_tensor as _local,
    reduce_scatter_single,
)
from lightning_4d.parallel.compression import PowerSGD, compressible
from lightning_4d.parallel.tensor import token_parallel_parameters
from lightning_4d.partition import GRADIENT_BUCKET_BYTES, bucket_lengths, bucket_shard, expert_shard_dim

_BUCKET_BYTES = GRADIENT_BUCKET_BYTES  # the one definition is in partition.py (the memory model reads it)


def _buckets(
    tensors: list[Tensor],
    bucket_bytes: int,
    key: Callable[[Tensor], Tensor] = lambda t: t,
    kind: Callable[[Tensor], Any] = lambda t: None,
) -> Iterable[list[Tensor]]:
    """Group tensors of the same dtype, device (of ``key(t)``) and ``kind(t)`` (expert and token-parallel parameters
    apart: other process groups) into buckets of at most ``bucket_bytes`` of ``key(t)`` (one tensor may exceed),
    keeping their order (:func:`lightning_4d.partition.bucket_lengths`)."""
    by_key: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        k = key(t)
        by_key.setdefault((k.dtype, k.device, kind(t)), []).append(t)
    for group in by_key.values():
        start = 0
        for length in bucket_lengths([key(t).numel() * key(t).element_size() for t in group], bucket_bytes):
            yield group[start : start + length]
            start += length


# ---------------------------------------------------------------------------------------------------- stage 2, 3
def fsdp_reduce_dtype(gradient_compression: str) -> Optional[torch.dtype]:
    """The ``reduce_dtype`` of FSDP2's ``MixedPrecisionPolicy`` for ``ParallelConfig.gradient_compression`` at ZeRO
    2/3: ``torch.bfloat16`` for ``"bf16"`` (half the reduce-scatter bytes), else ``None`` (:func:`apply_fsdp`'s
    default). Every caller of :func:`apply_fsdp` for a strategy layout passes this (our Llama, any module,
    transformers' Llama)."""
    return torch.bfloat16 if gradient_compression == "bf16" else None


def apply_fsdp(
    model: nn.Module,
    dp_cp_mesh: DeviceMesh,
    zero_stage: int,
    blocks: Optional[Iterable[nn.Module]] = None,
    reshard_after_forward: Optional[bool] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    expert_mesh: Optional[DeviceMesh] = None,
) -> None:
    """Shard ``model`` with FSDP2 for ZeRO stage 2 or 3, one FSDP unit per transformer block, then the root.

    Under expert parallelism (``expert_mesh``: the 1D expert data-parallel mesh ``edp``, dp·cp/ep ranks) every module
    that directly holds expert weights (DTensors ``Shard(0)`` on the ep mesh,
    :func:`~lightning_4d.parallel.expert.is_expert_parameter`) becomes a unit of its own first, over ``edp`` (FSDP2
    joins the two 1D meshes, children of one parent, into the 2D ``(edp, ep)`` mesh: each expert row block is
    sharded on dim 0 over ``edp`` inside its ep shard, torchtitan's ``dp_mod_ep`` units). Its gradients are
    divided by D = dp·cp too, not by D/ep: the all-to-all's backward already summed the ep group's contributions
    (:mod:`lightning_4d.parallel.expert`), so the result is the mean of the D per-rank losses' gradients, as for the
    dense parameters.

    Stacked expert weights (:func:`~lightning_4d.parallel.expert.stacked_expert_weights`, ``[E_local, d1, d2]``;
    under ep in their own units over ``edp``, else in their block's unit over ``dp_cp``) are sharded on dim 1
    (FSDP2's ``shard_placement_fn`` returning ``Shard(1)``) when their group's size does not divide ``E_local`` and
    divides ``d1`` (:func:`lightning_4d.partition.expert_shard_dim`; torchtitan's rule for ``dp_shard·ep >
    num_experts``): each rank holds ``d1/G`` rows of every local expert instead of ``ceil(E_local/G)`` padded whole
    experts. Every other parameter is sharded on dim 0 (FSDP2's default).

    Args:
        model: the module (DTensor tensor-parallel parameters are fine: FSDP2 shards their local dim 0).
        dp_cp_mesh: the 1D ``dp_cp`` mesh.
        zero_stage: 2 (``reshard_after_forward=False``) or 3 (``True``).
        blocks: the submodules that become their own FSDP units (default: ``model.layers.values()``).
        expert_mesh: the ``edp`` mesh under expert parallelism (see above), else ``None``.
        reshard_after_forward: override the stage's default (``zero_stage == 3``); the zero-bubble pipeline
            schedules pass ``False`` for stage 3 (see ``parallelize_model``).
        param_dtype: mixed precision (``bf16-mixed``): FSDP2's ``MixedPrecisionPolicy(param_dtype=param_dtype,
            reduce_dtype=torch.float32, cast_forward_inputs=False)``: the sharded float32 parameters are the master
            weights, each unit is all-gathered in ``param_dtype`` for compute and its gradients reduce-scattered
            (and, under a pipeline's gradient accumulation, accumulated) in float32; the blocks' inputs are not
            cast (the rotary tables stay float32). ``None``: parameters compute in their own dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in (``gradient_compression="bf16"``:
            ``torch.bfloat16``); default float32 under ``param_dtype``, else the parameters' dtype.

    Raises:
        ValueError: ``zero_stage`` is not 2 or 3. RuntimeError: an expert weight needs dim 1 on a torch whose
            ``fully_shard`` has no ``shard_placement_fn`` (torch < 2.6; ``_compat.FULLY_SHARD_PLACEMENT_FN``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, got zero_stage={zero_stage}")
    reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
    if blocks is None:
        layers = getattr(model, "layers", None)
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    kw: dict[str, Any] = {"mesh": dp_cp_mesh, "reshard_after_forward": reshard}
    if param_dtype is not None or reduce_dtype is not None:
        # the blocks' float32 inputs stay as they are: the rotary tables must not be rounded to bf16 (the residual
        # stream is in param_dtype already)
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype,
            cast_forward_inputs=False,
            reduce_dtype=reduce_dtype or (torch.float32 if param_dtype is not None else None),
        )
    from lightning_4d.parallel.expert import is_expert_parameter, stacked_expert_weights

    expert_weights = stacked_expert_weights(model)  # held: FSDP2 replaces them, and their ids must not be reused
    experts = {id(p) for p in expert_weights}

    def placement(mesh: DeviceMesh) -> Optional[Callable[[nn.Parameter], Optional[Shard]]]:
        """FSDP2's ``shard_placement_fn`` over ``mesh``: ``Shard(expert_shard_dim(...))`` for a stacked expert
        weight, FSDP2's default ``Shard(0)`` (``None``) for every other parameter; ``None`` (no function) when
        no expert weight is sharded on dim 1."""

        def dim(p: nn.Parameter) -> int:
            return expert_shard_dim(tuple(_local(p).shape), mesh.size()) if id(p) in experts else 0

        if not any(dim(p) for p in model.parameters()):
            return None
        if not FULLY_SHARD_PLACEMENT_FN:  # pragma: no cover - torch without shard_placement_fn
            raise RuntimeError(
                f"torch {torch.__version__}: fully_shard has no shard_placement_fn argument, needed to shard expert "
                f"weights whose {mesh.size()}-rank group does not divide their experts (dim 0) on dim 1"
            )
        return lambda p: Shard(1) if dim(p) == 1 else None

    units = []
    if expert_mesh is not None:
        holders = [m for m in model.modules() if any(is_expert_parameter(p) for p in m.parameters(recurse=False))]
        fn = placement(expert_mesh)
        units = [
            fully_shard(m, **{**kw, "mesh": expert_mesh}, **({"shard_placement_fn": fn} if fn else {})) for m in holders
        ]
        for unit in units:
            average_expert_gradients(unit, expert_mesh.size(), dp_cp_mesh.size())
    fn = placement(dp_cp_mesh)  # without ep the experts are sharded with their block, over dp_cp
    if fn:
        kw["shard_placement_fn"] = fn
    dense = [fully_shard(b, **kw) for b in blocks]
    root = fully_shard(model, **kw)
    for unit in [*dense, root] if hasattr(root, "set_gradient_divide_factor") else []:
        # average over dp_cp explicitly (pre-divide by 1, post-divide by D): independent of the backend's ReduceOp.
        # torch < 2.8 has no such setting; its default, the average over the unit's group (dp_cp), is the same
        unit.set_gradient_divide_factor(float(dp_cp_mesh.size()))


def average_expert_gradients(unit: Any, group_size: int, dp_cp_size: int) -> None:
    """Make the FSDP2 unit ``unit`` (a module holding expert weights, sharded over the ``group_size`` ranks of
    ``edp`` = dp·cp/ep) leave its gradients divided by D = ``dp_cp_size`` (the mean of the D per-rank losses'
    gradients; the ep all-to-all's backward has already summed the ep group's contributions), on every torch the
    package accepts.

    - ``group_size > 1``: a divide factor (D) other than the group's size makes FSDP2 reduce-scatter with
      ``ReduceOp.PREMUL_SUM``, which gloo refuses (measured, torch 2.13): a forced sum, then a division by D
      (torch >= 2.8); torch < 2.8 has only ``set_reduce_scatter_divide_factor`` (the ``PREMUL_SUM``, NCCL only).
    - ``group_size == 1`` (ep = D): FSDP2's own division on a one-rank group differs between torch releases: from
      torch 2.9's skip of the one-rank reduce-scatter (pytorch#162021) until pytorch#167178 (torch 2.10) the
      gradient is copied without dividing by the factor at all (expert gradients D times too large); since, it is
      divided once when copied, and once more by a forced sum's post-divide (halved at dp2 ep2, measured, torch
      2.13). So FSDP2 is given no factor and, where it can, a forced sum (never ``ReduceOp.AVG`` on one rank, which
      NCCL can get wrong, pytorch#144045): on every release its reduction of this unit is then the identity, and the
      unit's all-reduce hook (``set_all_reduce_hook``, torch >= 2.7; it sees each reduction's output before it is
      accumulated into ``.grad``) divides by D. torch < 2.7 runs the one-rank reduce-scatter, so there
      ``set_reduce_scatter_divide_factor`` divides.

    Raises:
        RuntimeError: a torch whose ``FSDPModule`` has none of these settings.
    """
    if group_size == 1 and hasattr(unit, "set_all_reduce_hook"):
        if hasattr(unit, "set_force_sum_reduction_for_comms"):
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_all_reduce_hook(lambda reduced: reduced.div_(dp_cp_size))
    elif hasattr(unit, "set_gradient_divide_factor"):
        unit.set_gradient_divide_factor(float(dp_cp_size))
        if group_size > 1:
            unit.set_force_sum_reduction_for_comms(True)
    elif hasattr(unit, "set_reduce_scatter_divide_factor"):  # pragma: no cover - torch < 2.8
        unit.set_reduce_scatter_divide_factor(float(dp_cp_size))
    else:  # pragma: no cover - torch < 2.5
        raise RuntimeError(f"torch {torch.__version__}: FSDP2 units cannot divide expert gradients by dp·cp")


# ---------------------------------------------------------------------------------------------------- stage 0, 1
def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a Lightning ``LightningOptimizer`` (or ``optimizer`` itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def reduced_by_fsdp(p: Tensor) -> bool:
    """Whether FSDP2 (ZeRO 2/3 over ``dp_cp``, or for expert weights over ``edp``) already averages this parameter's
    gradient."""
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return "dp_cp" in names or "edp" in names


def mixed_precision_dtype(precision: Optional[str]) -> Optional[torch.dtype]:
    """The compute dtype of mixed precision with master weights for a Lightning ``precision`` flag:
    ``torch.bfloat16`` for ``"bf16-mixed"``, ``None`` for the others (``"16-mixed"`` keeps Lightning's autocast and
    gradient scaler)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def validate_precision(precision: Optional[str], zero_stage: int, full_file_checkpoints: bool = False) -> None:
    """Refuse a precision ZeRO cannot serve, before any process group exists.

    Raises:
        ValueError: ``"16-mixed"`` (:func:`lightning_4d.config.check_training_precision`); master weights
            (``"bf16-mixed"``) at ZeRO 0 with full-file checkpoints (``full_file_checkpoints``:
            ``save_distributed_checkpoint=False``; each rank's master weights and optimizer states are saved in the
            sharded folder's per-rank files only).
    """
    if precision is not None:
        check_training_precision(precision)
    if mixed_precision_dtype(precision) is not None and zero_stage == 0 and full_file_checkpoints:
        raise ValueError(
            f"save_distributed_checkpoint=False is not supported with precision={precision!r} and zero_stage=0: the "
            "fp32 master weights live with the optimizer states, saved per rank in a sharded folder. Use "
            "save_distributed_checkpoint=True, or zero_stage 2 or 3 (FSDP2: the fp32 parameters are the masters)."
        )


def setup_zero(
    model: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    group: dist.ProcessGroup,
    zero_stage: int,
    master_dtype: Optional[torch.dtype] = None,
    tp_rank: int = 0,
    compression: str = "none",
    powersgd_rank: int = 4,
    powersgd_start_step: int = 0,
    powersgd_comm_dtype: Optional[torch.dtype] = None,
    expert_group: Optional[dist.ProcessGroup] = None,
    token_group: Optional[dist.ProcessGroup] = None,
) -> Optional["GradientBuckets"]:
    """ZeRO 0/1 for the parameters FSDP2 does not own: their gradients in :class:`GradientBuckets` over ``group``
    (``dp_cp``; returned, ``None`` when there is none), and a :class:`ShardedOptimizer` around every torch optimizer
    (found again with :meth:`ShardedOptimizer.of`) when ``zero_stage == 1`` (the states of 1/D of the buckets per
    rank) or when there are master weights (``master_dtype``: the parameters are in a lower precision and the
    optimizer steps float32 copies of them).

    Args:
        model: the module whose parameters are trained.
        optimizers: the torch optimizers (not Lightning's wrappers) over those parameters.
        group: the ``dp_cp`` process group.
        zero_stage: 0 or 1 (2, 3: the parameters FSDP2 owns are skipped, the rest get stage-0 treatment).
        master_dtype: the dtype of master weights and gradients (``torch.float32`` under ``bf16-mixed`` for
            ``lightning_4d`` Llama models, whose parameters are then bfloat16), or ``None`` (the parameters are the
            master weights). The buckets' hooks are then not registered yet: cast the parameters, then call
            :meth:`GradientBuckets.register_hooks`.
        tp_rank: this rank's tensor-parallel rank (tp-replicated parameters count once in the clipping norm).
        compression, powersgd_rank, powersgd_start_step, powersgd_comm_dtype: the buckets' gradient compression
            (``ParallelConfig.gradient_compression`` and its PowerSGD options;
            :class:`~lightning_4d.parallel.compression.PowerSGD`).
        expert_group: under expert parallelism the expert data-parallel group (``dp_cp / ep``): the expert
            parameters (:func:`~lightning_4d.parallel.expert.is_expert_parameter`) get buckets of their own over it
            (averaged over D all the same, :class:`GradientBuckets`), and every optimizer a
            :class:`ShardedOptimizer` (also at ZeRO 0: the global-norm clipping counts each expert once). Under tp
            with ep it is the ``edp_tp`` group (the experts run token parallel, see ``token_group``).
        token_group: under tensor parallelism the ``dp_cp_tp`` group: the parameters of modules that run token
            parallel (:func:`~lightning_4d.parallel.tensor.token_parallel_parameters`: Mixture-of-Experts layers,
            each tp rank on its own tokens) get buckets of their own over it, so that their gradients are summed over
            tp and averaged over D in one collective (:class:`GradientBuckets`), and every optimizer a
            :class:`ShardedOptimizer` (the clipping); ``None`` without tp (ignored for a model without such modules).

    Raises:
        ValueError: an optimizer holds a parameter the buckets do not (a frozen one or one FSDP2 owns) while it must
            be sharded or given a master weight.
    """
    params = [p for p in model.parameters() if p.requires_grad and not reduced_by_fsdp(p)]
    if not params:
        return None
    shard = zero_stage == 1 and dist.get_world_size(group) > 1
    tokens = token_parallel_parameters(model) if token_group is not None else []
    # with master weights the parameters are cast after this: their hooks are registered then (register_hooks)
    buckets = GradientBuckets(
        params,
        group,
        reduce_scatter=shard,
        grad_dtype=master_dtype,
        hooks=master_dtype is None,
        compression=compression,
        powersgd_rank=powersgd_rank,
        powersgd_start_step=powersgd_start_step,
        powersgd_comm_dtype=powersgd_comm_dtype,
        expert_group=expert_group,
        token_group=token_group if tokens else None,
        token_params=tokens,
    )
    # expert and token-parallel gradients live in buckets over other groups: only the ShardedOptimizer's clipping
    # counts each once (and torch's would mix plain and DTensor gradients)
    if shard or master_dtype is not None or expert_group is not None or tokens:
        for optimizer in optimizers:
            ShardedOptimizer(optimizer, buckets, master_dtype=master_dtype, tp_rank=tp_rank)
    return buckets


class _Bucket:
    """One communication bucket: parameters in backward order and a flat gradient buffer ``[padded]`` holding their
    gradients back to back (``padded`` = their local elements rounded up to a multiple of the group size), reduced
    over ``group`` (``dp_cp``, or for expert parameters the expert data-parallel group) of ``world`` ranks, this one
    ``rank``; ``kind``: 0 dense (``dp_cp``), 1 token parallel (``dp_cp_tp``), 2 experts (their replicas' group).

    The buffer exists from the first gradient that reaches the bucket to the end of the optimizer step
    (:meth:`allocate`, :meth:`release`): ``None`` in between."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, group: dist.ProcessGroup, kind: int = 0) -> None:
        self.group = group
        self.kind = kind
        self.world = world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = params
        self.offsets: dict[int, int] = {}
        n = 0
        for p in params:
            self.offsets[id(p)] = n
            n += _local(p).numel()
        self.numel = n
        self.padded = bucket_shard(n, world, world - 1)[1]  # the end of the last rank's range
        self.dtype = dtype
        self.device = _local(params[0]).device
        self.buffer: Optional[Tensor] = None

    def allocate(self) -> Tensor:
        """The buffer, made (zeros) if it does not exist."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        return self.buffer

    def release(self) -> None:
        """Drop the buffer (its memory goes back to the allocator; the next gradient makes a new one)."""
        self.buffer = None

    def own_range(self, rank: int, world: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s 1/world of the bucket (:func:`lightning_4d.partition.bucket_shard`)."""
        return bucket_shard(self.numel, world, rank)


class GradientBuckets:
    """ZeRO stages 0 and 1 gradients: every parameter's gradient lives in a flat communication bucket (PyTorch DDP's
    ``gradient_as_bucket_view``, Megatron-LM's contiguous gradient buffer), averaged over the ``dp_cp`` group by an
    asynchronous collective per bucket overlapped with the backward pass.

    Parameters are grouped into buckets of about ``bucket_bytes`` of parameters (default 25 MiB, DDP's) in reverse
    order, the order backward produces their gradients. ``main_grad(p)`` is ``p``'s slice of its bucket (flat, the
    local shard's elements, in ``grad_dtype``: float32 under master weights, else the parameter's dtype). A
    post-accumulate-grad hook adds each fresh gradient into it (a copy at the first accumulation after an optimizer
    step) and frees the parameter's own ``.grad``, so a gradient exists once, in its bucket (plus the one gradient
    just produced).

    A bucket's buffer is made when the first gradient reaches it and dropped by :meth:`start_accumulation` after the
    optimizer step (PyTorch's ``zero_grad(set_to_none=True)``, bucket by bucket). Megatron-LM keeps its contiguous
    gradient buffer for the whole run; here, without gradient accumulation (no pipeline, one batch per step), no
    gradient exists while the forward pass builds the activations, and during backward a layer's gradients appear as
    its saved activations are freed, so the step's peak holds the larger of the two rather than their sum
    (``lightning_4d/memory/model.py``, **Peak**).

    Inside :meth:`overlap_with_backward` a bucket's collective starts as soon as all its gradients arrived:

    - ZeRO 0: ``all_reduce`` of the bucket;
    - ZeRO 1 (``reduce_scatter``): ``reduce_scatter_tensor`` into the rank's own 1/D of the bucket (Megatron-LM's
      distributed optimizer; with the all-gather of the updated parameters 2/3 of the bytes of all-reduce +
      all-gather per element, as all-reduce is itself a reduce-scatter and an all-gather).

    :meth:`synchronize` takes in gradients set outside the hook (the zero-bubble schedules assign ``.grad``), starts
    what was not started, waits and divides by D. Without master weights at ZeRO 0, each parameter's ``.grad`` is
    then its bucket slice (a DTensor of the parameter's placements for a tensor-parallel one), for a plain torch
    optimizer, clipping and user hooks. Otherwise ``.grad`` stays ``None`` and the :class:`ShardedOptimizer` hands
    the bucket slices to the optimizer. :meth:`start_accumulation` (after each optimizer step) makes the next
    gradient overwrite instead of add.

    Under tensor parallelism the parameters of token-parallel modules (Mixture-of-Experts layers: each tp rank runs
    them whole on its own ``s/t`` tokens, :class:`lightning_4d.parallel.tensor.TokenParallel`) hold the gradient of
    their rank's tokens only: their buckets go over ``token_group`` (``dp_cp x tp``), and the sum over it divided by
    D is the sum over tp of the mean over ``dp_cp``; under ep the experts' over ``expert_group`` (``edp x tp``) in
    the same way. (A DTensor ``Replicate`` parameter used through ``to_local(grad_placements=Partial)`` would say the
    same, but its gradient would be all-reduced over tp per parameter, synchronously, before the bucket's own
    collective; a bucket over the combined group is one collective, overlapped with backward, and lets ZeRO 1 shard
    these states over ``D·t`` ranks: Megatron-core's expert data-parallel group with expert tensor parallelism 1.)

    A tensor-parallel gradient whose placement differs from its parameter's (the vocabulary-parallel embedding's
    comes back partial over tp) is redistributed to the parameter's placement first. A parameter that got no
    gradient since the last step has none at the optimizer step (its slice is zeroed before the collective).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        reduce_scatter: bool = False,
        grad_dtype: Optional[torch.dtype] = None,
        bucket_bytes: Optional[int] = None,
        hooks: bool = True,
        compression: str = "none",
        powersgd_rank: int = 4,
        powersgd_start_step: int = 0,
        powersgd_comm_dtype: Optional[torch.dtype] = None,
        expert_group: Optional[dist.ProcessGroup] = None,
        token_group: Optional[dist.ProcessGroup] = None,
        token_params: Iterable[Tensor] = (),
    ) -> None:
        from lightning_4d.parallel.expert import is_expert_parameter

        self.params = [p for p in params if p.requires_grad]
        self.compression = compression
        self.powersgd = (
            PowerSGD(powersgd_rank, group, powersgd_start_step, powersgd_comm_dtype)
            if compression == "powersgd"
            else None
        )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reduce_scatter = reduce_scatter
        self.grad_dtype = grad_dtype
        bucket_bytes = _BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.expert_group = expert_group
        self.token_group = token_group
        tokens = {id(p) for p in token_params}
        groups = {0: group, 1: token_group, 2: expert_group}

        def kind(p: Tensor) -> int:  # 0 dense, 1 token parallel, 2 experts (class docstring)
            if expert_group is not None and is_expert_parameter(p):
                return 2
            return 1 if token_group is not None and id(p) in tokens else 0

        self.buckets = [
            _Bucket(ps, grad_dtype or _local(ps[0]).dtype, groups[kind(ps[0])], kind(ps[0]))
            for ps in _buckets(self.params[::-1], bucket_bytes, key=_local, kind=kind)
        ]
        self._reduces = any(b.world > 1 for b in self.buckets)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._numel = {id(p): _local(p).numel() for p in self.params}
        self._fresh = {id(p) for p in self.params}  # no gradient since the last optimizer step
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, Any] = {}
        self._overlap = False
        self._step = 0  # the optimizer step being accumulated (overlap_with_backward): PowerSGD's start
        self._suspended = False
        self._hooks: list[Any] = []
        if hooks:
            self.register_hooks()

    def register_hooks(self) -> None:
        """Register the post-accumulate-grad hooks on the parameters. With ``hooks=False`` at construction, call it
        once the parameters have their final dtype: ``Module.to`` swaps a DTensor parameter's tensor in place
        (``torch.utils.swap_tensors``), and a hook registered before (even removed and registered again) no longer
        fires (measured, torch 2.13)."""
        self.close()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def close(self) -> None:
        """Remove the backward hooks (the strategy calls it before building new buckets)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """A backward inside this context leaves the buckets alone (its gradients stay in ``.grad``): for backward
        passes whose gradients are discarded, such as a pipeline schedule run for evaluation."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def main_grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient slice of its bucket (flat, ``[local numel]``, ``grad_dtype``); the bucket's buffer is made
        (zeros) if it does not exist yet."""
        b = self.buckets[self._bucket_of[id(p)]]
        start = b.offsets[id(p)]
        return b.allocate()[start : start + self._numel[id(p)]]

    def has_grad(self, p: Tensor) -> bool:
        """Whether ``p`` received a gradient since the last optimizer step."""
        return id(p) not in self._fresh

    def existing_grads(self) -> list[Tensor]:
        """Every parameter's gradient slice (:meth:`main_grad`) in the buckets whose buffer exists now (for byte
        counts: makes no buffer)."""
        return [self.main_grad(p) for b in self.buckets if b.buffer is not None for p in b.params]

    def buffers(self) -> list[Tensor]:
        """The flat gradient buffers that exist now (for byte counts)."""
        return [b.buffer for b in self.buckets if b.buffer is not None]

    def bucket_of(self, p: Tensor) -> tuple[_Bucket, int]:
        """(the bucket holding ``p``, ``p``'s offset in it)."""
        b = self.buckets[self._bucket_of[id(p)]]
        return b, b.offsets[id(p)]

    def start_accumulation(self) -> None:
        """The next gradient of every parameter overwrites its slice (called after each optimizer step): the buckets'
        buffers are dropped (and ``.grad`` views of them, ZeRO 0 without master weights), made again by the next
        backward."""
        self._fresh = {id(p) for p in self.params}
        if self._pending:
            raise RuntimeError("start_accumulation with bucket collectives in flight: call synchronize first")
        for p in self.params:
            if p.grad is not None and self._is_bucket_view(p):
                p.grad = None
        for b in self.buckets:
            b.release()

    def _is_bucket_view(self, p: Tensor) -> bool:
        """Whether ``p.grad`` is a view of its bucket (:meth:`_expose`)."""
        b = self.buckets[self._bucket_of[id(p)]]
        grad = _local(p.grad)
        return b.buffer is not None and grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()

    @contextmanager
    def overlap_with_backward(self, step: int = 0) -> Iterator[None]:
        """Start each bucket's collective from the backward pass that runs inside this context. ``step``: the
        optimizer step (``trainer.global_step``); PowerSGD's steps reduce in :meth:`synchronize` instead (its two
        all-reduces need every matrix of the bucket), its start steps overlap like uncompressed ones."""
        self._ready = [0] * len(self.buckets)
        self._step = step
        self._overlap = True
        try:
            yield
        finally:
            self._overlap = False

    @torch.no_grad()
    def _accumulate(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        local = _local(g).reshape(-1)
        main = self.main_grad(p)
        if local.data_ptr() != main.data_ptr():  # not accumulated in place into an exposed slice
            if id(p) in self._fresh:
                main.copy_(local)
            else:
                main.add_(local)
        self._fresh.discard(id(p))
        p.grad = None

    def _grad_ready(self, p: Tensor) -> None:
        if self._suspended:
            return
        self._accumulate(p)
        if not self._overlap or not self._reduces or (self.powersgd is not None and self.powersgd.active(self._step)):
            return  # PowerSGD reduces in synchronize (its two all-reduces need every matrix of the bucket)
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i].params):
            self._launch(i)

    def _zero_missing(self, b: _Bucket) -> None:
        """Zero the slices of ``b``'s parameters that got no gradient this step (not the last step's values)."""
        for p in b.params:
            if id(p) in self._fresh:
                self.main_grad(p).zero_()

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        if i in self._pending:
            return
        b = self.buckets[i]
        b.allocate()  # a bucket none of whose parameters got a gradient still takes part in the collective
        self._zero_missing(b)
        if b.world == 1:  # experts with ep = dp·cp: no other rank holds them (divided by D in synchronize)
            self._pending[i] = (None, b.buffer)
            return
        wire = b.buffer.to(torch.bfloat16) if self.compression == "bf16" else b.buffer  # the bytes sent
        if self.reduce_scatter:
            start, end = b.own_range(b.rank, b.world)
            work = reduce_scatter_single(wire[start:end], wire, group=b.group, async_op=True)
        else:
            work = dist.all_reduce(wire, group=b.group, async_op=True)
        self._pending[i] = (work, wire)

    @torch.no_grad()
    def synchronize(self, step: int = 0) -> None:
        """Finish the averaging: take in gradients assigned outside the hook, start the remaining buckets' collectives,
        wait, divide by D (ZeRO 1: the rank's own ranges only are meaningful afterwards). ``step``: the optimizer
        step (``trainer.global_step``), which tells PowerSGD whether it compresses yet."""
        for p in self.params:
            if p.grad is not None:
                self._accumulate(p)
        if self.world > 1 and self.powersgd is not None and self.powersgd.active(step):
            self._powersgd_reduce()
        elif self._reduces:  # some bucket's group has other ranks (tp alone: the token-parallel ones)
            for i in range(len(self.buckets)):
                self._launch(i)
            for i in sorted(self._pending):
                work, wire = self._pending[i]
                if work is not None:
                    work.wait()
                b = self.buckets[i]
                start, end = b.own_range(b.rank, b.world) if self.reduce_scatter else (0, b.padded)
                if wire is not b.buffer:  # bf16 on the wire: back into the float32 bucket
                    b.buffer[start:end].copy_(wire[start:end])
                b.buffer[start:end].div_(self.world)  # D also for expert buckets (parallel/expert.py)
            self._pending = {}
        if self.grad_dtype is None and not self.reduce_scatter:
            self._expose()

    @torch.no_grad()
    def _powersgd_reduce(self) -> None:
        """Every bucket's mean gradient through :class:`~lightning_4d.parallel.compression.PowerSGD` (the whole
        bucket, on every rank: at ZeRO 1 the rank then reads its own range)."""
        for b in self.buckets:
            self._zero_missing(b)
            matrices, vectors = [], []
            for p in b.params:
                shape = _local(p).shape
                if compressible(shape, self.powersgd.rank):
                    matrices.append((id(p), self.main_grad(p).view(shape)))
                else:
                    vectors.append(self.main_grad(p))
            self.powersgd.reduce(matrices, vectors)

    def compression_state(self, names: dict[int, str]) -> Optional[dict[str, dict[str, Tensor]]]:
        """PowerSGD's error-feedback and warm-start state by parameter name (``None`` without PowerSGD)."""
        return self.powersgd.state(names) if self.powersgd is not None else None

    def load_compression_state(self, names: dict[int, str], state: dict[str, dict[str, Tensor]]) -> None:
        """Restore :meth:`compression_state`."""
        if self.powersgd is not None:
            self.powersgd.load_state(
                {id(p): names[id(p)] for p in self.params if id(p) in names}, state, self.buckets[0].device
            )

    def _expose(self) -> None:
        """``p.grad`` = ``p``'s bucket slice (shaped and placed like ``p``) for every parameter with a gradient."""
        for p in self.params:
            if id(p) in self._fresh:
                continue
            view = self.main_grad(p).view(_local(p).shape)
            if isinstance(p, DTensor):
                view = DTensor.from_local(
                    view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            p.grad = view


#: ``{torch optimizer: the ShardedOptimizer around it}`` (:meth:`ShardedOptimizer.of`); weak keys: an entry goes
#: with its optimizer
_SHARDED_OPTIMIZERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, ShardedOptimizer]" = weakref.WeakKeyDictionary()


class ShardedOptimizer:
    """ZeRO stage 1 and mixed-precision master weights around an existing element-wise ``torch.optim.Optimizer``
    (SGD, Adam, AdamW, ...; not Shampoo or LAMB, which need whole tensors), over :class:`GradientBuckets`.

    Each parameter's *owned slice* is the part of its flat local tensor that falls in this rank's 1/D of its bucket
    (ZeRO 1, Megatron-LM's distributed optimizer; a parameter may straddle ranks or own nothing) or all of it (ZeRO 0
    with master weights). For each owned slice the optimizer steps one tensor: a float32 copy of the slice when
    ``master_dtype`` is given (the master weight; the model's parameter is bfloat16), else a view of the parameter
    itself. Per parameter that is, with D = dp·cp ranks: ZeRO 1 under ``bf16-mixed``, 2 (bf16 weight) + 4 (fp32
    gradient in its bucket) + 12/D (fp32 master, Adam m and v) bytes, Megatron-LM's distributed optimizer; ZeRO 0
    under ``bf16-mixed``, 18 bytes.

    At rest the optimizer's ``param_groups`` hold the model's parameters (so LR schedulers and checkpoints see the
    model). The optimizer itself is left untouched: :meth:`of` finds the ``ShardedOptimizer`` of an optimizer, and
    the strategy's precision plugin (:class:`lightning_4d.precision.FourDPrecision`) calls :meth:`step` in place of
    ``optimizer.step``, which

    1. runs the closure (forward, backward, gradient averaging, clipping),
    2. points the param groups at the owned tensors, their gradients at the owned slices of the buckets, and runs
       the wrapped optimizer's step (its states are those of the owned slices only),
    3. restores the param groups, copies the updated masters into the parameters (cast to their dtype) and, at
       ZeRO 1, all-gathers every bucket's updated parameters (``all_gather_into_tensor`` of each rank's range).

    Raises:
        ValueError: an optimizer parameter that is not in the buckets, or a non-contiguous one.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: GradientBuckets,
        master_dtype: Optional[torch.dtype] = None,
        tp_rank: int = 0,
    ) -> None:
        self._optimizer = weakref.ref(optimizer)  # weak: the registry's value must not keep its key alive
        self.buckets = buckets
        self.master_dtype = master_dtype
        self.tp_rank = tp_rank
        self.world = buckets.world if buckets.reduce_scatter else 1
        self.rank = buckets.rank if buckets.reduce_scatter else 0
        self.sharded = buckets.reduce_scatter  # ZeRO 1: each rank owns its range of every bucket (over its group)
        self._full_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.owned: dict[int, tuple[int, int]] = {}  # id(param) -> [start, end) of its flat local tensor
        self.shard: dict[int, nn.Parameter] = {}  # id(param) -> the tensor the optimizer steps
        self.has_master: set[int] = set()  # id(param) of the parameters stepped through a separate master copy
        for params in self._full_groups:
            for p in params:
                self._make_shard(p)
        # looked up by the optimizer (:meth:`of`) without touching it; the entry lives as long as the optimizer
        _SHARDED_OPTIMIZERS[optimizer] = self

    def _make_shard(self, p: Tensor) -> None:
        if id(p) not in self.buckets._bucket_of:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is frozen or owned by FSDP2: ZeRO 1 "
                "and master weights need every optimizer parameter to be trainable and outside FSDP2 units."
            )
        local = _local(p.data)
        if not local.is_contiguous():
            raise ValueError("ZeRO 1 and master weights need contiguous parameters")
        bucket, offset = self.buckets.bucket_of(p)
        lo, hi = self._own_range(bucket)
        start, end = min(max(lo - offset, 0), local.numel()), min(max(hi - offset, 0), local.numel())
        self.owned[id(p)] = (start, end)
        flat = local.view(-1)[start:end]
        if self.master_dtype is not None:  # the parameter is cast to the compute dtype after this
            flat = flat.detach().to(self.master_dtype, copy=True)
            self.has_master.add(id(p))
        self.shard[id(p)] = nn.Parameter(flat, requires_grad=p.requires_grad)

    def _own_range(self, bucket: _Bucket) -> tuple[int, int]:
        """This rank's range of ``bucket`` at ZeRO 1 (over the bucket's group), the whole bucket otherwise."""
        return bucket.own_range(bucket.rank, bucket.world) if self.sharded and bucket.world > 1 else (0, bucket.padded)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        optimizer = self._optimizer()
        assert optimizer is not None, "the wrapped optimizer no longer exists"
        return optimizer

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Optional["ShardedOptimizer"]:
        """The ``ShardedOptimizer`` wrapping ``optimizer`` (a torch optimizer, not Lightning's wrapper), or ``None``."""
        return _SHARDED_OPTIMIZERS.get(optimizer)

    def parameters(self) -> list[nn.Parameter]:
        """The model parameters of the wrapped optimizer."""
        return [p for params in self._full_groups for p in params]

    def owned_grad(self, p: Tensor) -> Optional[Tensor]:
        """The owned slice of ``p``'s averaged gradient in its bucket, ``None`` when ``p`` got no gradient."""
        if not self.buckets.has_grad(p):
            return None
        start, end = self.owned[id(p)]
        return self.buckets.main_grad(p)[start:end]

    def master_tensors(self) -> list[Tensor]:
        """The master weights (``[]`` without ``master_dtype``: the parameters are their own masters)."""
        return [self.shard[i] for i in self.shard if i in self.has_master]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step in place of the wrapped optimizer's (class docstring: closure, step of the owned slices,
        master write-back, ZeRO-1 all-gather); the wrapped ``optimizer.step`` runs inside it, so an LR scheduler
        that wrapped that method counts the step. Returns the closure's result (``None`` without closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, params in zip(self.optimizer.param_groups, self._full_groups):
            for p in params:
                self.shard[id(p)].grad = self.owned_grad(p)
            group["params"] = [self.shard[id(p)] for p in params]
        try:
            self.optimizer.step()
        finally:
            for group, params in zip(self.optimizer.param_groups, self._full_groups):
                group["params"] = params
                for p in params:
                    self.shard[id(p)].grad = None
        self._write_back()
        return loss

    @torch.no_grad()
    def _write_back(self) -> None:
        """Copy the updated masters into the parameters, then (ZeRO 1) all-gather every bucket's parameters."""
        for p in self.parameters():
            if id(p) in self.has_master:
                start, end = self.owned[id(p)]
                if end > start:
                    _local(p.data).view(-1)[start:end].copy_(self.shard[id(p)])
        if not self.sharded:
            return
        mine = set(map(id, self.parameters()))
        for bucket in self.buckets.buckets:
            params = [p for p in bucket.params if id(p) in mine]
            if not params or bucket.world == 1:
                continue
            slices = {id(p): _local(p.data).view(-1)[slice(*self.owned[id(p)])] for p in params}
            gathered = self._gather_owned(bucket, params, slices, _local(params[0]).dtype)
            for p in params:
                offset = bucket.offsets[id(p)]
                local = _local(p.data).view(-1)
                local.copy_(gathered[offset : offset + local.numel()])
            del gathered  # one bucket's temporaries at a time

    def _gather_owned(
        self, bucket: _Bucket, params: list[Tensor], slices: dict[int, Tensor], dtype: torch.dtype
    ) -> Tensor:
        """The whole bucket ``[padded]`` in ``dtype`` from every rank's owned slices: this rank's ``slices``
        (``{id(p): owned slice of p's tensor}``; a missing one counts as zeros) are placed at their bucket offsets
        in its own range, which is all-gathered over the bucket's group (without ZeRO 1 the range is the whole
        bucket)."""
        lo, hi = self._own_range(bucket)
        own = torch.zeros(hi - lo, dtype=dtype, device=bucket.device)
        for p in params:
            if id(p) in slices:
                start, end = self.owned[id(p)]
                at = bucket.offsets[id(p)] + start - lo
                own[at : at + end - start] = slices[id(p)]
        if not self.sharded or bucket.world == 1:
            return own
        gathered = torch.empty(bucket.padded, dtype=dtype, device=own.device)
        _all_gather_flat(gathered, own, bucket.group)
        return gathered

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients by their global norm over all ranks (dp/cp shards, tp shards, pipeline
        stages), in place; returns the norm (float32 scalar, the same on every rank).

        Each rank adds the norm of its owned slices (float32), counting a parameter replicated over tp (RMSNorm
        weights) on tp rank 0 only (Megatron-LM's ``clip_grad_norm_fp32``); the sum of ``|g|^q`` (``max`` for
        q = inf) goes through an all-reduce over all ranks, divided by D at ZeRO 0 (every dp/cp rank holds the
        whole averaged gradient; under expert parallelism the experts' sum by D/ep, the ranks holding them; under
        tp the token-parallel parameters' by D·t and the experts' by D·t/ep: their buckets' groups, whose ranks all
        hold them, tp ranks included, and whose owned slices partition them at ZeRO 1);
        coefficient ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.
        """
        grads = [(p, g) for p in self.parameters() if (g := self.owned_grad(p)) is not None]
        device = self.buckets.buckets[0].device
        inf = math.isinf(norm_type)
        # [dense, token parallel, expert] sums (_Bucket.kind): at ZeRO 0 the ranks of a bucket's group all hold its
        # whole gradient (D of them for dense parameters, D·t for token-parallel ones, D/ep or D·t/ep for experts),
        # so each sum is divided by its group's size after the all-reduce
        totals = torch.zeros(3, dtype=torch.float32, device=device)
        for p, g in grads:
            i = self.buckets.bucket_of(p)[0].kind
            if (i == 0 and _tp_duplicate(p, self.tp_rank)) or g.numel() == 0:
                continue
            n = torch.linalg.vector_norm(g.float(), norm_type)
            totals[i] = torch.maximum(totals[i], n) if inf else totals[i] + n**norm_type
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        if inf:
            total = totals.max()
        else:
            if not self.sharded:  # every rank of a group counted the whole gradient
                for i, group in enumerate((self.buckets.group, self.buckets.token_group, self.buckets.expert_group)):
                    if group is not None:
                        totals[i] = totals[i] / dist.get_world_size(group)
            total = totals.sum() ** (1.0 / norm_type)
        coef = clip_coefficient(max_norm, total)
        for _, g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every averaged gradient element to ``[-clip_value, clip_value]``, in place."""
        for p in self.parameters():
            g = self.owned_grad(p)
            if g is not None:
                g.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ checkpoint support
    @torch.no_grad()
    def gathered_state(self, fqns: dict[int, str]) -> dict[str, Any]:
        """The optimizer state in the layout-free form of ``torch.distributed.checkpoint.state_dict``'s
        ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, the form ZeRO 0/2/3 save:
        ``{"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<hyper-parameter>": value}``. Collective over the
        ``dp_cp`` group (call it on every rank).

        Each element-wise state (Adam's ``exp_avg`` / ``exp_avg_sq``, the float32 ``master`` weight) is all-gathered
        over ``dp_cp``, one bucket and one state at a time, into the parameter's whole local (tp-shard) tensor, then
        copied into the CPU: for a DTensor parameter a DTensor with the parameter's mesh and placements whose local
        tensor stays on the CPU (:func:`host_zeros_like`; so the checkpoint reshards on load to any tp / pp / dp /
        ZeRO stage). Scalar states (``step``) are copied to the CPU. Transient memory: one bucket's gather on the
        device; on the CPU, this rank's tp-shard of every state (12 bytes per local parameter with masters, 8
        without), freed once the checkpoint is written.
        """
        out: dict[str, Any] = {}
        mine = set(map(id, self.parameters()))
        for bucket in self.buckets.buckets:
            params = [p for p in bucket.params if id(p) in mine]
            states = {id(p): self._state_with_master(p) for p in params}
            keys = sorted({k for st in states.values() for k, v in st.items() if v.ndim == 1})
            for key in keys:
                dtype = next(st[key].dtype for st in states.values() if key in st)
                slices = {id(p): st[key] for p in params if key in (st := states[id(p)])}
                gathered = self._gather_owned(bucket, params, slices, dtype)
                for p in params:
                    offset, full = bucket.offsets[id(p)], host_zeros_like(p, dtype)
                    host = _local(full).view(-1)
                    host.copy_(gathered[offset : offset + host.numel()])  # one device-to-host copy
                    out[f"state.{fqns[id(p)]}.{key}"] = full
                del gathered
            for p in params:
                for k, v in states[id(p)].items():
                    if v.ndim == 0:
                        out[f"state.{fqns[id(p)]}.{k}"] = v.detach().cpu().clone()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in group.items():
                    if k != "params":
                        out[f"param_groups.{fqns[id(p)]}.{k}"] = v
        return out

    def _state_with_master(self, p: Tensor) -> dict[str, Tensor]:
        shard = self.shard[id(p)]
        state = {
            k: (v if isinstance(v, Tensor) else torch.tensor(v))
            for k, v in (self.optimizer.state.get(shard) or {}).items()
        }
        if id(p) in self.has_master:
            state["master"] = shard.detach()
        return state

    @torch.no_grad()
    def load_gathered_state(
        self, fqns: dict[int, str], flat: dict[str, Any], weights: Optional[dict[str, Tensor]] = None
    ) -> None:
        """Inverse of :meth:`gathered_state` on any layout: ``flat`` holds, for this rank's parameters, whole local
        (tp-shard) states as the checkpoint loader filled them (:func:`lightning_4d.checkpoint.load_sharded`); each
        rank keeps its owned slices. The master weights come from ``flat``'s ``master`` entries when present, else
        from ``weights`` (``{fqn: the saved weight read in float32}``, what a folder holds since the masters are
        saved as the model's weights), else from the loaded parameters. The parameters are then refreshed from the
        masters."""
        weights = weights or {}
        by_fqn: dict[str, dict[str, Any]] = {}  # "state.<fqn>.<field>" -> {fqn: {field: value}}, one pass
        for key, value in flat.items():
            if key.startswith("state."):
                fqn, _, field = key[len("state.") :].rpartition(".")
                by_fqn.setdefault(fqn, {})[field] = value
        loaded: dict[int, dict[str, Tensor]] = {}
        for p in self.parameters():
            shard = self.shard[id(p)]
            start, end = self.owned[id(p)]
            state: dict[str, Tensor] = {}
            for field, value in by_fqn.get(fqns[id(p)], {}).items():
                value = _local(value)
                state[field] = (
                    value.clone()
                    if value.ndim == 0
                    else value.reshape(-1)[start:end].to(device=shard.device, copy=True)
                )
            master = state.pop("master", None)
            if master is None and fqns[id(p)] in weights:
                master = _local(weights[fqns[id(p)]]).reshape(-1)[start:end]
            if id(p) in self.has_master:
                shard.copy_(master if master is not None else _local(p.data).view(-1)[start:end])
            if state:
                loaded[id(p)] = state
        self._load_states(loaded)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key in group:
                    if key != "params" and f"param_groups.{fqns[id(p)]}.{key}" in flat:
                        group[key] = flat[f"param_groups.{fqns[id(p)]}.{key}"]
        if self.has_master:
            self._write_back()

    @torch.no_grad()
    def load_sharded_state(self, names: dict[int, str], states: dict[str, dict[str, Tensor]]) -> None:
        """Load the per-rank ZeRO-1 files of folders saved before :meth:`gathered_state` existed
        (``{name: {"exp_avg": slice, ..., "master": slice}}``, same layout only); then the parameters are refreshed
        from the masters."""
        loaded: dict[int, dict[str, Tensor]] = {}
        for p in self.parameters():
            s = dict(states.get(names[id(p)]) or {})
            master = s.pop("master", None)
            if id(p) in self.has_master:  # no master saved (another precision): the loaded weights are the master
                start, end = self.owned[id(p)]
                self.shard[id(p)].copy_(master if master is not None else _local(p.data).view(-1)[start:end])
            if s:
                loaded[id(p)] = {k: v.clone() for k, v in s.items()}
        self._load_states(loaded)
        if self.has_master:
            self._write_back()

    def _load_states(self, states: dict[int, dict[str, Tensor]]) -> None:
        """Make ``states`` (``{id(model parameter): {"step": scalar, "exp_avg": owned slice, ...}}``) the wrapped
        optimizer's states of those parameters' owned shards, through torch's own ``Optimizer.load_state_dict``: each
        tensor gets the device and dtype torch gives it on a resume (``step`` as it is, or in float32 on the shard's
        device for a ``fused`` or ``capturable`` optimizer, whose kernels read it there; the element-wise states in
        the shard's dtype on its device). The other shards keep their states; the param groups keep their
        hyper-parameters and, once done, hold the model's parameters again."""
        optimizer = self.optimizer
        for group, params in zip(optimizer.param_groups, self._full_groups):
            group["params"] = [self.shard[id(p)] for p in params]
        try:
            packed = optimizer.state_dict()  # the shards numbered as load_state_dict numbers them
            index = {id(p): i for i, p in enumerate(p for params in self._full_groups for p in params)}
            packed["state"].update({index[i]: state for i, state in states.items()})
            optimizer.load_state_dict(packed)
        finally:
            for group, params in zip(optimizer.param_groups, self._full_groups):
                group["params"] = params


def host_zeros_like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """A zero tensor shaped like ``p``'s local (tp-shard) tensor, in ``dtype``, in host (CPU) memory.

    For a DTensor ``p`` the result is a DTensor with ``p``'s mesh, placements, global shape and stride whose local
    tensor is on the CPU whatever the mesh's device type: ``DTensor.from_local`` would copy a CPU tensor to the
    device of a CUDA mesh, so the DTensor is made on the meta device (which ``from_local`` leaves where it is) and
    then on the CPU by ``torch.zeros_like``. DCP saves such a DTensor and loads into one (torch's asynchronous save
    stages its DTensors in CPU memory the same way). Bytes: ``p``'s local element count times ``dtype``'s size.
    """
    local = _local(p)
    if not isinstance(p, DTensor):
        return torch.zeros(local.shape, dtype=dtype, device="cpu")
    meta = torch.empty(local.shape, dtype=dtype, device="meta")
    spec = DTensor.from_local(meta, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.zeros_like(spec, device="cpu")


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


def _all_gather_flat(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """``output = cat(input of every rank)``."""
    all_gather_single(output, input, group=group)


def local_bytes(tensors: Iterable[Optional[Tensor]]) -> int:
    """Bytes held on this rank by ``tensors`` (the local shard of a DTensor; ``None`` counts 0).

    A tensor seen twice (same data pointer and size, e.g. a tied weight) is counted once.
    """
    seen: set = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = (t.data_ptr(), t.numel()) if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def model_state_tensors(
    model: nn.Module, optimizers: Iterable[Any], buckets: Optional[GradientBuckets]
) -> dict[str, list[Tensor]]:
    """The tensors behind one rank's model states, by kind, for byte counts (:func:`local_bytes`) against the memory
    model (``lightning_4d.memory.model.model_state_bytes``).

    Returns ``{"parameters": [...], "gradients": [...], "optimizer_states": [...], "master_weights": [...],
    "compression": [...]}``: the
    parameters (the local
    shards), the gradients (each parameter's slice of its bucket at ZeRO 0/1, padding excluded, for the buckets that
    exist: from the first gradient to the end of the optimizer step; ``.grad`` otherwise)
    and the optimizer states (every tensor state of at least one dimension, e.g. Adam's m and v, plus the master
    weights of :class:`ShardedOptimizer` and PowerSGD's error-feedback and warm-start matrices).
    """
    params = list(model.parameters())
    in_buckets = set() if buckets is None else {id(p) for p in buckets.params}
    grads = buckets.existing_grads() if buckets is not None else []
    grads += [p.grad for p in params if id(p) not in in_buckets and p.grad is not None]
    states: list[Tensor] = []
    masters: list[Tensor] = []
    for optimizer in optimizers:
        torch_opt = unwrap_optimizer(optimizer)
        states += [v for st in torch_opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.ndim > 0]
        sharded = ShardedOptimizer.of(torch_opt)
        if sharded is not None:
            masters += sharded.master_tensors()
    # PowerSGD's error feedback and warm start: persistent state, counted with the optimizer's
    compression = buckets.powersgd.tensors() if buckets is not None and buckets.powersgd is not None else []
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_states": states + masters + compression,
        "master_weights": masters,
        "compression": compression,
    }
