"""Our strategy's own memory model: bytes per rank and per pipeline stage, counted from what our code allocates.

The paper's estimator (:mod:`lightning_4d.planning.fujii2024`: Fujii, Watanabe and Yokota 2024, arXiv 2411.06465)
models Megatron-LM and leaves what it does not model to a 20% margin (a layout is trainable below 80% of the GPU).
This model counts those things instead, because it follows FourDStrategy's own code, tensor by tensor:

**Model states** (:func:`model_state_bytes`). Every parameter tensor of the pp rank's pipeline stages with its
tensor-parallel local shape (``wq``/``wk``/``wv``/``w1``/``w3``/``output`` split on rows, ``wo``/``w2`` on columns,
the embedding by vocabulary rows, RMSNorm weights replicated), then its ZeRO shard over ``dp_cp`` (D = dp·cp ranks):

- ZeRO stage 0: everything replicated; gradients in ``GradientBuckets`` (one copy, from the first gradient to the
  end of the optimizer step);
- ZeRO stage 1 (``GradientBuckets`` + ``ShardedOptimizer``): the parameters, in reverse order, fill gradient buckets
  of ``GRADIENT_BUCKET_BYTES`` (25 MiB of parameters as built), each padded to a multiple of D; rank r owns range r of
  every bucket and holds Adam m and v (and the master weights) for those elements only
  (:func:`~lightning_4d.planning.states.bucket_owned`);
- ZeRO stages 2, 3 (FSDP2 ``fully_shard``): parameters, gradients and Adam states of ``ceil(rows/D)`` rows of dim
  0 (rank r holds rows ``[r·chunk, (r+1)·chunk)``, clipped), as ``torch.chunk``; an MoE layer's stacked weights
  maybe on dim 1 (:mod:`lightning_4d.features.moe.costs`).

Dtypes (:class:`~lightning_4d.planning.tensors.Dtypes`; ``lightning_4d/parallel/sharded_optimizer.py``): ``32-true``
float32 everywhere; ``bf16-mixed`` (master weights, Megatron-LM's and torchtitan's mixed precision) bfloat16 parameters,
float32 gradients, float32 master weights + Adam m, v: 2 + 4 + 12 bytes per parameter at ZeRO 0, 2 + 4 + 12/D at ZeRO 1,
and at ZeRO 2/3 the float32 FSDP2 shard is the master (16/D); ``bf16-true`` bfloat16 everywhere; ``16-mixed``
(Lightning's autocast, kept for float16) float32 weights, gradients and moments. The step counters (0-d float32 tensors
on the CPU unless ``capturable``) are not counted.

**Activations** (:func:`saved_activation_bytes`): the tensors our layers save for backward, as
``torch.autograd.graph.saved_tensors_hooks`` sees them (each storage once), for the SDPA backend (its fused CPU and
CUDA kernels save q, k, v, the output and a float32 log-sum-exp ``[b, heads, s]``; kv heads are not repeated). Per
layer, with ``y`` = b·s·h elements, ``s'`` = s/t under sequence parallelism (s otherwise), ``c`` = bytes of the
compute dtype, ``r`` = bytes of the residual stream (2 for ``bf16-mixed`` and ``bf16-true``, 4 for ``32-true`` and
``16-mixed``):

- two RMSNorms: the input as given (r·b·s'·h) and the float32 reciprocal RMS (4·b·s');
- the inputs of ``wq``/``wk``/``wv`` and of ``w1``/``w3``, once per group: under sp the sequence shard (c·b·s'·h,
  gathered again in backward: ``lightning_4d/features/tensor_parallel/runtime.py``), else c·y (under ``16-mixed``
  autocast casts the float32 norm output once per linear: 3 + 2 copies);
- SDPA: q and its output (c·y/t each), k and v (c·b·s·k·d/t each), the log-sum-exp (4·b·s·a/t);
- SwiGLU: ``w1 x``, ``w3 x``, ``silu(w1 x)`` and the product (c·b·s·f/t each); an MoE layer its feed-forward's saved set
  instead (:func:`lightning_4d.features.moe.costs.saved_bytes`: its module docstring says what it counts).

Outside the layers: the token ids (int64), the RoPE cos/sin tables (float32 ``[s, d/2]`` each, shared by all layers),
the final norm (as above), the head's input (c·b·s'·h: under sp the sequence shard), and what the loss saves
(:mod:`lightning_4d.parallel.loss`): the logits as the head made them, in the compute dtype (c·b·s·V/t, the local
vocabulary shard under tp; a tensor that would otherwise be freed after the forward), the float32 log-sum-exp of every
token (4·b·s) and the labels (int64, 8·b·s). With ``16-mixed`` (Lightning's autocast), autocast's float16 copies of the
weight matrices are saved too (2 bytes per local matrix element; the embedding is not cast). With full activation
checkpointing a layer saves only its input (r·b·s'·h) and the backward re-runs one layer at a time (one layer's saved
set, transient). With selective activation checkpointing (``lightning_4d/parallel/activation_checkpoint.py``: the
outputs of the matmuls, attention kernels and tp reductions kept, everything else recomputed) a layer keeps
(:func:`~lightning_4d.planning.activations.layer_selective_parts`; measured as the outputs the policy keeps, plus the
checkpoint's input):

- its input (r·b·s'·h);
- the outputs of its matmuls: c·b·s·((a + 2k)·d + 2f)/t for ``wq``/``wk``/``wv`` and ``w1``/``w3``, and at tp = 1
  c·b·s·h for ``wo``; under tp not ``wo``'s partial sum (full ``[b, s, h]`` on every rank: the backward recomputes
  it), and nothing of ``w2`` (the recomputation stops once it has ``w2``'s inputs);
- each attention kernel call's output and float32 log-sum-exp, (c·d + 4)·b·a/t bytes per query token: s tokens
  without cp; under cp (s the local sequence), cp rank r's calls cover s·(1 + r) + s·(cp − 1 − r)/2 tokens with
  ``"ring"`` and 2·s (1.5·s on cp rank 0) with ``"allgather"``; the figure is the last cp rank's, the largest
  (ring: cp·s, the whole sequence; allgather: 2·s);
- under tp, the reduced output of ``wo`` (all-reduce, or reduce-scatter under sp): c·b·s'·h;

and one layer's backward recomputes, transiently (``recompute``,
:func:`~lightning_4d.planning.activations.layer_selective_recompute`), what the layer would save without checkpointing
less what it takes from the kept outputs (v, the attention output and log-sum-exp, ``w1 x``, ``w3 x``): the ffn norm's
input, both norms' rsqrt, the matmul inputs (sequence shards under sp, autocast casts), the rotated q and k, ``silu(w1
x)`` and the SwiGLU product (not the attention norm's input: it is the layer's input, kept); the kept outputs the
recomputation consumes are freed by then (``wq``'s and ``wk``'s, whose rotated copies are saved instead, and ``wo``'s
output or reduction, read only by the residual sum): net of those. Measured tensor by tensor on CPU (``LiveTensorBytes``
at the last layer's ``w2`` / SwiGLU backward, tiny-test tp1 and tp2, ``32-true`` and ``bf16-mixed``): the ``recompute``
phase within 216 B. autocast's weight copies and ``"allgather"``'s gathered K/V are made again there as under full
checkpointing.

**Peak** (:class:`MemoryEstimate`): memory moves through the phases of a step (and initialization before the
first one), and the estimate is the largest:

- start of backward: activations (no layer recomputed yet) + the loss's backward working set (the logits' gradient
  in the compute dtype, ``c·b·s·V/t``, + when the compute dtype is not float32 one chunk's float32 softmax,
  ``4·n·V/t`` with ``n = min(b·s, loss_chunk_tokens(V/t))`` tokens: at most 64 MiB,
  :func:`lightning_4d.partition.loss_chunk_tokens`; a float32 gradient is computed in place), or instead the head's
  gradient (made once the loss' backward has freed the saved logits: the larger of the two; with one micro-batch per
  step at ZeRO 0/1, the head's gradient + the gradient bucket made for it, no bucket on one rank without master
  weights, pp or tp: :func:`lightning_4d.partition.gradient_buckets_needed`) + compute copies + parameters gathered by
  FSDP2 (with the head's gradient; with the loss' working set too, except at ZeRO 3 without pp, where every unit,
  the root included, is resharded after its forward and the root is gathered again only once the loss' backward is
  done) + ZeRO 0/1's gradient buckets when the step has several micro-batches (a pipeline, gradient accumulation:
  the buckets exist from the first backward to the end of the optimizer step; with one micro-batch they are made
  during backward as the layers' activations are freed, which peaks at the end of backward) + one layer's
  context-parallel transients;
- the MoE feature's backward phase (ep > 1, :data:`lightning_4d.features.moe.costs.BACKWARD_PHASE`): the activations
  less what the loss' backward freed, + one MoE layer's all-to-all receive buffers at the stated load
  (:func:`lightning_4d.features.moe.costs.all_to_all_buffers`), as the recompute phase;
- float8 backward (``float8``): the same (under activation checkpointing the last layer's backward: its recomputed
  set alive, the head's saved tensors freed), + the largest converted linear's float8 backward transient
  (:func:`lightning_4d.planning.float8_costs.float8_backward_transient`; the saved activations change only under tp,
  :func:`lightning_4d.planning.float8_costs.float8_tensor_parallel_saved`);
- float8 forward (``float8``): the last layer's forward, a converted linear casting its input and weight: the
  activations less what the head and the loss save, + the cast's float32 arithmetic
  (:func:`lightning_4d.planning.float8_costs.float8_forward_transient`) + the previous step's gradient shards (ZeRO 2/3
  without pp) + the parameters FSDP2 holds gathered in a layer's forward (ZeRO 3: the root, the layer and the
  prefetched one; ZeRO 2 and pp: all), the converted weights in one byte with FSDP2's float8 all-gather
  (:func:`lightning_4d.planning.float8_costs.float8_gathered_saving`). Measured on CPU (small b=2 s=256 dp2 ZeRO 3
  ``bf16-mixed``): the peak at the last layer's ``w2`` input cast, estimate within 0.01% with either recipe;
- head backward (the last stage under tp with sp;
  :func:`~lightning_4d.features.tensor_parallel.costs.head_backward_transient`): the activations (without a layer's
  recomputed set: none is being recomputed yet) less what the loss' backward freed
  (all it saved but the labels) + the logits' gradient (compute dtype) + the head's weight gradient + the working set of
  the head's backward (the input gathered again, its gradient and the reduce-scatter's copies, or
  the tp ring overlap's shards) + compute copies + gathered parameters + ZeRO 0/1's buckets (with several
  micro-batches per step);
- end of backward: the gradients (full for ZeRO stages 0/1, this rank's shard + the root unit's unsharded gradients for
  2/3) + gradient communication buffers (ZeRO stages 0/1: one parameter's fresh gradient before its hook adds it to the
  bucket, none without buckets; 2: two FSDP2 units of unsharded gradients) + gathered parameters; at ZeRO 3 without pp
  the larger of two moments (measured tensor by tensor on CPU; :mod:`lightning_4d.planning.buffers`), each with the
  gradient shards made so far (all but the root's), the gathered root and the reduce-scatter input FSDP2 keeps of the
  last unit reduced (a layer's, in the reduce dtype): the first layer's backward (+ two gathered layer units + the
  head's gradient, less the first layer's shard) and the embedding's (+ the root's unsharded gradients; a tied weight's
  three: the head's, the embedding's and their sum); under pp at ZeRO 0/1, + the saved tensors of the micro-batches
  still in flight when the rank's first backward ends
  (:func:`~lightning_4d.features.pipeline.costs.held_at_backward_end`; measured on CPU, llama3.2-3b tp4 pp2 cp2 dp2
  selective s=4096, pp rank 0: the embedding's bucket made in micro-batch 0's backward beside micro-batch 1's saved
  tensors, 5,520,331,492 B, estimated 5,536,354,304, 5,098,004,480 without them);
- recompute (activation checkpointing): the first checkpointed layer's backward, where the step's peak was measured
  on CPU (full and selective, tp 1 and 2, ZeRO 0, 1 and 3): the activations with one layer's recomputed set, less
  what the loss' backward freed (all it saved but the labels) and the head's saved tensors (the final norm's input
  and rsqrt, the head's input: freed by its backward), + the gradient of the layer's output and the larger of
  ``w2``'s backward (its input gradient, its weight gradient and under sp its output gradient all-gathered,
  ``[T, h]``) and the SwiGLU product's after it (the product freed, two ``[T, f/t]`` gradients beside the product's):
  :func:`~lightning_4d.planning.activations.recompute_backward` + the gradient bucket made for the head's gradient (ZeRO
  0/1, one micro-batch; without buckets the head's, the final norm's and ``w2``'s gradients, in a stage offloaded
  whole the later layers' too, in its first layer's backward) + gathered parameters + ZeRO 0/1's buckets (several
  micro-batches per step);
- end of forward (ZeRO 2/3 without pp): the activations (no layer recomputed) + the loss' forward chunk (float32
  ``exp(x - max)``) + the previous step's gradient shards (Lightning calls ``zero_grad`` after ``training_step``) +
  the parameters gathered while the loss runs;
- optimizer step: the gradients + ZeRO-1's all-gather buckets + the optimizer's temporaries: none for
  ``torch.optim.AdamW(fused=True)`` (:class:`~lightning_4d.tasks.CausalLMModule`'s: one kernel updates each tensor
  in place; measured on CPU: no byte allocated during the step), one moment's bytes for ``AdamW(foreach=True)``
  (``_foreach_sqrt`` of the second moments; ``Workload(..., fused_optimizer=False)``);
- initialization (before the first step; :func:`~lightning_4d.planning.buffers.initialization_bytes`):
``LlamaModel.init_weights`` draws every
  parameter whole in float32 (so that every layout starts from one process's weights) and copies this rank's piece
  out of it: the rank's parameters in their setup dtype + the largest whole parameter of its stages (the embedding,
  ``V·h``, not divided by tp); under ``bf16-mixed`` at ZeRO 0/1, the cast to bfloat16 after the optimizer's setup
  (float32 parameters + master weights + one parameter's bfloat16 copy) if larger. Measured with
  ``lightning-4d measure`` on CPU (llama3.2-1b, the peak at the end of setup): tp8 dp8 ZeRO 3 1.052 GiB (estimated
  1.050), dp8 ZeRO 3 1.554 (1.554), tp4 cp2 dp2 ZeRO 1 2.712 (2.712).

``total = parameters + optimizer_states + overhead + max(phases)``; ``overhead`` is the measured allowance for the
CUDA context and fragmentation (:mod:`lightning_4d.planning.hardware`), zero on CPU.

**Pipeline parallelism** (validated against measured per-pp-rank bytes in ``tests/test_memory_model.py``): pp rank
r holds v pipeline stages (:meth:`~lightning_4d.config.ParallelConfig.rank_stages`) of ``L/(p·v)`` layers each (the
first stage also the embedding, the last the final norm, head and loss); 1F1B keeps ``min(m, p − r)`` micro-batches
of activations, GPipe ``m``, interleaved 1F1B ``min(m·v, 2(p − r − 1) + (v − 1)p + 1)`` stage-micro-batches
(Megatron-LM's warm-up count), plus the receive buffers of one micro-batch's hidden states per micro-batch and
stage boundary.

**Context parallelism** (``lightning_4d/features/context_parallel/runtime.py``) divides every sequence-sized tensor by c
(each rank holds ``s/c`` tokens of every sequence). What is not divided by c, per method: ``"ring"`` saves only the
local q, k, v, output and float32 log-sum-exp (the same tensors as plain attention) and holds, transiently in one
layer's backward, the K/V block in hand and the one arriving, the block's float32 dK/dV accumulator and the one
arriving, the rank's own block's float32 dK/dV (kept to the end, so that the accumulators travel ``c − 1`` hops), and
float32 dq (``2·(2·c_b + 3·4)·b·(s/c)·k·d/t + 4·b·(s/c)·a·d/t`` bytes, ``c_b`` the compute dtype's bytes);
``"allgather"`` saves the gathered K and V of the whole sequence instead of the local ones, and a copy of the output as
``wo``'s input (``c_b·b·d·(2·(s − s/c)·k/t + (s/c)·a/t)`` more bytes per layer,
:func:`~lightning_4d.features.context_parallel.costs.gathered_kv_bytes`), and its backward has a phase of its own
(:func:`~lightning_4d.features.context_parallel.costs.allgather_backward`: float32 dK/dV of all ``s`` tokens and dq,
and its largest kernel call's working set); ``"alltoall"`` (Ulysses) saves q, k, v, the output and the
log-sum-exp of the whole sequence for ``a/(t·c)`` heads (the bytes of the local ones), plus the local output ``wo``
saves (a tensor of its own: ``c_b·b·(s/c)·a·d/t``) and, where a tp rank's kv heads are fewer than c, the replicated
ones (``2·c_b·b·d·(s·k' − (s/c)·k/t)``, ``k' = max(k/t, c)/c``;
:func:`~lightning_4d.features.context_parallel.costs.alltoall_saved_extra`) and, in one layer's backward, the
whole-sequence dq/dk/dv of its heads with the all-to-all's send and receive buffers
(``3·c_b·b·s·(a/(t·c) + 2·k')·d``, :func:`~lightning_4d.features.context_parallel.costs.alltoall_buffers`).

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from lightning_4d.config import PIPELINE_SCHEDULES, ParallelConfig, check_positive_int
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.features.pipeline.costs import Activations, activation_terms
from lightning_4d.planning.activations import saved_bytes, saved_per_layer
from lightning_4d.planning.buffers import Buffers, buffer_terms, initialization_bytes
from lightning_4d.planning.hardware import GIB, OverheadAllowance, overhead_allowance
from lightning_4d.planning.offload_costs import copies_in_flight, offloaded_per_stage, offloaded_whole
from lightning_4d.planning.params import rank_layout
from lightning_4d.planning.states import ModelStates, model_state_bytes
from lightning_4d.planning.tensors import PRECISIONS, Dtypes, checkpoint_bytes_per_parameter, normalize_precision
from lightning_4d.planning.workload import Workload

__all__ = [
    "MemoryEstimate",
    "ModelStates",
    "PRECISIONS",
    "PIPELINE_SCHEDULES",
    "estimate_memory",
    "estimate_all_pp_ranks",
    "model_state_bytes",
    "offloaded_bytes_per_microbatch",
    "saved_activation_bytes",
    "checkpoint_bytes_per_parameter",
    "normalize_precision",
]


def saved_activation_bytes(
    workload: Workload,
    parallel_config: ParallelConfig,
    *,
    pp_rank: int = 0,
    device_type: str = "cpu",
) -> dict[str, int]:
    """Bytes saved for backward by one micro-batch's forward of ``workload`` (its model a
    :class:`~lightning_4d.models.LlamaConfig`; ``num_microbatches`` and ``fused_optimizer`` not read) through all
    pipeline stages of pp rank ``pp_rank``, by part. ``device_type="cuda"`` counts, for ``32-true`` GQA models on the
    ``sdpa`` backend, the k and v heads the backend repeats there (``sdpa_repeats_kv_heads`` of
    ``lightning_4d.models.attention_backends``).

    Returns a dict with ``layers`` (all layers of the rank: their saved tensors, only their inputs under full
    activation checkpointing, their inputs and kept matmul / attention / reduction outputs under selective
    checkpointing), ``embedding`` (token ids), ``rope`` (cos/sin, which every layer shares; with document masking per
    sample, with the mask every layer shares, or under cp the document ids), ``head`` (final norm and head input),
    ``loss`` (the
    logits, the float32 log-sum-exp and the labels), ``compute_weights`` (``16-mixed``: autocast's weight copies),
    ``context_parallel_kv`` (all layers' saved K/V beyond the local ones: the gathered K/V of the whole sequence in
    place of the local K/V, and a copy of the attention output, under ``context_parallel_method="allgather"``
    (:func:`~lightning_4d.features.context_parallel.costs.gathered_kv_bytes`), under ``"alltoall"`` the second
    copy of the attention output and replicated kv heads
    (:func:`~lightning_4d.features.context_parallel.costs.alltoall_saved_extra`), none for ``"ring"``; under full or
    selective checkpointing they are part of ``recompute``) and ``recompute`` (what one layer's backward
    recomputes, transient: its whole saved set under full checkpointing, its pointwise tensors under selective
    checkpointing). Under ep an MoE layer runs on the rows the rank receives: the balanced figure times the
    workload's MoE load (:func:`lightning_4d.features.moe.costs.rank_load`;
    :func:`lightning_4d.features.moe.costs.saved_bytes`; here the load of one rank, any number > 0: below 1 for a rank
    that receives fewer rows than the balanced figure). ``sum(...) - recompute`` is what ``saved_tensors_hooks`` (plus
    the checkpointed layers' inputs and, under selective checkpointing, the outputs its policy keeps) sees. Under
    context parallelism and selective checkpointing, the figure is that of the cp rank that keeps the most (the last:
    module docstring). Formulas: module docstring.

    Raises:
        ValueError: non-positive sizes, a sequence not divisible as the layout requires, an unknown precision, an
            MoE load that is not a number > 0 (:func:`~lightning_4d.features.moe.costs.rank_load`).
    """
    imbalance = moe_costs.rank_load(workload)
    b = check_positive_int("micro_batch_size", workload.micro_batch_size)
    s = check_positive_int("seq_length", workload.seq_length)
    pc = parallel_config
    pc.validate_sequence(s)
    dt = Dtypes.for_layout(normalize_precision(workload.precision), workload.model, pc, device_type)
    return saved_bytes(workload.model, pc, dt, b, s, pp_rank, imbalance, workload.document_masking)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one rank (the worst pp rank unless asked for one), bytes.

    Attributes:
        parameters: parameters at rest (this rank's ZeRO shard).
        gradients: gradients at the optimizer step.
        optimizer_states: Adam m and v.
        activations: saved for backward by all in-flight micro-batches (layers, embedding, rope, final norm,
            context-parallel K/V) + one layer's recompute set under full checkpointing.
        logits: the loss's backward working set beyond what it saved (the logits, counted in ``activations``): the
            logits' gradient in the compute dtype, + one chunk's float32 softmax when that is not float32.
        buffers: transient buffers at their largest: autocast weight copies, FSDP2-gathered parameters, gradient
            communication buckets, optimizer-step temporaries, pipeline send/receive buffers, one MoE layer's
            all-to-all buffers under ep.
        overhead: CUDA context and allocator fragmentation allowance (zero on CPU).
        total: the peak, ``parameters + optimizer_states + overhead + max(phases)`` (not the sum of the fields).
        peak_phase: ``"backward start"``, ``"head backward"``, ``"backward end"``, ``"optimizer step"``, the MoE
            feature's (:data:`~lightning_4d.features.moe.costs.BACKWARD_PHASE`), ``"float8 backward"``, ``"float8
            forward"`` or ``"initialization"``.
        pp_rank: the pp rank this is for (it holds the pipeline stages of
            :meth:`~lightning_4d.config.ParallelConfig.rank_stages`).
        details: the terms behind each field (bytes), by name.
        host: host (CPU) memory this rank holds, bytes, beside ``total`` (which is the device's): the model states
            ``optimizer_offload`` keeps there (:func:`~lightning_4d.planning.states.offloaded_states`) and the
            activations ``activation_offload_layers`` copies there (at their most).
        host_per_node: ``host`` times the ranks of a node (``ranks_per_node`` of :func:`estimate_memory`): the host
            memory a node needs for this layout (an upper bound: every rank of the node counted as this one).
    """

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    buffers: int
    overhead: int
    total: int
    peak_phase: str
    pp_rank: int = 0
    details: dict[str, int] = field(default_factory=dict)
    host: int = 0
    host_per_node: int = 0

    @property
    def total_gib(self) -> float:
        """``total`` in GiB (2^30 bytes)."""
        return self.total / GIB

    def to_dict(self) -> dict[str, Any]:
        """All fields (bytes) plus ``total_gib``."""
        out = asdict(self)
        out["total_gib"] = self.total_gib
        return out

    def fits(self, device_memory: int, budget: float = 1.0) -> bool:
        """``total <= budget * device_memory``."""
        return self.total <= budget * device_memory


def estimate_memory(
    workload: Workload,
    parallel_config: ParallelConfig,
    *,
    pp_rank: Optional[int] = None,
    dp_cp_rank: int = 0,
    device_type: str = "cuda",
    overhead: Optional[OverheadAllowance] = None,
    gpu_name: Optional[str] = None,
    ranks_per_node: Optional[int] = None,
) -> MemoryEstimate:
    """Peak memory of one rank of FourDStrategy training ``workload`` with ``parallel_config`` (bytes)::

        estimate_memory(Workload("llama3-8b", micro_batch_size=1, seq_length=8192), ParallelConfig(...))

    Args:
        workload: the model (a :class:`~lightning_4d.models.LlamaConfig` or a preset name), the batch shape (b, s, m:
            ``num_microbatches`` defaults to :attr:`~lightning_4d.config.ParallelConfig.microbatches`), the precision,
            the MoE load and the optimizer (:class:`~lightning_4d.planning.workload.Workload`). Its MoE load
            multiplies the received rows of every MoE layer of the rank (their saved activations, the regrouped rows
            and the all-to-all buffers; :func:`lightning_4d.features.moe.costs.with_checked_load`); a capacity factor
            bounds the rows to ``E·capacity``; no effect at ep = 1 or on dense models.
        parallel_config: the layout, pipeline schedule, stages per rank and layer split included;
            ``data_parallel_size="auto"`` is not allowed here (resolve it first; another schedule:
            ``dataclasses.replace(parallel_config, pipeline_schedule=...)``).
        pp_rank: one pp rank; default: every pp rank is estimated and the largest returned.
        dp_cp_rank: rank in ``dp_cp`` (0 holds the largest ZeRO shards).
        device_type: ``"cuda"`` adds the overhead allowance; ``"cpu"`` none.
        overhead: an explicit allowance (default: from ``overhead.json`` for ``gpu_name``).
        gpu_name: ``torch.cuda.get_device_name()`` to pick the measured allowance.
        ranks_per_node: the ranks (GPUs) of one node, for :attr:`MemoryEstimate.host_per_node` (default
            ``min(world size, DEFAULT_RANKS_PER_NODE)``).

    Returns:
        :class:`MemoryEstimate` (module docstring: formulas and sources).

    Raises:
        ValueError: an invalid layout for the model (tp not dividing heads, layers not splitting into pp·v
            stages, ...), a sequence length the layout cannot split, an unknown precision or schedule, a
            ``num_microbatches`` the schedule cannot run, non-positive sizes, an MoE load below 1.
    """
    workload = moe_costs.with_checked_load(workload)
    cfg = _model(workload.model)
    pc = parallel_config
    if pc.data_parallel_size == "auto":
        raise ValueError("parallel_config.data_parallel_size is 'auto': call parallel_config.resolve(world_size).")
    pc.validate_model(cfg)
    m = workload.num_microbatches or pc.microbatches
    pc.validate_microbatches(m)
    ranks = [pp_rank] if pp_rank is not None else list(range(pc.pp))
    allowance = overhead if overhead is not None else overhead_allowance(gpu_name, device_type)
    precision = normalize_precision(workload.precision)
    work = replace(workload, model=cfg, precision=precision, num_microbatches=m)
    results = [_estimate_pp_rank(work, pc, r, dp_cp_rank, device_type, allowance) for r in ranks]
    worst = max(results, key=lambda e: e.total)
    per_node = ranks_per_node or min(pc.world_size, DEFAULT_RANKS_PER_NODE)
    host = max(e.host for e in results)
    return replace(worst, host=host, host_per_node=host * per_node)


def resident_state_bytes(workload: Workload, parallel_config: ParallelConfig, pp_rank: int = 0) -> int:
    """A lower bound of ``estimate_memory(workload, parallel_config, pp_rank=pp_rank).total`` (bytes): the parameters
    and optimizer states pp rank ``pp_rank`` (dp_cp rank 0) holds in every phase of a step
    (:func:`~lightning_4d.planning.states.model_state_bytes`). The estimate's total is these plus its peak phase's
    bytes plus the overhead allowance, both non-negative, so a layout whose resident states alone exceed a limit
    needs no full estimate (the planner's search skips it). The layout is not validated here: pass one that
    :func:`estimate_memory` accepts (the planner's are).

    Raises:
        ValueError: an unknown precision, a pp rank out of range.
    """
    cfg = _model(workload.model)
    states = model_state_bytes(cfg, parallel_config, normalize_precision(workload.precision), pp_rank=pp_rank)
    return states.resident


#: ranks on one node when the caller does not say (the GPUs of a DGX/HGX node)
DEFAULT_RANKS_PER_NODE = 8


def estimate_all_pp_ranks(workload: Workload, parallel_config: ParallelConfig, **kw: Any) -> list[MemoryEstimate]:
    """:func:`estimate_memory` for every pp rank, in pp-rank order (same arguments, ``pp_rank`` excepted)."""
    return [estimate_memory(workload, parallel_config, pp_rank=r, **kw) for r in range(parallel_config.pp)]


def _model(model_config: Any) -> Any:
    if isinstance(model_config, str):
        from lightning_4d.models.llama_config import LlamaConfig

        return LlamaConfig.from_preset(model_config)
    return model_config


def offloaded_bytes_per_microbatch(
    model_config: Any,
    parallel_config: ParallelConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str = "bf16-mixed",
    *,
    pp_rank: int = 0,
    device_type: str = "cuda",
) -> int:
    """Bytes one micro-batch's forward copies from pp rank ``pp_rank``'s device to host memory under
    ``activation_offload_layers`` (the same bytes come back in its backward): 0 without offload. The step-time model
    charges ``2·m·`` these over the host link (:mod:`lightning_4d.planning.step_time`).

    Raises:
        ValueError: see :func:`saved_activation_bytes`.
    """
    cfg, pc = _model(model_config), parallel_config
    if not pc.activation_offload_layers:
        return 0
    work = Workload(cfg, micro_batch_size, seq_length, precision)
    saved = saved_activation_bytes(work, pc, pp_rank=pp_rank, device_type=device_type)
    n_layers = rank_layout(cfg.num_layers, pc, pp_rank)[0]
    per_layer = saved_per_layer(saved, n_layers)
    return int(sum(offloaded_per_stage(pc, pc.rank_stages(cfg.num_layers, pp_rank), per_layer, saved["rope"])))


#: the phase of document masking's cp attention backward with its masks (ring and all-to-all: planning/buffers.py's
#: masked_ring_phase)
MASKED_PHASE = "masked cp attention backward"
#: the phase of the cp all-gather method's attention backward (planning/buffers.py's allgather_phase)
ALLGATHER_PHASE = "allgather attention backward"


def _phases(states: ModelStates, act: Activations, buf: Buffers, initialization: int = 0) -> dict[str, int]:
    """The bytes beyond parameters and optimizer states in each phase of a step (module docstring, **Peak**);
    ``initialization``: :func:`lightning_4d.planning.buffers.initialization_bytes` (before the first step: no
    optimizer states yet)."""
    # alive through forward and backward: autocast's weight copies, pipeline receive buffers, one layer's
    # context-parallel transients (an MoE layer's all-to-all buffers: their own phase below)
    layer_transients = act.compute_weights + buf.pipeline + buf.context_parallel
    phases = {
        "initialization": initialization - states.parameters - states.optimizer_states,
        # the loss' backward (its working set beside the saved logits) ends before the head's weight gradient exists,
        # and frees the saved logits (at least as large as the head's gradient for s >= h): the larger of the two
        "backward start": act.activations
        - act.recompute
        + max(
            act.logits + buf.gathered_loss,
            max(buf.head_gradient, buf.root_regather) + buf.first_bucket + buf.gathered_start,
        )
        + layer_transients
        + buf.resident_gradients,
        "backward end": states.gradients
        + buf.gradient_buffers
        + buf.gathered_end
        + buf.pipeline
        + buf.embedding_gradient
        + act.backward_end_held,
        "optimizer step": states.gradients + buf.step_temporaries,
    }
    phases.update(_feature_phases(act, buf, layer_transients))
    return phases


def _feature_phases(act: Activations, buf: Buffers, layer_transients: int) -> dict[str, int]:
    """The phases of a step that only some features have (module docstring, **Peak**), in the order
    :func:`_phases` reports them: a zero-bubble input pass, activation checkpointing's recompute, activation
    offload's prefetch, an MoE layer's backward under ep, float8's forward and backward, the loss' forward at ZeRO
    2/3 without pp, the head's backward under tp with sp."""
    phases: dict[str, int] = {}
    if act.input_pass:
        # a zero-bubble schedule's input pass keeps every saved tensor (retain_graph) and the output gradients its
        # weight pass will read (pipeline.weight_pass_inputs), the peak at its end
        phases["input pass"] = act.input_pass + layer_transients + buf.resident_gradients
    if act.recompute:
        phases["recompute"] = _recompute_phase(act, buf, layer_transients)
    if act.prefetch:
        # activation offload: a layer's backward with the offloaded layer below it prefetched beside it, the gradients
        # of the layers done made (when not resident from backward start)
        after = _after_loss(act, buf, layer_transients) - act.head_freed - act.recompute + buf.kept_weight_gradient
        phases["offload prefetch"] = after + max(extra + done * buf.layer_gradient for extra, done in act.prefetch)
    if buf.all_to_all:
        # an MoE layer's backward under ep: its all-to-all buffers exist after the loss' backward (not beside the
        # loss' working set: measured on CPU, tiny-moe dp2 ep2 ZeRO 1 s=512 bf16-mixed, the peak at backward start
        # was the estimate's without these buffers, 0.7% apart)
        phases[moe_costs.BACKWARD_PHASE] = _after_loss(act, buf, layer_transients) - act.recompute + buf.all_to_all
    if buf.masked_ring:
        # document masking under the cp ring: the first layer's attention backward with the own block's mask (its
        # feed-forward's backward done), once the loss' backward is done (planning/buffers.py's masked_ring_phase)
        phases[MASKED_PHASE] = _after_loss(act, buf, layer_transients) - act.recompute + buf.masked_ring
    if buf.allgather_backward:
        # the cp all-gather method: the first layer's attention backward, its largest kernel call (rank 0's last query
        # chunk against the keys before it), once the loss' backward is done (planning/buffers.py's allgather_phase)
        phases[ALLGATHER_PHASE] = _after_loss(act, buf, layer_transients) - act.recompute + buf.allgather_backward
    if buf.float8_backward:
        # float8: a converted linear's backward (its float8 copies and scale arithmetic) once the loss' backward has
        # freed what it saved but the labels (planning/float8_costs.py); under activation checkpointing
        # (recompute_backward) in the last layer's backward, its recomputed set alive and the head's saved tensors freed
        checkpointed = buf.recompute_backward > 0
        held = _after_loss(act, buf, layer_transients) - (act.head_freed if checkpointed else act.recompute)
        phases["float8 backward"] = held + buf.float8_backward
    if buf.float8_forward:
        # float8: the last decoder layer's forward, a converted linear casting its input (planning/float8_costs.py):
        # every saved tensor but the head's and the loss' (under checkpointing the layer's set alive as it runs), the
        # previous step's gradient shards (ZeRO 2/3), the gathered parameters (the converted weights in float8 with
        # FSDP2's float8 all-gather)
        in_forward = _in_forward(act, buf, layer_transients, buf.gathered_forward)
        phases["float8 forward"] = in_forward - act.forward_tail + buf.float8_forward
    if buf.forward_gradients:
        # the loss' forward at ZeRO 2/3 without pp: every saved tensor but a recomputed layer's, the loss' chunk, the
        # previous step's gradient shards (freed by zero_grad only after the forward)
        in_forward = _in_forward(act, buf, layer_transients, buf.gathered_loss)
        phases["forward end"] = in_forward - act.recompute + buf.loss_forward
    if buf.head_backward:
        phases["head backward"] = _head_backward_phase(act, buf)
    return phases


def _in_forward(act: Activations, buf: Buffers, layer_transients: int, gathered: int) -> int:
    """A moment of the forward: the activations, the previous step's gradient shards (ZeRO 2/3 without pp), the
    layer transients and the ``gathered`` parameters of that moment."""
    return act.activations + buf.forward_gradients + layer_transients + gathered


def _recompute_phase(act: Activations, buf: Buffers, layer_transients: int) -> int:
    """The first checkpointed layer's backward: its recomputed set, the first op's gradients, the gradient bucket
    made for the head's gradient (ZeRO 0/1, one micro-batch); the loss' backward has freed what it saved but the
    labels, and the head's backward what the head saved (module docstring, **Peak**)."""
    if buf.recompute_apart_from_cp:
        transient = max(buf.recompute_backward, buf.context_parallel) - buf.context_parallel
    else:
        transient = buf.recompute_backward
    return _after_loss(act, buf, layer_transients) - act.head_freed + transient


def _after_loss(act: Activations, buf: Buffers, layer_transients: int) -> int:
    """A layer's backward once the loss' backward has freed what it saved but the labels: the activations, the
    layer transients, the gradients gathered or resident at backward start and the first gradient bucket (without
    buckets, the gradients kept in ``.grad`` instead: ``Buffers.head_gradient_kept``)."""
    return (
        act.activations
        - act.loss_freed
        + layer_transients
        + buf.gathered_start
        + buf.resident_gradients
        + buf.first_bucket
        + buf.head_gradient_kept
    )


def _head_backward_phase(act: Activations, buf: Buffers) -> int:
    """The LM head's backward (tp with sp, last stage): the loss' backward has freed what it saved but the labels
    (the batch holds them), the logits' gradient (compute dtype) is alive, the head's weight gradient is made; no
    layer is recomputed yet."""
    return (
        act.activations
        - act.recompute
        - act.loss_freed
        + act.logits_gradient
        + buf.head_backward
        + buf.head_gradient
        + act.compute_weights
        + buf.gathered_start
        + buf.pipeline
        + buf.resident_gradients
    )


def _estimate_pp_rank(
    work: Workload,
    pc: ParallelConfig,
    pp_rank: int,
    dp_cp_rank: int,
    device_type: str,
    allowance: OverheadAllowance,
) -> MemoryEstimate:
    """:func:`estimate_memory` of one pp rank (``work``: its model a config, its precision normalized, its
    ``num_microbatches`` and MoE load given): each feature's terms (model states, activations,
    buffers), then the phases of a step and the peak."""
    cfg, precision = work.model, work.precision
    dt = Dtypes.for_layout(precision, cfg, pc, device_type)
    states = model_state_bytes(cfg, pc, precision, pp_rank=pp_rank, dp_cp_rank=dp_cp_rank)
    saved = saved_activation_bytes(work, pc, pp_rank=pp_rank, device_type=device_type)
    act = activation_terms(work, pc, dt, pp_rank, saved)
    buf = buffer_terms(work, pc, dt, pp_rank, states, device_type)
    phases = _phases(states, act, buf, initialization_bytes(cfg, pc, dt, pp_rank, states, buf))
    _add_held_copies(phases, work, pc, pp_rank, saved, device_type)
    for name in (MASKED_PHASE, ALLGATHER_PHASE):
        if name in phases and pc.activation_checkpointing != "none":
            # the recomputed layer's set is alive in its attention's backward (masked_ring_phase subtracts the parts
            # its feed-forward's backward freed from it)
            phases[name] += act.recompute
    peak_phase = max(phases, key=phases.get)
    tensors = states.resident + phases[peak_phase]
    extra = allowance.bytes_for(tensors)
    gathered = max(buf.gathered_start, buf.gathered_end)
    buffers = (
        act.compute_weights
        + gathered
        + buf.gradient_buffers
        + buf.step_temporaries
        + buf.pipeline
        + buf.context_parallel
        + buf.all_to_all
        + buf.embedding_gradient
    )
    return MemoryEstimate(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer_states=states.optimizer_states,
        activations=act.activations,
        logits=act.logits,
        buffers=buffers,
        overhead=extra,
        total=tensors + extra,
        peak_phase=peak_phase,
        pp_rank=pp_rank,
        details=_details(saved, states, act, buf, phases, work.num_microbatches if pc.pp > 1 else 1),
        host=states.host + act.offloaded,
    )


#: the phases in which activation offload's last offloaded layer is no longer held for its copy to host: before
#: the first step, after the whole backward, and when backward has reached that layer (its prefetch)
_HELD_COPIES_GONE = ("initialization", "backward end", "optimizer step", "offload prefetch")


def _add_held_copies(
    phases: dict[str, int], work: Workload, pc: ParallelConfig, pp_rank: int, saved: dict[str, int], device_type: str
) -> None:
    """Add to ``phases`` (in place) the device storages activation offload holds for the last offloaded layer's copy
    to host on CUDA (:func:`lightning_4d.planning.offload_costs.copies_in_flight`) in every phase from that layer's
    forward until backward reaches it; the RoPE tables (or the document mask) its views keep alive count only for a
    stage offloaded whole (otherwise the kept layers share and count them)."""
    if not pc.activation_offload_layers:
        return
    cfg = work.model
    per_layer = saved_per_layer(saved, rank_layout(cfg.num_layers, pc, pp_rank)[0])
    rope = saved["rope"] if offloaded_whole(cfg, pc, pp_rank) else 0
    held = copies_in_flight(pc, pc.rank_stages(cfg.num_layers, pp_rank), per_layer, rope, device_type)
    for name in phases:
        if name not in _HELD_COPIES_GONE:
            phases[name] += held


def _details(
    saved: dict[str, int], states: ModelStates, act: Activations, buf: Buffers, phases: dict[str, int], m: int
) -> dict[str, int]:
    """:attr:`MemoryEstimate.details`: the terms behind each field, by name (``m``: micro-batches in the pipeline)."""
    return {
        **{f"saved_{k}": val for k, val in saved.items()},
        "saved_for_backward": sum(saved.values()) - saved["recompute"],
        "in_flight_microbatches_x1000": int(act.in_flight * 1000),
        "num_microbatches": m,
        "compute_weights": act.compute_weights,
        "master_weights": states.master_weights,
        "host_model_states": states.host,
        "gathered_parameters": max(buf.gathered_start, buf.gathered_end),
        "gradient_buffers": buf.gradient_buffers,
        "optimizer_step_temporaries": buf.step_temporaries,
        "pipeline_buffers": buf.pipeline,
        "context_parallel_buffers": buf.context_parallel,
        moe_costs.BUFFER_DETAIL: buf.all_to_all,
        "head_gradient": buf.head_gradient,
        "host_offloaded_activations": act.offloaded,
        "offload_unpacked": act.recompute - saved["recompute"],
        **{f"phase_{k.replace(' ', '_')}": val for k, val in phases.items()},
    }
