"""Mixture of Experts in the memory and step-time models: every term an MoE layer, its routed experts and expert
parallelism (ep) add, in one place; the dense modules call these functions and name no expert.

**Memory** (:mod:`lightning_4d.planning.model` composes the terms). An MoE layer's feed-forward is the router
``[E, h]``, the experts' stacked ``w1``, ``w3`` ``[E, f_e, h]`` and ``w2`` ``[E, h, f_e]`` (``E/ep`` rows each: the
experts of this ep rank) and the shared experts' ``w1``, ``w3``, ``w2`` (width ``n_s·f_e``), none of them divided by
tp: under tp an MoE layer runs whole on each tp rank's tokens (``features/tensor_parallel/runtime.py``'s
``TokenParallel``), so its parameters are reduced and ZeRO-sharded over ``dp·cp·tp`` and the experts' over
``dp·cp·tp/ep`` (:func:`layer_params` marks them: :attr:`~lightning_4d.planning.tensors.Param.group`). At ZeRO 2/3 a
stacked expert weight ``[E_local, d1, d2]`` whose group (G ranks) does not divide ``E_local`` but divides ``d1`` is
sharded on dim 1 instead, evenly: ``E_local·(d1/G)·d2`` elements per rank (:func:`fsdp_shard_dim`). What one MoE layer
saves for backward: :func:`saved_bytes`; under expert parallelism on the rows the rank receives, the balanced figure
times ``expert_load_imbalance`` (:data:`DEFAULT_EXPERT_LOAD_IMBALANCE`, measured), and the all-to-alls' transient
receive buffers (:func:`all_to_all_buffers`).

**Mixture of Experts** (``num_experts`` E > 0, top-k routed experts of width f_e, n_s shared experts; ``docs/moe.md``).
An MoE layer's matmuls count the parameters a token goes through (its *active* parameters, as
:meth:`~lightning_4d.models.LlamaConfig.num_active_parameters` and the MFU convention do: DeepSpeed-MoE, Rajbhandari
et al. 2022, arXiv 2201.05596, §2; Mixtral, Jiang et al. 2024, arXiv 2401.04088, §2.1: 12.9B of 46.7B per token),
not all experts: ``6·(P_attn/tp + E·h + 3·k·h·f_e + 3·n_s·h·f_e)·T/tp`` FLOPs (attention, router, routed and shared
experts; under tp each tp rank routes its own ``T/tp`` tokens through whole experts), the routed GEMMs in the class
of their ``ep·T·k/(E·tp)`` rows per local expert, f_e and h. The pointwise bytes take ``(k + n_s)·f_e`` for f (the
routing's sort, gather and scatter are not counted: not measured). Layers alternate dense and MoE with
``moe_layer_interval``; one layer's time is the average of the two kinds, weighted by their counts (exact without
pp; a pipeline rank's own mix is not followed). Under tp an MoE layer is charged the dense layer's tp collectives
(an upper bound: MoE under tp is not implemented yet).

**Expert parallel** (ep > 1): per MoE layer and micro-batch 4 all-to-alls (dispatch and combine forward, both again
backward; 2 more in full activation checkpointing's recomputation), not overlapped (``features/moe/expert.py`` issues
them synchronously between the router and the experts), each sending ``n = (T/tp)·k·h·c`` bytes per GPU of which
``(ep−1)/ep`` leave the GPU (dropless routing at balanced load). Pairwise-exchange all-to-all cost ``(p−1)·α +
(p−1)/p·n·β`` (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1), §4.5), with the node split of the ep group: an ep group is ``ep`` consecutive ranks of the MoE
layers' token ranks (``dp_cp``, under tp ``dp_cp_tp``: ep folded over tp first, ``features/moe/runtime.py``), i.e.
``ep`` consecutive global ranks (``mesh.py``: dims ``("pp", "dp", "cp", "tp")``, tp innermost); when ``ep`` divides the
GPUs per node the exchange stays on NVLink, else each GPU sends ``(g−1)/ep·n`` bytes over NVLink to the ``g =
gpus_per_node`` group members of its node and ``(ep−g)/ep·n`` over its NIC, the two at once (the slower sets the
time) with the inter-node α. Plus, per MoE layer forward, the counts' all-to-all (``E`` integers: latency
only) and the load-balancing counts' all-reduce over the ranks that route tokens, ``dp_cp_tp`` (``E + 2`` integers:
``2·⌈log₂(D·tp)⌉·α``, recursive doubling, Thakur et al. 2005 §4.4); under tp also the router probabilities' mean over
tp (``E`` floats, an all-reduce forward and one backward: ``2·⌈log₂ tp⌉·α`` each).
Data parallel with ep: the dense parameters' gradients go over D ranks, the expert
parameters' (``E/ep`` experts per GPU) over the expert data-parallel group of ``D·tp/ep`` ranks; ZeRO shards each
over its own group.

**The load** a workload states (``expert_load_imbalance``) is the MoE feature's too: its command-line option
(:func:`add_load_option`, :func:`load_of_args`), its check and default (:func:`with_checked_load`, :func:`rank_load`)
and the estimate's phase it enlarges (:data:`BACKWARD_PHASE`); the planner's ep choices and its check of a pinned ep
(:func:`ep_sizes`, :func:`check_job_ep`).

Pure Python: no torch import.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from lightning_4d.models.llama_config import divisors
from lightning_4d.planning.rates import (
    COLLECTIVE_EFFICIENCY,
    LINK_LATENCY,
    POINTWISE_BYTES,
    POINTWISE_EFFICIENCY,
    data_parallel_collectives,
    gemm_efficiency,
    link,
    ring,
)
from lightning_4d.planning.tensors import Dtypes, Param

__all__ = [
    "expert_shard_dim",
    "BUFFER_DETAIL",
    "DEFAULT_EXPERT_LOAD_IMBALANCE",
    "MoeShape",
    "BACKWARD_PHASE",
    "MEASURE_NOTES",
    "add_load_option",
    "all_to_all_buffers",
    "all_to_all_time",
    "check_dense",
    "check_expert_load_imbalance",
    "check_job_ep",
    "check_rank_load",
    "count_moe_layers",
    "data_parallel_terms",
    "ep_sizes",
    "fsdp_shard_dim",
    "is_moe_layer",
    "layer_param_counts",
    "layer_params",
    "layer_times",
    "load_of_args",
    "load_type",
    "model_dims",
    "moe_shape",
    "rank_all_to_all_buffers",
    "rank_load",
    "received_rows",
    "saved_bytes",
    "split_layers",
    "with_checked_load",
]

#: The default ``expert_load_imbalance`` of :func:`estimate_memory` (and of ``lightning-4d estimate`` / ``plan``,
#: :class:`~lightning_4d.memory_check.MemoryEstimatorCallback` and the planner, which all take it from here): the
#: rows the most loaded ep rank's experts receive over the balanced figure, max over steps, MoE layers and ep ranks,
#: measured on the tiny MoE job (``configs/tiny_moe.yaml``: dp2 x tp2, ep2, 450 steps) with
#: :class:`lightning_4d.callbacks.ExpertLoadMonitor` (``moe_expert_load_imbalance_max``): its largest value, early in
#: the run, rounded up (the figures: docs/validation.md, "Measurements behind constants in the code"; docs/moe.md,
#: "Measure your router's load", gives the command).
#: Under a capacity factor the capacity bounds the received rows instead when it is lower.
DEFAULT_EXPERT_LOAD_IMBALANCE = 1.93

#: The name of one MoE layer's all-to-all buffers in :attr:`~lightning_4d.planning.model.MemoryEstimate.details`.
BUFFER_DETAIL = "expert_parallel_buffers"


def expert_shard_dim(shape: Sequence[int], group: int) -> int:
    """The dimension FSDP2 shards a stacked expert weight of local ``shape`` ``[E_local, d1, d2]`` on over ``group``
    ranks at ZeRO 2/3: 1 when ``E_local`` is not a multiple of ``group`` and ``d1`` is, else 0 (FSDP2's default).

    Dim 0 (whole experts) is FSDP2's default, but with ``E_local % group != 0`` it pads dim 0 to a multiple of the
    group (``torch.chunk``: each rank holds ``ceil(E_local/group)`` rows' worth of storage, rank 0 a whole expert while
    ``group > E_local``), and every all-gather moves the padding. Dim 1 (``f_e`` of ``w1``/``w3``, ``h`` of ``w2``)
    then splits every expert evenly: torchtitan shards experts ``Shard(1)`` when ``dp_shard·ep > num_experts``
    (``torchtitan/models/llama4/infra/parallelize.py``); this rule also covers ``E_local > group`` not divisible.
    FSDP2 refuses uneven sharding on a dimension other than 0 (``NotImplementedError``, torch 2.13
    ``_fsdp_param.py``), hence dim 0 when ``d1`` is not a multiple of ``group`` either. A group of one rank: 0.
    """
    if len(shape) < 2 or group <= 1:
        return 0
    return 1 if shape[0] % group and shape[1] % group == 0 else 0


def check_expert_load_imbalance(value: Any) -> float:
    """``value`` as a float when it is a valid ``expert_load_imbalance`` (a finite number >= 1.0; ``None``: the
    default :data:`DEFAULT_EXPERT_LOAD_IMBALANCE`).

    Raises:
        ValueError: a value below 1, not finite, or not a number (naming it and the valid ones).
    """
    if value is None:
        return DEFAULT_EXPERT_LOAD_IMBALANCE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise ValueError(
            f"expert_load_imbalance={value!r} is not valid: expected a finite number >= 1.0 (the rows the most "
            "loaded expert-parallel rank receives over the balanced figure: 1.0 is balanced load, ep all rows on one "
            f"rank; default {DEFAULT_EXPERT_LOAD_IMBALANCE}, measured on configs/tiny_moe.yaml, docs/moe.md)."
        )
    return float(value)


def load_type(text: str) -> float:
    """argparse type of ``--expert-load-imbalance``: a finite number >= 1 (:func:`check_expert_load_imbalance`)."""
    try:
        return check_expert_load_imbalance(float(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def add_load_option(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` (``lightning-4d estimate``, ``plan``, ``measure``) the option of the MoE load, read back by
    :func:`load_of_args`."""
    parser.add_argument(
        "--expert-load-imbalance",
        type=load_type,
        default=None,
        help="Mixture-of-Experts models under expert parallelism: the rows the most loaded ep rank's experts receive "
        "over the balanced figure (>= 1.0; at most ep; a capacity factor bounds it); it multiplies the experts' "
        f"saved activations and all-to-all buffers (default {DEFAULT_EXPERT_LOAD_IMBALANCE:g}, measured on "
        "configs/tiny_moe.yaml: docs/moe.md)",
    )


def load_of_args(args: argparse.Namespace, checked: bool = False) -> dict[str, Optional[float]]:
    """The MoE load :func:`add_load_option` read, as the keyword argument of a
    :class:`~lightning_4d.planning.workload.Workload` or ``Job`` and the field of the commands' ``--json`` output
    (``checked``: defaulted and checked, :func:`check_expert_load_imbalance`)."""
    value = args.expert_load_imbalance
    return {"expert_load_imbalance": check_expert_load_imbalance(value) if checked else value}


#: what ``lightning-4d measure`` adds to the help of the MoE feature's layout option, by field name
MEASURE_NOTES = {
    "expert_parallel_size": "; measure answers the fake process group's count exchange with the rows "
    "--expert-load-imbalance states (docs/moe_costs.md)",
}


def with_checked_load(workload: Any) -> Any:
    """``workload`` (a :class:`~lightning_4d.planning.workload.Workload`) with its ``expert_load_imbalance`` checked
    and defaulted (:func:`check_expert_load_imbalance`): what ``estimate_memory`` and ``measure`` estimate.

    Raises:
        ValueError: as :func:`check_expert_load_imbalance`.
    """
    return replace(workload, expert_load_imbalance=check_expert_load_imbalance(workload.expert_load_imbalance))


def rank_load(workload: Any) -> float:
    """One ep rank's load of ``workload`` (its ``expert_load_imbalance``, :func:`check_rank_load`).

    Raises:
        ValueError: as :func:`check_rank_load`.
    """
    return check_rank_load(workload.expert_load_imbalance)


def check_job_ep(cfg: Any, ep: int, num_gpus: int, pp: int) -> None:
    """The planner's check of an ep it is asked to keep fixed: ``ep`` must divide the ``num_gpus / pp`` token ranks
    (dp·cp·tp) of some layout of the job (``cfg``: the model config).

    Raises:
        ValueError: ``ep`` divides no dp·cp·tp of the job, naming the valid ones (:func:`ep_sizes`).
    """
    if (num_gpus // pp) % ep:
        raise ValueError(
            f"expert_parallel_size={ep} divides no dp*cp*tp of {num_gpus} GPUs with pp={pp}: "
            f"valid expert_parallel_size values here: {ep_sizes(cfg, num_gpus // pp)}."
        )


#: the phase of a step at an MoE layer's backward under ep (its all-to-all buffers alive), in
#: :attr:`~lightning_4d.planning.model.MemoryEstimate.phases`
BACKWARD_PHASE = "expert-parallel backward"


def check_rank_load(value: Any) -> float:
    """``value`` as one ep rank's load (its received rows over the balanced figure: any finite number > 0, below 1
    for a rank that receives fewer rows than the balanced figure; ``None``: :data:`DEFAULT_EXPERT_LOAD_IMBALANCE`).

    Raises:
        ValueError: a value that is not a finite number > 0.
    """
    load = DEFAULT_EXPERT_LOAD_IMBALANCE if value is None else value
    if isinstance(load, bool) or not isinstance(load, (int, float)) or not 0 < load < math.inf:
        raise ValueError(
            f"expert_load_imbalance={value!r} is not valid here: expected a finite number > 0 (this "
            "rank's received rows over the balanced figure; estimate_memory takes the most loaded rank's, >= 1.0)."
        )
    return load


def is_moe_layer(cfg: Any, index: int) -> bool:
    """Whether layer ``index`` of ``cfg`` is a Mixture-of-Experts layer (``LlamaConfig.is_moe_layer``; a duck-typed
    config without it is dense)."""
    test = getattr(cfg, "is_moe_layer", None)
    return bool(test(index)) if test is not None else False


def split_layers(cfg: Any, layers: Any) -> tuple[list[int], list[int]]:
    """``(dense layers, MoE layers)`` among ``layers`` of ``cfg``, in order (a dense config: no per-layer test, the
    planner asks this thousands of times)."""
    if getattr(cfg, "num_experts", 0):
        return [i for i in layers if not is_moe_layer(cfg, i)], [i for i in layers if is_moe_layer(cfg, i)]
    return list(layers), []


def ep_sizes(cfg: Any, ranks: int) -> list[int]:
    """The expert parallel sizes of ``cfg`` over ``ranks`` token ranks (dp·cp·tp): the divisors of ``ranks`` that
    divide ``num_experts``, ascending; ``[1]`` for a dense model (the planner's ep choices, and the valid ones its
    error names)."""
    if not getattr(cfg, "is_moe", False):
        return [1]
    return [e for e in divisors(ranks) if cfg.num_experts % e == 0]


def count_moe_layers(cfg: Any, layers: Any) -> int:
    """How many of ``layers`` are MoE layers of ``cfg``."""
    return sum(is_moe_layer(cfg, i) for i in layers)


@dataclass(frozen=True)
class MoeShape:
    """The sizes of a config's MoE layers, hashable (:class:`lightning_4d.planning.params.Sizes` holds one)."""

    num_experts: int
    expert_intermediate_size: int
    num_shared_experts: int
    layers: tuple[int, ...]


def moe_shape(cfg: Any, num_layers: int, moe_layers: Optional[tuple[int, ...]] = None) -> Optional[MoeShape]:
    """The :class:`MoeShape` of ``cfg``; ``moe_layers``: its MoE layers among ``range(num_layers)`` (default: found),
    or those of the layers the caller will ask about. ``None`` when none is an MoE layer."""
    moe = moe_layers
    if moe is None:
        moe = tuple(i for i in range(num_layers) if is_moe_layer(cfg, i)) if getattr(cfg, "num_experts", 0) else ()
    if not moe:
        return None
    return MoeShape(cfg.num_experts, cfg.expert_intermediate_size, getattr(cfg, "num_shared_experts", 0), moe)


def layer_params(shape: MoeShape, unit: str, h: int, ep: int) -> list[Param]:
    """The parameters of one MoE layer's feed-forward (FSDP2 unit ``unit``), in the model's order: the router
    ``[E, h]``, the experts' stacked ``w1``, ``w3`` ``[E, f_e, h]`` and ``w2`` ``[E, h, f_e]`` (``E/ep`` rows each: the
    experts of this ep rank) and the shared experts' ``w1``, ``w3``, ``w2`` (width ``n_s·f_e``), none divided by tp
    (the layer runs token parallel under tp: group ``"tp"``; the experts also split over ep: ``"ep"``)."""
    e, fe, fs = shape.num_experts, shape.expert_intermediate_size, shape.num_shared_experts
    token, experts = ("tp",), ("ep", "tp")
    out = [
        Param(e, h, True, unit, group=token),
        Param(e // ep, fe * h, True, unit, group=experts, dim1=fe),
        Param(e // ep, fe * h, True, unit, group=experts, dim1=fe),
        Param(e // ep, h * fe, True, unit, group=experts, dim1=h),
    ]
    if fs:
        out += [
            Param(fs * fe, h, True, unit, group=token),
            Param(fs * fe, h, True, unit, group=token),
            Param(h, fs * fe, True, unit, group=token),
        ]
    return out


def fsdp_shard_dim(p: Param, group: int) -> int:
    """The dimension FSDP2 shards ``p`` on over ``group`` ranks at ZeRO 2/3: a stacked expert weight's by
    :func:`expert_shard_dim`, every other tensor's 0."""
    return expert_shard_dim((p.rows, p.dim1), group) if p.dim1 else 0


def assignments(cfg: Any, tokens: int) -> int:
    """Expert assignments one MoE layer processes for ``tokens`` tokens at balanced load: ``tokens·k`` dropless,
    else at most ``E · capacity`` (``lightning_4d.features.moe.layer.capacity``). Dropless, the count is exact whatever
    the balance (every assignment is processed on the rank that routed it until expert parallelism exists)."""
    n = tokens * cfg.num_experts_per_token
    if cfg.capacity_factor is None:
        return n
    cap = math.ceil(cfg.capacity_factor * tokens * cfg.num_experts_per_token / cfg.num_experts)
    return min(n, cfg.num_experts * cap)


def received_rows(cfg: Any, tokens: int, ep: int, imbalance: float) -> int:
    """Rows one ep rank's experts receive in one MoE layer under expert parallelism over ``ep`` ranks, every rank
    routing ``tokens`` tokens: the balanced figure (the ep group's ``ep·N`` assignments over ``ep`` ranks: ``N`` =
    :func:`assignments`, the rank's own) times ``imbalance`` (``expert_load_imbalance``), rounded up, at most all
    ``ep·N`` rows, and under a capacity at most ``E·capacity`` (each of the ``E/ep`` local experts takes at most
    ``capacity`` rows from each of the ``ep`` sources: ``features/moe/expert.py``)."""
    n = assignments(cfg, tokens)
    rows = min(math.ceil(imbalance * n), ep * n)
    if cfg.capacity_factor is not None:
        rows = min(
            rows,
            cfg.num_experts * math.ceil(cfg.capacity_factor * tokens * cfg.num_experts_per_token / cfg.num_experts),
        )
    return rows


def saved_bytes(cfg: Any, dt: Dtypes, b: int, s: int, ep: int = 1, imbalance: float = 1.0) -> int:
    """Bytes one MoE feed-forward saves for backward beyond its input (``lightning_4d/features/moe/layer.py``; ``T =
    b·s`` tokens, ``N`` assignments :func:`assignments`, ``c`` the compute dtype's bytes), as
    ``saved_tensors_hooks`` sees them:

    - the router: softmax: the float32 probabilities ``[T, E]`` (shared with the load-balancing loss), the top-k
      indices (int64 ``[T, k]``), the division's float32 operands (top-k probabilities ``[T, k]`` and their sum
      ``[T, 1]``); sigmoid: the top-k indices, the float32 sigmoid ``[T, k]`` and the loss's float32 softmax
      ``[T, E]``; the loss's float32 counts ``[E]``;
    - dispatch: the assignment order and each assignment's token (int64 ``[N]`` each), the float32 weights
      ``[N, 1]``, the gathered tokens ``[N, h]`` (c), and the weighted experts' output (softmax, c·N·h) or the
      weighted experts' input (sigmoid, c·N·h);
    - the experts: ``w1 x``, ``w3 x``, their silu and product (4·c·N·f_e);
    - the shared experts: 4·c·T·n_s·f_e (their input is the layer's ffn input, counted once).

    Under expert parallelism (``ep`` > 1, ``lightning_4d/features/moe/expert.py``'s ``ExpertDispatch.exchange``) the
    experts run on the ``R`` rows this rank RECEIVES (:func:`received_rows`: balanced ``N`` times ``imbalance``), not
    on the ``N`` it routed, and the all-to-alls (whose autograd function saves no tensor) change what is kept: the
    routing side keeps its int64 order and tokens, float32 weights and one ``[N, h]`` tensor (c: softmax the combined
    outputs the weights multiply, sigmoid the gathered tokens the scores multiply; the gathered tokens of the softmax
    router and the sigmoid's weighted input go into the dispatch all-to-all and are not saved); the receiving side
    keeps the received rows regrouped expert-major ``[R, h]`` (c, the experts' input), the permutation and its
    inverse (int64 ``[R]`` each: the two index ops) and the experts' 4·c·R·f_e. The all-to-alls' receive buffers
    that are not saved are transient (:func:`all_to_all_buffers`).
    """
    t, e, k, h = b * s, cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size
    n, fe, c = assignments(cfg, t), cfg.expert_intermediate_size, dt.compute
    if cfg.router_score == "softmax":
        router = 4 * t * e + 8 * t * k + 4 * t * k + 4 * t
    else:
        router = 8 * t * k + 4 * t * k + 4 * t * e
    if ep == 1:  # every assignment runs here: the gathered tokens and the weighted outputs (inputs), N rows each
        dispatch, rows = 2 * 8 * n + 4 * n + 2 * c * n * h, n
    else:
        rows = received_rows(cfg, t, ep, imbalance)
        dispatch = 2 * 8 * n + 4 * n + c * n * h + c * rows * h + 2 * 8 * rows
    return router + 4 * e + dispatch + 4 * c * rows * fe + 4 * c * t * cfg.num_shared_experts * fe


def rank_all_to_all_buffers(work: Any, cfg: Any, pc: Any, dt: Dtypes, layers: Any) -> int:
    """:func:`all_to_all_buffers` of a rank holding ``layers`` of ``cfg`` (its model as held) for the batch and the
    stated load of ``work`` (a :class:`~lightning_4d.planning.workload.Workload`): 0 without ep or without an MoE
    layer among them."""
    if pc.ep == 1 or count_moe_layers(cfg, layers) == 0:
        return 0
    return all_to_all_buffers(cfg, pc, dt, work.micro_batch_size, work.seq_length, work.expert_load_imbalance)


def all_to_all_buffers(cfg: Any, pc: Any, dt: Dtypes, b: int, seq_length: int, imbalance: float) -> int:
    """Transient bytes of one MoE layer's all-to-alls under expert parallelism (``features/moe/expert.py``), 0 without
    ep: in backward, the combine's gradient received ``[R, h]`` and its permuted copy ``[R, h]`` (the index op's
    backward) exist together before the experts' backward (``R`` = :func:`received_rows` for the rank's
    ``T = b·s/(cp·t)`` tokens), ``2·c·R·h``; the forward's receive buffer and its permuted copy are as large. The
    dispatch's send buffer is the gathered tokens themselves (contiguous: ``all_to_all_single`` takes them as they
    are). Not measured (``saved_tensors_hooks`` does not see transients)."""
    if pc.ep == 1:
        return 0
    tokens = b * (seq_length // pc.cp) // pc.tp
    return 2 * dt.compute * received_rows(cfg, tokens, pc.ep, imbalance) * cfg.hidden_size


def model_dims(cfg: Any) -> tuple[int, int, int, int, int]:
    """(E, top-k, f_e, n_s, MoE layers) of a model config for the step-time model's ``dims``
    (:func:`lightning_4d.planning.step_time.model_dims`), zeros for a dense one."""
    if not getattr(cfg, "is_moe", False):
        return (0, 0, 0, 0, 0)
    return (
        cfg.num_experts,
        cfg.num_experts_per_token,
        cfg.expert_intermediate_size,
        cfg.num_shared_experts,
        cfg.num_moe_layers,
    )


def layer_param_counts(dims: tuple[int, ...], tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds of one MoE layer: attention ``/tp``, router ``E·h`` and shared
    experts ``3·n_s·h·f_e`` (replicated over tp: whole experts per tp rank), and its ``E/ep`` routed experts
    ``3·h·f_e`` each."""
    h, _, d, a, k = dims[:5]
    e, _, fe, ns = dims[7:11]
    attention = h * (a + 2 * k) * d + a * d * h
    return attention / tp + e * h + 3 * ns * h * fe, e // ep * 3 * h * fe


def all_to_all_time(nbytes: float, ep: int, gpu: Any, gpus_per_node: int) -> float:
    """Seconds of one all-to-all over an ep group in which every GPU sends ``nbytes`` (``(ep−1)/ep`` of it to the
    others): pairwise exchange, ``(p−1)·α + (p−1)/p·n·β`` (Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), §4.5).
    The group is ``ep`` consecutive global ranks (ep folded over tp first: module docstring); when ``ep`` divides
    ``gpus_per_node`` it stays on NVLink, else the bytes to the ``g = gpus_per_node`` members of the GPU's node go
    over NVLink and the rest over its NIC at the same time (the slower sets the time), with the inter-node latency."""
    if ep == 1:
        return 0.0
    if gpus_per_node % ep == 0:
        bandwidth, latency = link(gpu, True)
        return (ep - 1) / ep * nbytes / (COLLECTIVE_EFFICIENCY * bandwidth) + (ep - 1) * latency
    g = min(ep, gpus_per_node)
    intra = (g - 1) / ep * nbytes / (COLLECTIVE_EFFICIENCY * gpu.intra_node_bandwidth)
    inter = (ep - g) / ep * nbytes / (COLLECTIVE_EFFICIENCY * gpu.inter_node_bandwidth)
    return max(intra, inter) + (ep - 1) * LINK_LATENCY[1]


def layer_times(
    dims: tuple[int, ...], dense: tuple[float, float], shape: Any, gpu: Any, gpus_per_node: int
) -> tuple[float, float, float, float]:
    """(matmul, pointwise, MoE collectives forward, MoE collectives forward + backward) seconds of one layer and one
    micro-batch of ``shape`` (a :class:`~lightning_4d.planning.rates.LayerShape`), averaged over the dense and MoE
    layers (module docstring, **Mixture of Experts** and **Expert parallel**): ``dense`` the dense layer's (matmul,
    pointwise) seconds; ``tokens`` = b·s/cp, ``dd`` = dp·cp."""
    tp, sp, ep, dd = shape.tp, shape.sp, shape.ep, shape.dd
    tokens = shape.b * shape.s / shape.cp
    h, f, d, a, k, vocab, num_layers = dims[:7]
    e, top, fe, ns, n_moe = dims[7:12]
    c = 2
    peak, hbm = gpu.peak_flops * gpu.compute_fraction, POINTWISE_EFFICIENCY * gpu.memory_bandwidth
    ch, cq, cf = POINTWISE_BYTES
    frac = n_moe / num_layers
    routed = tokens / tp  # each tp rank routes its own tokens through whole experts
    rows = ep * routed * top / e  # rows per local expert at balanced load
    t_moe_mm = (
        6 * (h * (a + 2 * k) * d + a * d * h) / tp * tokens / (gemm_efficiency(min(tokens, h, a * d / tp)) * peak)
        + 6 * e * h * routed / (gemm_efficiency(min(routed, h, e)) * peak)
        + 6 * 3 * top * h * fe * routed / (gemm_efficiency(min(rows, h, fe)) * peak)
        + (6 * 3 * ns * h * fe * routed / (gemm_efficiency(min(routed, h, ns * fe)) * peak) if ns else 0.0)
    )
    t_moe_pw = (ch * h / (tp if sp else 1) + (cq * (a + 2 * k) * d + cf * (top + ns) * fe) / tp) * tokens / hbm
    t_mm = frac * t_moe_mm + (1 - frac) * dense[0]
    t_pw = frac * t_moe_pw + (1 - frac) * dense[1]
    one = all_to_all_time(routed * top * h * c, ep, gpu, gpus_per_node)
    inside = gpus_per_node % ep == 0
    counts = (ep - 1) * LINK_LATENCY[0 if inside else 1] if ep > 1 else 0.0
    routing = tp * dd  # the ranks that route tokens (dp_cp_tp): the load-balancing counts' all-reduce
    balance = 2 * math.ceil(math.log2(routing)) * link(gpu, routing <= gpus_per_node)[1] if routing > 1 else 0.0
    tp_mean = 2 * math.ceil(math.log2(tp)) * link(gpu, tp <= gpus_per_node)[1] if tp > 1 else 0.0
    forward = frac * (2 * one + counts + balance + tp_mean)
    return t_mm, t_pw, forward, forward + frac * (2 * one + tp_mean)


def data_parallel_terms(
    dims: tuple[int, ...],
    layers: int,
    sizes: tuple[int, int, int],
    zero_stage: int,
    weights: tuple[float, float],
    link_rates: tuple[float, float],
) -> tuple[float, float, float, float]:
    """The data-parallel terms of a pp rank holding ``layers`` decoder layers of an MoE model (module docstring,
    **Expert parallel**): (parameters reduced over dp·cp, parameters this rank's optimizer owns of the experts,
    seconds of the experts' float32 gradient reduce-scatter, of their parameter all-gather). ``sizes`` = (tp, ep,
    dd); the dense parameters go over ``dd`` = dp·cp ranks, the experts' over the expert data-parallel group of
    ``dd·tp/ep`` (ep folded over tp: module docstring); ``weights`` = (a dense layer's matmul weights, the rank's
    embedding and head), ``link_rates`` = (bandwidth, latency) of the link
    (:func:`lightning_4d.planning.rates.link`)."""
    tp, ep, dd = sizes
    dense_layer, vocabulary = weights
    bandwidth, latency = link_rates
    c = 2
    frac = dims[11] / dims[6]
    dense_moe, per_layer = layer_param_counts(dims, tp, ep)
    params = layers * ((1 - frac) * dense_layer / tp + frac * dense_moe) + vocabulary
    experts = layers * frac * per_layer
    edp = dd * tp // ep
    owned = experts / edp if zero_stage >= 1 else experts
    if not experts or edp == 1:
        return params, owned, 0.0, 0.0
    k = data_parallel_collectives(zero_stage, round(layers * frac), 4 * experts)  # an FSDP2 unit per MoE layer
    return params, owned, ring(4 * experts, edp, bandwidth, latency, k), ring(c * experts, edp, bandwidth, latency, k)


def check_dense(model_config: Any) -> None:
    """Refuse a Mixture-of-Experts config for the paper's estimator (:mod:`lightning_4d.planning.fujii2024`): its
    formulas have no term for routed experts, the router or the dispatch, so an estimate would silently be that of a
    dense model.

    Raises:
        ValueError: ``num_experts`` > 0 (the message says so and names ``--formula lightning_4d``).
    """
    if getattr(model_config, "num_experts", 0):
        raise ValueError(
            f"the fujii2024 formula (Fujii et al. 2024, arXiv 2411.06465) has no Mixture-of-Experts terms: it models "
            f"dense Llama only, and this model has num_experts={model_config.num_experts}; use --formula "
            "lightning_4d (our memory model counts the router, the experts and the shared experts)."
        )
