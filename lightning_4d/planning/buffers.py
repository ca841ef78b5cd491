"""The transient buffers of one pp rank (:mod:`lightning_4d.planning.model`'s docstring, **Peak**): FSDP2's gathered
parameters and unsharded gradients (ZeRO 2/3), the gradient buckets (ZeRO 0/1) and what compression puts on the
wire, the head's gradient, the optimizer step's temporaries, and the transients each feature adds (pipeline receive
buffers, context-parallel attention, the LM head's backward under tp, an MoE layer's all-to-alls), composed by
:func:`buffer_terms`; and the peak of setup (:func:`initialization_bytes`).

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_4d.config import ParallelConfig
from lightning_4d.features.context_parallel.costs import (
    allgather_backward,
    alltoall_masked_backward,
    context_parallel_buffers,
    ring_masked_backward,
)
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.features.pipeline.costs import receive_buffer_bytes
from lightning_4d.features.tensor_parallel.costs import embedding_gradient_bytes, head_backward_transient
from lightning_4d.partition import GRADIENT_BUCKET_BYTES, gradient_buckets_needed, loss_chunk_tokens
from lightning_4d.planning.activations import layer_saved_parts, norm_input_saved, recompute_backward
from lightning_4d.planning.compression_costs import compression_buffer_bytes
from lightning_4d.planning.float8_costs import (
    float8_backward_transient,
    float8_forward_transient,
    float8_gathered_saving,
)
from lightning_4d.planning.offload_costs import offloaded_whole, unpacked_bytes
from lightning_4d.planning.params import Sizes, StageKey, as_held, rank_layers, rank_layout, weighted_params
from lightning_4d.planning.states import ModelStates, first_bucket_elements, fsdp_padded_numel, fsdp_shard_numel
from lightning_4d.planning.tensors import Dtypes
from lightning_4d.planning.workload import Workload

__all__ = ["Buffers", "buffer_terms", "initialization_bytes"]


@dataclass(frozen=True)
class Buffers:
    """The transient buffers of one pp rank (bytes; module docstring, **Peak**)."""

    gathered_start: int  # FSDP2-gathered parameters at the start of backward
    gathered_end: int  # ... and at its end
    gradient_buffers: int  # gradient communication: flat bucket copies (ZeRO 0/1) or unsharded gradients (2/3)
    head_gradient: int  # the LM head's gradient, made at the start of backward
    pipeline: int  # PipelineStage's receive buffers
    context_parallel: int  # one layer's context-parallel attention backward
    all_to_all: int  # one MoE layer's all-to-all receive buffers under ep (moe_costs.all_to_all_buffers)
    step_temporaries: int  # the optimizer's temporaries (none for fused AdamW) + ZeRO-1's all-gather buckets
    resident_gradients: int  # gradients that exist before backward starts (ZeRO 0/1 buckets, several micro-batches)
    #: tp > 1, the rank holding the embedding: torch's vocabulary-parallel embedding backward (DTensor's
    #: ``RowwiseParallel`` on ``nn.Embedding``) runs ``embedding_dense_backward`` with the whole vocabulary
    #: (``num_weights = V``; measured: tiny-test tp2 gave a [256, 64] gradient for its [128, 64] shard) and reduces
    #: the ``[V, h]`` partial sum to the rank's rows: ``V·h`` in the compute dtype at the end of backward
    embedding_gradient: int = 0
    #: ZeRO 0/1 with one micro-batch per step: the gradient bucket made for the first gradient of backward (the
    #: head's), beside it (the buckets are made as gradients arrive: :func:`buffer_terms`)
    first_bucket: int = 0
    #: ZeRO 0/1 without gradient buckets (one rank: :func:`lightning_4d.partition.gradient_buckets_needed`): the
    #: head's and the final norm's gradients, which a bucket would have taken in (``first_bucket``), stay the
    #: ``.grad`` autograd made through the layers' backward; in a stage offloaded whole also the later layers'
    #: (:func:`_later_layers_gradients`)
    head_gradient_kept: int = 0
    #: one decoder layer's gradients as a layer's backward leaves them (a share of ``ModelStates.gradients``: its
    #: dtype, its ZeRO sharding), when they are not resident from backward start (one micro-batch per step): what
    #: each layer whose backward ran adds (activation offload's prefetch phase)
    layer_gradient: int = 0
    #: without gradient buckets: ``w2``'s weight gradient, kept in ``.grad`` beside the next backward ops
    kept_weight_gradient: int = 0
    #: the last stage under tp with sp: the working set of the LM head's backward beyond its saved input
    #: (:func:`lightning_4d.features.tensor_parallel.costs.head_backward_transient`), 0 elsewhere
    head_backward: int = 0
    #: FSDP2-gathered parameters while the loss runs (its forward and its backward): ``gathered_start`` but at
    #: ZeRO 3 without pp, where every unit, the root included, is resharded after its forward (``fully_shard(...,
    #: reshard_after_forward=True)`` given explicitly: torch keeps the root gathered only when the argument is left
    #: to its default) and the root is gathered again when the loss' backward reaches the logits: 0
    gathered_loss: int = 0
    #: ZeRO 3 without pp: the root's all-gather output, alive beside the root's unsharded parameters (in
    #: ``gathered_start``) while FSDP2 copies them out of it, when the head's backward gathers the root again (its
    #: pre-backward; the head's gradient does not exist yet). Measured on CPU (LiveTensorBytes at the peak,
    #: llama3.1-8b's vocabulary at h=256, 2 layers, dp8 ZeRO 3 32-true s=512): the flat all-gather output, both
    #: unsharded root weights and the logits' gradient alive at once; 0 elsewhere
    root_regather: int = 0
    #: the last stage: the loss' forward working set beyond its saved tensors, one chunk's float32 ``exp(x - max)``
    #: (``parallel/loss.py``), ``4·min(b·s/cp, loss_chunk_tokens(V/t))·V/t``
    loss_forward: int = 0
    #: ZeRO 2/3 without pp: the previous step's gradient shards, alive through the forward of every step after the
    #: first (Lightning's automatic optimization calls ``zero_grad`` (set to None) after ``training_step``, before
    #: ``backward``), 0 elsewhere
    forward_gradients: int = 0
    #: under activation checkpointing, the first backward op of a recomputed layer beyond its recomputed set: the
    #: gradient reaching the layer's output (residual dtype, ``[b, s/cp, h]``, ``/t`` under sp) and ``w2``'s input
    #: gradient (compute dtype, ``[b, s/cp, f/t]``); 0 without checkpointing
    recompute_backward: int = 0
    #: ``float8``: the largest converted linear's float8 backward transient
    #: (:func:`lightning_4d.planning.float8_costs.float8_backward_transient`), 0 without float8
    float8_backward: int = 0
    #: ``float8``: the largest converted linear's float8 forward transient
    #: (:func:`lightning_4d.planning.float8_costs.float8_forward_transient`), 0 without float8
    float8_forward: int = 0
    #: ``float8``: FSDP2-gathered parameters during a decoder layer's forward (``gathered_start``: at ZeRO 3 without pp
    #: the root, the layer and the prefetched one; else all the rank's units), less the float8 all-gather's saving on
    #: each gathered layer unit (:func:`lightning_4d.planning.float8_costs.float8_gathered_saving`); 0 at ZeRO 0/1
    gathered_forward: int = 0
    #: under activation checkpointing (no stage offloaded whole): the context-parallel attention backward runs after
    #: the layer's feed-forward backward has freed its recomputed SwiGLU tensors and kept ``w1``/``w3`` outputs (more
    #: than the output gradient ``recompute_backward`` also holds), so the recompute phase takes the larger of the two
    #: transients, not their sum (measured on CPU: tiny-test cp2 b=4 s=256 ``32-true``, the peak at the last layer's
    #: SwiGLU product backward, no cp buffer alive)
    recompute_apart_from_cp: bool = False
    #: document masking under the cp ring or all-to-all: a layer's attention backward with its masks
    #: (:func:`masked_ring_phase`), beyond what a layer's backward holds after the loss' backward; 0 elsewhere
    masked_ring: int = 0
    #: the cp ``"allgather"`` method: a layer's attention backward (:func:`allgather_phase`), beyond what a layer's
    #: backward holds after the loss' backward; 0 elsewhere
    allgather_backward: int = 0


class _Held(NamedTuple):
    """What pp rank ``pp_rank`` holds: the model as held (:func:`~lightning_4d.planning.params.as_held`), its decoder
    layers, whether it holds the embedding (``first``) and the head (``last``), its parameters with their counts
    (:func:`~lightning_4d.planning.params.weighted_params`)."""

    cfg: Any
    pp_rank: int
    layers: list[int]
    first: bool
    last: bool
    params: list


def buffer_terms(
    work: Workload, pc: ParallelConfig, dt: Dtypes, pp_rank: int, states: ModelStates, device_type: str = "cuda"
) -> Buffers:
    """The transient buffers of pp rank ``pp_rank`` for ``work`` (its model a config, its ``num_microbatches`` and
    MoE load given): FSDP2's gathered parameters and unsharded gradients, gradient communication buckets, the head's
    gradient (:func:`_gradient_terms`), pipeline receive buffers, context-parallel attention buffers, one MoE layer's
    all-to-all buffers (at the workload's load) and the other features' transients (:func:`_feature_terms`), the
    optimizer step's temporaries and, with document masking under the cp ring, its masked backward on
    ``device_type`` (:func:`masked_ring_phase`)."""
    cfg = as_held(work.model, pc)
    layers = rank_layers(cfg.num_layers, pc, pp_rank)
    _, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    held = _Held(cfg, pp_rank, layers, first, last, weighted_params(cfg, pc.tp, layers, first, last, pc.ep))
    gradients = _gradient_terms(work, held, pc, dt, states)
    features = _feature_terms(work, held, pc, dt, gradients["gathered_start"])
    if work.document_masking:
        features["masked_ring"] = masked_ring_phase(cfg, pc, dt, work, device_type, features["context_parallel"])
    features["allgather_backward"] = allgather_phase(cfg, pc, dt, work, device_type, last)
    return Buffers(**gradients, **features)


def masked_ring_phase(cfg: Any, pc: ParallelConfig, dt: Dtypes, work: Workload, device_type: str, cp: int) -> int:
    """Document masking under the cp ring or all-to-all: the bytes of the first layer's attention backward beyond
    what a layer's backward holds once the loss' backward is done (``model.py``'s ``_after_loss``, which holds the
    method's buffers ``cp`` = :func:`~lightning_4d.features.context_parallel.costs.context_parallel_buffers`): the
    ring's backward with the own block's mask in their place
    (:func:`~lightning_4d.features.context_parallel.costs.ring_masked_backward`; its masked blocks run explicit
    matmuls on CUDA and under the ``"eager"`` backend), or all-to-all's with the whole sequence's mask
    (:func:`~lightning_4d.features.context_parallel.costs.alltoall_masked_backward`), + the gradient of the layer's
    output (residual dtype, ``[b, s/c, h]``, ``/t`` under sp) and of the attention's output (compute dtype,
    ``[b, s/c, a·d/t]``), − what the layer's feed-forward backward, which runs before its attention's, has freed of
    its saved set (the ffn norm's input and reciprocal RMS, ``w1``/``w3``'s input, the SwiGLU tensors:
    :func:`~lightning_4d.planning.activations.layer_saved_parts`' dense parts). The head's saved tensors, freed by
    the head's backward before, are not subtracted: the margin for the kernel's scratch and the per-block document
    ids. Measured on CPU
    (``measure --document-tokens 128``, tiny-test ``32-true`` cp2): the phase within 4.1% above the peak at
    b=2 s=1024 and 3.5% at b=2 s=2048 (where it is the estimate's peak). Under full checkpointing the layer's
    input, which the checkpoint holds, is not counted again in the recomputed set ``model.py`` adds. 0 without cp
    and for ``"allgather"``, whose backward, masks included, is its own phase (:func:`allgather_phase`)."""
    if pc.cp == 1 or pc.context_parallel_method == "allgather":
        return 0
    b, eager = work.micro_batch_size, _eager(cfg, device_type)
    masked = ring_masked_backward(cfg, pc, dt, b, work.seq_length, eager)
    masked += alltoall_masked_backward(cfg, pc, dt, b, work.seq_length, eager)
    return _attention_backward_phase(cfg, pc, dt, work, masked, cp)


def allgather_phase(cfg: Any, pc: ParallelConfig, dt: Dtypes, work: Workload, device_type: str, last: bool) -> int:
    """The cp ``"allgather"`` method: the bytes of the first layer's attention backward beyond what a layer's
    backward holds once the loss' backward is done, as :func:`masked_ring_phase` counts them, with the all-gather's
    backward in place of the ring's (:func:`~lightning_4d.features.context_parallel.costs.allgather_backward`, with
    document masking its masks). Measured on CPU (``lightning-4d measure``, tiny-test ``32-true`` b=2 s=2048): cp4
    rank 0's peak is in this call (15,967,432 B; the estimate without the phase was 0.957 of it). 0 without cp and
    for the other methods."""
    b, s = work.micro_batch_size, work.seq_length
    eager = _eager(cfg, device_type, masked=work.document_masking, float32=dt.compute == 4)
    documents = (work.document_tokens or 0) if work.document_masking else None
    core = allgather_backward(cfg, pc, dt, b, s, eager, documents, device_type != "cpu")
    if not core:
        return 0
    # wo's backward, before the attention's, has freed wo's input, a copy of the attention output (gathered_kv_bytes),
    # and on the last stage the head's backward what the head saved (its norm's input and rsqrt, its input)
    L, h = s // pc.cp, cfg.hidden_size
    core -= dt.compute * b * L * cfg.num_heads // pc.tp * cfg.head_dim
    if last:
        s_sp = L // pc.tp if pc.sp else L
        core -= norm_input_saved(dt.residual, b, s_sp, h) + dt.compute * b * s_sp * h
    return _attention_backward_phase(cfg, pc, dt, work, core, 0)


def _eager(cfg: Any, device_type: str, masked: bool = True, float32: bool = False) -> bool:
    """Whether a cp attention block runs explicit matmuls (runtime ``_use_eager``): always under the ``"eager"``
    backend; off CPU a masked block (the fused CUDA kernels take no mask) or a float32 one (ATen's flash kernel takes
    float16/bfloat16)."""
    backend = getattr(cfg, "attention_backend", "sdpa")
    return backend == "eager" or (device_type != "cpu" and (masked or float32))


def _attention_backward_phase(cfg: Any, pc: ParallelConfig, dt: Dtypes, work: Workload, core: int, cp: int) -> int:
    """:func:`masked_ring_phase`'s sum for the attention backward's own bytes ``core``: + the output gradients, − the
    feed-forward's freed saved set, − the layer transients ``cp``, − under full checkpointing the layer's input."""
    b, L, tp = work.micro_batch_size, work.seq_length // pc.cp, pc.tp
    sp_tokens = L // tp if pc.sp else L
    gradients = dt.residual * b * sp_tokens * cfg.hidden_size + dt.compute * b * L * cfg.num_heads // tp * cfg.head_dim
    parts = layer_saved_parts(cfg, dt, b, L, tp, pc.sp)
    feed_forward = parts["norms"] // 2 + parts["ffn_in"] + parts["swiglu"]
    # full checkpointing: the recomputed set the phase adds (model.py) counts the layer's input again, which the
    # checkpoint holds (its saved_layers): measured, the masked ring at tiny-test b=2 s=2048 cp2 32-true was
    # 1.070 of the peak with it, 1.046 without
    kept = dt.residual * b * sp_tokens * cfg.hidden_size if pc.activation_checkpointing == "full" else 0
    return core + gradients - feed_forward - cp - kept


def _gradient_terms(work: Workload, held: _Held, pc: ParallelConfig, dt: Dtypes, states: ModelStates) -> dict:
    """:class:`Buffers`' fields of the gradients and the parameters ZeRO gathers: FSDP2's gathered parameters and
    unsharded gradients (ZeRO 2/3), the gradient buckets (0/1), the head's gradient, the gradients resident or kept
    in ``.grad``, the optimizer step's temporaries and the first backward op of a recomputed layer."""
    cfg, layers, first, last, params = held.cfg, held.layers, held.first, held.last, held.params
    b, s, m = work.micro_batch_size, work.seq_length, work.num_microbatches
    world, zero = pc.zero_shard, pc.zero_stage  # the ZeRO shard group (dp_cp; under HSDP its shard group)
    head = next((p for p, _ in params if p.role == "head"), None)
    tied = head is None and last and cfg.tie_word_embeddings
    if tied:
        head = next(p for p, _ in params if p.role == "embedding")
    head_grad = head.numel * (dt.compute if dt.master and zero >= 2 else dt.param) if head is not None else 0
    units = _fsdp_units(params, world, pc.ep, pc.tp)
    root = units[3] * (dt.compute if dt.master else dt.param)  # FSDP2's all-gather output (bf16 under mixed precision)
    if zero >= 2:
        gathered_start, gathered_end, grad_buffers = _fsdp_buffers(pc, dt, params, units, m, head_grad, bool(tied))
    else:
        gathered_start = gathered_end = 0
        grad_buffers = _bucket_buffers(pc, dt, params, states)
    resident, first_bucket = _resident_gradients(cfg, pc, dt, m, states, first, last)
    offloaded = offloaded_whole(cfg, pc, held.pp_rank)
    needed = gradient_buckets_needed(pc.dp_cp, bool(dt.master), pc.pp > 1, pc.tp > 1, pc.optimizer_offload)
    head_kept, bucketed = 0, zero >= 2 or needed
    if not bucketed:
        # no bucket: no fresh gradient waits to be copied into one, none is made for the head's gradient, which
        # stays with the final norm's (made by the first backward ops, before the layers')
        grad_buffers, first_bucket = 0, 0
        head_kept = head_grad + (cfg.hidden_size * dt.param if last else 0)
        if offloaded:
            # two moments of the stage offloaded whole: its last layer's backward (the saved tensors brought back
            # node by node, ``unpacked``, the layer before it prefetched) and its first layer's (that layer's
            # prefetched set, no node brought back, the later layers' gradients made): the larger
            later = _later_layers_gradients(params, min(layers), dt)
            head_kept += max(0, later - unpacked_bytes(cfg, pc, dt, b, s)) if len(layers) >= 2 else later
    layer_numel = sum(p.numel for p, _ in params if p.unit == f"layers.{min(layers)}") if layers else 0
    total_numel = sum(p.numel * count for p, count in params)
    return dict(
        gathered_start=gathered_start,
        gathered_end=gathered_end,
        gradient_buffers=grad_buffers,
        head_gradient=head_grad,
        step_temporaries=_step_temporaries(pc, dt, params, states, work.fused_optimizer),
        resident_gradients=resident,
        first_bucket=first_bucket,
        head_gradient_kept=head_kept,
        layer_gradient=0 if resident or not total_numel else states.gradients * layer_numel // total_numel,
        kept_weight_gradient=0 if bucketed else dt.param * cfg.hidden_size * cfg.intermediate_size // pc.tp,
        gathered_loss=0 if zero == 3 and pc.pp == 1 else gathered_start,
        root_regather=root if zero == 3 and pc.pp == 1 else 0,
        forward_gradients=states.gradients if zero >= 2 and pc.pp == 1 else 0,
        recompute_backward=recompute_backward(cfg, pc, dt, b, s, offloaded, gradients_kept=not bucketed),
        recompute_apart_from_cp=pc.activation_checkpointing != "none" and not offloaded,
    )


def _feature_terms(work: Workload, held: _Held, pc: ParallelConfig, dt: Dtypes, gathered_start: int) -> dict:
    """:class:`Buffers`' fields of the features' transients: pipeline receive buffers, context-parallel attention
    buffers, one MoE layer's all-to-all buffers, the vocabulary-parallel embedding's gradient, the head's backward
    under sp, the loss' forward chunk and float8's transients (``gathered_start``: FSDP2's gathered parameters, less
    float8's all-gather saving in a layer's forward)."""
    cfg, layers, last = held.cfg, held.layers, held.last
    b, s, m = work.micro_batch_size, work.seq_length, work.num_microbatches
    zero = pc.zero_stage
    local_vocab = cfg.padded_vocab_size // pc.tp
    gather_bytes = dt.compute if dt.master else dt.param
    gathered_units = (2 if zero == 3 and pc.pp == 1 else len(layers)) if zero >= 2 else 0
    return dict(
        pipeline=receive_buffer_bytes(cfg, pc, dt, b, s, held.pp_rank, m),
        context_parallel=context_parallel_buffers(cfg, pc, dt, b, s),
        all_to_all=moe_costs.rank_all_to_all_buffers(work, cfg, pc, dt, layers),
        embedding_gradient=embedding_gradient_bytes(cfg, pc, dt, held.first),
        head_backward=head_backward_transient(cfg, pc, dt, b, s) if last else 0,
        loss_forward=4 * min(b * (s // pc.cp), loss_chunk_tokens(local_vocab)) * local_vocab if last else 0,
        float8_backward=float8_backward_transient(cfg, pc, b, s),
        float8_forward=float8_forward_transient(cfg, pc, b, s),
        gathered_forward=gathered_start - gathered_units * float8_gathered_saving(cfg, pc, gather_bytes),
    )


def _later_layers_gradients(params: Any, first_layer: int, dt: Dtypes) -> int:
    """Gradient bytes (``.grad``, the parameters' dtype) of the rank's decoder layers but ``first_layer``: what exists
    in the first layer's backward of a stage offloaded whole without gradient buckets (the later layers' gradients
    grow through the backward; measured on CPU before the prefetch, tiny-test one rank, both layers offloaded,
    ``32-true``: layer 1's gradients and layer 0's ``w2``'s beside layer 0's SwiGLU product backward, the peak; with
    the prefetch the last layer's backward, the first layer's set prefetched beside it, peaks higher there: 4,825,088
    B estimated, 4,825,300 measured). ``params``: :func:`~lightning_4d.planning.params.weighted_params`
    (``first_layer``, the smallest index, represents its kind of layer)."""
    first = f"layers.{first_layer}"
    layers = sum(p.numel * count for p, count in params if p.unit != "root")
    return (layers - sum(p.numel for p, _ in params if p.unit == first)) * dt.param


def _fsdp_units(params: Any, world: int, ep: int, tp: int) -> tuple[int, int, int, int]:
    """(padded elements of the largest FSDP2 layer unit, rank 0's shard of it (the largest), padded elements of all
    the layer units, of the root unit) of the rank's ``params`` (:func:`fsdp_padded_numel`)."""
    units: dict[str, list[int]] = {}  # representative layer -> [padded elements, layers like it, shard elements]
    for p, count in params:
        if p.unit != "root":
            unit = units.setdefault(p.unit, [0, count, 0])
            unit[0] += fsdp_padded_numel(p, world, ep, tp)
            unit[2] += fsdp_shard_numel(p, world, 0, ep, tp, 0)  # rank 0's shard, the largest
    layer_numel, _, layer_shard = max(units.values(), default=(0, 0, 0))  # the largest FSDP2 layer unit
    all_layers_numel = sum(n * count for n, count, _ in units.values())
    root_numel = sum(fsdp_padded_numel(p, world, ep, tp) for p, _ in params if p.unit == "root")
    return layer_numel, layer_shard, all_layers_numel, root_numel


def _fsdp_buffers(
    pc: ParallelConfig, dt: Dtypes, params: Any, units: tuple[int, int, int, int], m: int, head_grad: int, tied: bool
) -> tuple[int, int, int]:
    """(gathered parameters at the start of backward, at its end, gradient buffers) of FSDP2 (ZeRO 2/3): parameters
    gathered for compute (padded all-gather outputs; bf16 under ``MixedPrecisionPolicy``), unsharded gradients
    before reduce-scatter (bf16, then their float32 cast for the reduce-scatter); ``units``: :func:`_fsdp_units`."""
    world = pc.zero_shard
    gather_bytes = dt.compute if dt.master else dt.param
    layer_numel, layer_shard, all_layers_numel, root_numel = units
    largest_layer, root = layer_numel * gather_bytes, root_numel * gather_bytes
    if pc.pp > 1:
        # under a pipeline schedule FSDP2 neither reshards after backward nor reduces gradients until the last
        # micro-batch (PipelineStage.backward_maybe_with_nosync): all the rank's parameters and their unsharded
        # gradients (accumulated in float32 under MixedPrecisionPolicy) are held from the first backward to the end
        # of the step
        gathered = root + all_layers_numel * gather_bytes
        return gathered, gathered, (root_numel + all_layers_numel) * (4 if dt.master else dt.param)
    if pc.zero_stage == 2:
        # kept unsharded from forward to backward; the root's unsharded gradients live to the end; 2 units in flight
        unsharded_grad_bytes = dt.compute + 4 if dt.master else dt.param
        grad_buffers = (root_numel + 2 * layer_numel) * unsharded_grad_bytes
        return root + all_layers_numel * gather_bytes, root + largest_layer, grad_buffers
    root_shard = sum(fsdp_shard_numel(p, world, 0, pc.ep, pc.tp, 0) for p, _ in params if p.unit == "root")
    root_grads = sum(p.numel for p, _ in params if p.unit == "root") * (dt.compute if dt.master else dt.param)
    root_grads += 2 * head_grad if tied else 0
    if m > 1:  # gradient accumulation: every gradient shard exists from the first micro-batch's backward on
        root_shard = layer_shard = 0
    shards = (layer_numel, layer_shard, root_shard)
    end, grad_buffers = _zero3_backward_end(dt, root, largest_layer, shards, root_grads, head_grad)
    return (
        root + 2 * largest_layer,
        end,
        grad_buffers,
    )  # at the start: root + the layer in backward + the prefetched one


def _zero3_backward_end(
    dt: Dtypes, root: int, largest_layer: int, shards: tuple[int, int, int], root_grads: int, head_grad: int
) -> tuple[int, int]:
    """(gathered parameters, gradient buffers) at the end of backward at ZeRO 3 without pp (``shards``: a layer
    unit's elements, its gradient shard's, the root's gradient shard's): the larger of two moments. Measured tensor by
    tensor on CPU with ``lightning_4d.measure.LiveTensorBytes`` (tiny-test dp2 ZeRO 3 bf16-mixed, tied and untied
    head; torch 2.13's ``FSDPParamGroup.post_backward``): a unit's unsharded gradients are copied, cast to the reduce
    dtype, into its reduce-scatter input, which FSDP2 keeps until the next unit's reduce-scatter
    (``comm_ctx.reduce_scatter_states``); the root's unsharded gradients are made by the head's backward and the
    embedding's and reduced last, when its gradient shard is made. Two moments, beside the gradient shards made so
    far and the gathered root:

    (a) the first layer's backward: the root's and the two layer units' gathered parameters (the layer in backward,
        the prefetched one), the previous layer's reduce-scatter input, the head's gradient; neither the root's
        gradient shard nor the first layer's exists yet;
    (b) the embedding's backward: the previous layer's reduce-scatter input, the root's unsharded gradients (a tied
        weight: the head's gradient, the embedding's and their sum, AccumulateGrad adding out of place); the root's
        gradient shard does not exist yet."""
    layer_numel, layer_shard, root_shard = shards
    reduce_bytes = 4 if dt.master else dt.param  # FSDP2's reduce dtype: its reduce-scatter input, gradient shards
    common = layer_numel * reduce_bytes - root_shard * reduce_bytes
    first_layer = 2 * largest_layer + head_grad - layer_shard * reduce_bytes
    if first_layer >= root_grads:
        return root + 2 * largest_layer, common + head_grad - layer_shard * reduce_bytes
    return root, common + root_grads


def _bucket_buffers(pc: ParallelConfig, dt: Dtypes, params: Any, states: ModelStates) -> int:
    """ZeRO 0/1's gradient communication buffers at the end of backward (``GradientBuckets``): a parameter's fresh
    gradient (its dtype) exists until the hook adds it into its bucket, + what the gradient compression puts on the
    wire (:func:`lightning_4d.planning.compression_costs.compression_buffer_bytes`)."""
    largest = max((p.numel for p, _ in params), default=0)
    return largest * dt.param + compression_buffer_bytes(pc, dt, states.gradients, pc.dp_cp, largest)


def _step_temporaries(pc: ParallelConfig, dt: Dtypes, params: Any, states: ModelStates, fused_optimizer: bool) -> int:
    """The optimizer step's temporaries: none for fused AdamW (it steps in place), the sqrt of the second moments (one
    moment's bytes) for foreach AdamW; + at ZeRO 1 ``ShardedOptimizer``'s all-gather of one bucket at a time, this
    rank's range and the gathered bucket (a bucket holds at most ``GRADIENT_BUCKET_BYTES`` of parameters, or one
    larger parameter alone: the head, the embedding)."""
    step_temp = 0 if fused_optimizer else (states.optimizer_states - states.master_weights - states.compression) // 2
    world = pc.zero_shard
    if pc.zero_stage == 1 and world > 1:
        largest = max((p.numel for p, _ in params), default=0)
        bucket = max(min(GRADIENT_BUCKET_BYTES // dt.setup, states.parameters // dt.param), largest) * dt.param
        step_temp += int(bucket * (1 + 1 / world))
    return step_temp


def _resident_gradients(
    cfg: Any, pc: ParallelConfig, dt: Dtypes, m: int, states: ModelStates, first: bool, last: bool
) -> tuple[int, int]:
    """(gradients that exist before backward starts, the gradient bucket made for the first gradient of backward).

    ZeRO 0/1 gradient buckets exist from the first gradient of the step to the end of its optimizer step
    (``parallel/grad_buffers.py``'s ``GradientBuckets``): with more than one micro-batch per step (a pipeline,
    gradient accumulation), from the first backward on, so while later micro-batches' activations are built; with
    one, no gradient exists in forward, and at the start of backward only the bucket that takes the first gradient
    (the head's) is made, while the saved activations are all alive: the rest appear as backward frees the layers'
    activations (the sum of the two is linear over the layers, largest at an end: the backward end phase). ZeRO 2/3
    accumulating over m > 1 micro-batches: FSDP2's gradient shards, from the first backward on."""
    zero = pc.zero_stage
    if zero <= 1 and (pc.pp > 1 or m > 1) or zero >= 2 and pc.pp == 1 and m > 1:
        return states.gradients, 0
    if zero >= 2:
        return 0, 0
    sizes = Sizes.of(cfg, cfg.num_layers)
    stage = StageKey(pc.tp, tuple(range(cfg.num_layers)), first, last, pc.ep)
    elements = first_bucket_elements(sizes, stage, dt.setup, GRADIENT_BUCKET_BYTES, pc.zero_shard)
    return 0, elements * dt.grad


def initialization_bytes(
    cfg: Any, pc: ParallelConfig, dt: Dtypes, pp_rank: int, states: ModelStates, buf: Buffers
) -> int:
    """Bytes held at the peak of setup, before the first step (module docstring, **Peak**): the larger of
    initialization (the rank's parameters in their setup dtype + the largest whole float32 parameter of its stages:
    ``families/native_llama.py``'s ``_local_piece`` copies the rank's piece out of a view of it) and the cast that
    follows the optimizer's setup (setup-dtype parameters + master weights + the compute-dtype copy of the largest
    parameter
    being made; the gradient buckets are made by the first backward)."""
    cfg = as_held(cfg, pc)
    layers = sorted(i for _, r in pc.rank_stages(cfg.num_layers, pp_rank) for i in r)
    _, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    largest = max(p.numel for p, _ in weighted_params(cfg, 1, layers, first, last))
    largest_local = max(p.numel for p, _ in weighted_params(cfg, pc.tp, layers, first, last, pc.ep))
    params = states.parameters if pc.zero_stage >= 2 else states.parameters // dt.param * dt.setup
    cast = 0
    if pc.zero_stage < 2 and dt.master:
        cast = states.master_weights + largest_local * dt.param
    return params + max(4 * largest, cast)
