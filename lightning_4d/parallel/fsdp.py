"""ZeRO stages 2 and 3 over the ``dp_cp`` group (under HSDP over ``dp_shard_cp``, replicated over ``dp_replicate``):
FSDP2 ``fully_shard`` per transformer block, then the root (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", arXiv 1910.02054).

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

**Mixed precision** (``bf16-mixed``): ``apply_fsdp(policy=FSDPPolicy(param_dtype=torch.bfloat16))`` (FSDP2
``MixedPrecisionPolicy``: the fp32 shard is the master, 16/D bytes per parameter at rest plus the bf16 units gathered
for compute).

Gradients are *averaged* over the group (the loss is a per-rank mean over equally many tokens); the divide factor is
set explicitly so that the result does not depend on the backend's reduce op (on gloo FSDP2 has been reported to sum
instead of average, https://github.com/pytorch/pytorch/issues/162338; the parity tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_4d.features.moe import runtime as moe
from lightning_4d.module_tree import find_submodel
from lightning_4d.parallel.optimizer_offload import cpu_offload_policy


def fsdp_reduce_dtype(gradient_compression: str) -> Optional[torch.dtype]:
    """The ``reduce_dtype`` of FSDP2's ``MixedPrecisionPolicy`` for ``ParallelConfig.gradient_compression`` at ZeRO
    2/3: ``torch.bfloat16`` for ``"bf16"`` (half the reduce-scatter bytes), else ``None`` (:func:`apply_fsdp`'s
    default). Every caller of :func:`apply_fsdp` for a strategy layout passes this (our Llama, any module,
    transformers' Llama)."""
    return torch.bfloat16 if gradient_compression == "bf16" else None


@dataclass(frozen=True)
class FSDPPolicy:
    """The FSDP2 policies of :func:`apply_fsdp`'s units: mixed precision and offload.

    Attributes:
        param_dtype: mixed precision (``bf16-mixed``): FSDP2's ``MixedPrecisionPolicy(param_dtype=param_dtype,
            reduce_dtype=torch.float32, cast_forward_inputs=False)``: the sharded float32 parameters are the master
            weights, each unit is all-gathered in ``param_dtype`` for compute and its gradients reduce-scattered
            (and, under a pipeline's gradient accumulation, accumulated) in float32; the blocks' inputs are not
            cast (the rotary tables stay float32). ``None``: parameters compute in their own dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in (``gradient_compression="bf16"``:
            ``torch.bfloat16``); default float32 under ``param_dtype``, else the parameters' dtype.
        offload: ``optimizer_offload``: FSDP2's ``CPUOffloadPolicy`` (pinned on CUDA,
            :func:`lightning_4d.parallel.optimizer_offload.cpu_offload_policy`). It moves more than the optimizer's
            states: the sharded parameters (under ``param_dtype`` the float32 masters) and their sharded gradients
            live on the host, so the optimizer (and its states) steps there on the CPU; each unit's shard is copied
            to the device for its all-gather and each reduce-scattered gradient shard back to the host.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload: bool = False

    def options(self, device_type: str) -> dict[str, Any]:
        """``fully_shard``'s ``mp_policy`` and ``offload_policy`` for these policies (none when unset)."""
        out: dict[str, Any] = {}
        if self.param_dtype is not None or self.reduce_dtype is not None:
            out["mp_policy"] = _mixed_precision_policy(self.param_dtype, self.reduce_dtype)
        if self.offload:
            out["offload_policy"] = cpu_offload_policy(device_type)
        return out


def apply_fsdp(
    model: nn.Module,
    dp_cp_mesh: DeviceMesh,
    zero_stage: int,
    blocks: Optional[Iterable[nn.Module]] = None,
    reshard_after_forward: Optional[bool] = None,
    policy: Optional["FSDPPolicy"] = None,
    moe_meshes: Optional[dict[str, Optional[DeviceMesh]]] = None,
) -> None:
    """Shard ``model`` with FSDP2 for ZeRO stage 2 or 3, one FSDP unit per transformer block, then the root.

    The MoE component shards its layers first, in units of their own
    (:func:`lightning_4d.features.moe.runtime.shard_units`: over the meshes of ``moe_meshes``), and says on which
    dimension each parameter of the dense units is sharded (:class:`lightning_4d.features.moe.runtime.ExpertPlacement`;
    FSDP2's default dim 0 for every dense parameter).

    Args:
        model: the module (DTensor tensor-parallel parameters are fine: FSDP2 shards their local dim 0).
        dp_cp_mesh: the mesh ZeRO shards over (:attr:`lightning_4d.mesh.ParallelMesh.zero`): the 1D ``dp_cp`` mesh,
            or under HSDP the 2D ``("dp_replicate", "dp_shard_cp")`` mesh (FSDP2's hybrid sharding: sharded over
            the inner dim, replicated over the outer, gradients reduce-scattered then all-reduced).
        zero_stage: 2 (``reshard_after_forward=False``) or 3 (``True``).
        blocks: the submodules that become their own FSDP units (default: ``model.layers.values()``).
        reshard_after_forward: override the stage's default (``zero_stage == 3``); the zero-bubble pipeline
            schedules pass ``False`` for stage 3 (see ``parallelize_model``).
        policy: the units' mixed precision and offload (:class:`FSDPPolicy`; default: neither).
        moe_meshes: the meshes of the MoE layers' own units (:func:`lightning_4d.features.moe.runtime.fsdp_options`,
            which says which; :func:`~lightning_4d.features.moe.runtime.shard_units` shards those units with them).

    Raises:
        ValueError: ``zero_stage`` is not 2 or 3. RuntimeError: from
        :func:`lightning_4d.features.moe.runtime.shard_units`.
    """
    from torch.distributed.fsdp import fully_shard

    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, got zero_stage={zero_stage}")
    reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
    if blocks is None:
        layers = find_submodel(model, "layers")
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    kw: dict[str, Any] = {"mesh": dp_cp_mesh, "reshard_after_forward": reshard}
    kw.update((policy or FSDPPolicy()).options(dp_cp_mesh.device_type))
    kw = moe.shard_units(model, kw, **(moe_meshes or {}))  # the MoE layers' own units first (docstring)
    for unit in [*(fully_shard(b, **kw) for b in blocks), fully_shard(model, **kw)]:
        average_gradients(unit, dp_cp_mesh)


def average_gradients(unit: Any, mesh: DeviceMesh) -> None:
    """Make FSDP2 ``unit`` average its gradients over all ``mesh.size()`` ranks explicitly, independent of the
    backend's ``ReduceOp`` (pre-divide by 1, post-divide by D). Under HSDP (``mesh`` 2D, replicate x shard) the
    reduce-scatter and the all-reduce across replicas both sum and the sum is divided by D once (FSDP2's
    ``set_force_sum_reduction_for_comms``: its premultiplied sum is not a gloo op). torch < 2.8 has no such
    setting; its default, the average over the unit's group, is the same."""
    try:
        divide = unit.set_gradient_divide_factor
    except AttributeError:  # pragma: no cover - torch < 2.8
        return
    divide(float(mesh.size()))
    if mesh.ndim == 2:
        unit.set_force_sum_reduction_for_comms(True)


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


def reduced_by_fsdp(p: Tensor) -> bool:
    """Whether FSDP2 (ZeRO 2/3 over ``dp_cp``, or over the MoE layers' own meshes,
    :data:`lightning_4d.features.moe.runtime.FSDP_MESH_NAMES`) already averages this parameter's gradient."""
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return any(name in names for name in ("dp_cp", "dp_shard_cp", *moe.FSDP_MESH_NAMES))
