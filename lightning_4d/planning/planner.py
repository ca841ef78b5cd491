"""Enumerate the layouts of a training job, keep those that fit, rank them by a predicted step time.

A *job* (:class:`~lightning_4d.planning.workload.Job`) is a model, a number of GPUs (``gpus_per_node`` per node) of one
kind, a sequence length, a global batch (samples per optimizer step) and a precision; what to search
(:class:`~lightning_4d.planning.workload.Search`) fixes some sizes or adds optional features. A *layout* is everything
FourDStrategy lets a user choose: tp, pp, cp, dp with ``tp·pp·cp·dp = num_gpus``, the micro-batch size b, the ZeRO
stage, activation checkpointing (none, selective, full), sequence parallelism on or off (tp > 1), the context-parallel
method (ring, allgather, and alltoall where the heads split over tp·cp; cp > 1), when :class:`Search` asks for the tp
ring overlap also the tp projections as overlapped rings (tp > 1 with sp, checkpointing none or full: the values the
feature gives, :func:`lightning_4d.features.tensor_parallel.costs.ring_choices`; off by default, as in FourDStrategy,
until it is measured faster on a GPU) and, with pp > 1, the pipeline schedule with its stages per rank v and its layer
split:

- tp inside a node, dividing the heads, kv heads, FFN size and padded vocabulary; ``seq_length`` divisible by
  ``2·cp`` (and by tp under sp), cp at most 32 and keeping at least :data:`MIN_CONTEXT_CHUNK` tokens in each of
  the 2·cp chunks; b dividing ``global_batch / dp``, ``m = global_batch / (dp·b)`` micro-batches;
- pp any size up to the number of layers (not only its divisors): 1F1B (v = 1), interleaved 1F1B (v = 2, 4, 8;
  m a multiple of pp) and ZBV (v = 2), each with at least one layer per stage; GPipe (1F1B's bubble, more memory)
  and DualPipeV (ZBV's bubble for a dense model, m >= 2p) are never better and are not listed;
- when ``pp·v`` does not divide the layers, the split of :func:`propose_layer_split`: the first and the last
  stages, which also hold the embedding and the LM head, get the fewer layers (Meta's 126 layers on 16 stages:
  7, 8, ..., 8, 7; Llama 3 paper, arXiv 2407.21783, §3.3.2);
- for a Mixture-of-Experts model, the sizes ep of :func:`~lightning_4d.features.moe.costs.ep_sizes` (ep folded over tp
  where it exceeds dp·cp, or tp > 1: ``lightning_4d/features/moe/runtime.py``; 1 for a dense model). Every layout passes
  through :meth:`ParallelConfig.validate_model <lightning_4d.config.ParallelConfig.validate_model>` (and the ZeRO stages
  through ``ParallelConfig`` itself), so the planner proposes for an MoE model exactly the layouts FourDStrategy accepts
  for it.

Each layout's step time is predicted by :mod:`lightning_4d.planning.step_time` (term by term, calibrated on
published runs) and its memory by :func:`~lightning_4d.planning.model.estimate_memory`. Layouts are ranked by
predicted step time; at equal times the one that recomputes less comes first (none, then selective, then full),
then the one that needs less memory. A layout is dropped when another of the same parallel sizes and micro-batch
size is predicted no slower and needs no more memory (e.g. ZeRO 0 where ZeRO 1 is as fast, sequence parallelism
off, or selective checkpointing where none fits). Each :class:`Candidate` carries the fractions of its step spent in
the pipeline
bubble, in exposed communication and in recomputation: why it ranks where it does (Hagemann et al. 2023,
arXiv 2311.05610: micro-batch size 1 is usually best; sequence parallelism beats activation checkpointing where
memory allows).

The memory of a layout is estimated only when it could still be among the ``top`` fastest that fit (layouts are
visited fastest first), so a plan over 16,384 GPUs answers in under a second (0.84 s of CPU for llama3.1-405b on
the 2-core dev machine; tests/test_memory_check.py).

Predicted tokens/s = ``global_batch·s / step``; predicted MFU = model FLOPs per token × tokens/s / (num_gpus·P),
with the model FLOPs of :meth:`~lightning_4d.models.LlamaConfig.flops_per_token` (``6N + 12·L·h·s``, PaLM appendix
B), the figure the training task logs its MFU with, so that predicted and logged MFU compare.

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

from lightning_4d.config import (
    ACTIVATION_CHECKPOINTING,
    CONTEXT_PARALLEL_METHODS,
    ZERO_STAGES,
    ParallelConfig,
    check_compile,
    check_positive_int,
)
from lightning_4d.features import moe
from lightning_4d.features.context_parallel import alltoall_heads
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.features.tensor_parallel.costs import ring_choices, without_rings
from lightning_4d.layout import plan_values, planned_dataclass, strategy_arguments
from lightning_4d.models.llama_config import divisors
from lightning_4d.planning.fujii2024 import check_dense, fujii2024_of_layout
from lightning_4d.planning.hardware import GIB
from lightning_4d.planning.model import MemoryEstimate, estimate_memory, resident_state_bytes
from lightning_4d.planning.step_time import Layout, StepTime, model_dims, step_time_parts
from lightning_4d.planning.workload import Job, Search, Workload, document_attention_context

__all__ = [
    "accumulated_batches",
    "Candidate",
    "enumerate_layouts",
    "fitting_layout_lines",
    "format_size",
    "plan",
    "propose_layer_split",
    "suggest_layouts",
    "suggestion_line",
]

#: how much each activation checkpointing mode recomputes, for ranking layouts of equal predicted step time
_RECOMPUTATION = {"none": 0, "selective": 1, "full": 2}
MAX_CONTEXT_PARALLEL = 32
#: the fewest tokens each of the 2·cp load-balanced chunks of a sequence keeps (shorter attention blocks run the
#: fused kernel far below its peak: :data:`~lightning_4d.planning.step_time.ATTENTION_EFFICIENCY`)
MIN_CONTEXT_CHUNK = 512
#: the pipeline schedules the planner proposes, with their stages per pp rank
PLANNED_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("interleaved_1f1b", 8), ("zbv", 2))


@planned_dataclass
class Candidate(Layout):
    """One layout of a job (the fields of :class:`~lightning_4d.planning.step_time.Layout`) with its memory estimate
    (``memory``, bytes; ``fraction`` of the GPU's), whether it ``fits``, its predicted ``step_time`` (seconds),
    ``tokens_per_sec`` and ``mfu``, and where that time goes (``bubble_fraction``, ``communication_fraction``
    (exposed, the MoE all-to-alls included), ``recompute_fraction``: fractions of the step)."""

    memory: int
    fraction: float
    fits: bool
    step_time: float
    tokens_per_sec: float
    mfu: float
    bubble_fraction: float = 0.0
    communication_fraction: float = 0.0
    recompute_fraction: float = 0.0
    #: bytes of host memory per node the layout needs (optimizer offload; 0 without)
    host_memory: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_gib"] = self.memory / GIB
        out["pipeline_layer_split"] = list(self.pipeline_layer_split) if self.pipeline_layer_split else None
        return out


def propose_layer_split(num_layers: int, num_stages: int) -> Optional[list[int]]:
    """Decoder layers per pipeline stage for ``num_stages`` stages: ``None`` when they divide ``num_layers`` (the
    even split), else ``num_layers // num_stages`` per stage with one more on the middle stages, the first and last
    stages (which also hold the embedding, and the final norm, head and loss) keeping the fewer (Llama 3 paper,
    arXiv 2407.21783, §3.3.2: one layer fewer on the first and the last stage).

    Raises:
        ValueError: fewer layers than stages.
    """
    check_positive_int("num_layers", num_layers)
    check_positive_int("num_stages", num_stages)
    if num_layers < num_stages:
        raise ValueError(f"num_layers={num_layers} cannot fill num_stages={num_stages} stages (one layer each).")
    base, extra = divmod(num_layers, num_stages)
    if not extra:
        return None
    split = [base] * num_stages
    order = sorted(range(num_stages), key=lambda i: (i in (0, num_stages - 1), abs(2 * i - (num_stages - 1))))
    for i in order[:extra]:
        split[i] += 1
    return split


def _pipelines(model_config: Any, pp: int, m: int) -> Iterator[tuple[str, int, Optional[list[int]]]]:
    """(schedule, v, layer split) of :data:`PLANNED_SCHEDULES` that can run ``m`` micro-batches on ``pp`` ranks."""
    if pp == 1:
        yield "1f1b", 1, None
        return
    for name, v in PLANNED_SCHEDULES:
        if pp * v > model_config.num_layers:
            continue
        pc = ParallelConfig(pipeline_parallel_size=pp, pipeline_schedule=name, virtual_pipeline_stages=v)
        try:
            pc.validate_microbatches(m)
        except ValueError:
            continue
        yield name, v, propose_layer_split(model_config.num_layers, pp * v)


#: the sizes :func:`plan` can keep fixed (``Search.fixed``), by their ``estimate``/``plan`` option names
FIXED_KEYS = ("tp", "pp", "cp", "dp", "ep", "zero_stage", "dp_replicate")


def _layouts(job: Job, search: Search) -> Iterator[Layout]:
    """The layouts of :func:`enumerate_layouts` as plain values (:class:`~lightning_4d.planning.step_time.Layout`):
    every parallel shape (:func:`_shapes`), then every batch shape, schedule and option of it
    (:func:`_shape_layouts`)."""
    for shape in _shapes(job, search.fixed or {}):
        yield from _shape_layouts(job, search, shape)


def _shapes(job: Job, fixed: dict[str, int]) -> Iterator[tuple[int, int, int, int, bool, int]]:
    """``(tp, pp, cp, dp, sp, ep)`` of every parallel shape of ``job`` with the sizes ``fixed`` asks for that the
    model and the sequence length take (``ParallelConfig.validate_model`` and ``validate_sequence``)."""
    model_config, num_gpus, gpus_per_node, seq_length = job.model, job.num_gpus, job.gpus_per_node, job.seq_length
    is_moe = getattr(model_config, "is_moe", False)
    for tp in divisors(min(num_gpus, gpus_per_node)):
        if num_gpus % tp or fixed.get("tp", tp) != tp:
            continue
        for pp in divisors(num_gpus // tp):
            if pp > model_config.num_layers:
                break
            if fixed.get("pp", pp) != pp or (is_moe and not _pipeline_accepted(model_config, pp)):
                continue  # not the size asked for, or one validate_model refuses for this MoE model
            for cp in divisors(num_gpus // (tp * pp)):
                if cp > MAX_CONTEXT_PARALLEL or (cp > 1 and seq_length < 2 * cp * MIN_CONTEXT_CHUNK):
                    break
                dp = num_gpus // (tp * pp * cp)
                if job.global_batch_size % dp or fixed.get("cp", cp) != cp or fixed.get("dp", dp) != dp:
                    continue
                eps = moe_costs.ep_sizes(model_config, dp * cp * tp)
                for sp, ep in ((sp, ep) for sp in ((True, False) if tp > 1 else (False,)) for ep in eps):
                    if fixed.get("ep", ep) != ep:
                        continue
                    base = ParallelConfig(
                        data_parallel_size=dp,
                        tensor_parallel_size=tp,
                        context_parallel_size=cp,
                        sequence_parallel=sp if tp > 1 else None,
                        **moe.layout_fields(ep),
                    )
                    try:
                        base.validate_model(model_config)
                        base.validate_sequence(seq_length)
                    except ValueError:
                        continue
                    yield tp, pp, cp, dp, sp, ep


def _shape_layouts(job: Job, search: Search, shape: tuple[int, int, int, int, bool, int]) -> Iterator[Layout]:
    """The layouts of one parallel shape ``(tp, pp, cp, dp, sp, ep)``: every micro-batch size (or
    ``search.micro_batch_size``), pipeline schedule, context-parallel method, ZeRO stage and checkpointing mode the
    layout rules take; each with the tp ring overlap's values for it (:func:`ring_choices`: when ``search`` asks for
    the overlap, a layout with tp > 1, sp and checkpointing other than selective also with it on, right after it); with
    ``search.compile`` only those ``compile=True`` takes (:func:`~lightning_4d.config.check_compile`), each with it
    on."""
    tp, pp, cp, dp, sp, ep = shape
    fixed, compile = search.fixed or {}, search.compile
    per_rank = job.global_batch_size // dp
    for b in [search.micro_batch_size] if search.micro_batch_size else divisors(per_rank):
        if per_rank % b:
            continue
        m = per_rank // b
        for name, v, split in _pipelines(job.model, pp, m):
            split = tuple(split) if split else None
            for method in _cp_methods(job.model, tp, cp):
                for zero, replicas in _zero_choices(job, fixed, shape):
                    for ac in ACTIVATION_CHECKPOINTING:
                        if ac == "selective" and name in ("zbv", "dualpipev"):
                            continue  # refused by ParallelConfig (PyTorch SAC recomputes once)
                        if compile and not _compile_accepted(ac):
                            continue  # compile=True refuses selective (check_compile)
                        layout = dict(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch_size=b, num_microbatches=m)
                        layout.update(sequence_parallel=sp, context_parallel_method=method, pipeline_schedule=name)
                        layout.update(virtual_pipeline_stages=v, pipeline_layer_split=split, zero_stage=zero)
                        layout.update(activation_checkpointing=ac, **moe.layout_fields(ep))
                        layout.update(data_parallel_replicate_size=replicas)
                        for rings in ring_choices(search, sp, ac):
                            yield Layout(**layout, **rings, compile=compile)


def _zero_choices(
    job: Job, fixed: dict[str, int], shape: tuple[int, int, int, int, bool, int]
) -> Iterator[tuple[int, int]]:
    """``(ZeRO stage, HSDP replicas)`` of a parallel shape ``(tp, pp, cp, dp, sp, ep)``: every stage the layout rules
    take (ZeRO 1-3 need dp·cp > 1; with ep those ``ParallelConfig`` takes), each flat (1 replica) and, for ZeRO 1-3
    of a dense model whose ZeRO group (dp·cp ranks, ``tp·dp·cp`` consecutive ranks) spans nodes, with the replica
    counts of :func:`hsdp_replicas`; ``fixed`` keeps ``zero_stage`` or
    ``dp_replicate`` to a value."""
    tp, _, cp, dp, _, ep = shape
    hsdp = hsdp_replicas(tp, cp, dp, job.gpus_per_node) if not getattr(job.model, "is_moe", False) else ()
    for zero in ZERO_STAGES:
        if (zero > 0 and dp * cp == 1) or fixed.get("zero_stage", zero) != zero:
            continue  # nothing to shard over, or not the stage asked for
        if ep > 1 and not _zero_accepted(ep, zero):
            continue  # a ZeRO stage ParallelConfig refuses with this ep
        for replicas in (1, *hsdp) if zero > 0 else (1,):
            if fixed.get("dp_replicate", replicas) == replicas:
                yield zero, replicas


@functools.lru_cache(maxsize=4096)
def hsdp_replicas(tp: int, cp: int, dp: int, gpus_per_node: int, every: bool = False) -> tuple[int, ...]:
    """The HSDP replica counts r > 1 (divisors of dp, ascending) tried when the ZeRO group, ``tp·cp·dp`` consecutive
    ranks, spans nodes of ``gpus_per_node`` GPUs; ``()`` when all of it fits in a node. Each keeps a shard group
    (``cp·dp/r`` ranks of the ZeRO group) of more than one rank and has no more replicas than the fewest whose shard
    group fits in a node (more replicas only add memory and all-reduce bytes).

    ``every=False`` (the planner: at most one per parallel shape, so that ``plan`` times as many layouts as when it
    tried in-node shard groups only): the fewest replicas whose shard group fits in a node (its ring on NVLink), else,
    where none does (tp·cp fills a node), the divisor of dp nearest ``sqrt(cp·dp/2)`` (in log scale, the smaller on a
    tie). Its reason: every collective over n ranks pays ``(n−1)·α`` (module docstring of
    :mod:`lightning_4d.planning.step_time`); a ZeRO 1 step issues its k bucket collectives twice over the shard group
    (reduce-scatter, all-gather) and the replicas' all-reduce (two ring passes over r ranks), ``2k·α·(n + r − 2)`` for
    ``n·r = cp·dp``, least at ``r = sqrt(cp·dp)``; the all-reduce's bytes, ``2(r−1)/r`` of the float32 shard, favour
    fewer replicas, hence ``sqrt(cp·dp/2)`` (llama3.1-405b, tp8 dp128 ZeRO 1 on H100 nodes: of all divisors, r = 8 =
    sqrt(128/2) is the model's fastest). ``every=True`` (``estimate``, one layout): every such divisor."""
    if tp * cp * dp <= gpus_per_node:
        return ()
    in_node = next((r for r in divisors(dp) if tp * cp * (dp // r) <= gpus_per_node), dp)
    if every:
        return tuple(r for r in divisors(dp) if 1 < r <= in_node and cp * dp // r > 1)
    if tp * cp * (dp // in_node) > gpus_per_node or cp * dp // in_node == 1:  # no shard group > 1 rank in a node
        in_node = min(divisors(dp), key=lambda r: (round(abs(math.log(2 * r * r / (cp * dp))), 9), r))
    # one replica (r = 1) is the flat layout itself, which _zero_choices yields already
    return (in_node,) if in_node > 1 and cp * dp // in_node > 1 else ()


def _cp_methods(model_config: Any, tp: int, cp: int) -> tuple[str, ...]:
    """The context-parallel methods the planner tries at (tp, cp): ``"ring"`` alone without cp, else all of
    :data:`~lightning_4d.config.CONTEXT_PARALLEL_METHODS` but ``"alltoall"`` where the heads do not split over tp·cp
    (:func:`~lightning_4d.features.context_parallel.alltoall_heads` refuses)."""
    return _cp_methods_of(model_config.num_heads, model_config.num_kv_heads, tp, cp)


@functools.lru_cache(maxsize=4096)
def _cp_methods_of(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> tuple[str, ...]:
    """:func:`_cp_methods` by head counts (asked once per layout shape: the planner's inner loop)."""
    if cp == 1:
        return ("ring",)
    try:
        alltoall_heads(num_heads, num_kv_heads, tp, cp)
    except ValueError:
        return tuple(m for m in CONTEXT_PARALLEL_METHODS if m != "alltoall")
    return CONTEXT_PARALLEL_METHODS


@functools.lru_cache(maxsize=64)
def _compile_accepted(activation_checkpointing: str) -> bool:
    """Whether ``compile=True`` goes with the checkpointing mode (:func:`~lightning_4d.config.check_compile`, asked
    once)."""
    try:
        check_compile(True, activation_checkpointing)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _zero_accepted(ep: int, zero_stage: int) -> bool:
    """Whether ``ParallelConfig`` takes ep ``ep`` with ``zero_stage`` (its own rule, asked once)."""
    try:
        ParallelConfig(**moe.layout_fields(ep), zero_stage=zero_stage)
    except ValueError:
        return False
    return True


def _pipeline_accepted(model_config: Any, pp: int) -> bool:
    """Whether ``validate_model`` takes ``pp`` for ``model_config`` (an MoE model: pp may be refused for it) with the
    planner's layer split."""
    if pp == 1:
        return True
    try:
        ParallelConfig(
            pipeline_parallel_size=pp, pipeline_layer_split=propose_layer_split(model_config.num_layers, pp)
        ).validate_model(model_config)
    except ValueError:
        return False
    return True


def enumerate_layouts(job: Job, search: Search = Search()) -> Iterator[tuple[ParallelConfig, int, int]]:
    """Every valid ``(parallel_config, micro_batch_size, num_microbatches)`` of ``job`` (its ``gpu`` and
    ``precision`` not read) among those ``search`` asks for (see the module docstring and
    :class:`~lightning_4d.planning.workload.Search`)."""
    for layout in _layouts(job, search):
        yield layout.parallel_config(), layout.micro_batch_size, layout.num_microbatches


def plan(
    job: Job,
    search: Search = Search(),
    *,
    budget: float = 0.8,
    formula: str = "lightning_4d",
    top: Optional[int] = 20,
    include_unfit: bool = False,
    max_estimated: Optional[int] = None,
    estimate_kw: Optional[dict[str, Any]] = None,
) -> list[Candidate]:
    """The layouts of a job that fit ``budget · gpu.memory``, fastest predicted first. When none fits, the layouts
    with ``optimizer_offload=True`` that do (:func:`_with_optimizer_offload`), each with the host memory per node it
    needs (``Candidate.host_memory``).

    Args:
        job: the model, the GPUs (count, per node, kind: :data:`~lightning_4d.planning.hardware.GPU_PRESETS` or a custom
            :class:`GpuSpec`), the sequence length, the global batch and the precision
            (:class:`~lightning_4d.planning.workload.Job`).
        search: which layouts to consider (:class:`~lightning_4d.planning.workload.Search`: a fixed micro-batch size,
            fixed sizes, ``Search(fixed={"tp": 8, "pp": 16})`` only those layouts; the tp ring overlap: also the
            layouts with it on, tp > 1 with sp, checkpointing none or full, off by default as the strategy's option,
            not yet measured faster on a GPU; ``compile``: the layouts of
            ``FourDStrategy(compile=True)``, checkpointing none or full, their step predicted with compiled decoder
            layers, :data:`~lightning_4d.planning.step_time.POINTWISE_FACTOR`).
        budget: the fraction of ``job.gpu.memory`` a layout may use.
        formula: ``"lightning_4d"`` (:func:`~lightning_4d.planning.model.estimate_memory`) or ``"fujii2024"`` (the
            paper's estimator: ZeRO stage 1 is its distributed optimizer, stage 0 without it; stages 2-3,
            checkpointing, ZBV and the allgather and alltoall cp methods are not modelled by it, so those layouts
            are skipped).
        top: how many to return (None: all, every layout's memory is then estimated: seconds on large jobs).
        include_unfit: keep layouts that do not fit (ranked after those that do; estimates every layout).
        max_estimated: estimate the memory of at most this many layouts, the fastest predicted (for a plot of a
            large job: its ~10^5 layouts take minutes to estimate).
        estimate_kw: more keyword arguments of :func:`~lightning_4d.planning.model.estimate_memory` (``device_type``,
            ``overhead``, ``gpu_name``).

    Raises:
        ValueError: non-positive sizes, ``num_gpus`` not a multiple of ``gpus_per_node`` (when above it), no
            ``job.gpu``, an unknown formula (or ``"fujii2024"`` for a Mixture-of-Experts model), a budget outside
            (0, 1], a ``top`` below 1, an unknown key in ``fixed``, fixed sizes the model or the job cannot take, no
            valid layout at all (the message says why).
    """
    _check_job(job, search.fixed, budget, formula, top)
    timed = _timed_layouts(job, search, formula)
    memory_of = _MemoryOf.of_plan(job, budget, formula, include_unfit, estimate_kw)
    context = document_attention_context(job.seq_length, job.document_tokens) if job.document_tokens else None
    flops = job.model.flops_per_token(job.seq_length, context)  # with document masking, the documents' attention
    candidate = functools.partial(_candidate, job=job, model_flops_per_token=flops)
    out = _fastest_that_fit(timed, memory_of, candidate, top, max_estimated)
    if formula == "lightning_4d" and not any(c.fits for c in out):
        host_limit = None if job.host_memory is None else budget * job.host_memory
        out = _with_optimizer_offload(job, timed, memory_of, candidate, (top, max_estimated), host_limit) or out
    out.sort(key=lambda c: (not c.fits, c.step_time, _RECOMPUTATION[c.activation_checkpointing], c.memory))
    return out[:top] if top else out


def _step_time_kw(job: Job) -> dict[str, Any]:
    """The keyword arguments of :func:`~lightning_4d.planning.step_time.step_time_parts` for ``job``'s layouts (its
    sequence, GPU and document masking's documents)."""
    return {
        "seq_length": job.seq_length,
        "gpu": job.gpu,
        "gpus_per_node": job.gpus_per_node,
        "document_tokens": job.document_tokens,
    }


def _with_optimizer_offload(
    job: Job,
    timed: list[tuple[float, int, Layout, tuple[float, ...]]],
    memory_of: "_MemoryOf",
    candidate: Callable[..., Candidate],
    limits: tuple[Optional[int], Optional[int]],
    host_limit: Optional[float],
) -> list[Candidate]:
    """The layouts of ``timed`` at ZeRO 1-3 with ``optimizer_offload=True`` (their step times predicted again: the
    host step and the host-link copies, :mod:`~lightning_4d.planning.optimizer_offload_costs`) that fit, fastest
    first, each with the host memory per node it needs (``host_memory``, :attr:`MemoryEstimate.host_per_node` with
    ``job.gpus_per_node`` ranks), those over ``host_limit`` bytes dropped; ``limits``: ``(top, max_estimated)``
    of :func:`plan`. Proposed only when no layout fits without it (:func:`plan`): it is slower."""
    dims, kw = model_dims(job.model), _step_time_kw(job)
    offloaded = []
    for _, recomputation, lay, _ in timed:
        if lay.zero_stage >= 1:
            lay = replace(lay, optimizer_offload=True)
            parts = step_time_parts(dims, lay, **kw)
            offloaded.append((StepTime(*parts).total, recomputation, lay, parts))
    offloaded.sort(key=lambda t: (t[0], t[1]))
    out = []
    for c in _fastest_that_fit(offloaded, memory_of, candidate, *limits):
        work = job.workload(c.micro_batch_size, c.num_microbatches)
        pc = c.parallel_config()
        host = estimate_memory(work, pc, ranks_per_node=job.gpus_per_node, **memory_of.estimate_kw).host_per_node
        if host_limit is None or host <= host_limit:
            out.append(replace(c, host_memory=host))
    return out


def _check_job(job: Job, fixed: Optional[dict[str, int]], budget: float, formula: str, top: Optional[int]) -> None:
    """Check :func:`plan`'s arguments, and that the sizes in ``fixed`` suit the model and the job on their own.

    Raises:
        ValueError: see :func:`plan` (all but "no valid layout").
    """
    model_config, num_gpus, gpus_per_node = job.model, job.num_gpus, job.gpus_per_node
    seq_length, global_batch_size = job.seq_length, job.global_batch_size
    unknown = set(fixed or {}) - set(FIXED_KEYS)
    if unknown:
        raise ValueError(f"fixed={fixed!r}: unknown keys {sorted(unknown)}; valid: {', '.join(FIXED_KEYS)}.")
    check_positive_int("num_gpus", num_gpus)
    check_positive_int("gpus_per_node", gpus_per_node)
    check_positive_int("seq_length", seq_length)
    check_positive_int("global_batch_size", global_batch_size)
    if top is not None:
        check_positive_int("top", top)
    if not 0 < budget <= 1:
        raise ValueError(f"budget={budget!r} is not valid: expected a fraction in (0, 1], e.g. 0.8.")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of gpus_per_node={gpus_per_node}.")
    if formula not in ("lightning_4d", "fujii2024"):
        raise ValueError(f"formula={formula!r} is not valid: expected 'lightning_4d' or 'fujii2024'.")
    if job.gpu is None:
        raise ValueError("job.gpu is None: plan needs the GPU kind (a GpuSpec, e.g. GPU_PRESETS['H100-80GB']).")
    if formula == "fujii2024":
        check_dense(model_config)
    if fixed:  # the sizes asked for must suit the model and the job on their own (the message says why not)
        pinned = ParallelConfig(
            tensor_parallel_size=fixed.get("tp", 1),
            pipeline_parallel_size=fixed.get("pp", 1),
            context_parallel_size=fixed.get("cp", 1),
            data_parallel_size=fixed.get("dp", 1),
            **moe.layout_fields(fixed.get("ep", 1)),
            pipeline_layer_split=propose_layer_split(model_config.num_layers, fixed["pp"])
            if fixed.get("pp", 1) > 1 and fixed["pp"] <= model_config.num_layers
            else None,
        )
        pinned.validate_model(model_config)
        pinned.validate_sequence(seq_length)
        product = pinned.tp * pinned.pp * pinned.cp * (pinned.dp if "dp" in fixed else 1)
        if num_gpus % product:
            raise ValueError(f"fixed sizes {fixed} do not divide num_gpus={num_gpus}.")
        if "ep" in fixed:
            moe_costs.check_job_ep(model_config, pinned.ep, num_gpus, pinned.pp)


def _timed_layouts(job: Job, search: Search, formula: str) -> list[tuple[float, int, Layout, tuple[float, ...]]]:
    """``(predicted step seconds, recomputation rank, layout, step time parts)`` of every layout of the job the
    formula models, fastest first (at equal times, the one that recomputes less); the parts are
    :class:`~lightning_4d.planning.step_time.StepTime`'s fields
    (:func:`~lightning_4d.planning.step_time.step_time_parts`).

    Raises:
        ValueError: no valid layout at all (the message says what a layout needs).
    """
    dims, kw, seq_length, gpus_per_node = model_dims(job.model), _step_time_kw(job), job.seq_length, job.gpus_per_node
    timed: list[tuple[float, int, Layout, tuple[float, ...]]] = []
    # the paper's formula models Megatron's plain TP: no overlapped layouts for it
    for lay in _layouts(job, search if formula == "lightning_4d" else without_rings(search)):
        if formula == "fujii2024" and (
            lay.zero_stage > 1
            or lay.activation_checkpointing != "none"
            or lay.pipeline_schedule == "zbv"
            or lay.context_parallel_method != "ring"
            or not lay.sequence_parallel
            or lay.data_parallel_replicate_size > 1
        ):
            continue
        parts = step_time_parts(dims, lay, **kw)
        compute, recompute, bubble, t_tp, t_cp, t_pp, t_dp, t_opt, t_ep = parts
        total = compute + recompute + bubble + t_tp + t_cp + t_pp + t_dp + t_ep + t_opt  # StepTime.total's order
        timed.append((total, _RECOMPUTATION[lay.activation_checkpointing], lay, parts))
    if not timed:
        raise ValueError(
            f"no valid layout of {job.num_gpus} GPUs ({gpus_per_node} per node) for this model with "
            f"seq_length={seq_length} and global_batch_size={job.global_batch_size}"
            + (f" and {search.fixed}" if search.fixed else "")
            + ": the global batch must be a multiple of dp, tp must "
            "divide the heads, kv heads, FFN size and vocabulary, the sequence 2·cp (and tp under sp), "
            + moe.PLAN_NEEDS
            + "."
        )
    timed.sort(key=lambda t: (t[0], t[1]))
    return timed


@dataclass
class _MemoryOf:
    """Bytes per GPU of a layout for :func:`plan`: the paper's estimate (``formula="fujii2024"``), or ours on the pp
    rank that needs the most. Ours visits rank 0 and the rank that needed the most on the last kept layout of the same
    pipeline shape (pp, schedule, v) first, and stops at the first rank over ``limit`` (unless ``include_unfit``):
    such a layout is dropped, so the rest need no estimate. A rank whose resident model states alone are over
    ``limit`` (:func:`~lightning_4d.planning.model.resident_state_bytes`, a lower bound of its estimate) is over it
    without a full estimate."""

    job: Job
    formula: str
    limit: float
    include_unfit: bool
    estimate_kw: dict[str, Any]
    worst_rank: dict[tuple, int] = field(default_factory=dict)  # per (pp, schedule, v), of the last kept layout

    @classmethod
    def of_plan(
        cls, job: Job, budget: float, formula: str, include_unfit: bool, estimate_kw: Optional[dict[str, Any]]
    ) -> "_MemoryOf":
        """The memory side of :func:`plan`, from its arguments: the limit is ``budget · job.gpu.memory`` bytes, our
        estimates are made for ``job.gpu`` (its ``gpu_name``) with the further ``estimate_kw``."""
        kw = {"gpu_name": job.gpu.name, **(estimate_kw or {})}
        return cls(job, formula, budget * job.gpu.memory, include_unfit, kw)

    def __call__(self, pc: ParallelConfig, b: int, m: int) -> float:
        if self.formula == "fujii2024":
            return fujii2024_of_layout(self.job.model, pc, self.job.seq_length, b, m).total
        hint = (pc.pp, pc.pipeline_schedule, pc.v)
        work = self.job.workload(b, m)
        est = None
        for r in dict.fromkeys((0, self.worst_rank.get(hint, 0), *range(pc.pp))):
            floor = resident_state_bytes(work, pc, r)
            if floor > self.limit and not self.include_unfit:
                return floor  # does not fit: its resident states alone are over the limit
            one = estimate_memory(work, pc, pp_rank=r, **self.estimate_kw)
            if est is None or (one.total, -r) > (est.total, -est.pp_rank):
                est = one
            if one.total > self.limit and not self.include_unfit:
                break
        if est.total <= self.limit or self.include_unfit:
            self.worst_rank[hint] = est.pp_rank
        return est.total


def _fastest_that_fit(
    timed: list[tuple[float, int, Layout, tuple[float, ...]]],
    memory_of: _MemoryOf,
    candidate: Callable[..., Candidate],
    top: Optional[int],
    max_estimated: Optional[int],
) -> list[Candidate]:
    """The candidates of ``timed`` (fastest first) that fit (all of them with ``include_unfit``) and that no other
    dominates (:func:`_dominated`), estimating memory only while a layout could still be among the ``top``
    fastest that fit, and for at most ``max_estimated`` layouts."""
    include_unfit = memory_of.include_unfit
    out: list[Candidate] = []
    fitting = 0
    for visited, (total, _, lay, parts) in enumerate(timed):
        if top and not include_unfit and fitting >= top and total > out[-1].step_time:
            break  # every later layout is slower than the last one kept
        if max_estimated is not None and visited >= max_estimated:
            break
        pc, b, m = lay.parallel_config(), lay.micro_batch_size, lay.num_microbatches
        memory = memory_of(pc, b, m)
        fits = memory <= memory_of.limit
        if not fits and not include_unfit:
            continue
        cand = candidate(pc, b, m, StepTime(*parts), memory, fits=fits)
        if _dominated(cand, out):
            continue
        out = [c for c in out if not _dominated(c, [cand])]
        out.append(cand)
        fitting = sum(c.fits for c in out)
    return out


def _candidate(
    pc: ParallelConfig, b: int, m: int, st: StepTime, memory: float, fits: bool, job: Job, model_flops_per_token: float
) -> Candidate:
    """The :class:`Candidate` of layout ``pc`` with micro-batch size b and m micro-batches of ``job``, predicted to
    take ``st`` and ``memory`` bytes per GPU (``model_flops_per_token``: ``job.model``'s at ``job.seq_length``)."""
    gpu, num_gpus = job.gpu, job.num_gpus
    total = st.total
    tokens = job.global_batch_size * job.seq_length / total
    return Candidate(
        **plan_values(pc, b, m),
        memory=int(memory),
        fraction=memory / gpu.memory,
        fits=fits,
        step_time=total,
        tokens_per_sec=tokens,
        mfu=model_flops_per_token * tokens / (num_gpus * gpu.peak_flops),
        bubble_fraction=st.bubble / total,
        communication_fraction=st.exposed_communication / total,
        recompute_fraction=st.recompute / total,
    )


def _dominated(c: Candidate, others: list[Candidate]) -> bool:
    """``c`` is dominated when another candidate of the same parallel sizes (ep included) and micro-batch size (any
    ZeRO stage, checkpointing, schedule, sp, cp method) is predicted no slower, needs no more memory, fits if ``c``
    does, and is strictly better in one of time, memory or recomputation, or equal in all three with a lower ZeRO
    stage (it communicates less than the model's overlap assumptions show)."""
    key = (c.tp, c.pp, c.cp, c.dp, c.ep, c.micro_batch_size)
    rank = _RECOMPUTATION[c.activation_checkpointing]
    for o in others:
        if o is c or (o.tp, o.pp, o.cp, o.dp, o.ep, o.micro_batch_size) != key:
            continue
        if (
            o.step_time <= c.step_time
            and o.memory <= c.memory
            and (o.fits or not c.fits)
            and (
                o.step_time < c.step_time
                or o.memory < c.memory
                or _RECOMPUTATION[o.activation_checkpointing] < rank
                or (_RECOMPUTATION[o.activation_checkpointing] == rank and o.zero_stage < c.zero_stage)
            )
        ):
            return True
    return False


def format_size(n: float) -> str:
    """``n`` bytes as GiB (2^30), or MiB (2^20) below 1 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def suggestion_line(parallel_config: Any, micro_batch_size: int) -> str:
    """A ``FourDStrategy(...)`` call with the layout's arguments (:func:`lightning_4d.layout.strategy_arguments`,
    concise: every dimension that applies to it, without the values its defaults give), followed by a comment naming
    the micro-batch size it assumes (and at pp = 1 the accumulated micro-batches, ``num_microbatches`` > 1): a line
    that can be pasted as it is."""
    args = ", ".join(f"{k}={v!r}" for k, v in strategy_arguments(parallel_config, concise=True).items())
    m = accumulated_batches(parallel_config)
    accumulate = f" and accumulate_grad_batches={m}" if m > 1 else ""
    return f"FourDStrategy({args})  # with micro_batch_size={micro_batch_size}{accumulate}"


def accumulated_batches(parallel_config: Any) -> int:
    """The micro-batches a layout accumulates per optimizer step: its ``num_microbatches`` at pp = 1, else 1 (a
    pipeline's micro-batches are the schedule's)."""
    return (parallel_config.num_microbatches or 1) if parallel_config.pp == 1 else 1


def fitting_layout_lines(layouts: list[tuple[str, float]], world_size: int) -> list[str]:
    """The lines that name the layouts that fit, given as ``(suggestion_line, estimated peak in bytes)`` of
    :func:`suggest_layouts`' pairs, or what to do when none does: the end of ``MemoryBudgetExceeded``'s message and
    of ``lightning-4d estimate`` on a layout that does not fit."""
    if not layouts:
        return [
            "No layout of this world size fits with this micro-batch size and sequence length: use more GPUs, a "
            "smaller micro_batch_size or a shorter seq_length (try `lightning-4d plan`)."
        ]
    return [f"Layouts of the same {world_size} GPUs that fit (fastest predicted first):"] + [
        f"  {line}: {format_size(total)}" for line, total in layouts
    ]


def suggest_layouts(
    workload: Workload,
    world_size: int,
    device_memory: int,
    budget: float,
    gpus_per_node: Optional[int] = None,
    count: int = 3,
    global_batch_size: Optional[int] = None,
    **estimate_kw: Any,
) -> list[tuple[ParallelConfig, MemoryEstimate]]:
    """Up to ``count`` layouts of ``world_size`` GPUs that fit, with the same micro-batch size and sequence length as
    ``workload`` (its model, precision and ``fused_optimizer`` too), fastest predicted first (for
    :class:`MemoryBudgetExceeded`). ``global_batch_size`` (sequences per optimizer step; default one micro-batch per
    GPU) is the job's: each layout runs it as ``global_batch_size / (b·dp)`` micro-batches, pipelined or, at pp = 1,
    accumulated (the layout's ``num_microbatches``; their float32 gradients are alive beside the next micro-batch's
    activations), and is estimated with them."""
    from lightning_4d.planning.hardware import gpu_spec

    b = workload.micro_batch_size
    gpu = gpu_spec(device_memory)
    per_node = gpus_per_node or min(world_size, 8)
    job = workload.job(world_size, per_node, global_batch_size or b * world_size, gpu)
    found = []
    for cand in plan(job, Search(micro_batch_size=b), budget=budget, top=count, estimate_kw=estimate_kw):
        pc = cand.parallel_config()
        accumulated = cand.num_microbatches if cand.pp == 1 and cand.num_microbatches > 1 else None
        if accumulated:
            pc = replace(pc, num_microbatches=accumulated)
        found.append((pc, estimate_memory(replace(workload, num_microbatches=accumulated), pc, **estimate_kw)))
        if len(found) == count:
            break
    return found
