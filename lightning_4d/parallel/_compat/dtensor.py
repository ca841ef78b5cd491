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
