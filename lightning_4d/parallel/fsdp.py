"""ZeRO stages 2 and 3 over the ``dp_cp`` group: FSDP2 ``fully_shard`` per transformer block, then the root (Rajbhandari
et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054).

=====  ===========================================  ===============================================================
stage  what is sharded over dp_cp (size D)           how
=====  ===========================================  ===============================================================
2      optimizer states + gradients                  FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients
                                                     reduce-scattered, parameters kept gathered between forward and
                                                     backward, sharded between steps
3      + parameters                                  FSDP2 ``fully_shard(reshard_after_forward=True)`` per layer
=====  ===========================================  ===============================================================

Stages 0 and 1 are :mod:`lightning_4d.parallel.grad_buffers` (the gradient buckets) and
:mod:`lightning_4d.parallel.sharded_optimizer` (the sharded optimizer and master weights); clipping is
:func:`lightning_4d.parallel.clipping.clip_grad_norm_` for every stage.

**Mixed precision** (``bf16-mixed``): ``apply_fsdp(param_dtype=torch.bfloat16)`` (FSDP2 ``MixedPrecisionPolicy``: the
fp32 shard is the master, 16/D bytes per parameter at rest plus the bf16 units gathered for compute).

Gradients are *averaged* over the group (the loss is a per-rank mean over equally many tokens); the divide factor is
set explicitly so that the result does not depend on the backend's reduce op (on gloo FSDP2 has been reported to sum
instead of average, pytorch issue 162338; the parity tests check this).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_4d.parallel import moe
from lightning_4d.parallel._compat import FULLY_SHARD_PLACEMENT_FN, local_tensor as _local
from lightning_4d.parallel.moe import average_expert_gradients  # noqa: F401 - importable from here too (issue 32)
from lightning_4d.partition import expert_shard_dim


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
    token_mesh: Optional[DeviceMesh] = None,
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

    Under tensor parallelism with MoE layers (``token_mesh``: the 1D ``dp_cp_tp`` mesh) every module run token
    parallel (an MoE layer, :class:`~lightning_4d.parallel.tensor.TokenParallel`: its router, shared experts and,
    without ep, its experts, replicated over tp, each tp rank's gradient its own tokens') becomes a unit of its own
    next, over ``dp_cp_tp``: its reduce-scatter sums the tp ranks' partial gradients and averages over dp·cp (divided
    by D, :func:`lightning_4d.parallel.moe.shard_token_units`), and its states are sharded over dp·cp·tp ranks.

    Stacked expert weights are sharded on dim 1 where their group does not divide their experts
    (:func:`_unit_options`); every other parameter on dim 0 (FSDP2's default).

    Args:
        model: the module (DTensor tensor-parallel parameters are fine: FSDP2 shards their local dim 0).
        dp_cp_mesh: the 1D ``dp_cp`` mesh.
        zero_stage: 2 (``reshard_after_forward=False``) or 3 (``True``).
        blocks: the submodules that become their own FSDP units (default: ``model.layers.values()``).
        expert_mesh: the ``edp`` mesh under expert parallelism (see above), else ``None``.
        token_mesh: the ``dp_cp_tp`` mesh of a model with MoE layers under tp (see above), else ``None``.
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
    from torch.distributed.fsdp import fully_shard

    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, got zero_stage={zero_stage}")
    reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
    if blocks is None:
        layers = getattr(model, "layers", None)
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    kw: dict[str, Any] = {"mesh": dp_cp_mesh, "reshard_after_forward": reshard}
    if param_dtype is not None or reduce_dtype is not None:
        kw["mp_policy"] = _mixed_precision_policy(param_dtype, reduce_dtype)
    from lightning_4d.parallel.expert import stacked_expert_weights

    expert_weights = stacked_expert_weights(model)  # held: FSDP2 replaces them, and their ids must not be reused
    experts = {id(p) for p in expert_weights}
    if expert_mesh is not None:  # the MoE component's units first, over edp (docstring)
        moe.shard_expert_units(model, _unit_options(kw, model, experts, expert_mesh), dp_cp_mesh.size())
    if token_mesh is not None:  # then the MoE layers run token parallel under tp, over dp_cp_tp (docstring)
        moe.shard_token_units(model, _unit_options(kw, model, experts, token_mesh), dp_cp_mesh.size())
    kw = _unit_options(kw, model, experts, dp_cp_mesh)  # without ep the experts are sharded with their block
    dense = [fully_shard(b, **kw) for b in blocks]
    root = fully_shard(model, **kw)
    for unit in [*dense, root] if hasattr(root, "set_gradient_divide_factor") else []:
        # average over dp_cp explicitly (pre-divide by 1, post-divide by D): independent of the backend's ReduceOp.
        # torch < 2.8 has no such setting; its default, the average over the unit's group (dp_cp), is the same
        unit.set_gradient_divide_factor(float(dp_cp_mesh.size()))


def _mixed_precision_policy(param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype]) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for :func:`apply_fsdp`'s ``param_dtype`` and ``reduce_dtype`` (reduced in
    float32 under ``param_dtype`` unless ``reduce_dtype`` says otherwise). The blocks' float32 inputs stay as they are
    (``cast_forward_inputs=False``): the rotary tables must not be rounded to bf16 (the residual stream is in
    ``param_dtype`` already)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        cast_forward_inputs=False,
        reduce_dtype=reduce_dtype or (torch.float32 if param_dtype is not None else None),
    )


def _unit_options(kw: dict[str, Any], model: nn.Module, experts: set[int], mesh: DeviceMesh) -> dict[str, Any]:
    """``fully_shard`` options ``kw`` over ``mesh`` (:func:`apply_fsdp`), with FSDP2's ``shard_placement_fn`` when a
    stacked expert weight of ``model`` (``id`` in ``experts``) is sharded on dim 1.

    Stacked expert weights (:func:`~lightning_4d.parallel.expert.stacked_expert_weights`, ``[E_local, d1, d2]``;
    under ep in their own units over ``edp``, else in their block's unit over ``dp_cp``, or under tp in their MoE
    layer's unit over ``dp_cp_tp``) are sharded on dim 1 (``Shard(1)``) when their group's size does not divide
    ``E_local`` and divides ``d1`` (:func:`lightning_4d.partition.expert_shard_dim`; torchtitan's rule for
    ``dp_shard·ep > num_experts``): each rank holds ``d1/G`` rows of every local expert instead of ``ceil(E_local/G)``
    padded whole experts. Every other parameter: FSDP2's default ``Shard(0)``; no function at all when no expert
    weight is sharded on dim 1.

    Raises:
        RuntimeError: an expert weight needs dim 1 on a torch whose ``fully_shard`` has no ``shard_placement_fn``.
    """

    def dim(p: nn.Parameter) -> int:
        return expert_shard_dim(tuple(_local(p).shape), mesh.size()) if id(p) in experts else 0

    options = {**kw, "mesh": mesh}
    if not any(dim(p) for p in model.parameters()):
        return options
    if not FULLY_SHARD_PLACEMENT_FN:  # pragma: no cover - torch without shard_placement_fn
        raise RuntimeError(
            f"torch {torch.__version__}: fully_shard has no shard_placement_fn argument, needed to shard expert "
            f"weights whose {mesh.size()}-rank group does not divide their experts (dim 0) on dim 1"
        )
    return {**options, "shard_placement_fn": lambda p: Shard(1) if dim(p) == 1 else None}


def reduced_by_fsdp(p: Tensor) -> bool:
    """Whether FSDP2 (ZeRO 2/3 over ``dp_cp``, for expert weights over ``edp``, for the MoE layers under tp over
    ``dp_cp_tp``) already averages this parameter's gradient."""
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return any(name in names for name in ("dp_cp", "edp", "dp_cp_tp"))
