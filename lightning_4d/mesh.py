"""Building the 4D ``DeviceMesh`` ``("pp", "dp", "cp", "tp")`` and its named sub-meshes.

tp is innermost, so a tp group sits on consecutive ranks (one node, NVLink); pp is outermost (the only dimension
whose traffic is point-to-point). Parameters are replicated across dp and cp, so ZeRO shards over and gradients
are reduced over the flattened ``("dp", "cp")`` mesh, named ``dp_cp`` (Megatron-core's rank order ``tp-cp-dp-pp``).

Hybrid sharding (HSDP, ``data_parallel_replicate_size`` r > 1) splits ``dp_cp`` into ``("dp_replicate",
"dp_shard_cp")`` (r replicas of a shard group of ``dp_cp / r`` consecutive ranks): ZeRO shards over ``dp_shard_cp``
and the reduced shards are all-reduced over ``dp_replicate`` (:attr:`ParallelMesh.zero`).

A feature whose groups are not dimensions of the world mesh carves them out of it (:meth:`ParallelMesh.flatten`,
:meth:`ParallelMesh.unflatten`) and finds them again by name (:meth:`ParallelMesh.get`): :func:`build_mesh` lets
each such feature carve its own (:func:`_feature_meshes`; the MoE component's groups:
:func:`lightning_4d.features.moe.runtime.carve_meshes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_4d.config import MESH_DIM_NAMES, ParallelConfig
from lightning_4d.parallel._compat.dtensor import clear_sharding_caches, flatten_mesh, unflatten_mesh
from lightning_4d.parallel._compat.process import set_process_group_timeout


@dataclass
class ParallelMesh:
    """Every process group of the job, by name (like Megatron-core's named group getters).

    Attributes:
        world: the 4D mesh with dims ``("pp", "dp", "cp", "tp")``.
        dp_cp: the 1D flattened ``("dp", "cp")`` mesh (ZeRO sharding, gradient reduction, loss averaging).
        submeshes: the 1D meshes features carved out of these (:meth:`flatten`, :meth:`unflatten`), by name; each is
            also an attribute (``mesh.<name>``) once carved.
        tp, dp, cp, pp: the 1D slices of ``world``, each made once, when the mesh is built (slicing a DeviceMesh
            costs ~1-5 ms of Python per call: benchmarks/step_overhead.py measured the per-step reads of ``cp`` and
            ``dp``).
        dp_rank, tp_rank: this rank's coordinates in ``dp`` and ``tp`` (they never change; the sampler reads the
            rank every step).
        zero: the mesh ZeRO shards over: ``dp_cp`` (1D), or under HSDP the 2D ``("dp_replicate", "dp_shard_cp")``
            mesh (FSDP2's HSDP mesh: replicate outer, shard inner; :func:`build_mesh`).
    """

    world: DeviceMesh
    dp_cp: DeviceMesh
    submeshes: dict[str, DeviceMesh] = field(default_factory=dict)
    tp: DeviceMesh = field(init=False)
    dp: DeviceMesh = field(init=False)
    cp: DeviceMesh = field(init=False)
    pp: DeviceMesh = field(init=False)
    dp_rank: int = field(init=False)
    tp_rank: int = field(init=False)
    zero: DeviceMesh = field(init=False)

    def __post_init__(self) -> None:
        self.zero = self.dp_cp
        self.tp, self.dp, self.cp, self.pp = (self.world[dim] for dim in ("tp", "dp", "cp", "pp"))
        self.dp_rank, self.tp_rank = self.dp.get_local_rank(), self.tp.get_local_rank()

    def __getattr__(self, name: str) -> DeviceMesh:
        submeshes = self.__dict__.get("submeshes", {})
        if name in submeshes:
            return submeshes[name]
        raise AttributeError(f"ParallelMesh has no mesh {name!r}: carved ones are {sorted(submeshes)}")

    @property
    def zero_shard(self) -> DeviceMesh:
        """The 1D mesh ZeRO shards the states over: ``dp_shard_cp`` under HSDP, else ``dp_cp``."""
        return self.zero["dp_shard_cp"] if self.zero.ndim == 2 else self.zero

    @property
    def zero_replicate(self) -> Optional[DeviceMesh]:
        """HSDP's ``dp_replicate`` mesh (the shards' all-reduce across replicas), ``None`` without HSDP."""
        return self.zero["dp_replicate"] if self.zero.ndim == 2 else None

    def groups(self) -> list[Any]:
        """Every process group of this mesh that holds this rank, each once: the world mesh's four dims, ``dp_cp``,
        HSDP's dims and the carved meshes' (``torch.distributed.ProcessGroup``s)."""
        found: dict[str, Any] = {}
        for mesh in (self.world, self.dp_cp, self.zero, *self.submeshes.values()):
            for group in mesh.get_all_groups():
                found.setdefault(group.group_name, group)
        return list(found.values())

    def get(self, name: str) -> Optional[DeviceMesh]:
        """The carved 1D mesh ``name``, or ``None`` when no feature carved it (the feature is off)."""
        return self.submeshes.get(name)

    def flatten(self, dims: tuple[str, ...], name: str, source: Optional[DeviceMesh] = None) -> DeviceMesh:
        """Carve the 1D mesh ``name`` over the ranks of ``source[dims]`` (``source``: the world mesh by default, or
        a mesh :meth:`unflatten` returned), flattened, and keep it under ``name`` (its process group lives as long
        as the object)."""
        flat = flatten_mesh((self.world if source is None else source)[dims], name)
        self.submeshes[name] = flat
        return flat

    def unflatten(self, parent: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """Split the 1D mesh ``parent`` (``"dp_cp"`` or a carved one) into ``len(sizes)`` dims named ``names``, the
        last innermost (consecutive ranks of ``parent``), keep each dim's 1D mesh under its name and return the
        N-D mesh (for :meth:`flatten` of some of its dims)."""
        mesh = unflatten_mesh(self.dp_cp if parent == "dp_cp" else self.submeshes[parent], sizes, names)
        for dim in names:
            self.submeshes[dim] = mesh[dim]
        return mesh


def build_mesh(config: ParallelConfig, device_type: str, timeout: Optional[timedelta] = None) -> ParallelMesh:
    """Create the mesh for a resolved ``config`` (``data_parallel_size`` must be an int); ``timeout``: the limit of
    each operation on every group it makes (:meth:`ParallelMesh.groups`), as ``init_process_group(timeout=...)``
    sets the default group's (without it, torch gives each new group its default: 30 minutes for gloo, 10 for
    NCCL); ``None`` leaves torch's default.

    Its DTensors communicate on its own groups: DTensor's caches are cleared first
    (:func:`~lightning_4d.parallel._compat.dtensor.clear_sharding_caches`), else a mesh equal to an earlier one would
    get the earlier one's groups through them.

    Must be called on every rank after ``torch.distributed`` is initialized with ``config.world_size`` ranks.

    Raises:
        RuntimeError: the process group's world size differs from ``config.world_size``.
    """
    world_size = torch.distributed.get_world_size()
    if world_size != config.world_size:
        raise RuntimeError(f"process group has {world_size} ranks but the layout needs {config.world_size}")
    clear_sharding_caches()  # an earlier mesh equal to this one (the same layout) would lend its groups to its DTensors
    mesh = init_device_mesh(device_type, config.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    dp_cp = flatten_mesh(mesh["dp", "cp"], "dp_cp")  # keep the returned object: it holds the process group
    out = ParallelMesh(world=mesh, dp_cp=dp_cp)
    if config.dp_replicate > 1:  # HSDP: r replicas of a shard group of consecutive dp_cp ranks
        out.zero = out.unflatten("dp_cp", (config.dp_replicate, config.zero_shard), ("dp_replicate", "dp_shard_cp"))
    for carve in _feature_meshes():
        carve(out, config)
    if timeout is not None:
        for group in out.groups():
            set_process_group_timeout(group, timeout)
    return out


def _feature_meshes() -> tuple[Any, ...]:
    """The functions ``carve(mesh, config)`` of the features that carve groups of their own out of the world mesh
    (collective: every rank calls each, in this order)."""
    from lightning_4d.features.moe import runtime as moe

    return (moe.carve_meshes,)


def embedding_group(mesh: ParallelMesh, config: ParallelConfig, timeout: Optional[timedelta] = None) -> Optional[Any]:
    """The *embedding group* of tied embeddings under pp > 1 (Megatron-Core's ``default_embedding_ranks``): the pp
    ranks holding the first and the last pipeline stage, at this rank's dp/cp/tp coordinates, over which the two
    copies of the tied ``[V, h]`` matrix sum their gradients
    (:class:`lightning_4d.features.pipeline.runtime.TiedEmbedding`).

    Collective when it makes groups: every rank calls it with the same arguments (``torch.distributed.new_group``
    for each dp/cp/tp coordinate, pp > 2 with a looped schedule).

    Args:
        mesh: the job's mesh (:func:`build_mesh`).
        config: the resolved layout.
        timeout: the limit of each operation on a group it makes (as :func:`build_mesh`'s); ``None``: torch's
            default.

    Returns:
        The pp group itself when the two stages' ranks are the whole pp group (pp = 2 with a looped schedule), a new
        two-rank group (pp > 2), or ``None`` when one pp rank holds both stages (a V schedule: zbv, dualpipev; pp = 1)
        or this rank holds neither.
    """
    last_stage = config.num_stages - 1
    holders = [r for r in range(config.pp) if any(s in (0, last_stage) for s in config.stage_indices(r))]
    if len(holders) == 1:
        return None
    if len(holders) == config.pp:
        return mesh.pp.get_group()
    grid = mesh.world.mesh.reshape(config.pp, -1)  # [pp, dp·cp·tp] global ranks
    me = torch.distributed.get_rank()
    mine = None
    for column in range(grid.shape[1]):
        ranks = [int(grid[r, column]) for r in holders]
        group = torch.distributed.new_group(ranks, timeout=timeout)
        if me in ranks:
            mine = group
    return mine
