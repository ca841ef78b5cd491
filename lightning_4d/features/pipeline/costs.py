"""Pipeline parallelism in the memory model (:mod:`lightning_4d.planning.model`'s docstring, **Pipeline
parallelism**): how many micro-batches' activations each pipeline stage of a pp rank holds at its peak under each
schedule (:func:`in_flight`; ZBV and DualPipeV from their action lists, :func:`zbv_peak`), what a zero-bubble
schedule keeps for its weight pass (:func:`weight_pass_inputs`), the activation side of a pp rank's peak
(:func:`activation_terms`) and ``PipelineStage``'s receive buffers (:func:`receive_buffer_bytes`).

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lightning_4d.config import ParallelConfig
from lightning_4d.features.pipeline import ZERO_BUBBLE_SCHEDULES
from lightning_4d.partition import loss_chunk_tokens
from lightning_4d.planning import offload_costs
from lightning_4d.planning.activations import kept_layer_backward, layer_input_grad_only, saved_per_layer
from lightning_4d.planning.params import rank_layout
from lightning_4d.planning.tensors import Dtypes
from lightning_4d.planning.workload import Workload

__all__ = [
    "Activations",
    "action_states",
    "activation_terms",
    "dualpipev_actions",
    "in_flight",
    "receive_buffer_bytes",
    "weight_pass_inputs",
    "zbv_actions",
    "zbv_peak",
]


def in_flight(pc: ParallelConfig, pp_rank: int, m: int) -> list[int]:
    """Micro-batches whose activations pp rank ``pp_rank`` holds at its peak, per pipeline stage it holds (the order
    of :meth:`~lightning_4d.config.ParallelConfig.rank_stages`), for the schedules of ``torch.distributed.pipelining``
    (counts read off their action lists for rank r of p, stages per rank v, m micro-batches):

    - GPipe: all m forwards before the first backward: ``m``;
    - 1F1B: ``p - r - 1`` warm-up forwards, then one forward and one backward at a time: ``min(m, p - r)``
      (Narayanan et al. 2021, PipeDream-Flush, arXiv 2006.09503);
    - interleaved 1F1B: ``w = min(m·v, (v-1)·n + 2(p-1-r) + 1)`` forwards in flight (warm-up of
      ``_get_warmup_ops`` + 1; n = micro-batches per round = m // max(1, m // p)), handed out to the rank's
      stages in rounds of n (Narayanan et al. 2021, Megatron-LM, arXiv 2104.04473, §2.2);
    - ZBV zero-bubble and DualPipeV: see :func:`zbv_peak` (which also counts what stays alive after each weight
      pass; each schedule's own action list); the counts returned here are those at that peak.
    """
    p, r, v = pc.pp, pp_rank, len(pc.stage_indices(pp_rank)) if pc.pp > 1 else 1
    if p == 1:
        return [1]
    name = pc.pipeline_schedule
    if name == "gpipe":
        return [m] * v
    if name == "1f1b":
        return [min(m, p - r)] * v
    if name == "interleaved_1f1b":
        per_round = m // max(1, m // p)
        warm = min(m * v, (v - 1) * per_round + 2 * (p - 1 - r) + 1)
        counts = [0] * v
        for step in range(warm):
            counts[(step // per_round) % v] += 1
        return [min(m, c) for c in counts]
    return list(zbv_peak(p, r, m, (1.0, 1.0), schedule=name)[1])  # zbv, dualpipev: (stage r, stage 2p-1-r)


@functools.lru_cache(maxsize=65536)
def zbv_peak(
    p: int,
    r: int,
    m: int,
    sizes: tuple[float, float],
    retained: tuple[float, float] = (0.0, 0.0),
    schedule: str = "zbv",
    input_pass_of: Optional[int] = None,
) -> tuple[float, tuple[int, int]]:
    """Peak of ``held[0]·sizes[0] + held[1]·sizes[1] + done[0]·retained[0] + done[1]·retained[1]`` over
    ``ScheduleZBVZeroBubble``'s (``schedule="zbv"``) or ``ScheduleDualPipeV``'s (``"dualpipev"``:
    :func:`dualpipev_actions`) action list for rank r, with ``held[i]`` the micro-batches forwarded through the
    rank's stage i (stage r, then stage 2p-1-r) whose weight gradient (W) has not run yet and ``done[i]`` those whose
    W has run; returns (peak, held at the peak). ``input_pass_of``: only the states in which an input pass of that
    chunk runs (0 or 1; :func:`action_states`).

    ``retained[i]``: bytes of one micro-batch that stay alive after its W until the end of the step. Measured
    (torch 2.13, ``saved_tensors_hooks``): the input-gradient pass (I, ``stage_backward_input``) runs with
    ``retain_graph=True`` and the weight pass frees only the nodes it traverses, so what only the input gradient
    needs (the norms' inputs and rsqrt, the rotary tables, attention's q/k/v/output/log-sum-exp, the loss' saved
    logits, log-sum-exp and labels) is held to the end of the step on every stage whose input requires a gradient
    (all but stage 0).

    The list is the schedule's (``torch.distributed.pipelining``): warm-up ``2(p-r)-1`` F of stage 0, ``r`` pairs
    (F stage 1, F stage 0), ``p-r`` triples (F, I, W of stage 1); steady pairs (F stage 0 while micro-batches remain;
    I, W stage 0; F, I, W stage 1); cool-down (I of both, then I, W of stage 0, then the remaining W), with the
    schedule's micro-batch count ``max(2p-1, m)`` and actions on indices >= m dropped.
    """
    states = _zbv_state_array(p, r, m, schedule, input_pass_of)
    if not len(states):
        return 0.0, (0, 0)
    # the same products and left-to-right sums as a Python loop would do (bit-identical), the first maximum
    values = states[:, 0] * sizes[0] + states[:, 1] * sizes[1] + states[:, 2] * retained[0] + states[:, 3] * retained[1]
    i = int(np.argmax(values))
    if values[i] <= 0:
        return 0.0, (0, 0)
    return float(values[i]), (int(states[i, 0]), int(states[i, 1]))


@functools.lru_cache(maxsize=4096)
def _zbv_state_array(p: int, r: int, m: int, schedule: str = "zbv", input_pass_of: Optional[int] = None) -> np.ndarray:
    """:func:`action_states` of the schedule's action list (:func:`zbv_actions`, :func:`dualpipev_actions`) as a
    float64 ``[n, 4]`` array (exact: the counts are small integers)."""
    actions = zbv_actions(p, r, m) if schedule == "zbv" else dualpipev_actions(p, r, m)
    return np.asarray(action_states(actions, input_pass_of), dtype=np.float64).reshape(-1, 4)


def action_states(
    actions: tuple[tuple[int, str], ...], input_pass_of: Optional[int] = None
) -> tuple[tuple[int, int, int, int], ...]:
    """The distinct ``(held[0], held[1], done[0], done[1])`` after each of ``actions`` (``(chunk, kind)``, chunk 0
    the rank's first stage, 1 its second; kind ``F`` forward, ``I`` input gradient (frees nothing: it runs with
    ``retain_graph=True``), ``W`` weight gradient (the micro-batch leaves ``held`` for ``done``: what only the
    input gradient needed stays, :func:`zbv_peak`), ``B`` full backward (frees the micro-batch's graph)), in order
    of first appearance. With ``input_pass_of`` (a chunk): only the states in which an input pass of that chunk
    runs."""
    held, done = [0, 0], [0, 0]
    states: dict[tuple[int, int, int, int], None] = {}
    for chunk, kind in actions:
        if kind == "F":
            held[chunk] += 1
        elif kind in ("W", "B"):
            held[chunk] -= 1
            done[chunk] += kind == "W"
        if input_pass_of is None or (kind == "I" and chunk == input_pass_of):
            states[(held[0], held[1], done[0], done[1])] = None
    return tuple(states)


@functools.lru_cache(maxsize=4096)
def dualpipev_actions(p: int, r: int, m: int) -> tuple[tuple[int, str], ...]:
    """``ScheduleDualPipeV``'s actions for rank r of p with m micro-batches (torch.distributed.pipelining, after
    DeepSeek's DualPipeV; ``tests/test_memory_model.py`` checks this list against torch's), as ``(chunk, kind)``
    (:func:`action_states`): an overlapped forward + backward pair is its forward, then its full backward.

    Steps (chunk 0: stage r, chunk 1: stage 2p-1-r): ``2(p-r-1)`` F0; ``r+1`` (F0, F1); ``p-r-1`` (I1, W of the
    oldest pending input pass, F1); ``m-2p+r+1`` (F0 B1, F1 B0), the first pair of the last rank not overlapped;
    ``p-r-1`` (B1, F1 B0); ``r+1`` (x1, x0) with x = B for the first half and I from the middle on (odd ranks switch
    before x1, even ranks after it); ``p-r-1`` (W pending, x0); ``r+1`` W pending.
    """
    actions: list[tuple[int, str]] = []
    pending: list[int] = []  # chunks of input passes whose weight pass has not run, oldest first

    def add(chunk: int, kind: str) -> None:
        actions.append((chunk, kind))
        if kind == "I":
            pending.append(chunk)

    def weight() -> None:
        if pending:
            actions.append((pending.pop(0), "W"))

    for _ in range(2 * (p - r - 1)):
        add(0, "F")
    for _ in range(r + 1):
        add(0, "F")
        add(1, "F")
    for _ in range(p - r - 1):
        add(1, "I")
        weight()
        add(1, "F")
    for _ in range(m - 2 * p + r + 1):
        add(0, "F")
        add(1, "B")
        add(1, "F")
        add(0, "B")
    for _ in range(p - r - 1):
        add(1, "B")
        add(1, "F")
        add(0, "B")
    zero_bubble = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        add(1, "I" if zero_bubble else "B")
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        add(0, "I" if zero_bubble else "B")
    for _ in range(p - r - 1):
        weight()
        add(0, "I" if zero_bubble else "B")
    for _ in range(r + 1):
        weight()
    return tuple(actions)


@functools.lru_cache(maxsize=4096)
def zbv_actions(p: int, r: int, m: int) -> tuple[tuple[int, str], ...]:
    """``ScheduleZBVZeroBubble``'s actions for rank r of p with m micro-batches (torch.distributed.pipelining;
    ``tests/test_memory_model.py`` checks this list against torch's), as ``(chunk, kind)`` (:func:`action_states`;
    chunk 0: stage r, chunk 1: stage 2p-1-r).

    With ``n = max(2p-1, m)`` micro-batches scheduled and every action on a micro-batch index >= m dropped: warm-up
    ``2(p-r)-1`` F0, ``r`` (F1, F0), ``p-r`` (F1, I1, W1); steady (F0 while fewer than n, I0, W0, F1, I1, W1) while
    F1 trails F0 or F0 < n; cool-down ``r`` (I0, I1), ``p-r`` (I0, W0), then the remaining W1, then the remaining W0.
    """
    n = max(2 * p - 1, m)
    counts: dict[tuple[int, str], int] = {}
    actions: list[tuple[int, str]] = []

    def act(chunk: int, *kinds: str) -> None:  # the kinds in order, on one chunk
        for kind in kinds:
            index = counts.get((chunk, kind), 0)
            counts[(chunk, kind)] = index + 1
            if index < m:
                actions.append((chunk, kind))

    def count(chunk: int, kind: str) -> int:
        return counts.get((chunk, kind), 0)

    for _ in range(2 * (p - r) - 1):
        act(0, "F")
    for _ in range(r):
        act(1, "F")
        act(0, "F")
    for _ in range(p - r):
        act(1, "F", "I", "W")
    while count(1, "F") < count(0, "F") or count(0, "F") < n:
        if count(0, "F") < n:
            act(0, "F")
        act(0, "I", "W")
        act(1, "F", "I", "W")
    for _ in range(r):
        act(0, "I")
        act(1, "I")
    for _ in range(p - r):
        act(0, "I", "W")
    while count(1, "W") < count(1, "I"):
        act(1, "W")
    while count(0, "W") < count(0, "I"):
        act(0, "W")
    return tuple(actions)


def weight_pass_inputs(cfg: Any, dt: Dtypes, b: int, s: int, tp: int, sp: bool, layers: int, last: bool) -> int:
    """Bytes one micro-batch's input-gradient pass (``stage_backward_input``) of a zero-bubble schedule (ZBV,
    DualPipeV) captures for its weight pass (``stage_backward_weight``): torch.distributed.pipelining keeps the
    gradient of the output of every node through which a parameter's gradient flows, from the input pass to the weight
    pass (``_backward.py``: ``param_groups``' ``grads``). Per layer (``s`` this rank's sequence length): the outputs
    of ``wq``/``wk``/``wv`` and ``w1``/``w3`` (c·b·s·((a + 2k)·d + 2f)/t), of ``wo`` and ``w2`` (their partial sums,
    c·b·s·h each) and of both RMSNorms (r·b·s'·h each); on the last stage also the final norm's and the head's
    (the logits' gradient, c·b·s·V/t). Measured (CPU, ``LiveTensorBytes``, the ``small`` preset pp2 ZBV b=2 s=1024
    ``bf16-mixed``): the peak is in the last stage's input pass, 23.3 MB above the estimate without this term, which
    counts 26.0 MB there. The first stage (its input needs no gradient) runs a full backward: 0 there. An MoE layer
    is counted as a dense one (what its feed-forward captures is not modelled)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    c, r = dt.compute, dt.residual
    s_sp = s // tp if sp else s
    per_layer = c * b * s * ((a + 2 * k) * d + 2 * (f // tp)) + 2 * c * b * s * h + 2 * r * b * s_sp * h
    head = r * b * s_sp * h + c * b * s * (cfg.padded_vocab_size // tp) if last else 0
    return layers * per_layer + head


@dataclass(frozen=True)
class Activations:
    """The activation side of one pp rank's peak (bytes, except ``in_flight``)."""

    activations: int  # saved for backward at the schedule's peak (+ rope without pp, + one recompute set)
    logits: int  # the loss's backward working set beyond its saved tensors
    compute_weights: int  # autocast's weight copies, one per in-flight micro-batch under pp
    in_flight: float  # micro-batches in flight, averaged over the rank's layers
    loss_freed: int = 0  # what the loss' backward frees of its saved tensors (all but the labels), last stage
    logits_gradient: int = 0  # the logits' gradient in the compute dtype, last stage
    recompute: int = 0  # one layer's recomputed (or offloaded, brought back) set, made only in its backward
    offloaded: int = 0  # host memory: the saved tensors of the offloaded layers' in-flight micro-batches
    head_freed: int = 0  # last stage, offloaded whole or checkpointed: the head's saved tensors, freed by its backward
    #: activation offload's prefetch (``parallel/offload.py``): the moments that can make the peak, ``(bytes beyond
    #: the activations after the loss, layers done)`` (:func:`lightning_4d.planning.offload_costs.prefetch_moments`)
    prefetch: tuple[tuple[int, int], ...] = ()
    #: zero-bubble schedules: the saved tensors alive during an input pass (its largest) + the output gradients it
    #: keeps for its weight pass (:func:`weight_pass_inputs`) + one recomputed set
    input_pass: int = 0
    #: the last stage: what the head and the loss save (one micro-batch), not made yet while the decoder layers run
    #: their forward
    forward_tail: int = 0
    #: pp > 1 (GPipe, 1F1B, interleaved): the saved tensors of the other micro-batches in flight when the rank's first
    #: backward ends (:func:`held_at_backward_end`)
    backward_end_held: int = 0


def activation_terms(
    work: Workload, pc: ParallelConfig, dt: Dtypes, pp_rank: int, saved: dict[str, int]
) -> Activations:
    """Activations of pp rank ``pp_rank`` at its peak for ``work`` (its model a config, its ``num_microbatches``
    given): every pipeline stage of the rank holds its in-flight
    micro-batches' saved tensors (:func:`in_flight`, :func:`zbv_peak`), the embedding's with the first stage, the
    head's and the loss's with the last (:mod:`lightning_4d.planning.model`'s docstring, **Activations** and
    **Pipeline parallelism**); ``saved``: one micro-batch's, by part
    (:func:`lightning_4d.planning.activations.saved_bytes`)."""
    cfg, b, s, m = work.model, work.micro_batch_size, work.seq_length, work.num_microbatches
    stages = pc.rank_stages(cfg.num_layers, pp_rank)
    n_layers, _, last = rank_layout(cfg.num_layers, pc, pp_rank)
    counts = in_flight(pc, pp_rank, m)
    per_layer = saved_per_layer(saved, n_layers)
    # activation offload: the first ``activation_offload_layers`` of each stage hold their saved tensors in host
    # memory (parallel/offload.py), none on the device
    offloaded = [min(pc.activation_offload_layers, len(layers)) for _, layers in stages]
    sizes = _stage_sizes(pc, stages, offloaded, per_layer, saved)
    whole = offload_costs.offloaded_whole(cfg, pc, pp_rank)
    host = offload_costs.offloaded_per_stage(pc, stages, per_layer, saved["rope"])
    zero_bubble = pc.pp > 1 and pc.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
    retained: list[float] = []
    if zero_bubble:
        retained = _retained(work, pc, dt, list(zip(stages, offloaded)), n_layers, saved)
        peak, held = zbv_peak(
            pc.pp, pp_rank, m, (sizes[0], sizes[1]), (retained[0], retained[1]), schedule=pc.pipeline_schedule
        )
        host_bytes = sum(c * x for c, x in zip(held, host))
    else:
        peak = sum(c * size for c, size in zip(counts, sizes))
        host_bytes = sum(c * x for c, x in zip(counts, host))
    unpacked = offload_costs.unpacked_bytes(cfg, pc, dt, b, s) if whole else 0
    backward = kept_layer_backward(cfg, pc, dt, b, s)
    prefetch = tuple(offload_costs.prefetch_moments(stages, offloaded, int(per_layer), saved["rope"], backward))
    # a stage offloaded whole: its last layer's backward (node by node) beside the layer before it, prefetched
    prefetched = int(per_layer) + saved["rope"] if whole and any(len(r) >= 2 for _, r in stages) else 0
    recompute = saved["recompute"] + unpacked + prefetched
    activations = int(peak) + (saved["rope"] if pc.pp == 1 and not whole else 0) + recompute
    in_flight_mean = sum(c * len(layers) for c, (_, layers) in zip(counts, stages)) / max(1, n_layers)
    logits, loss_freed, gradient = _loss_terms(cfg, pc, dt, b, s, last, saved)
    compute_weights, head_freed = _weights_and_head(pc, saved, in_flight_mean, last, bool(unpacked))
    input_pass = 0
    if zero_bubble:
        input_pass = _input_pass(work, pc, dt, pp_rank, (sizes[0], sizes[1]), retained, recompute)
    return Activations(
        activations,
        logits,
        compute_weights,
        in_flight_mean,
        loss_freed,
        gradient,
        recompute,
        int(host_bytes),
        head_freed,
        prefetch,
        input_pass,
        saved["head"] + saved["loss"] if last else 0,
        held_at_backward_end(pc, pp_rank, m, sizes),
    )


def held_at_backward_end(pc: ParallelConfig, pp_rank: int, m: int, sizes: list[float]) -> int:
    """Bytes the other micro-batches hold when the first backward of pp rank ``pp_rank``'s first stage ends (``m``
    micro-batches; ``sizes``: one micro-batch's saved bytes per stage of the rank, the order of ``rank_stages``), under
    GPipe, 1F1B and interleaved 1F1B at ZeRO 0/1 (the gradient buckets exist from the first backward on); 0 without
    pp, at ZeRO 2/3 and on the zero-bubble schedules (their own action lists): not counted there.

    The end of that backward is the model's *backward end* moment: on the first stage the embedding's backward, its
    ``[V, h]`` partial gradient (:func:`lightning_4d.features.tensor_parallel.costs.embedding_gradient_bytes`), one
    fresh gradient and, at ZeRO 0/1, the last gradient bucket made. Under a pipeline it comes while later
    micro-batches' forwards are still saved: GPipe's and 1F1B's in-flight count less one (:func:`in_flight`);
    interleaved 1F1B: the schedule's order, read at the end of the first stage's first backward (see the code).
    Measured (CPU, ``LiveTensorBytes``, llama3.2-3b tp4 pp2 cp2 dp2 ZeRO 1 1F1B selective, s=4096, pp rank 0): the
    peak is the embedding's bucket (``aten.zeros [98,500,608]`` float32) made in micro-batch 0's backward beside the
    ``embedding_dense_backward`` output ``[128256, 3072]`` bf16, the reduced ``[32064, 3072]`` gradient and micro-batch
    1's saved tensors (its ``w1``/``w3`` outputs, attention outputs, ...), which the estimate left out before this
    term (the figures: docs/validation.md, "Measurements behind constants in the code")."""
    if pc.pp == 1 or pc.pipeline_schedule in ZERO_BUBBLE_SCHEDULES or pc.zero_stage >= 2:
        # ZeRO 2/3 (FSDP2 per stage chunk): the backward-end terms are those of the last micro-batch's backward, when
        # the gradients are reduce-scattered and nothing else is in flight; an earlier backward's end, with FSDP2
        # holding unsharded gradients beside the later micro-batches, is not modelled (not measured)
        return 0
    counts = in_flight(pc, pp_rank, m)
    if pc.pipeline_schedule != "interleaved_1f1b":
        return int(sum((c - 1) * size for c, size in zip(counts, sizes)))
    # interleaved: the schedule's order (w forwards, then one forward per backward; forward i on stage (i // n) % v,
    # backward j on stage v - 1 - (j // n) % v) read at the end of the first stage's first backward, after (v - 1)·n
    # backwards of the later stages. Measured: llama3.1-8b tp8 pp4 v2 m4 selective s=2048 rank 0 (memory_at_scale
    # row 4), 6.163 GiB; 6.155 estimated with this count (5.882 without the term, 6.519 with the peak less one
    # first-stage micro-batch)
    v, p = len(sizes), pc.pp
    per_round = m // max(1, m // p)
    warm = min(m * v, (v - 1) * per_round + 2 * (p - 1 - pp_rank) + 1)
    first_backward = (v - 1) * per_round
    alive = [0] * v
    for i in range(min(m * v, warm + first_backward)):
        alive[(i // per_round) % v] += 1
    for j in range(first_backward + 1):
        alive[v - 1 - (j // per_round) % v] -= 1
    return int(sum(max(0, a) * size for a, size in zip(alive, sizes)))


def _weights_and_head(
    pc: ParallelConfig, saved: dict[str, int], in_flight_mean: float, last: bool, unpacked: bool
) -> tuple[int, int]:
    """(autocast's weight copies of the in-flight micro-batches, the head's saved tensors its backward frees before
    any layer's offloaded or recomputed backward runs) of a pp rank (``last``: it holds the head)."""
    compute_weights = saved["compute_weights"]
    if pc.pp > 1:
        # autocast casts the weights again in every micro-batch's forward: one copy per in-flight micro-batch
        compute_weights = int(compute_weights * in_flight_mean)
    head_freed = saved["head"] if last and (unpacked or pc.activation_checkpointing != "none") else 0
    return compute_weights, head_freed


def _stage_sizes(
    pc: ParallelConfig, stages: list, offloaded: list[int], per_layer: float, saved: dict[str, int]
) -> list[float]:
    """One micro-batch's saved bytes on the device per stage of the rank (``stages``: ``rank_stages``): its layers
    but the ``offloaded`` ones, the embedding's with the first stage, the head's and the loss's with the last; under
    pp each stage's forward computes its own RoPE tables (kept unless the stage is offloaded whole)."""
    return [
        (len(layers) - o) * per_layer
        + (saved["embedding"] if st == 0 else 0)
        + (saved["head"] + saved["loss"] if st == pc.num_stages - 1 or pc.pp == 1 else 0)
        + (saved["rope"] if pc.pp > 1 and o < len(layers) else 0)
        for (st, layers), o in zip(stages, offloaded)
    ]


def _retained(
    work: Workload, pc: ParallelConfig, dt: Dtypes, held: list, n_layers: int, saved: dict[str, int]
) -> list[float]:
    """A zero-bubble schedule's bytes of one micro-batch that stay alive after its weight pass, to the end of the
    step, per stage of the rank (:func:`zbv_peak`): none on the first stage; elsewhere what only the input gradient
    needs of each device-held layer (:func:`lightning_4d.planning.activations.layer_input_grad_only`, with the gathered
    K/V), the RoPE tables and, on the last stage, the loss' saved logits, log-sum-exp and labels (no weight gradient
    passes through the loss; the final norm's saved tensors serve its weight gradient and are freed by the weight
    pass). ``held``: ``((stage, layers), layers offloaded)`` of each stage of the rank."""
    cfg, b, s = work.model, work.micro_batch_size, work.seq_length
    layer_kept = (
        0
        if pc.activation_checkpointing == "full"
        else (
            layer_input_grad_only(cfg, dt, b, s // pc.cp, pc.tp, pc.sp)
            + saved["context_parallel_kv"] / max(1, n_layers)
        )
    )
    head_kept = saved["loss"]
    return [
        0 if st == 0 else (len(layers) - o) * layer_kept + saved["rope"] + (head_kept if st == pc.num_stages - 1 else 0)
        for (st, layers), o in held
    ]


def _input_pass(
    work: Workload,
    pc: ParallelConfig,
    dt: Dtypes,
    pp_rank: int,
    sizes: tuple[float, float],
    retained: list[float],
    recompute: int,
) -> int:
    """The largest moment of a zero-bubble schedule's input passes on pp rank ``pp_rank``: during an input pass of a
    stage (not the first: its input needs no gradient, a full backward runs) every saved tensor is alive
    (``retain_graph``) beside the output gradients kept for its weight pass (:func:`weight_pass_inputs`) and one
    recomputed set."""
    cfg, b, s, m = work.model, work.micro_batch_size, work.seq_length, work.num_microbatches
    input_pass = 0
    for chunk, (st, layers) in enumerate(pc.rank_stages(cfg.num_layers, pp_rank)):
        if st == 0:
            continue
        held_peak, _ = zbv_peak(
            pc.pp, pp_rank, m, sizes, (retained[0], retained[1]), schedule=pc.pipeline_schedule, input_pass_of=chunk
        )
        captured = weight_pass_inputs(cfg, dt, b, s // pc.cp, pc.tp, pc.sp, len(layers), st == pc.num_stages - 1)
        input_pass = max(input_pass, int(held_peak) + captured + recompute if held_peak else 0)
    return input_pass


def _loss_terms(
    cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int, last: bool, saved: dict[str, int]
) -> tuple[int, int, int]:
    """(the loss's backward working set beyond its saved tensors, what its backward frees of them, the logits'
    gradient) on the stage holding the loss, zeros elsewhere. The working set: the logits' gradient in the compute
    dtype, + one chunk's float32 softmax unless that gradient is float32 (then computed in place,
    :func:`lightning_4d.partition.loss_chunk_tokens`); it frees all it saved but the labels (int64, they stay with
    the batch)."""
    if not last:
        return 0, 0, 0
    tokens, local_vocab = b * (s // pc.cp), cfg.padded_vocab_size // pc.tp
    chunk = 4 * min(tokens, loss_chunk_tokens(local_vocab)) * local_vocab if dt.compute != 4 else 0
    gradient = dt.compute * tokens * local_vocab
    return gradient + chunk, saved["loss"] - 8 * tokens, gradient


def receive_buffer_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int, pp_rank: int, m: int) -> int:
    """``PipelineStage``'s receive buffers on pp rank ``pp_rank``, allocated once: one per micro-batch for the
    activations of every stage but the first and for the gradients of every stage but the last (one micro-batch's
    hidden states each, in the residual stream's dtype, sequence-sharded under sp); 0 without pp."""
    hidden = dt.residual * b * (s // pc.cp) * cfg.hidden_size // (pc.tp if pc.sp else 1)
    boundaries = sum((st != 0) + (st != pc.num_stages - 1) for st in pc.stage_indices(pp_rank)) if pc.pp > 1 else 0
    return m * boundaries * hidden
