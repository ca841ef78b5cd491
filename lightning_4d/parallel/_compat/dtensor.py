"""DTensor and DeviceMesh internals: a DTensor's local storage and global offset, flattening and unflattening a mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor as the very storage the DTensor holds (``DTensor._local_tensor``; in-place
    updates reach the DTensor, which ``to_local()`` does not promise under autograd); ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_offset(t: DTensor) -> tuple[int, ...]:
    """The global index of this rank's shard's first element of DTensor ``t``, per dimension
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


def flatten_mesh(mesh: "DeviceMesh", name: str) -> "DeviceMesh":
    """The 1D mesh over all ranks of ``mesh`` (a sub-mesh such as ``world["dp", "cp"]``), registered under ``name``
    (``DeviceMesh._flatten``). Keep the object this returns: it is the one whose process group is set up."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: "DeviceMesh", sizes: tuple[int, ...], names: tuple[str, ...]) -> "DeviceMesh":
    """The 1D ``mesh`` (e.g. the flattened ``dp_cp``) split into ``len(sizes)`` dims, the last innermost (consecutive
    ranks of ``mesh``), with process groups for each (``DeviceMesh._unflatten``, torch >= 2.9; its root is the world
    mesh's)."""
    try:
        unflatten = mesh._unflatten
    except AttributeError:  # pragma: no cover - older torch
        raise RuntimeError(
            f"ep > 1 (MoE) needs DeviceMesh._unflatten (torch >= 2.9), torch {torch.__version__} lacks it"
        ) from None
    return unflatten(0, tuple(sizes), tuple(names))


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding propagation (the native cache, ``torch._C._clear_DTensor_sharding_propagator
    _cache``, where this torch has one, and this thread's Python one, ``DTensor._op_dispatcher.sharding_propagator
    .propagate_op_sharding``) and redistribution plans (``_redistribute.clear_redistribute_planner_cache``): private
    names.

    Why: ``DeviceMesh`` equality and hash ignore the process groups, so a mesh over the same ranks and dim names as an
    earlier one (a second ``FourDStrategy`` of the same layout in one process) hits the cached output specs of the
    earlier mesh, and the DTensors it returns carry that mesh: their later collectives run on the earlier strategy's
    groups, under its timeout (measured: 4 gloo ranks, two ``(dp, tp)`` meshes made in turn, a Shard(0) @ Replicate
    matmul on each: the second product's tp group was the first mesh's, its own once this had run).
    """
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    try:
        torch._C._clear_DTensor_sharding_propagator_cache()
    except AttributeError:  # pragma: no cover - an older torch: no native cache
        pass
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_redistribute_planner_cache()
