"""Building the 4D ``DeviceMesh`` ``("pp", "dp", "cp", "tp")`` and its named sub-meshes.

tp is innermost, so a tp group sits on consecutive ranks (one node, NVLink); pp is outermost (the only dimension
whose traffic is point-to-point). Parameters are replicated across dp and cp, so ZeRO shards over and gradients
are reduced over the flattened ``("dp", "cp")`` mesh, named ``dp_cp`` (Megatron-core's rank order ``tp-cp-dp-pp``).

Expert parallelism (ep > 1) adds no dimension to the world mesh: ``dp_cp`` (size D) is unflattened into
``("edp", "ep")`` of sizes ``(D/ep, ep)``, ep innermost, so an ep group is ``ep`` consecutive ranks of the flattened
``dp_cp`` mesh (``dp_cp`` index i: ep rank ``i % ep``, expert data-parallel rank ``i // ep``; with cp = 1 and tp = pp
= 1, consecutive global ranks: the all-to-all stays within a node when ep divides the GPUs per node), and the expert
data-parallel group ``edp`` is the D/ep ranks holding the same experts (torchtitan's ``ep`` /
``dp_shard_mod_ep``, Megatron-core's expert-data-parallel group).

Mixture-of-Experts layers under tensor parallelism (tp > 1) run token parallel: each tp rank runs the whole MoE layer
on its own ``1/t`` of the sequence (expert tensor parallelism 1, ``docs/moe.md``), so the ``dp_cp x tp`` ranks hold
disjoint tokens of it. The flattened ``("dp", "cp", "tp")`` mesh, ``dp_cp_tp``, is their group (routing counts, and
the gradients of the MoE layers' non-expert parameters, summed over it). With ep > 1 it is unflattened into
``("edp", "ep", "etp")`` of sizes ``(D/ep, ep, t)``: the ep groups are the same as without tp (``ep`` consecutive
``dp_cp`` ranks at one tp coordinate), and ``edp_tp`` (``edp`` x ``etp`` flattened, ``D·t/ep`` ranks) is the
group that holds the same experts (Megatron-core's expert-data-parallel group with expert tensor parallelism 1,
"MoE parallel folding", which also spans the attention's tp ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_4d.config import MESH_DIM_NAMES, ParallelConfig
from lightning_4d.parallel._compat import flatten_mesh, unflatten_mesh


@dataclass
class ParallelMesh:
    """Every process group of the job, by name (like Megatron-core's named group getters).

    Attributes:
        world: the 4D mesh with dims ``("pp", "dp", "cp", "tp")``.
        dp_cp: the 1D flattened ``("dp", "cp")`` mesh (ZeRO sharding, gradient reduction, loss averaging).
        ep: the 1D expert-parallel mesh (``ep`` consecutive ranks of ``dp_cp``; the experts are split over it and
            tokens exchanged over it by all-to-all), ``None`` without expert parallelism.
        edp: the 1D expert data-parallel mesh (``dp_cp / ep`` ranks holding the same experts: the expert
            parameters' gradients are reduced and their ZeRO 1 states sharded over it), ``None`` without expert
            parallelism.
        dp_cp_tp: the 1D flattened ``("dp", "cp", "tp")`` mesh (tp > 1; ``None`` otherwise): the ranks holding
            disjoint tokens of a token-parallel MoE layer (module docstring).
        edp_tp: the 1D mesh of the ``D·t/ep`` ranks holding the same experts under tp > 1 and ep > 1 (their
            gradients are summed and their ZeRO 1 states sharded over it); ``None`` otherwise.
    """

    world: DeviceMesh
    dp_cp: DeviceMesh
    ep: Optional[DeviceMesh] = None
    edp: Optional[DeviceMesh] = None
    dp_cp_tp: Optional[DeviceMesh] = None
    edp_tp: Optional[DeviceMesh] = None
    #: the 1D slices of ``world`` by dim name, made once (slicing a DeviceMesh costs ~1-5 ms of Python per call:
    #: benchmarks/step_overhead.py measured the per-step reads of ``cp`` and ``dp``)
    _slices: dict = field(default_factory=dict, repr=False, compare=False)

    def _slice(self, name: str) -> DeviceMesh:
        if name not in self._slices:
            self._slices[name] = self.world[name]
        return self._slices[name]

    @property
    def tokens(self) -> DeviceMesh:
        """The ranks holding disjoint tokens of a Mixture-of-Experts layer: ``dp_cp_tp`` under tp, else ``dp_cp``."""
        return self.dp_cp_tp if self.dp_cp_tp is not None else self.dp_cp

    @property
    def expert_replicas(self) -> Optional[DeviceMesh]:
        """The ranks holding the same experts under expert parallelism (``edp_tp`` under tp, else ``edp``), over
        which the experts' gradients are reduced; ``None`` without ep."""
        return self.edp_tp if self.edp_tp is not None else self.edp

    @property
    def tp(self) -> DeviceMesh:
        return self._slice("tp")

    @property
    def dp(self) -> DeviceMesh:
        return self._slice("dp")

    @property
    def cp(self) -> DeviceMesh:
        return self._slice("cp")

    @property
    def pp(self) -> DeviceMesh:
        return self._slice("pp")

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp.get_local_rank()


def build_mesh(config: ParallelConfig, device_type: str) -> ParallelMesh:
    """Create the mesh for a resolved ``config`` (``data_parallel_size`` must be an int).

    Must be called on every rank after ``torch.distributed`` is initialized with ``config.world_size`` ranks.

    Raises:
        RuntimeError: the process group's world size differs from ``config.world_size``.
    """
    world_size = torch.distributed.get_world_size()
    if world_size != config.world_size:
        raise RuntimeError(f"process group has {world_size} ranks but the layout needs {config.world_size}")
    mesh = init_device_mesh(device_type, config.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    dp_cp = flatten_mesh(mesh["dp", "cp"], "dp_cp")  # keep the returned object: it holds the process group
    if config.tp > 1:
        tokens = flatten_mesh(mesh["dp", "cp", "tp"], "dp_cp_tp")
        if config.ep == 1:
            return ParallelMesh(world=mesh, dp_cp=dp_cp, dp_cp_tp=tokens)
        experts = unflatten_mesh(tokens, (config.expert_dp, config.ep, config.tp), ("edp", "ep", "etp"))
        edp_tp = flatten_mesh(experts["edp", "etp"], "edp_tp")
        return ParallelMesh(
            world=mesh, dp_cp=dp_cp, ep=experts["ep"], edp=experts["edp"], dp_cp_tp=tokens, edp_tp=edp_tp
        )
    if config.ep == 1:
        return ParallelMesh(world=mesh, dp_cp=dp_cp)
    experts = unflatten_mesh(dp_cp, (config.expert_dp, config.ep), ("edp", "ep"))
    return ParallelMesh(world=mesh, dp_cp=dp_cp, ep=experts["ep"], edp=experts["edp"])


def embedding_group(mesh: ParallelMesh, config: ParallelConfig) -> Optional[Any]:
    """The *embedding group* of tied embeddings under pp > 1 (Megatron-Core's ``default_embedding_ranks``): the pp
    ranks holding the first and the last pipeline stage, at this rank's dp/cp/tp coordinates, over which the two
    copies of the tied ``[V, h]`` matrix sum their gradients (:class:`lightning_4d.parallel.pipeline.TiedEmbedding`).

    Collective when it makes groups: every rank calls it with the same arguments (``torch.distributed.new_group``
    for each dp/cp/tp coordinate, pp > 2 with a looped schedule).

    Args:
        mesh: the job's mesh (:func:`build_mesh`).
        config: the resolved layout.

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
        group = torch.distributed.new_group(ranks)
        if me in ranks:
            mine = group
    return mine
