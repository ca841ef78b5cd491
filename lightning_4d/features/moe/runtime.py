"""The Mixture-of-Experts component of the strategy: what the rest of the training code asks of MoE, in one place.

The model's MoE layer is :mod:`lightning_4d.features.moe.layer` (router, stacked experts, load-balancing loss); expert
parallelism's placement and all-to-all dispatch are :mod:`lightning_4d.features.moe.expert`. This module holds the rest:

- **meshes** (:func:`carve_meshes`, called by :func:`lightning_4d.mesh.build_mesh`). MoE layers under tensor
  parallelism (tp > 1) run token parallel: each tp rank runs the whole MoE layer on its own ``1/t`` of the sequence
  (expert tensor parallelism 1, ``docs/moe_design.md``), so the ``dp_cp x tp`` ranks hold disjoint tokens of it. The
  flattened ``("dp", "cp", "tp")`` mesh, ``dp_cp_tp`` (tp innermost), is their group (routing counts, and the
  gradients of the MoE layers' non-expert parameters, summed over it); without tp the group is ``dp_cp``. Expert
  parallelism (ep > 1) adds no dimension to the world mesh: that token group (size ``D·t``, D = dp·cp) is
  unflattened into ``("edp", "ep")`` of sizes ``(D·t/ep, ep)``, ep innermost, so an ep group is ``ep`` consecutive
  ranks of it (index i: ep rank ``i % ep``, expert data-parallel rank ``i // ep``,
  ``ParallelConfig.ep_coordinates``), and the expert data-parallel group ``edp`` is the ``D·t/ep`` ranks holding the
  same experts (torchtitan's ``ep`` / ``dp_shard_mod_ep``, Megatron-core's expert-data-parallel group). Under tp the
  tp ranks are the innermost ep ranks: ep is *folded* over tp first (Megatron-core's "MoE parallel folding", Liu et
  al. 2025, arXiv 2504.14960, whose expert grid ``ETP x EP x EDP x PP`` with ETP = 1 puts EP on attention's tp ranks
  first), then over cp and dp; ep need only divide ``D·t``. Within a pipeline stage the token group's ranks are
  consecutive global ranks (``mesh.py``: pp outermost, tp innermost), so an ep group is ``ep`` consecutive global
  ranks: within a node when ep divides the GPUs per node.
- **gradient groups** (:func:`gradient_groups`): the parameters whose gradients are not reduced over ``dp_cp`` alone,
  declared to the ZeRO 0/1 buckets as :class:`~lightning_4d.parallel.grad_buffers.GradientGroup`: the experts over
  the ranks holding the same experts, the MoE layers' other parameters under tp (run token parallel) over
  ``dp_cp x tp``;
- **ZeRO 2/3** (:func:`shard_units`, called by :func:`lightning_4d.parallel.fsdp.apply_fsdp`): under ep the
  experts' FSDP2 units over ``edp`` (:func:`shard_expert_units`) and their gradient division
  (:func:`average_expert_gradients`), under tp the MoE layers' over ``dp_cp_tp`` (:func:`shard_token_units`), and
  the dimension FSDP2 shards stacked expert weights on (:class:`ExpertPlacement`);
- **metering** (:func:`comm_groups`, :data:`ALL_TO_ALL_DIMS`, for :class:`~lightning_4d.parallel.comm.CommMeter`)
  and ``lightning-4d measure``'s answer to the count exchange (:func:`answer_count_exchange`, :func:`received_rows`);
- **training** (:class:`MoETraining`, a LightningModule mixin): the load-balancing loss' gradient scale per step and
  its logging, with the routing statistics; :class:`ExpertLoadMonitor` (a callback) logs the ep ranks' load.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.contract import grad_accumulation, layout_strategy
from lightning_4d.features.moe.costs import expert_shard_dim
from lightning_4d.features.moe.expert import (
    ExpertDispatch,
    is_expert_parameter,
    shard_experts,
    stacked_expert_weights,
)
from lightning_4d.features.moe.layer import MoEFeedForward, hf_stacked_slices
from lightning_4d.features.tensor_parallel.runtime import token_parallel_parameters
from lightning_4d.parallel._compat.dtensor import local_offset, local_tensor
from lightning_4d.parallel._compat.fsdp import FULLY_SHARD_PLACEMENT_FN
from lightning_4d.parallel._compat.lightning import attached_trainer
from lightning_4d.parallel.grad_buffers import GradientGroup


def carve_meshes(mesh: Any, config: Any) -> None:
    """Carve the MoE groups (module docstring) out of ``mesh`` (a :class:`~lightning_4d.mesh.ParallelMesh`) for the
    resolved layout ``config``: ``dp_cp_tp`` under tp; ``ep`` and ``edp`` under ep (blocks of ``ep`` consecutive
    ranks of ``dp_cp_tp`` under tp, folded over tp first; of ``dp_cp`` without). Collective (every rank calls it)."""
    if config.tp > 1:
        mesh.flatten(("dp", "cp", "tp"), "dp_cp_tp")
    if config.ep > 1:
        mesh.unflatten("dp_cp_tp" if config.tp > 1 else "dp_cp", (config.expert_dp, config.ep), ("edp", "ep"))


def token_mesh(mesh: Any) -> Any:
    """The ranks holding disjoint tokens of an MoE layer: ``dp_cp_tp`` under tp, else ``dp_cp``."""
    tokens = mesh.get("dp_cp_tp")
    return mesh.dp_cp if tokens is None else tokens


def expert_replicas(mesh: Any) -> Any:
    """The ranks holding the same experts under expert parallelism (``edp``: ``dp·cp·tp/ep`` ranks), over which the
    experts' gradients are reduced; ``None`` without ep."""
    return mesh.get("edp")


#: the MoE dimensions whose groups carry all-to-all traffic (the experts' token dispatch and combine), for
#: :class:`~lightning_4d.parallel.comm.CommMeter`: ep's all-to-alls count under ``ep`` even where its group is also
#: ``cp``'s or ``dp_cp``'s (ep = dp·cp)
ALL_TO_ALL_DIMS = ("ep",)


def comm_groups(mesh: Any) -> dict[str, Any]:
    """The MoE groups a :class:`~lightning_4d.parallel.comm.CommMeter` names (``{dimension: process group}``):
    ``ep`` and ``edp`` under expert parallelism, else none. Where ep = dp·cp, ``ep`` is ``dp_cp``'s group: its
    collectives count under ``dp_cp`` (named first), its all-to-alls under ``ep`` (:data:`ALL_TO_ALL_DIMS`)."""
    return {d: mesh.get(d).get_group() for d in ("ep", "edp") if mesh.get(d) is not None}


def validate_sequence(config: Any, model_config: Any, seq_length: int) -> None:
    """Check ``seq_length`` against the MoE layers of ``model_config`` (``None``: no model config) under the layout
    ``config``, before any process group.

    Raises:
        ValueError: an MoE model under tp without sp whose sequence per cp rank is not divisible by tp (its MoE
            layers run token parallel: each tp rank takes ``s/t`` tokens,
            :mod:`lightning_4d.features.tensor_parallel.runtime`).
    """
    moe = model_config is not None and model_config.is_moe
    if moe and config.tp > 1 and not config.sp and (seq_length // config.cp) % config.tp:
        raise ValueError(
            f"seq_length={seq_length} (per cp rank {seq_length // config.cp}) is not divisible by "
            f"tensor_parallel_size={config.tp}: the Mixture-of-Experts layers of this model run on 1/tp of the "
            "sequence per tp rank; use a seq_length that is a multiple of tp*2*cp."
        )


def apply(family: Any, model: nn.Module, mesh: Any, config: Any) -> None:
    """The MoE steps of :func:`~lightning_4d.parallel.parallelize.parallelize_model` (after tp and cp): the family's
    ``apply_data_parallel`` with :func:`token_mesh` when dp·cp·tp > 1 (the ranks over which routing counts are
    summed), its ``apply_expert_parallel`` on the ``ep`` mesh when ep > 1."""
    if config.dp_cp * config.tp > 1:
        family.apply_data_parallel(model, token_mesh(mesh))
    if config.ep > 1:
        if not isinstance(family, ExpertParallelFamily):
            raise NotImplementedError(f"the model family {family.name!r} does not implement apply_expert_parallel()")
        family.apply_expert_parallel(model, mesh.ep)


class ExpertParallelFamily(abc.ABC):
    """A model family whose MoE layers split their experts over ep (a base of its class: :class:`LlamaMoEFamily`,
    :class:`~lightning_4d.features.moe.hf_mixtral.HFMixtralFamily`); :func:`apply` calls its hook when ep > 1."""

    @abc.abstractmethod
    def apply_expert_parallel(self, model: nn.Module, ep_mesh: Any) -> None:
        """Split ``model``'s routed experts over ``ep_mesh`` and dispatch tokens to them by all-to-all
        (:mod:`lightning_4d.features.moe.expert`). Called only when ep > 1 (``ParallelConfig.validate_model`` refuses
        ep > 1 for a dense model first)."""


class LlamaMoEFamily(ExpertParallelFamily):
    """The MoE hooks of our Llama's family (a base of :class:`~lightning_4d.families.native_llama.LlamaFamily`, as
    :class:`~lightning_4d.features.moe.layer.MoEModel` is of ``LlamaModel``): what its MoE layers
    (:class:`~lightning_4d.features.moe.layer.MoEFeedForward`) compute over the data-parallel batch, and ep."""

    def apply_data_parallel(self, model: nn.Module, tokens_mesh: Any) -> None:
        """Every MoE layer sums its routing counts over ``tokens_mesh`` (``dp_cp``, or ``dp_cp x tp`` under tp,
        where MoE layers run token parallel; ``MoEFeedForward.stats_group``): the load-balancing loss of the global
        batch, the same on every layout (:mod:`lightning_4d.features.moe.layer`)."""
        for module in model.modules():
            if isinstance(module, MoEFeedForward):
                module.stats_group = tokens_mesh.get_group()

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: Any) -> None:
        """Every MoE layer's stacked experts become DTensors ``Shard(0)`` on ``ep_mesh`` (this rank's ``E/ep``
        experts) and its tokens travel to them by all-to-all
        (:func:`lightning_4d.features.moe.expert.shard_experts`)."""
        for module in model.modules():
            if isinstance(module, MoEFeedForward):
                shard_experts(module.experts, ep_mesh)


def hf_stacked_targets(
    p: torch.Tensor, name: str, model_config: Any, available: set[str], path: Path
) -> Optional[dict[str, torch.Tensor]]:
    """``{Hugging Face key: the piece of p's local tensor it fills}`` for a stacked expert weight ``p`` ``[E, d1, d2]``
    of our Llama (``name``: its canonical name, :func:`~lightning_4d.features.moe.layer.expert_weight`),
    ``None`` for any other parameter (the family's ``load_hf`` reads it whole)
    (:func:`~lightning_4d.features.moe.layer.hf_stacked_slices`: one ``[d1, d2]`` tensor per expert): every expert
    of a plain tensor; of a DTensor, the experts of this rank's dim-0 rows (ep, FSDP2's dim-0 shards). Where the DTensor
    splits an expert too (ZeRO 2/3 sharding it on dim 1, :func:`lightning_4d.features.moe.costs.expert_shard_dim`), each
    row is a DTensor of the expert's ``[d1, d2]`` on ``p``'s mesh (``p``'s placements one dimension down, the expert
    dimension's split replicated): DCP's reader reads this rank's ``d1`` range of each expert's tensor only.

    Raises:
        ValueError: an expert's tensor missing from the directory.
    """
    from torch.distributed.tensor import Replicate, Shard

    slices = hf_stacked_slices(name, model_config)
    if slices is None:
        return None
    local, offset = p.data, 0
    placements = None
    if isinstance(p, DTensor):
        local = p.data.to_local()
        offset = local_offset(p)[0]
        if any(pl.is_shard() and pl.dim != 0 for pl in p.placements):  # an expert split (on dim 1 by ZeRO 2/3)
            placements = [Shard(pl.dim - 1) if pl.is_shard() and pl.dim > 0 else Replicate() for pl in p.placements]
    targets = {}
    for key, e in slices:
        if key not in available:
            raise ValueError(
                f"init_from={str(path)!r} holds no tensor {key!r} (expert {e} of our {name!r}): is it "
                "a Mixtral of this config?"
            )
        if offset <= e < offset + local.shape[0]:
            row = local[e - offset]
            if placements is not None:
                row = DTensor.from_local(
                    row, p.device_mesh, placements, run_check=False, shape=p.shape[1:], stride=(p.shape[2], 1)
                )
            targets[key] = row
    return targets


def fsdp_options(mesh: Any) -> dict[str, Any]:
    """:func:`~lightning_4d.parallel.fsdp.apply_fsdp`'s ``moe_meshes`` (the keyword arguments of :func:`shard_units`):
    the experts' own units over ``edp`` under ep, the token-parallel MoE layers' over ``dp_cp_tp`` under tp (``None``
    without)."""
    return {"expert_mesh": mesh.get("edp"), "token_mesh": mesh.get("dp_cp_tp")}


def on_own_mesh(params: list[Tensor]) -> bool:
    """Whether any of ``params`` is an expert weight on the ep mesh
    (:func:`~lightning_4d.features.moe.expert.is_expert_parameter`) or an MoE layer's parameter sharded over
    ``dp_cp_tp`` (ZeRO 2/3 under tp, :func:`shard_token_units`): its gradient is a DTensor on the ``(edp, ep)`` or
    ``dp_cp_tp`` mesh and the dense ones on ``dp_cp``, which torch's own ``clip_grad_norm_`` cannot stack (the precision
    plugin then clips with :func:`lightning_4d.parallel.clipping.clip_grad_norm_`)."""
    from torch.distributed.tensor import DTensor

    def token_sharded(p: Tensor) -> bool:
        return isinstance(p, DTensor) and "dp_cp_tp" in (p.device_mesh.mesh_dim_names or ())

    return any(is_expert_parameter(p) or token_sharded(p) for p in params)


def gradient_groups(model: nn.Module, mesh: Any) -> list[GradientGroup]:
    """The gradient groups of ``model``'s MoE layers on ``mesh`` (a :class:`~lightning_4d.mesh.ParallelMesh`), for
    :func:`lightning_4d.parallel.sharded_optimizer.setup_zero`:

    1. under expert parallelism the expert weights (:func:`~lightning_4d.features.moe.expert.is_expert_parameter`) over
       the ranks holding the same experts (``edp``; under tp its ranks span tp: the experts run token parallel), always
       (every optimizer then gets a ``ShardedOptimizer``, whose global-norm clipping counts each expert once);
    2. under tp the other parameters of modules run token parallel
       (:func:`~lightning_4d.features.tensor_parallel.runtime.token_parallel_parameters`) over ``dp_cp_tp``, when
       ``model`` has any: each tp rank's gradient is its own tokens' (the sum over tp of the mean over ``dp_cp``, in one
       collective).

    Both are tp-partial (each tp rank's gradient is a disjoint part of the sum). Empty for a dense model without tp.
    """
    groups = []
    replicas = expert_replicas(mesh)
    if replicas is not None:
        experts = tuple(p for p in model.parameters() if is_expert_parameter(p))
        groups.append(GradientGroup(replicas.get_group(), experts, tp_partial=True))
    if mesh.get("dp_cp_tp") is not None:
        tokens = tuple(token_parallel_parameters(model))
        if tokens:
            groups.append(GradientGroup(mesh.dp_cp_tp.get_group(), tokens, tp_partial=True))
    return groups


def received_rows(model_config: Any, pc: Any, micro_batch_size: int, seq_length: int, load: float) -> int:
    """Rows (token assignments) the measured rank's experts receive in one MoE layer's dispatch under expert
    parallelism at load ``load`` (``expert_load_imbalance``); 0 without ep or without experts.

    Every rank of the ep group routes ``T = b·(s/cp)/tp`` tokens (the MoE layers are token parallel over tp) and
    keeps ``N = T·k`` assignments (under a capacity factor at most ``E·C``, ``C`` =
    :func:`lightning_4d.features.moe.layer.capacity`, at balanced load); the ep group's ``ep·N`` over its ``ep`` ranks
    is ``N`` per rank at balanced load; this rank receives ``load`` times that (rounded up), at most all ``ep·N`` and
    under a capacity at most ``E·C`` (each of its ``E/ep`` experts takes at most ``C`` rows from each of the ``ep``
    sources). The load imbalance's definition: ``ExpertDispatch``'s ``received_rows`` over the ep group's mean
    (:class:`ExpertLoadMonitor`). ``lightning-4d measure`` states this load (:func:`answer_count_exchange`).
    """
    from lightning_4d.features.moe.layer import capacity

    if pc.ep == 1 or not model_config.num_experts:
        return 0
    tokens = micro_batch_size * (seq_length // pc.cp) // pc.tp
    n = tokens * model_config.num_experts_per_token
    cap = capacity(model_config, tokens)
    if cap is not None:
        n = min(n, model_config.num_experts * cap)
    rows = min(math.ceil(load * n), pc.ep * n)
    return rows if cap is None else min(rows, model_config.num_experts * cap)


def spread_counts(rows: int, sent: Tensor) -> Tensor:
    """The counts an ep rank receives in the count exchange (``ExpertDispatch.exchange``: ``[ep, E/ep]``, source
    major, flattened like ``sent`` ``[E]``) when its experts receive ``rows`` rows in all, spread as evenly as
    integers allow over every (source, local expert) pair."""
    per, rest = divmod(rows, sent.numel())
    out = torch.full_like(sent, per)
    out[:rest] += 1
    return out


def dispatches_of(model: nn.Module) -> tuple[ExpertDispatch, ...]:
    """The :class:`~lightning_4d.features.moe.expert.ExpertDispatch` of every MoE layer of ``model`` under ep, in module
    order (none without ep)."""
    found = [getattr(m, "dispatch", None) for m in model.modules()]
    return tuple(d for d in found if isinstance(d, ExpertDispatch))


def answer_count_exchange(model: nn.Module, rows: int) -> tuple[Any, tuple[ExpertDispatch, ...]]:
    """For ``lightning-4d measure`` (one rank on a fake process group, :mod:`lightning_4d.measure`): the context in
    which the count exchange of every dispatch of ``model`` is answered as if this rank's experts received ``rows``
    rows (:func:`spread_counts`, through :func:`lightning_4d.parallel._compat.answer_count_exchange`) instead of the
    other ranks' routing, and those dispatches (their ``received_rows`` read after the run). A null context for a
    model without dispatches."""
    from lightning_4d.parallel._compat.fake import answer_count_exchange as answer

    dispatches = dispatches_of(model)
    if not dispatches:
        return contextlib.nullcontext(), dispatches
    return answer([d.group for d in dispatches], functools.partial(spread_counts, rows)), dispatches


#: the meshes of the MoE layers' own FSDP2 units (:func:`shard_units`): ``edp`` (the experts under ep) and
#: ``dp_cp_tp`` (the MoE layers under tp); the dense units' is ``dp_cp``
FSDP_MESH_NAMES = ("edp", "dp_cp_tp")


class ExpertPlacement:
    """The dimension FSDP2 shards each stacked expert weight of a model on, as ``fully_shard`` options
    (:meth:`options`), for the MoE layers' units and the dense ones (:func:`shard_units`).

    Stacked expert weights (:func:`~lightning_4d.features.moe.expert.stacked_expert_weights`, ``[E_local, d1, d2]``;
    under ep in their own units over ``edp``, else in their block's unit over ``dp_cp``, or under tp in their MoE
    layer's unit over ``dp_cp_tp``) are sharded on dim 1 (``Shard(1)``) when their group's size does not divide
    ``E_local`` and divides ``d1`` (:func:`lightning_4d.features.moe.costs.expert_shard_dim`; torchtitan's rule for
    ``dp_shard·ep > num_experts``): each rank holds ``d1/G`` rows of every local expert instead of ``ceil(E_local/G)``
    padded whole experts. Every other parameter: FSDP2's default ``Shard(0)``.

    Args:
        model: the module, before any ``fully_shard``: its stacked expert weights are found (and held, as FSDP2
            replaces them and their ids must not be reused) now.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights = stacked_expert_weights(model)
        self.ids = {id(p) for p in self.weights}

    def dim(self, p: Tensor, group: int) -> int:
        """The dimension ``p`` is sharded on over ``group`` ranks: 0 unless it is a stacked expert weight."""
        return expert_shard_dim(tuple(local_tensor(p).shape), group) if id(p) in self.ids else 0

    def options(self, kw: dict[str, Any], mesh: Any) -> dict[str, Any]:
        """``fully_shard`` options ``kw`` over ``mesh``, with FSDP2's ``shard_placement_fn`` when a stacked expert
        weight of the model is sharded on dim 1 (no function at all when none is).

        Raises:
            RuntimeError: an expert weight needs dim 1 on a torch whose ``fully_shard`` has no
                ``shard_placement_fn`` (torch < 2.6; ``_compat.FULLY_SHARD_PLACEMENT_FN``).
        """
        from torch.distributed.tensor import Shard

        group = mesh.size()
        options = {**kw, "mesh": mesh}
        if not any(self.dim(p, group) for p in self.model.parameters()):
            return options
        if not FULLY_SHARD_PLACEMENT_FN:  # pragma: no cover - torch without shard_placement_fn
            raise RuntimeError(
                f"torch {torch.__version__}: fully_shard has no shard_placement_fn argument, needed to shard expert "
                f"weights whose {group}-rank group does not divide their experts (dim 0) on dim 1"
            )
        return {**options, "shard_placement_fn": lambda p: Shard(1) if self.dim(p, group) == 1 else None}


def shard_units(
    model: nn.Module, kw: dict[str, Any], expert_mesh: Any = None, token_mesh: Any = None
) -> dict[str, Any]:
    """ZeRO 2/3 of the MoE layers of ``model`` (:func:`lightning_4d.parallel.fsdp.apply_fsdp`, before its dense
    units), with ``apply_fsdp``'s ``fully_shard`` options ``kw`` (over ``dp_cp``, D ranks).

    Under expert parallelism (``expert_mesh``: the 1D expert data-parallel mesh ``edp``, dp·cp·tp/ep ranks) every
    module that directly holds expert weights (DTensors ``Shard(0)`` on the ep mesh,
    :func:`~lightning_4d.features.moe.expert.is_expert_parameter`) becomes a unit of its own first, over ``edp`` (FSDP2
    joins the two 1D meshes, children of one parent, into the 2D ``(edp, ep)`` mesh: each expert row block is
    sharded over ``edp`` inside its ep shard, torchtitan's ``dp_mod_ep`` units). Its gradients are divided by D =
    dp·cp too, not by the group's size: the all-to-all's backward already summed the ep group's contributions
    (:mod:`lightning_4d.features.moe.expert`), so the result is the mean of the D per-rank losses' gradients, as for the
    dense parameters (:func:`shard_expert_units`).

    Under tensor parallelism (``token_mesh``: the 1D ``dp_cp_tp`` mesh) every module run token parallel (an MoE
    layer, :class:`~lightning_4d.features.tensor_parallel.runtime.TokenParallel`: its router, shared experts and,
    without ep, its experts, replicated over tp, each tp rank's gradient its own tokens') becomes a unit of its own
    next, over ``dp_cp_tp``: its reduce-scatter sums the tp ranks' partial gradients and averages over dp·cp (divided by
    D, :func:`shard_token_units`), and its states are sharded over dp·cp·tp ranks.

    Returns:
        the options of the dense units (``kw`` over ``dp_cp``; without ep the experts are sharded with their block),
        each set with the placement of the stacked expert weights (:class:`ExpertPlacement`).

    Raises:
        RuntimeError: from :meth:`ExpertPlacement.options`.
    """
    placement = ExpertPlacement(model)
    dp_cp_size = kw["mesh"].size()
    if expert_mesh is not None:
        shard_expert_units(model, placement.options(kw, expert_mesh), dp_cp_size)
    if token_mesh is not None:
        shard_token_units(model, placement.options(kw, token_mesh), dp_cp_size)
    return placement.options(kw, kw["mesh"])


def shard_expert_units(model: nn.Module, options: dict[str, Any], dp_cp_size: int) -> None:
    """ZeRO 2/3 of the experts under expert parallelism (:func:`lightning_4d.parallel.fsdp.apply_fsdp`, before its
    dense units): every module of ``model`` that directly holds expert weights (:func:`is_expert_parameter`) becomes
    an FSDP2 unit with ``fully_shard`` ``options`` (``apply_fsdp``'s, over the ``edp`` mesh, with its placement of the
    stacked expert weights, :func:`shard_units`), its gradients divided by D = ``dp_cp_size``
    (:func:`average_expert_gradients`)."""
    from torch.distributed.fsdp import fully_shard

    holders = [m for m in model.modules() if any(is_expert_parameter(p) for p in m.parameters(recurse=False))]
    for m in holders:
        average_expert_gradients(fully_shard(m, **options), options["mesh"].size(), dp_cp_size)


def shard_token_units(model: nn.Module, options: dict[str, Any], dp_cp_size: int) -> None:
    """ZeRO 2/3 of the MoE layers under tp (:func:`lightning_4d.parallel.fsdp.apply_fsdp`, after the expert units
    and before its dense units): every module of ``model`` run token parallel (``token_parallel``, a
    :class:`~lightning_4d.features.tensor_parallel.runtime.TokenParallel`) becomes an FSDP2 unit with ``fully_shard``
    ``options`` (over the ``dp_cp_tp`` mesh; the expert weights already in units of their own under ep stay there). Each
    tp rank's gradient of these parameters is its own tokens' part, so the reduce-scatter over ``dp_cp_tp`` sums over tp
    and dp·cp and the unit divides by D = ``dp_cp_size`` (:func:`average_expert_gradients`): the sum over tp of the mean
    over dp·cp, as ZeRO 0/1's ``dp_cp_tp`` buckets (:func:`gradient_groups`)."""
    from torch.distributed.fsdp import fully_shard

    from lightning_4d.features.tensor_parallel.runtime import TokenParallel

    holders = [m for m in model.modules() if isinstance(getattr(m, "token_parallel", None), TokenParallel)]
    for m in holders:
        average_expert_gradients(fully_shard(m, **options), options["mesh"].size(), dp_cp_size)


def average_expert_gradients(unit: Any, group_size: int, dp_cp_size: int) -> None:
    """Make the FSDP2 unit ``unit`` (a module holding expert weights, sharded over the ``group_size`` ranks of
    ``edp`` = dp·cp·tp/ep; or an MoE layer under tp over ``dp_cp_tp``, :func:`shard_token_units`) leave its gradients
    divided by D = ``dp_cp_size`` (the mean of the D per-rank losses' gradients; the ep all-to-all's backward has
    already summed the ep group's contributions, the reduction sums the tp ranks'), on every torch the package
    accepts.

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


class MoETraining:
    """The training-step logic of an MoE model, mixed into a LightningModule (:class:`~lightning_4d.tasks.causal_lm
    .CausalLMModule`, which has ``model`` (a :class:`~lightning_4d.models.llama.LlamaModel`), ``model_config``,
    ``device``, ``log`` and ``_global_mean``). A Mixture-of-Experts model (``model_config.num_experts`` > 0) trains on
    the language-model loss plus ``router_aux_loss_coef`` × its load-balancing loss, whose gradient each MoE layer
    injects itself (:meth:`_start_moe_step`; so it also trains when its layers sit on other pipeline stages than the
    loss); ``train_loss`` stays the language-model loss, and the module logs ``train_aux_loss``,
    ``moe_tokens_per_expert_max``, ``moe_tokens_per_expert_mean`` and ``moe_dropped_fraction``
    (:meth:`_log_moe_step`, ``docs/moe.md``). Every method does nothing for a dense model."""

    model: Any
    model_config: Any
    device: Any
    log: Callable[..., None]
    _global_mean: Callable[[Tensor], Tensor]

    def _moe_pipeline(self, pipeline: Any) -> None:
        """Under pp (``pipeline``: the strategy's :class:`~lightning_4d.features.pipeline.runtime.PipelineRunner`, else
        ``None``): the schedule's shape inference runs the stages on placeholders, during which the MoE layers pass
        their input through (``LlamaModel.set_metadata_inference``)."""
        if pipeline is not None and self.model_config.is_moe and self.model is not None:
            pipeline.metadata_inference = self.model.set_metadata_inference

    def _start_moe_step(self, pipeline: Any) -> None:
        """Set the gradient the MoE layers inject into their load-balancing terms for this step's backwards
        (:meth:`LlamaModel.set_aux_loss_scale`): ``router_aux_loss_coef`` times the factor each backward's
        language-model loss carries, ``1/m`` for the pipeline's ``m`` micro-batches (the schedule's loss function
        divides by m) and ``1/A`` under Lightning's ``accumulate_grad_batches`` (its closure divides the loss by
        A), so that the gradient is that of ``loss + router_aux_loss_coef * aux`` averaged over the global batch
        whatever the layout; then start the step's mean aux loss. Nothing for a dense model."""
        if not self.model_config.is_moe:
            return
        assert self.model is not None
        m = pipeline.num_microbatches if pipeline is not None else 1
        trainer = attached_trainer(self)
        accumulate = grad_accumulation(trainer)
        self.model.set_aux_loss_scale(self.model_config.router_aux_loss_coef / (m * accumulate))
        self.model.reset_moe_aux_loss()
        if pipeline is not None:  # again after the schedule's metadata inference, before its first micro-batch
            pipeline.before_microbatches = self.model.reset_moe_aux_loss

    def _log_moe_step(self, pipeline: Any) -> None:
        """Log ``train_aux_loss`` (the global batch's load-balancing loss, without the coefficient: the mean over
        the step's micro-batches of every stage's share, summed over the pipeline stages, averaged over dp·cp),
        ``moe_tokens_per_expert_max`` / ``moe_tokens_per_expert_mean`` (assignments per expert in the most loaded
        layer's busiest expert, and on average; summed over dp·cp; under pp of the last micro-batch, over all
        stages) and ``moe_dropped_fraction`` (assignments dropped by the capacity). The same values on every rank.
        The loss trains through the layers' own gradient injection (:meth:`_start_moe_step`), not through this.
        Nothing for a dense model."""
        if not self.model_config.is_moe:
            return
        assert self.model is not None
        aux = self.model.moe_step_aux_loss()
        aux = aux if aux is not None else torch.zeros((), device=self.device)
        stats = self.model.moe_stats()
        if pipeline is not None and torch.distributed.get_world_size(pipeline.pp_group) > 1:
            # each stage holds its own MoE layers (some none): shares summed, statistics combined over the stages
            n = float(len([m for m in self.model.moe_layers() if m.tokens_per_expert is not None]))
            summed = torch.stack(
                [aux.float(), stats.get("dropped_fraction", torch.zeros(())).to(aux.device) * n, aux.new_tensor(n)]
            )
            torch.distributed.all_reduce(summed, group=pipeline.pp_group)
            peaks = torch.stack(
                [stats.get(k, torch.zeros(())) for k in ("tokens_per_expert_max", "tokens_per_expert_mean")]
            )
            peaks = peaks.to(aux.device)
            torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX, group=pipeline.pp_group)
            aux = summed[0]
            stats = {
                "tokens_per_expert_max": peaks[0],
                "tokens_per_expert_mean": peaks[1],  # T·k/E in every MoE layer
                "dropped_fraction": summed[1] / summed[2].clamp(min=1),  # every layer routes T·k assignments
            }
        self.log("train_aux_loss", self._global_mean(aux), on_step=True, on_epoch=False)
        for name, value in stats.items():
            self.log(f"moe_{name}", value, on_step=True, on_epoch=False)


class ExpertLoadMonitor(L.Callback):
    """Under expert parallelism, log after every training step the load imbalance of the experts' ranks: for each
    MoE layer and ep group, the rows the most loaded ep rank's experts received over the group's mean (1.0 is
    balanced, ``ep`` all rows on one rank), the max over layers and groups. It is the figure the memory model's
    ``expert_load_imbalance`` (:func:`lightning_4d.planning.model.estimate_memory`, ``lightning-4d estimate
    --expert-load-imbalance``) multiplies the balanced received rows by; docs/validation_cpu.md says how its default was
    measured with this callback.

    Logged: ``moe_expert_load_imbalance`` (this step's) and ``moe_expert_load_imbalance_max`` (the largest since the
    fit started); ``history`` keeps every step's. The rows are those of the step's last forward of each layer (under
    pp the last micro-batch's), read off :class:`~lightning_4d.features.moe.expert.ExpertDispatch`'s split sizes; one
    all-reduce of the layers' received rows over each ep group and one of a scalar over all ranks per step. Without
    expert parallelism it does nothing.
    """

    def __init__(self) -> None:
        self.history: list[float] = []
        self.peak = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        layout = layout_strategy(trainer.strategy)
        if layout is None or layout.parallel_config.ep == 1 or not dist.is_initialized():
            return
        dispatches = dispatches_of(pl_module)
        ratio = torch.zeros((), dtype=torch.float64, device=pl_module.device)
        if dispatches:  # the ranks of an ep group run the same pipeline stage: the same layers, in the same order
            received = torch.tensor([d.received_rows for d in dispatches], dtype=torch.float64, device=ratio.device)
            total = received.clone()
            dist.all_reduce(total, group=dispatches[0].group)
            ratio = (received * dispatches[0].size / total.clamp(min=1)).max()
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        value = float(ratio)
        self.history.append(value)
        self.peak = max(self.peak, value)
        pl_module.log("moe_expert_load_imbalance", value)
        pl_module.log("moe_expert_load_imbalance_max", self.peak)
