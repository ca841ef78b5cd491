"""Our strategy's own memory model: bytes per rank and per pipeline stage, counted from what our code allocates.

The paper's estimator (:mod:`lightning_4d.memory.fujii2024`: Fujii, Watanabe and Yokota 2024, arXiv 2411.06465)
models Megatron-LM and leaves what it does not model to a 20% margin (a layout is trainable below 80% of the GPU).
This model counts those things instead, because it follows FourDStrategy's own code, tensor by tensor:

**Model states** (:func:`model_state_bytes`). Every parameter tensor of the pp rank's pipeline stages with its
tensor-parallel local shape (``wq``/``wk``/``wv``/``w1``/``w3``/``output`` split on rows, ``wo``/``w2`` on columns,
the embedding by vocabulary rows, RMSNorm weights replicated), then its ZeRO shard over ``dp_cp`` (D = dp·cp ranks):

- ZeRO stage 0: everything replicated; gradients in ``GradientBuckets`` (one copy, from the first gradient to the
  end of the optimizer step);
- ZeRO stage 1 (``GradientBuckets`` + ``ShardedOptimizer``): the parameters, in reverse order, fill gradient buckets
  of ``GRADIENT_BUCKET_BYTES`` (25 MiB of parameters as built), each padded to a multiple of D; rank r owns range r
  of every bucket and holds Adam m and v (and the master weights) for those elements only (:func:`_bucket_owned`);
- ZeRO stages 2, 3 (FSDP2 ``fully_shard``): parameters, gradients and Adam states of ``ceil(rows/D)`` rows of dim
  0 (rank r holds rows ``[r·chunk, (r+1)·chunk)``, clipped), as ``torch.chunk``; a stacked expert weight
  ``[E_local, d1, d2]`` whose group (G ranks) does not divide ``E_local`` but divides ``d1`` on dim 1 instead, evenly:
  ``E_local·(d1/G)·d2`` elements per rank (:func:`lightning_4d.partition.expert_shard_dim`).

Dtypes (:class:`_Dtypes`; ``lightning_4d/parallel/sharded_optimizer.py``): ``32-true`` float32 everywhere;
``bf16-mixed`` (master weights, Megatron-LM's and torchtitan's mixed precision) bfloat16 parameters, float32 gradients,
float32 master
weights + Adam m, v: 2 + 4 + 12 bytes per parameter at ZeRO 0, 2 + 4 + 12/D at ZeRO 1, and at ZeRO 2/3 the float32
FSDP2 shard is the master (16/D); ``bf16-true`` bfloat16 everywhere; ``16-mixed`` (Lightning's autocast, kept for
float16) float32 weights, gradients and moments. The step counters (0-d float32 tensors on the CPU unless
``capturable``) are not counted.

**Activations** (:func:`saved_activation_bytes`): the tensors our layers save for backward, as
``torch.autograd.graph.saved_tensors_hooks`` sees them (each storage once), for the SDPA backend (its fused CPU and
CUDA kernels save q, k, v, the output and a float32 log-sum-exp ``[b, heads, s]``; kv heads are not repeated). Per
layer, with ``y`` = b·s·h elements, ``s'`` = s/t under sequence parallelism (s otherwise), ``c`` = bytes of the
compute dtype, ``r`` = bytes of the residual stream (2 for ``bf16-mixed`` and ``bf16-true``, 4 for ``32-true`` and
``16-mixed``):

- two RMSNorms: the input as given (r·b·s'·h) and the float32 reciprocal RMS (4·b·s');
- the inputs of ``wq``/``wk``/``wv`` and of ``w1``/``w3``, once per group: under sp the sequence shard (c·b·s'·h,
  gathered again in backward: ``lightning_4d/parallel/tensor.py``), else c·y (under ``16-mixed`` autocast casts the
  float32 norm output once per linear: 3 + 2 copies);
- SDPA: q and its output (c·y/t each), k and v (c·b·s·k·d/t each), the log-sum-exp (4·b·s·a/t);
- SwiGLU: ``w1 x``, ``w3 x``, ``silu(w1 x)`` and the product (c·b·s·f/t each); a Mixture-of-Experts layer its router,
  dispatch, experts and shared experts instead (:func:`_moe_saved`), under expert parallelism on the rows the rank
  receives: the balanced figure times ``expert_load_imbalance`` (:data:`DEFAULT_EXPERT_LOAD_IMBALANCE`, measured).

Outside the layers: the token ids (int64), the RoPE cos/sin tables (float32 ``[s, d/2]`` each, shared by all
layers), the final norm (as above), the head's input (c·b·s'·h: under sp the sequence shard), and what the loss saves
(:mod:`lightning_4d.parallel.loss`): the logits as the head made them, in the compute dtype (c·b·s·V/t, the local
vocabulary shard under tp; a tensor that would otherwise be freed after the forward), the float32 log-sum-exp of
every token (4·b·s) and the labels (int64, 8·b·s). With ``16-mixed`` (Lightning's autocast), autocast's float16
copies of the weight matrices are saved too (2 bytes per local matrix element; the embedding is not cast). With full
activation checkpointing a layer saves only its input (r·b·s'·h) and the backward re-runs one layer at a time (one
layer's saved set, transient).
With selective activation checkpointing (``lightning_4d/parallel/activation_checkpoint.py``: the outputs of the matmuls,
attention kernels and tp reductions kept, everything else recomputed) a layer keeps (:func:`_layer_selective_parts`;
measured as the outputs the policy keeps, plus the checkpoint's input):

- its input (r·b·s'·h);
- the outputs of its matmuls: c·b·s·((a + 2k)·d + 2f)/t for ``wq``/``wk``/``wv`` and ``w1``/``w3``, and at tp = 1
  c·b·s·h for ``wo``; under tp not ``wo``'s partial sum (full ``[b, s, h]`` on every rank: the backward recomputes
  it), and nothing of ``w2`` (the recomputation stops once it has ``w2``'s inputs);
- each attention kernel call's output and float32 log-sum-exp, (c·d + 4)·b·a/t bytes per query token: s tokens
  without cp; under cp (s the local sequence), cp rank r's calls cover s·(1 + r) + s·(cp − 1 − r)/2 tokens with
  ``"ring"`` and 2·s (1.5·s on cp rank 0) with ``"allgather"``; the figure is the last cp rank's, the largest
  (ring: cp·s, the whole sequence; allgather: 2·s);
- under tp, the reduced output of ``wo`` (all-reduce, or reduce-scatter under sp): c·b·s'·h;

and one layer's backward recomputes, transiently (``recompute``, :func:`_layer_selective_recompute`), what the layer
would save without checkpointing less what it takes from the kept outputs (v, the attention output and
log-sum-exp, ``w1 x``, ``w3 x``): the ffn norm's input, both norms' rsqrt, the matmul inputs (sequence shards under
sp, autocast casts), the rotated q and k, ``silu(w1 x)`` and the SwiGLU product (not the attention norm's input: it
is the layer's input, kept); the kept outputs the recomputation consumes are freed by then (``wq``'s and ``wk``'s,
whose rotated copies are saved instead, and ``wo``'s output or reduction, read only by the residual sum): net of
those. Measured tensor by tensor on CPU (``LiveTensorBytes`` at the last layer's ``w2`` / SwiGLU backward,
tiny-test tp1 and tp2, ``32-true`` and ``bf16-mixed``): the ``recompute`` phase within 216 B. autocast's weight
copies and ``"allgather"``'s gathered K/V are made again there as under full checkpointing.

**Peak** (:class:`MemoryEstimate`): memory moves through the phases of a step (and initialization before the
first one), and the estimate is the largest:

- start of backward: activations (no layer recomputed yet) + the loss's backward working set (the logits' gradient
  in the compute dtype, ``c·b·s·V/t``, + when the compute dtype is not float32 one chunk's float32 softmax,
  ``4·n·V/t`` with ``n = min(b·s, loss_chunk_tokens(V/t))`` tokens: at most 64 MiB,
  :func:`lightning_4d.partition.loss_chunk_tokens`; a float32 gradient is computed in place), or instead the head's
  gradient (made once the loss' backward has freed the saved logits: the larger of the two; with one micro-batch per
  step at ZeRO 0/1, the head's gradient + the gradient bucket made for it) + compute copies + parameters gathered by
  FSDP2 (with the head's gradient; with the loss' working set too, except at ZeRO 3 without pp, where every unit,
  the root included, is resharded after its forward and the root is gathered again only once the loss' backward is
  done) + ZeRO 0/1's gradient buckets when the step has several micro-batches (a pipeline, gradient accumulation:
  the buckets exist from the first backward to the end of the optimizer step; with one micro-batch they are made
  during backward as the layers' activations are freed, which peaks at the end of backward) + one layer's
  context-parallel transients;
- expert-parallel backward (ep > 1): the activations less what the loss' backward freed, + one MoE layer's
  all-to-all receive buffers at the stated load (:func:`_expert_parallel_buffers`), as the recompute phase;
- head backward (the last stage under tp with sp; :func:`_head_backward_transient`): the activations (without a
  layer's recomputed set: none is being recomputed yet) less what the loss' backward freed (all it saved but the
  labels) + the logits' gradient (compute dtype) + the head's weight gradient + the working set of the head's
  backward (the input gathered again, its gradient and the reduce-scatter's copies, or
  ``tensor_parallel_overlap``'s ring shards) + compute copies + gathered parameters + ZeRO 0/1's buckets (with
  several micro-batches per step);
- end of backward: the gradients (full for ZeRO stages 0/1, this rank's shard + the root unit's unsharded
  gradients for 2/3) + gradient communication buffers (ZeRO stages 0/1: one parameter's fresh gradient before its
  hook adds it to the bucket; 2: two FSDP2 units of unsharded gradients) + gathered parameters; at ZeRO 3 without
  pp the larger of two moments (measured tensor by tensor on CPU; ``_buffer_terms``), each with the gradient shards
  made so far (all but the root's), the gathered root and the reduce-scatter input FSDP2 keeps of the last unit
  reduced (a layer's, in the reduce dtype): the first layer's backward (+ two gathered layer units + the head's
  gradient, less the first layer's shard) and the embedding's (+ the root's unsharded gradients; a tied weight's
  three: the head's, the embedding's and their sum);
- recompute (activation checkpointing): the first checkpointed layer's backward, where the step's peak was measured
  on CPU (full and selective, tp 1 and 2, ZeRO 0, 1 and 3): the activations with one layer's recomputed set, less
  what the loss' backward freed (all it saved but the labels) and the head's saved tensors (the final norm's input
  and rsqrt, the head's input: freed by its backward), + the gradient of the layer's output and the larger of
  ``w2``'s backward (its input gradient, its weight gradient and under sp its output gradient all-gathered,
  ``[T, h]``) and the SwiGLU product's after it (the product freed, two ``[T, f/t]`` gradients beside the product's):
  ``_recompute_backward`` + the gradient bucket made for the head's gradient (ZeRO 0/1, one micro-batch) + gathered
  parameters + ZeRO 0/1's buckets (several micro-batches per step);
- end of forward (ZeRO 2/3 without pp): the activations (no layer recomputed) + the loss' forward chunk (float32
  ``exp(x - max)``) + the previous step's gradient shards (Lightning calls ``zero_grad`` after ``training_step``) +
  the parameters gathered while the loss runs;
- optimizer step: the gradients + ZeRO-1's all-gather buckets + the optimizer's temporaries: none for
  ``torch.optim.AdamW(fused=True)`` (:class:`~lightning_4d.tasks.CausalLMModule`'s: one kernel updates each tensor
  in place; measured on CPU: no byte allocated during the step), one moment's bytes for ``AdamW(foreach=True)``
  (``_foreach_sqrt`` of the second moments; ``estimate_memory(fused_optimizer=False)``);
- initialization (before the first step; :func:`_initialization_bytes`): ``LlamaModel.init_weights`` draws every
  parameter whole in float32 (so that every layout starts from one process's weights) and copies this rank's piece
  out of it: the rank's parameters in their setup dtype + the largest whole parameter of its stages (the embedding,
  ``V·h``, not divided by tp); under ``bf16-mixed`` at ZeRO 0/1, the cast to bfloat16 after the optimizer's setup
  (float32 parameters + master weights + one parameter's bfloat16 copy) if larger. Measured with
  ``lightning-4d measure`` on CPU (llama3.2-1b, the peak at the end of setup): tp8 dp8 ZeRO 3 1.052 GiB (estimated
  1.050), dp8 ZeRO 3 1.554 (1.554), tp4 cp2 dp2 ZeRO 1 2.712 (2.712).

``total = parameters + optimizer_states + overhead + max(phases)``; ``overhead`` is the measured allowance for the
CUDA context and fragmentation (:mod:`lightning_4d.memory.hardware`), zero on CPU.

**Pipeline parallelism** (validated against measured per-pp-rank bytes in ``tests/test_memory_model.py``): pp rank
r holds v pipeline stages (:meth:`~lightning_4d.config.ParallelConfig.rank_stages`) of ``L/(p·v)`` layers each (the
first stage also the embedding, the last the final norm, head and loss); 1F1B keeps ``min(m, p − r)`` micro-batches
of activations, GPipe ``m``, interleaved 1F1B ``min(m·v, 2(p − r − 1) + (v − 1)p + 1)`` stage-micro-batches
(Megatron-LM's warm-up count), plus the receive buffers of one micro-batch's hidden states per micro-batch and
stage boundary.

**Context parallelism** (``lightning_4d/parallel/context.py``) divides every sequence-sized tensor by c (each rank
holds ``s/c`` tokens of every sequence). What is not divided by c, per method: ``"ring"`` saves only the local
q, k, v, output and float32 log-sum-exp (the same tensors as plain attention) and holds, transiently in one layer's
backward, the K/V block in hand and the one arriving, the block's float32 dK/dV accumulator and the one arriving,
the rank's own block's float32 dK/dV (kept to the end, so that the accumulators travel ``c − 1`` hops), and float32
dq (``2·(2·c_b + 3·4)·b·(s/c)·k·d/t + 4·b·(s/c)·a·d/t`` bytes, ``c_b`` the compute dtype's bytes);
``"allgather"`` saves the gathered K and V of the whole sequence besides the local ones
(``2·c_b·b·s·k·d/t`` more bytes per layer) and, in one layer's backward, their float32 gradient for all
``s`` tokens and float32 dq (``2·4·b·s·k·d/t + 4·b·(s/c)·a·d/t``).

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import numpy as np

from lightning_4d.config import PIPELINE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, ParallelConfig, _check_positive_int
from lightning_4d.memory.hardware import GIB, OverheadAllowance
from lightning_4d.partition import (
    GRADIENT_BUCKET_BYTES,
    bucket_lengths,
    bucket_shard,
    expert_shard_dim,
    loss_chunk_tokens,
    powersgd_compressible,
)

__all__ = [
    "DEFAULT_EXPERT_LOAD_IMBALANCE",
    "MemoryEstimate",
    "PRECISIONS",
    "PIPELINE_SCHEDULES",
    "estimate_memory",
    "estimate_all_pp_ranks",
    "model_state_bytes",
    "offloaded_bytes_per_microbatch",
    "saved_activation_bytes",
    "check_expert_load_imbalance",
    "checkpoint_bytes_per_parameter",
    "normalize_precision",
]

#: The default ``expert_load_imbalance`` of :func:`estimate_memory` (and of ``lightning-4d estimate`` / ``plan``,
#: :class:`~lightning_4d.memory_check.MemoryEstimatorCallback` and the planner, which all take it from here): the
#: rows the most loaded ep rank's experts receive over the balanced figure, max over steps, MoE layers and ep ranks,
#: MEASURED on the tiny MoE job (``configs/tiny_moe.yaml``: dp2 x tp2, ep2, 450 steps, 2026-11-26) with
#: :class:`lightning_4d.callbacks.ExpertLoadMonitor` (``moe_expert_load_imbalance_max``): 1.9287 at step 7 (the freshly
#: initialized router sends almost every row of a layer to one rank; mean over the run 1.196, max 1.50 after step 100,
#: 1.26 after step 200), rounded up to 1.93. Per-step figures:
#: ``benchmarks/results/expert_load_imbalance_tiny_moe_cpu_2026-11-26.json``; docs/moe.md, "Memory", gives the command.
#: Under a capacity factor the capacity bounds the received rows instead when it is lower.
DEFAULT_EXPERT_LOAD_IMBALANCE = 1.93

#: Lightning precision flags the model knows (names as ``Trainer(precision=...)``).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
_PRECISION_ALIASES = {
    "32": "32-true",
    "fp32": "32-true",
    "float32": "32-true",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "32-true": "32-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "16-true": "bf16-true",
}  # float16 weights have bfloat16's byte counts


def normalize_precision(precision: str) -> str:
    """The precision of :data:`PRECISIONS` a Lightning precision flag or alias names (``"bf16"`` -> ``"bf16-mixed"``,
    ``"32"`` -> ``"32-true"``, ``"16-true"`` -> ``"bf16-true"``: float16 weights have bfloat16's byte counts).

    Raises:
        ValueError: a flag the memory model does not know.
    """
    key = str(precision).lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision={precision!r} is not valid: expected one of {list(PRECISIONS)}.")
    return _PRECISION_ALIASES[key]


@dataclass(frozen=True)
class _Dtypes:
    param: int  # bytes of a parameter element as the layers compute with it (ZeRO 0/1 storage)
    grad: int  # gradient (ZeRO 0/1: bucket) bytes
    master: int  # bytes of a master weight element (0: the parameters are their own masters)
    compute: int  # matmul inputs and outputs
    residual: int  # residual stream between layers
    autocast: bool  # 16-mixed: float32 weights and inputs cast per op by Lightning's autocast
    #: SDPA saves k and v with every query head's copy: float32 GQA on CUDA (models/attention_backends.py,
    #: ``sdpa_repeats_kv_heads``)
    kv_repeated: bool = False

    @staticmethod
    def for_layout(precision: str, model_config: Any, pc: ParallelConfig, device_type: str) -> "_Dtypes":
        """:meth:`of` ``precision``, with ``kv_repeated`` where the ``sdpa`` backend repeats the kv heads."""
        dt = _Dtypes.of(precision)
        repeats = (
            device_type == "cuda"
            and precision == "32-true"
            and pc.cp == 1
            and getattr(model_config, "attention_backend", "sdpa") == "sdpa"
            and model_config.num_kv_heads != model_config.num_heads
        )
        return replace(dt, kv_repeated=True) if repeats else dt

    @staticmethod
    def of(precision: str) -> "_Dtypes":
        if precision == "32-true":
            return _Dtypes(4, 4, 0, 4, 4, False)
        if precision == "bf16-mixed":  # bf16 weights, fp32 gradients and master weights (parallel/sharded_optimizer.py)
            return _Dtypes(2, 4, 4, 2, 2, False)
        if precision == "16-mixed":  # Lightning's autocast with a gradient scaler: fp32 weights
            return _Dtypes(4, 4, 0, 2, 4, True)
        return _Dtypes(2, 2, 0, 2, 2, False)

    @property
    def setup(self) -> int:
        """Bytes of a parameter element when the gradient buckets are built (before the cast to ``param``)."""
        return 4 if self.master else self.param

    @property
    def moment(self) -> int:
        """Bytes of one Adam moment element (the master's dtype, else the parameter's)."""
        return self.master or self.param


def checkpoint_bytes_per_parameter(precision: str) -> int:
    """Bytes one parameter takes in a checkpoint of a job trained in ``precision``: the parameter in its training
    dtype, its float32 master weight where that is separate, and Adam's two moments (``bf16-mixed`` 2 + 4 + 8 = 14,
    ``32-true`` 4 + 8 = 12); :func:`lightning_4d.memory.reliability.checkpoint_bytes` multiplies it by the parameters.

    Raises:
        ValueError: an unknown precision (:func:`normalize_precision`).
    """
    dt = _Dtypes.of(normalize_precision(precision))
    return dt.param + dt.master + 2 * dt.moment


@dataclass(frozen=True)
class _Param:
    name: str
    rows: int  # dim 0 of the tp-local tensor (experts: the experts this rank holds)
    cols: int  # elements per row (1 for a vector)
    matrix: bool
    unit: str  # FSDP2 unit: "layers.<i>" or "root"
    expert: bool = False  # a routed experts' stacked weight [E/ep, ...] (sharded over ep, ZeRO over dp·cp/ep)
    dim1: int = 0  # an expert weight's dim 1 (f_e of w1/w3, h of w2; cols = dim1 · dim 2): ZeRO 2/3 may shard it
    token: bool = False  # a Mixture-of-Experts layer's (run token parallel under tp: not split, ZeRO over dp·cp·tp)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def _with_pipeline(pc: ParallelConfig, **overrides: Any) -> ParallelConfig:
    """``pc`` with the pipeline options given (not ``None``) replaced (validated by ``ParallelConfig``)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(pc, **overrides) if overrides else pc


def _rank_layout(num_layers: int, pc: ParallelConfig, pp_rank: int) -> tuple[int, bool, bool]:
    """(decoder layers, holds the embedding, holds the final norm + head) of pp rank ``pp_rank``."""
    stages = pc.rank_stages(num_layers, pp_rank)
    indices = {st for st, _ in stages}
    return sum(len(r) for _, r in stages), 0 in indices, pc.num_stages - 1 in indices or pc.pp == 1


def _is_moe_layer(cfg: Any, index: int) -> bool:
    """Whether layer ``index`` of ``cfg`` is a Mixture-of-Experts layer (``LlamaConfig.is_moe_layer``; a duck-typed
    config without it is dense)."""
    test = getattr(cfg, "is_moe_layer", None)
    return bool(test(index)) if test is not None else False


def _stage_params(cfg: Any, tp: int, layers: Any, first: bool, last: bool, ep: int = 1) -> list[_Param]:
    """The parameters of layers ``layers`` (+ embedding / final norm and head), in the model's order (the order
    ``model.parameters()`` yields them: ZeRO 1's buckets follow it). An MoE layer's feed-forward is the router
    ``[E, h]``, the experts' stacked ``w1``, ``w3`` ``[E, f_e, h]`` and ``w2`` ``[E, h, f_e]`` (``E/ep`` rows each:
    the experts of this ep rank) and the shared experts' ``w1``, ``w3``, ``w2`` (width ``n_s·f_e``), none of them
    divided by tp: under tp an MoE layer runs whole on each tp rank's tokens (``parallel/tensor.py``'s
    ``TokenParallel``; ``token``-marked)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k, vocab = cfg.num_heads, cfg.num_kv_heads, cfg.padded_vocab_size
    out: list[_Param] = []
    if first:
        out.append(_Param("tok_embeddings.weight", vocab // tp, h, True, "root"))
    for i in layers:
        u = f"layers.{i}"
        out += [
            _Param(f"{u}.attention_norm.weight", h, 1, False, u),
            _Param(f"{u}.attention.wq.weight", a * d // tp, h, True, u),
            _Param(f"{u}.attention.wk.weight", k * d // tp, h, True, u),
            _Param(f"{u}.attention.wv.weight", k * d // tp, h, True, u),
            _Param(f"{u}.attention.wo.weight", h, a * d // tp, True, u),
            _Param(f"{u}.ffn_norm.weight", h, 1, False, u),
        ]
        if _is_moe_layer(cfg, i):
            e, fe, fs = cfg.num_experts, cfg.expert_intermediate_size, cfg.num_shared_experts
            ff = f"{u}.feed_forward"
            out += [
                _Param(f"{ff}.router.weight", e, h, True, u, token=True),
                _Param(f"{ff}.experts.w1", e // ep, fe * h, True, u, expert=True, token=True, dim1=fe),
                _Param(f"{ff}.experts.w3", e // ep, fe * h, True, u, expert=True, token=True, dim1=fe),
                _Param(f"{ff}.experts.w2", e // ep, h * fe, True, u, expert=True, token=True, dim1=h),
            ]
            if fs:
                out += [
                    _Param(f"{ff}.shared_experts.w1.weight", fs * fe, h, True, u, token=True),
                    _Param(f"{ff}.shared_experts.w3.weight", fs * fe, h, True, u, token=True),
                    _Param(f"{ff}.shared_experts.w2.weight", h, fs * fe, True, u, token=True),
                ]
        else:
            out += [
                _Param(f"{u}.feed_forward.w1.weight", f // tp, h, True, u),
                _Param(f"{u}.feed_forward.w3.weight", f // tp, h, True, u),
                _Param(f"{u}.feed_forward.w2.weight", h, f // tp, True, u),
            ]
    if last:
        out.append(_Param("norm.weight", h, 1, False, "root"))
        if not (cfg.tie_word_embeddings and first):  # tied at pp = 1: one tensor (pp > 1: _as_held)
            out.append(_Param("output.weight", vocab // tp, h, True, "root"))
    return out


class _UntiedView:
    """A model config read as untied (``tie_word_embeddings`` false), every other attribute the config's own."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg
        self.tie_word_embeddings = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def _as_held(cfg: Any, pc: ParallelConfig) -> Any:
    """``cfg`` as the ranks of layout ``pc`` hold its tensors. Tied embeddings under pp > 1 are two tensors, the
    first stage's embedding and the last stage's copy as the LM head (``parallel/pipeline.py``'s ``TiedEmbedding``),
    parameters, gradients and optimizer states alike, as in an untied model: a rank holding only one of the two
    stages holds one tensor either way; a V schedule's rank 0, which holds both stages, keeps the one tied weight at
    ZeRO 0/1 and two copies at ZeRO 2/3 (each stage chunk its own FSDP2 root), read here as untied. ``cfg`` itself
    otherwise."""
    if pc.pp > 1 and pc.zero_stage >= 2 and getattr(cfg, "tie_word_embeddings", False):
        return _UntiedView(cfg)
    return cfg


def _rank_layers(num_layers: int, pc: ParallelConfig, pp_rank: int) -> list[int]:
    """The indices of the decoder layers pp rank ``pp_rank`` holds, in order."""
    return sorted(i for _, r in pc.rank_stages(num_layers, pp_rank) for i in r)


def _weighted_params(
    cfg: Any, tp: int, layers: list[int], first: bool, last: bool, ep: int = 1
) -> tuple[tuple[_Param, int], ...]:
    """:func:`_stage_params` of ``layers`` with the identical layers folded into one representative layer and a
    count: one dense layer and, in an MoE config, one MoE layer (cached: the planner asks for the same stages
    thousands of times)."""
    if getattr(cfg, "num_experts", 0):
        moe = [i for i in layers if _is_moe_layer(cfg, i)]
        dense = [i for i in layers if not _is_moe_layer(cfg, i)]
    else:  # a dense model (the planner asks this thousands of times: no per-layer test)
        moe, dense = [], list(layers)
    reps = tuple((group[0], len(group)) for group in (dense, moe) if group)
    sizes = _Sizes.of(cfg, 0, moe_layers=tuple(moe[:1]))
    return _folded_params(sizes, tp, reps, first, last, ep)


@functools.lru_cache(maxsize=8192)
def _folded_params(
    sizes: "_Sizes", tp: int, reps: tuple[tuple[int, int], ...], first: bool, last: bool, ep: int
) -> tuple[tuple[_Param, int], ...]:
    """:func:`_weighted_params` on hashable values: ``reps`` = ``((representative layer, layers like it), ...)``."""
    counts = dict(reps)
    return tuple(
        (p, counts[int(p.unit.split(".")[1])] if p.unit != "root" else 1)
        for p in _stage_params(sizes, tp, sorted(counts), first, last, ep)
    )


def _chunk(n: int, world: int, rank: int) -> int:
    """Length of rank ``rank``'s piece when ``n`` is cut in pieces of ``ceil(n/world)`` (``torch.chunk``)."""
    size = math.ceil(n / world) if n else 0
    return max(0, min(n - rank * size, size))


@dataclass(frozen=True)
class _Sizes:
    """The model sizes :func:`_stage_params` reads, hashable (for :func:`_zero1_owned`'s cache)."""

    hidden_size: int
    head_dim: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    expert_intermediate_size: int = 0
    num_shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()

    @staticmethod
    def of(cfg: Any, num_layers: int, moe_layers: Optional[tuple[int, ...]] = None) -> "_Sizes":
        """The sizes of ``cfg``; ``moe_layers``: its MoE layers among ``range(num_layers)`` (default: found), or
        those of the layers the caller will ask about."""
        moe = moe_layers
        if moe is None:
            moe = tuple(i for i in range(num_layers) if _is_moe_layer(cfg, i)) if getattr(cfg, "num_experts", 0) else ()
        return _Sizes(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.padded_vocab_size,
            bool(cfg.tie_word_embeddings),
            getattr(cfg, "num_experts", 0),
            getattr(cfg, "expert_intermediate_size", 0) if moe else 0,
            getattr(cfg, "num_shared_experts", 0),
            moe,
        )

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers


@functools.lru_cache(maxsize=4096)
def _zero1_owned(
    sizes: _Sizes,
    tp: int,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    elem_bytes: int,
    world: int,
    rank: int,
    bucket_bytes: int,
    ep: int = 1,
    tp_rank: int = 0,
) -> int:
    """:func:`_bucket_owned` of the parameters of ``layers`` (+ embedding / head), cached: the planner asks for the
    same stage under many micro-batch sizes. Under expert parallelism (``ep`` > 1) the expert weights fill buckets
    of their own, sharded over the expert data-parallel group (``world / ep`` ranks; this rank is ``rank // ep`` of
    it, ``ParallelConfig.ep_coordinates``), the others over all ``world`` ranks (``parallel/grad_buffers.py``).
    Under tp the Mixture-of-Experts layers' parameters run token parallel: their buckets go over ``world·tp`` ranks
    (this rank
    ``rank·tp + tp_rank``), the experts' under ep over ``world·tp/ep`` (``(rank // ep)·tp + tp_rank``;
    ``lightning_4d/mesh.py``'s ``dp_cp_tp`` and ``edp_tp``)."""
    params = _stage_params(sizes, tp, layers, first, last, ep)
    kinds = {0: [], 1: [], 2: []}  # dense, token parallel, experts (GradientBuckets' kinds)
    for p in params:
        kinds[2 if p.expert and ep > 1 else 1 if p.token and tp > 1 else 0].append(p.numel)
    owned = _bucket_owned(kinds[0], elem_bytes, world, rank, bucket_bytes)
    owned += _bucket_owned(kinds[1], elem_bytes, world * tp, rank * tp + tp_rank, bucket_bytes)
    owned += _bucket_owned(kinds[2], elem_bytes, world * tp // ep, (rank // ep) * tp + tp_rank, bucket_bytes)
    return owned


@functools.lru_cache(maxsize=4096)
def _first_bucket_elements(
    sizes: _Sizes,
    tp: int,
    num_layers: int,
    first: bool,
    last: bool,
    ep: int,
    elem_bytes: int,
    bucket_bytes: int,
    world: int,
) -> int:
    """Elements of the first ZeRO 0/1 gradient bucket of a rank holding ``range(num_layers)`` (+ embedding / head):
    ``GradientBuckets`` fills buckets with the parameters in reverse order, of ``elem_bytes`` each, at most
    ``bucket_bytes`` per bucket, the token-parallel (tp > 1) and expert (ep > 1) parameters in buckets of their own
    (:func:`lightning_4d.partition.bucket_lengths`), each padded to a multiple of ``world`` (its group's ranks); the
    first holds the head's weight, the first gradient of backward."""
    dense = [
        p.numel
        for p in _stage_params(sizes, tp, range(num_layers), first, last, ep)
        if not (p.expert and ep > 1) and not (p.token and tp > 1)
    ][::-1]
    lengths = bucket_lengths([n * elem_bytes for n in dense], bucket_bytes)
    return bucket_shard(sum(dense[: lengths[0]]), world, world - 1)[1] if lengths else 0


def _bucket_owned(numels: list[int], elem_bytes: int, world: int, rank: int, bucket_bytes: int) -> int:
    """Elements rank ``rank`` of ``world`` owns at ZeRO 1 (``GradientBuckets`` + ``ShardedOptimizer``): the
    parameters, in reverse order, fill buckets of at most ``bucket_bytes`` (a bucket's first parameter may exceed it);
    each bucket is padded to a multiple of ``world`` elements and cut in ``world`` equal ranges, rank r owning range r
    (its real elements only): :func:`lightning_4d.partition.bucket_lengths` and
    :func:`lightning_4d.partition.bucket_shard`, the rules ``parallel/grad_buffers.py`` builds its buckets with."""
    order = numels[::-1]
    total = start = 0
    for length in bucket_lengths([n * elem_bytes for n in order], bucket_bytes):
        n = sum(order[start : start + length])
        lo, hi = bucket_shard(n, world, rank)
        total += max(0, min(n, hi) - min(n, lo))
        start += length
    return total


def _fsdp_dim(p: _Param, group: int) -> int:
    """The dimension FSDP2 shards ``p`` on over ``group`` ranks: :func:`lightning_4d.partition.expert_shard_dim` for
    an expert weight, else 0."""
    return expert_shard_dim((p.rows, p.dim1), group) if p.expert else 0


def _padded_numel(p: _Param, world: int, ep: int = 1) -> int:
    """Elements of ``p`` in FSDP2's all-gather output: dim 0 padded to a multiple of its group's size
    (:func:`_fsdp_group`), or an expert weight sharded on dim 1, which FSDP2 shards evenly only (no padding)."""
    group, _ = _fsdp_group(p, world, 0, ep)
    if _fsdp_dim(p, group) == 1:
        return p.numel
    return math.ceil(p.rows / group) * group * p.cols


def _fsdp_shard_numel(p: _Param, world: int, dp_cp_rank: int, ep: int) -> int:
    """Elements of ``p`` rank ``dp_cp_rank`` holds at ZeRO 2/3 (FSDP2's ``torch.chunk`` of dim 0 over its group,
    :func:`_fsdp_group`; an expert weight sharded on dim 1: ``rows · (dim1 / G) · dim 2``, even)."""
    group, rank = _fsdp_group(p, world, dp_cp_rank, ep)
    if _fsdp_dim(p, group) == 1:
        return p.rows * _chunk(p.dim1, group, rank) * (p.cols // p.dim1)
    return _chunk(p.rows, group, rank) * p.cols


def _fsdp_group(p: _Param, world: int, dp_cp_rank: int, ep: int) -> tuple[int, int]:
    """``(size, rank)`` of the group FSDP2 shards ``p`` over at ZeRO 2/3: the expert weights (``E/ep`` rows of this
    ep rank) over the expert data-parallel group (``dp·cp/ep`` ranks, this rank ``dp_cp_rank // ep``:
    ``ParallelConfig.ep_coordinates``, ``parallel/fsdp.py``'s ``apply_fsdp``), every other tensor over ``dp_cp``."""
    if p.expert and ep > 1:
        return world // ep, dp_cp_rank // ep
    return world, dp_cp_rank


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's parameters, gradients (at the optimizer step) and optimizer states: Adam's m and v plus
    the float32 master weights where they are separate from the parameters (``master_weights``, included in
    ``optimizer_states``, as Megatron-LM counts them: ``bf16-mixed`` at ZeRO 1 is 2 + 4 + 12/D bytes per
    parameter) and PowerSGD's state (``compression``, included too: float32 error feedback ``m·n`` and warm start
    ``n·r`` per compressed matrix, ``parallel/compression.py``)."""

    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int = 0
    compression: int = 0


def model_state_bytes(
    model_config: Any,
    parallel_config: ParallelConfig,
    precision: str = "bf16-mixed",
    *,
    pp_rank: int = 0,
    dp_cp_rank: int = 0,
    pipeline_layer_split: Optional[list[int]] = None,
    bucket_bytes: int = GRADIENT_BUCKET_BYTES,
    tp_rank: int = 0,
) -> ModelStates:
    """Exact bytes of the model states held at rest by one rank (see the module docstring for the rules).

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig` (duck-typed: sizes, ``padded_vocab_size``,
            ``head_dim``, ``tie_word_embeddings``).
        parallel_config: the layout (``data_parallel_size`` resolved).
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``.
        pp_rank: the pp rank (0 .. pp−1); it holds the ``v`` pipeline stages of
            :meth:`~lightning_4d.config.ParallelConfig.rank_stages` (schedule and v from ``parallel_config``).
        dp_cp_rank: the rank's index in the ``dp_cp`` group (rank 0 holds the largest shards); under expert
            parallelism its ep rank is ``dp_cp_rank % ep`` and its expert data-parallel rank ``dp_cp_rank // ep``.
        pipeline_layer_split: layers per pipeline stage (``pp·v`` counts; default ``parallel_config``'s, else
            equal).
        bucket_bytes: the ZeRO 0/1 gradient bucket size (``GRADIENT_BUCKET_BYTES`` of ``lightning_4d.partition``);
            at ZeRO 1 a rank owns its 1/D of every bucket.
        tp_rank: the tp rank: under tp a Mixture-of-Experts model's MoE parameters are ZeRO 1-sharded over
            ``dp·cp·tp`` ranks (the experts under ep over ``dp·cp·tp/ep``), where the tp rank picks the range.

    Returns:
        :class:`ModelStates`.

    Raises:
        ValueError: an unknown precision, a pp rank, dp_cp rank or tp rank out of range.
    """
    dt = _Dtypes.of(normalize_precision(precision))
    if not 0 <= tp_rank < parallel_config.tp:
        raise ValueError(f"tp_rank={tp_rank} is not valid: expected 0 .. {parallel_config.tp - 1}.")
    pc = _with_pipeline(parallel_config, pipeline_layer_split=pipeline_layer_split)
    if not 0 <= pp_rank < pc.pp:
        raise ValueError(f"pp_rank={pp_rank} is not valid: expected 0 .. {pc.pp - 1}.")
    if not 0 <= dp_cp_rank < pc.dp_cp:
        raise ValueError(f"dp_cp_rank={dp_cp_rank} is not valid: expected 0 .. {pc.dp_cp - 1}.")
    model_config = _as_held(model_config, pc)
    _, first, last = _rank_layout(model_config.num_layers, pc, pp_rank)
    world, zero = pc.dp_cp, pc.zero_stage
    weighted = _weighted_params(
        model_config, pc.tp, _rank_layers(model_config.num_layers, pc, pp_rank), first, last, pc.ep
    )
    if zero >= 2:  # FSDP2: rows [r·chunk, (r+1)·chunk) of dim 0 of every tensor (experts: over dp·cp/ep, maybe dim 1)
        n = sum(count * _fsdp_shard_numel(p, world, dp_cp_rank, pc.ep) for p, count in weighted)
        if dt.master:  # MixedPrecisionPolicy: the float32 shard is the master weight
            return ModelStates(4 * n, 4 * n, 8 * n)
        return ModelStates(n * dt.param, n * dt.param, 2 * n * dt.param)
    n = sum(count * p.numel for p, count in weighted)
    n_opt = n
    if zero == 1 and world > 1:
        layers = tuple(_rank_layers(model_config.num_layers, pc, pp_rank))
        n_opt = _zero1_owned(
            _Sizes.of(model_config, model_config.num_layers),
            pc.tp,
            layers,
            first,
            last,
            dt.setup,
            world,
            dp_cp_rank,
            bucket_bytes,
            pc.ep,
            tp_rank,
        )
    master = n_opt * dt.master
    compression = 0
    if pc.gradient_compression == "powersgd" and world > 1:  # every rank's own E and Q, whole local matrices
        r = pc.powersgd_rank
        compression = sum(
            count * 4 * (p.rows * p.cols + p.cols * r)
            for p, count in weighted
            if p.matrix and powersgd_compressible((p.rows, p.cols), r)
        )
    return ModelStates(n * dt.param, n * dt.grad, 2 * n_opt * dt.moment + master + compression, master, compression)


def _norm_input_saved(r: int, b: int, s_sp: int, h: int) -> int:
    """Bytes an RMSNorm saves for backward: its input ``[b, s', h]`` as given (``r`` bytes per element, the residual
    stream's dtype) and the float32 reciprocal RMS ``[b, s', 1]`` (``models/llama.py``'s ``_RMSNormFunction``)."""
    return r * b * s_sp * h + 4 * b * s_sp


def _moe_assignments(cfg: Any, tokens: int) -> int:
    """Expert assignments one MoE layer processes for ``tokens`` tokens at balanced load: ``tokens·k`` dropless,
    else at most ``E · capacity`` (``lightning_4d.models.moe.capacity``). Dropless, the count is exact whatever the
    balance (every assignment is processed on the rank that routed it until expert parallelism exists)."""
    n = tokens * cfg.num_experts_per_token
    if cfg.capacity_factor is None:
        return n
    cap = math.ceil(cfg.capacity_factor * tokens * cfg.num_experts_per_token / cfg.num_experts)
    return min(n, cfg.num_experts * cap)


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


def _moe_received(cfg: Any, tokens: int, ep: int, imbalance: float) -> int:
    """Rows one ep rank's experts receive in one MoE layer under expert parallelism over ``ep`` ranks, every rank
    routing ``tokens`` tokens: the balanced figure (the ep group's ``ep·N`` assignments over ``ep`` ranks: ``N`` =
    :func:`_moe_assignments`, the rank's own) times ``imbalance`` (``expert_load_imbalance``), rounded up, at most all
    ``ep·N`` rows, and under a capacity at most ``E·capacity`` (each of the ``E/ep`` local experts takes at most
    ``capacity`` rows from each of the ``ep`` sources: ``parallel/expert.py``)."""
    n = _moe_assignments(cfg, tokens)
    rows = min(math.ceil(imbalance * n), ep * n)
    if cfg.capacity_factor is not None:
        rows = min(
            rows,
            cfg.num_experts * math.ceil(cfg.capacity_factor * tokens * cfg.num_experts_per_token / cfg.num_experts),
        )
    return rows


def _moe_saved(cfg: Any, dt: _Dtypes, b: int, s: int, ep: int = 1, imbalance: float = 1.0) -> int:
    """Bytes one MoE feed-forward saves for backward beyond its input (``lightning_4d/models/moe.py``; ``T = b·s``
    tokens, ``N`` assignments :func:`_moe_assignments`, ``c`` the compute dtype's bytes), as
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

    Under expert parallelism (``ep`` > 1, ``lightning_4d/parallel/expert.py``'s ``ExpertDispatch.exchange``) the
    experts run on the ``R`` rows this rank RECEIVES (:func:`_moe_received`: balanced ``N`` times ``imbalance``), not
    on the ``N`` it routed, and the all-to-alls (whose autograd function saves no tensor) change what is kept: the
    routing side keeps its int64 order and tokens, float32 weights and one ``[N, h]`` tensor (c: softmax the combined
    outputs the weights multiply, sigmoid the gathered tokens the scores multiply; the gathered tokens of the softmax
    router and the sigmoid's weighted input go into the dispatch all-to-all and are not saved); the receiving side
    keeps the received rows regrouped expert-major ``[R, h]`` (c, the experts' input), the permutation and its
    inverse (int64 ``[R]`` each: the two index ops) and the experts' 4·c·R·f_e. The all-to-alls' receive buffers
    that are not saved are transient (:func:`_expert_parallel_buffers`).
    """
    t, e, k, h = b * s, cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size
    n, fe, c = _moe_assignments(cfg, t), cfg.expert_intermediate_size, dt.compute
    if cfg.router_score == "softmax":
        router = 4 * t * e + 8 * t * k + 4 * t * k + 4 * t
    else:
        router = 8 * t * k + 4 * t * k + 4 * t * e
    if ep == 1:  # every assignment runs here: the gathered tokens and the weighted outputs (inputs), N rows each
        dispatch, rows = 2 * 8 * n + 4 * n + 2 * c * n * h, n
    else:
        rows = _moe_received(cfg, t, ep, imbalance)
        dispatch = 2 * 8 * n + 4 * n + c * n * h + c * rows * h + 2 * 8 * rows
    return router + 4 * e + dispatch + 4 * c * rows * fe + 4 * c * t * cfg.num_shared_experts * fe


def _expert_parallel_buffers(
    cfg: Any, pc: ParallelConfig, dt: _Dtypes, b: int, seq_length: int, imbalance: float
) -> int:
    """Transient bytes of one MoE layer's all-to-alls under expert parallelism (``parallel/expert.py``), 0 without
    ep: in backward, the combine's gradient received ``[R, h]`` and its permuted copy ``[R, h]`` (the index op's
    backward) exist together before the experts' backward (``R`` = :func:`_moe_received` for the rank's
    ``T = b·s/(cp·t)`` tokens), ``2·c·R·h``; the forward's receive buffer and its permuted copy are as large. The
    dispatch's send buffer is the gathered tokens themselves (contiguous: ``all_to_all_single`` takes them as they
    are). Not measured (``saved_tensors_hooks`` does not see transients)."""
    if pc.ep == 1:
        return 0
    tokens = b * (seq_length // pc.cp) // pc.tp
    return 2 * dt.compute * _moe_received(cfg, tokens, pc.ep, imbalance) * cfg.hidden_size


def _layer_saved_parts(
    cfg: Any,
    dt: _Dtypes,
    b: int,
    s: int,
    tp: int,
    sp: bool,
    moe: bool = False,
    ep: int = 1,
    imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE,
) -> dict[str, int]:
    """Bytes one transformer layer saves for backward, per micro-batch (``s`` = this rank's sequence length), by
    part: ``norms`` (both norms' inputs and float32 reciprocal RMS), ``attn_in`` / ``ffn_in`` (the projections'
    inputs: the normalized tensor once, shared by wq/wk/wv and by w1/w3; under sp only this rank's sequence shard,
    gathered again in backward; without sp under ``16-mixed`` autocast's casts, one per linear), ``sdpa`` (q, k, v,
    output, float32 log-sum-exp) and ``swiglu`` (an MoE layer's: :func:`_moe_saved` under expert parallelism over
    ``ep`` ranks at load ``imbalance``)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    s_sp = s // tp if sp else s
    c = dt.compute
    # an MoE layer under tp runs whole on the rank's s/t tokens (parallel/tensor.py's TokenParallel): its input is
    # the sequence shard (under sp as given, else a contiguous copy of it: the replicated input is not kept)
    s_moe = s // tp
    return {
        "norms": 2 * _norm_input_saved(dt.residual, b, s_sp, h),
        # under sp the projections save the sequence shard and gather it again in backward (parallel/tensor.py)
        "attn_in": c * b * s_sp * h if sp else c * b * s * h * (3 if dt.autocast else 1),
        "ffn_in": c * b * (s_moe if moe else s_sp) * h
        if sp or (moe and tp > 1)
        else c * b * s * h * (2 if dt.autocast else 1),
        "sdpa": 2 * c * b * s * a * d + 2 * c * b * s * (a if dt.kv_repeated else k) * d + 4 * b * a * s,
        # an MoE layer (moe=True): the router, dispatch, experts and shared experts instead (_moe_saved)
        "swiglu": _moe_saved(cfg, dt, b, s_moe, ep, imbalance) if moe else 4 * c * b * s * (f // tp),
    }


def _layer_saved(*args: Any) -> int:
    """Bytes one transformer layer saves for backward, per micro-batch (the sum of :func:`_layer_saved_parts`, whose
    positional arguments it takes)."""
    return sum(_layer_saved_parts(*args).values())


def _layer_input_grad_only(cfg: Any, dt: _Dtypes, b: int, s: int, tp: int, sp: bool) -> int:
    """Bytes of one layer's saved set that only the input gradient uses (not the weight gradients): attention's q,
    k, v, output and float32 log-sum-exp (see :func:`_zbv_peak`; the RMSNorms' saved input and reciprocal RMS serve
    their weight gradient too, so the weight pass frees them)."""
    return _layer_saved_parts(cfg, dt, b, s, tp, sp)["sdpa"]


def _layer_selective_parts(
    cfg: Any, dt: _Dtypes, b: int, s: int, tp: int, sp: bool, attention_tokens: int
) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward under selective activation checkpointing, per micro-batch
    (``s`` = this rank's sequence length), by part: ``input`` (the layer's input, kept by the checkpoint),
    ``matmuls`` (the outputs of the matmuls: ``wq``/``wk``/``wv`` and ``w1``/``w3`` on their tp-local columns, and at
    tp = 1 ``wo``'s on all ``h``; under tp its partial sum is recomputed instead, and ``w2`` keeps nothing:
    :mod:`lightning_4d.parallel.activation_checkpoint`), ``attention`` (each attention
    kernel call's output and float32 log-sum-exp, for ``attention_tokens`` query tokens over all calls: ``s``
    without cp) and ``reductions`` (the reduced output of ``wo`` under tp: all-reduce, or reduce-scatter to ``s/t``
    tokens under sp)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    s_sp = s // tp if sp else s
    c = dt.compute
    return {
        "input": dt.residual * b * s_sp * h,
        # wo: its output at tp = 1; under tp its reduction instead (its partial sum recomputed); w2: nothing
        "matmuls": c * b * s * ((a + 2 * k) * d + 2 * (f // tp) + (h if tp == 1 else 0)),
        "attention": (c * a * d + 4 * a) * b * attention_tokens,
        "reductions": c * b * s_sp * h if tp > 1 else 0,
    }


def _layer_selective_recompute(cfg: Any, dt: _Dtypes, b: int, s: int, tp: int, sp: bool) -> int:
    """Bytes one layer's backward adds, transiently, to what the layers keep under selective activation
    checkpointing: its saved set without checkpointing (:func:`_layer_saved_parts`) less what is taken from the kept
    outputs (v, the attention output and log-sum-exp, ``w1 x`` and ``w3 x``) and less the attention norm's input (the
    layer's input, kept by the checkpoint), i.e. the ffn norm's input, both norms' rsqrt, the matmul inputs
    (sequence-parallel all-gathers and autocast casts included), the rotated q and k, ``silu(w1 x)`` and the
    SwiGLU product; net of the kept outputs the recomputation consumes and frees (PyTorch's selective checkpoint
    pops each kept output when the recomputation takes it): ``wq``'s and ``wk``'s ``c·b·s·(a + k)·d/t`` (the graph
    saves their rotated copies) and ``wo``'s output ``c·b·s·h`` (tp = 1) or reduction ``c·b·s'·h`` (tp > 1), read only
    by the residual sum. Measured on CPU (``lightning-4d measure`` with ``LiveTensorBytes`` at the last layer's
    ``w2`` and SwiGLU backward, tiny-test b=4 s=256 ``32-true`` tp1 and tp2, b=2 ``bf16-mixed`` dp2): exactly these
    tensors alive; the ``recompute`` phase within 216 B of the measured moment (tp1: 9,384,960 B estimated, 9,385,172
    measured, the step's peak)."""
    parts = _layer_saved_parts(cfg, dt, b, s, tp, sp)
    s_sp = s // tp if sp else s
    rotated_qk = dt.compute * b * s * (cfg.num_heads + cfg.num_kv_heads) // tp * cfg.head_dim
    recomputed = parts["norms"] + parts["attn_in"] + parts["ffn_in"] + rotated_qk + parts["swiglu"] // 2
    # the attention norm's input is the layer's input, kept by the checkpoint (counted there, not made again)
    recomputed -= dt.residual * b * s_sp * cfg.hidden_size
    # kept outputs the recomputation consumes and frees: wq's and wk's (the graph saves their rotated copies
    # instead) and wo's output (tp = 1) or reduction (tp > 1), read only by the residual sum
    kept = _layer_selective_parts(cfg, dt, b, s, tp, sp, s)
    consumed_qk = dt.compute * b * s * (cfg.num_heads + cfg.num_kv_heads) // tp * cfg.head_dim
    consumed_wo = kept["reductions"] if tp > 1 else dt.compute * b * s * cfg.hidden_size
    return recomputed - consumed_qk - consumed_wo


def saved_activation_bytes(
    model_config: Any,
    parallel_config: ParallelConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str = "bf16-mixed",
    *,
    pp_rank: int = 0,
    pipeline_layer_split: Optional[list[int]] = None,
    device_type: str = "cpu",
    expert_load_imbalance: Optional[float] = None,
) -> dict[str, int]:
    """Bytes saved for backward by one micro-batch's forward through all pipeline stages of pp rank ``pp_rank``, by
    part. ``device_type="cuda"`` counts, for ``32-true`` GQA models on the ``sdpa`` backend, the k and v heads the
    backend repeats there (``sdpa_repeats_kv_heads`` of ``lightning_4d.models.attention_backends``).

    Returns a dict with ``layers`` (all layers of the rank: their saved tensors, only their inputs under full
    activation checkpointing, their inputs and kept matmul / attention / reduction outputs under selective
    checkpointing), ``embedding`` (token ids), ``rope`` (cos/sin), ``head`` (final norm and head input),
    ``loss`` (the logits, the float32 log-sum-exp and the labels), ``compute_weights`` (``16-mixed``: autocast's
    weight copies), ``context_parallel_kv`` (all layers' saved K/V beyond the local ones: the gathered K/V of the
    whole sequence under ``context_parallel_method="allgather"``, none for ``"ring"``;
    under full or selective checkpointing they are part of ``recompute``) and ``recompute``
    (what one layer's backward recomputes, transient: its whole saved set under full checkpointing, its pointwise
    tensors under selective checkpointing). Under expert parallelism an MoE layer's experts run on the rows the rank
    receives: the balanced figure times ``expert_load_imbalance`` (default :data:`DEFAULT_EXPERT_LOAD_IMBALANCE`;
    :func:`_moe_saved`; here the load of one rank, any number > 0: below 1 for a rank that receives fewer rows than
    the balanced figure). ``sum(...) - recompute`` is what ``saved_tensors_hooks`` (plus the
    checkpointed layers' inputs and, under selective checkpointing, the outputs its policy keeps) sees. Under
    context parallelism and selective checkpointing, the figure is that of the cp rank that keeps the most (the
    last: module docstring). Formulas: module docstring.

    Raises:
        ValueError: non-positive sizes, a sequence not divisible as the layout requires, an unknown precision, an
            ``expert_load_imbalance`` that is not a number > 0.
    """
    imbalance = DEFAULT_EXPERT_LOAD_IMBALANCE if expert_load_imbalance is None else expert_load_imbalance
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not 0 < imbalance < math.inf:
        raise ValueError(
            f"expert_load_imbalance={expert_load_imbalance!r} is not valid here: expected a finite number > 0 (this "
            "rank's received rows over the balanced figure; estimate_memory takes the most loaded rank's, >= 1.0)."
        )
    b = _check_positive_int("micro_batch_size", micro_batch_size)
    _check_positive_int("seq_length", seq_length)
    pc = _with_pipeline(parallel_config, pipeline_layer_split=pipeline_layer_split)
    pc.validate_sequence(seq_length)
    dt = _Dtypes.for_layout(normalize_precision(precision), model_config, pc, device_type)
    tp, sp, cp = pc.tp, pc.sp, pc.cp
    s = seq_length // cp
    s_sp = s // tp if sp else s
    h, vocab = model_config.hidden_size, model_config.padded_vocab_size
    model_config = _as_held(model_config, pc)
    n_layers, first, last = _rank_layout(model_config.num_layers, pc, pp_rank)
    indices = _rank_layers(model_config.num_layers, pc, pp_rank)
    n_moe = sum(_is_moe_layer(model_config, i) for i in indices)
    dense_layer = _layer_saved(model_config, dt, b, s, tp, sp)
    moe_layer = _layer_saved(model_config, dt, b, s, tp, sp, True, pc.ep, imbalance) if n_moe else 0
    per_layer = max(dense_layer if n_layers > n_moe else 0, moe_layer)  # the largest layer's (one recompute)
    all_layers = (n_layers - n_moe) * dense_layer + n_moe * moe_layer
    full_ac = pc.activation_checkpointing == "full"
    recomputed = pc.activation_checkpointing != "none"  # a layer's casts and gathered K/V are made again in backward
    out = {
        "layers": n_layers * dt.residual * b * s_sp * h if full_ac else all_layers,
        "embedding": 8 * b * s if first else 0,
        "rope": 2 * 4 * s * (model_config.head_dim // 2),
        # the head's input: under sp only the sequence shard (gathered again in backward, parallel/tensor.py)
        "head": (_norm_input_saved(dt.residual, b, s_sp, h) + dt.compute * b * s_sp * h) if last else 0,
        "loss": (dt.compute * b * s * (vocab // tp) + 4 * b * s + 8 * b * s) if last else 0,
        "compute_weights": 0,
        "context_parallel_kv": 0,
        # a layer's whole saved set (its attention norm's input, the layer's input kept by the checkpoint, counted
        # again: r·b·s'·h of margin, which keeps ZeRO 3's recompute phase, short of the root's unsharded
        # gradients, within 3% under; measured: tests/test_memory_model.py)
        "recompute": per_layer if full_ac and n_layers else 0,
    }
    if pc.activation_checkpointing == "selective" and n_layers:
        # each attention kernel call keeps its output: one call of s tokens without cp; under cp the last cp rank's
        # calls cover the most query tokens: every block of the ring in full (c·s = seq_length), or its two chunks
        # against their diagonal and prefix blocks under allgather (2·s)
        tokens = s if cp == 1 else seq_length if pc.context_parallel_method == "ring" else 2 * s
        kept = _layer_selective_parts(model_config, dt, b, s, tp, sp, tokens)
        # MoE layers (not measured under selective checkpointing): counted as saving everything, an upper bound
        out["layers"] = (n_layers - n_moe) * sum(kept.values()) + n_moe * moe_layer
        out["recompute"] = _layer_selective_recompute(model_config, dt, b, s, tp, sp)
    if dt.autocast:
        # autocast's bfloat16 weight copies; a checkpointed layer's are made again (and dropped) in its recompute
        cast = [
            (p, n)
            for p, n in _weighted_params(model_config, tp, indices, first, last, pc.ep)
            if p.matrix and p.name != "tok_embeddings.weight"
        ]
        in_layers = sum(p.numel * n for p, n in cast if p.unit != "root")
        out["compute_weights"] = 2 * (sum(p.numel * n for p, n in cast) - (in_layers if recomputed else 0))
        if last and model_config.tie_word_embeddings and first:  # the tied head is cast too
            out["compute_weights"] += 2 * (vocab // tp) * h
        if recomputed and n_layers:
            out["recompute"] += 2 * in_layers // n_layers
    if cp > 1 and pc.context_parallel_method == "allgather":
        # the gathered K/V of all s tokens, on top of the local-K/V-sized tensors the layer saves anyway (measured
        # with saved_tensors_hooks: exactly this much more than the ring, whatever c)
        kv = 2 * dt.compute * b * seq_length * (model_config.num_kv_heads // tp) * model_config.head_dim
        if recomputed:  # made again in a layer's recompute, dropped after its backward
            out["recompute"] += kv if n_layers else 0
        else:
            out["context_parallel_kv"] = n_layers * kv
    return out


def _context_parallel_buffers(cfg: Any, pc: ParallelConfig, dt: _Dtypes, b: int, seq_length: int) -> int:
    """Transient bytes of one layer's context-parallel attention backward (module docstring), 0 without cp."""
    if pc.cp == 1:
        return 0
    s, tp = seq_length // pc.cp, pc.tp
    kv = b * (cfg.num_kv_heads // tp) * cfg.head_dim  # elements of K (or V) per token
    dq = 4 * b * s * (cfg.num_heads // tp) * cfg.head_dim
    if pc.context_parallel_method == "ring":
        return 2 * (2 * dt.compute + 3 * 4) * s * kv + dq
    return 2 * 4 * seq_length * kv + dq


def _in_flight(pc: ParallelConfig, pp_rank: int, m: int) -> list[int]:
    """Micro-batches whose activations pp rank ``pp_rank`` holds at its peak, per pipeline stage it holds (the order
    of :meth:`~lightning_4d.config.ParallelConfig.rank_stages`), for the schedules of ``torch.distributed.pipelining``
    (counts read off their action lists for rank r of p, stages per rank v, m micro-batches):

    - GPipe: all m forwards before the first backward: ``m``;
    - 1F1B: ``p - r - 1`` warm-up forwards, then one forward and one backward at a time: ``min(m, p - r)``
      (Narayanan et al. 2021, PipeDream-Flush, arXiv 2006.09503);
    - interleaved 1F1B: ``w = min(m·v, (v-1)·n + 2(p-1-r) + 1)`` forwards in flight (warm-up of
      ``_get_warmup_ops`` + 1; n = micro-batches per round = m // max(1, m // p)), handed out to the rank's
      stages in rounds of n (Narayanan et al. 2021, Megatron-LM, arXiv 2104.04473, §2.2);
    - ZBV zero-bubble and DualPipeV: see :func:`_zbv_peak` (which also counts what stays alive after each weight
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
    return list(_zbv_peak(p, r, m, (1.0, 1.0), schedule=name)[1])  # zbv, dualpipev: (stage r, stage 2p-1-r)


@functools.lru_cache(maxsize=65536)
def _zbv_peak(
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
    :func:`_dualpipev_actions`) action list for rank r, with ``held[i]`` the micro-batches forwarded through the
    rank's stage i (stage r, then stage 2p-1-r) whose weight gradient (W) has not run yet and ``done[i]`` those whose
    W has run; returns (peak, held at the peak). ``input_pass_of``: only the states in which an input pass of that
    chunk runs (0 or 1; :func:`_action_states`).

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
    """:func:`_action_states` of the schedule's action list (:func:`_zbv_actions`, :func:`_dualpipev_actions`) as a
    float64 ``[n, 4]`` array (exact: the counts are small integers)."""
    actions = _zbv_actions(p, r, m) if schedule == "zbv" else _dualpipev_actions(p, r, m)
    return np.asarray(_action_states(actions, input_pass_of), dtype=np.float64).reshape(-1, 4)


def _action_states(
    actions: tuple[tuple[int, str], ...], input_pass_of: Optional[int] = None
) -> tuple[tuple[int, int, int, int], ...]:
    """The distinct ``(held[0], held[1], done[0], done[1])`` after each of ``actions`` (``(chunk, kind)``, chunk 0
    the rank's first stage, 1 its second; kind ``F`` forward, ``I`` input gradient (frees nothing: it runs with
    ``retain_graph=True``), ``W`` weight gradient (the micro-batch leaves ``held`` for ``done``: what only the
    input gradient needed stays, :func:`_zbv_peak`), ``B`` full backward (frees the micro-batch's graph)), in order
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
def _dualpipev_actions(p: int, r: int, m: int) -> tuple[tuple[int, str], ...]:
    """``ScheduleDualPipeV``'s actions for rank r of p with m micro-batches (torch.distributed.pipelining, after
    DeepSeek's DualPipeV; ``tests/test_memory_model.py`` checks this list against torch's), as ``(chunk, kind)``
    (:func:`_action_states`): an overlapped forward + backward pair is its forward, then its full backward.

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
def _zbv_actions(p: int, r: int, m: int) -> tuple[tuple[int, str], ...]:
    """``ScheduleZBVZeroBubble``'s actions for rank r of p with m micro-batches (torch.distributed.pipelining;
    ``tests/test_memory_model.py`` checks this list against torch's), as ``(chunk, kind)`` (:func:`_action_states`;
    chunk 0: stage r, chunk 1: stage 2p-1-r).

    With ``n = max(2p-1, m)`` micro-batches scheduled and every action on a micro-batch index >= m dropped: warm-up
    ``2(p-r)-1`` F0, ``r`` (F1, F0), ``p-r`` (F1, I1, W1); steady (F0 while fewer than n, I0, W0, F1, I1, W1) while
    F1 trails F0 or F0 < n; cool-down ``r`` (I0, I1), ``p-r`` (I0, W0), then the remaining W1, then the remaining W0.
    """
    n = max(2 * p - 1, m)
    counts: dict[tuple[int, str], int] = {}
    actions: list[tuple[int, str]] = []

    def act(chunk: int, kind: str) -> None:
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
        act(1, "F")
        act(1, "I")
        act(1, "W")
    while count(1, "F") < count(0, "F") or count(0, "F") < n:
        if count(0, "F") < n:
            act(0, "F")
        act(0, "I")
        act(0, "W")
        act(1, "F")
        act(1, "I")
        act(1, "W")
    for _ in range(r):
        act(0, "I")
        act(1, "I")
    for _ in range(p - r):
        act(0, "I")
        act(0, "W")
    while count(1, "W") < count(1, "I"):
        act(1, "W")
    while count(0, "W") < count(0, "I"):
        act(0, "W")
    return tuple(actions)


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
            expert-parallel all-to-all buffers.
        overhead: CUDA context and allocator fragmentation allowance (zero on CPU).
        total: the peak, ``parameters + optimizer_states + overhead + max(phases)`` (not the sum of the fields).
        peak_phase: ``"backward start"``, ``"head backward"``, ``"backward end"``, ``"optimizer step"``,
            ``"expert-parallel backward"`` or ``"initialization"``.
        pp_rank: the pp rank this is for (it holds the pipeline stages of
            :meth:`~lightning_4d.config.ParallelConfig.rank_stages`).
        details: the terms behind each field (bytes), by name.
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
    model_config: Any,
    parallel_config: ParallelConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str = "bf16-mixed",
    *,
    num_microbatches: Optional[int] = None,
    pipeline_schedule: Optional[str] = None,
    virtual_pipeline_stages: Optional[int] = None,
    pipeline_layer_split: Optional[list[int]] = None,
    pp_rank: Optional[int] = None,
    dp_cp_rank: int = 0,
    device_type: str = "cuda",
    overhead: Optional[OverheadAllowance] = None,
    gpu_name: Optional[str] = None,
    expert_load_imbalance: Optional[float] = None,
    fused_optimizer: bool = True,
) -> MemoryEstimate:
    """Peak memory of one rank of FourDStrategy training ``model_config`` with ``parallel_config`` (bytes).

    Args:
        model_config: :class:`~lightning_4d.models.LlamaConfig` (or a preset name).
        parallel_config: the layout; ``data_parallel_size="auto"`` is not allowed here (resolve it first).
        micro_batch_size: samples per micro-batch per dp rank (b).
        seq_length: tokens per sample (s, the full sequence before cp splits it).
        precision: ``"32-true"``, ``"bf16-mixed"`` (default) or ``"bf16-true"``.
        num_microbatches: m, micro-batches per optimizer step (default
            :attr:`~lightning_4d.config.ParallelConfig.microbatches`: ``parallel_config.num_microbatches``, else pp;
            2·pp for dualpipev).
        pipeline_schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zbv"`` or ``"dualpipev"`` (default
            ``parallel_config``'s).
        virtual_pipeline_stages: v, pipeline stages per pp rank (default ``parallel_config``'s, i.e. the schedule's).
        pipeline_layer_split: layers per pipeline stage, ``pp·v`` counts (default ``parallel_config``'s).
        pp_rank: one pp rank; default: every pp rank is estimated and the largest returned.
        dp_cp_rank: rank in ``dp_cp`` (0 holds the largest ZeRO shards).
        device_type: ``"cuda"`` adds the overhead allowance; ``"cpu"`` none.
        overhead: an explicit allowance (default: from ``overhead.json`` for ``gpu_name``).
        gpu_name: ``torch.cuda.get_device_name()`` to pick the measured allowance.
        expert_load_imbalance: under expert parallelism, the rows the most loaded ep rank's experts receive in an
            MoE layer over the balanced figure (the rank's own ``T·k`` assignments), >= 1.0 (at most ``ep``); it
            multiplies the received rows of every MoE layer of the rank (the experts' saved activations, the
            regrouped rows and the all-to-all buffers). Default :data:`DEFAULT_EXPERT_LOAD_IMBALANCE` (measured on
            ``configs/tiny_moe.yaml``); a capacity factor bounds the rows to ``E·capacity``. No effect at ep = 1
            (every assignment runs where it was routed) or on dense models.
        fused_optimizer: the optimizer steps in place, with no temporaries (``torch.optim.AdamW(fused=True)``,
            :class:`~lightning_4d.tasks.CausalLMModule`'s; default); ``False``: ``AdamW(foreach=True)``, torch's
            default on CUDA, whose ``_foreach_sqrt`` of the second moments holds one moment's bytes at the step.

    Returns:
        :class:`MemoryEstimate` (module docstring: formulas and sources).

    Raises:
        ValueError: an invalid layout for the model (tp not dividing heads, layers not splitting into pp·v
            stages, ...), a sequence length the layout cannot split, an unknown precision or schedule, a
            ``num_microbatches`` the schedule cannot run, non-positive sizes, an ``expert_load_imbalance`` below 1.
    """
    imbalance = check_expert_load_imbalance(expert_load_imbalance)
    cfg = _model(model_config)
    if parallel_config.data_parallel_size == "auto":
        raise ValueError("parallel_config.data_parallel_size is 'auto': call parallel_config.resolve(world_size).")
    pc = _with_pipeline(
        parallel_config,
        pipeline_schedule=pipeline_schedule,
        virtual_pipeline_stages=virtual_pipeline_stages,
        pipeline_layer_split=pipeline_layer_split,
    )
    pc.validate_model(cfg)
    m = num_microbatches or pc.microbatches
    pc.validate_microbatches(m)
    ranks = [pp_rank] if pp_rank is not None else list(range(pc.pp))
    results = [
        _estimate_pp_rank(
            cfg,
            pc,
            micro_batch_size,
            seq_length,
            normalize_precision(precision),
            r,
            m,
            dp_cp_rank,
            device_type,
            overhead,
            gpu_name,
            imbalance,
            fused_optimizer,
        )
        for r in ranks
    ]
    return max(results, key=lambda e: e.total)


def estimate_all_pp_ranks(
    model_config: Any,
    parallel_config: ParallelConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str = "bf16-mixed",
    **kw: Any,
) -> list[MemoryEstimate]:
    """:func:`estimate_memory` for every pp rank, in pp-rank order (same arguments, ``pp_rank`` excepted)."""
    return [
        estimate_memory(model_config, parallel_config, micro_batch_size, seq_length, precision, pp_rank=r, **kw)
        for r in range(parallel_config.pp)
    ]


def _model(model_config: Any) -> Any:
    if isinstance(model_config, str):
        from lightning_4d.models.config import LlamaConfig

        return LlamaConfig.from_preset(model_config)
    return model_config


@dataclass(frozen=True)
class _Activations:
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
    #: zero-bubble schedules: the saved tensors alive during an input pass (its largest) + the output gradients it
    #: keeps for its weight pass (:func:`_weight_pass_inputs`) + one recomputed set
    input_pass: int = 0


def _offloaded_per_stage(pc: ParallelConfig, stages: list, per_layer: float, rope: int) -> list[float]:
    """Bytes one micro-batch's forward copies to host memory per pipeline stage of a rank (``stages``:
    ``rank_stages``), under ``activation_offload_layers`` (``parallel/offload.py``): its offloaded layers' saved
    sets (``per_layer`` each), and each one's copy of the RoPE tables (``rope``: the device shares them between
    layers, each offloaded layer copies those it saves). The same bytes come back in backward."""
    return [min(pc.activation_offload_layers, len(layers)) * (per_layer + rope) for _, layers in stages]


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
    charges ``2·m·`` these over the host link (:mod:`lightning_4d.memory.step_time`).

    Raises:
        ValueError: see :func:`saved_activation_bytes`.
    """
    cfg, pc = _model(model_config), parallel_config
    if not pc.activation_offload_layers:
        return 0
    saved = saved_activation_bytes(
        cfg, pc, micro_batch_size, seq_length, precision, pp_rank=pp_rank, device_type=device_type
    )
    n_layers = _rank_layout(cfg.num_layers, pc, pp_rank)[0]
    per_layer = (saved["layers"] + saved["context_parallel_kv"]) / max(1, n_layers)
    return int(sum(_offloaded_per_stage(pc, pc.rank_stages(cfg.num_layers, pp_rank), per_layer, saved["rope"])))


def _activation_terms(
    cfg: Any, pc: ParallelConfig, dt: _Dtypes, b: int, s: int, pp_rank: int, m: int, saved: dict[str, int]
) -> _Activations:
    """Activations of pp rank ``pp_rank`` at its peak: every pipeline stage of the rank holds its in-flight
    micro-batches' saved tensors (:func:`_in_flight`, :func:`_zbv_peak`), the embedding's with the first stage, the
    head's and the loss's with the last (module docstring, **Activations** and **Pipeline parallelism**)."""
    stages = pc.rank_stages(cfg.num_layers, pp_rank)
    n_layers, _, last = _rank_layout(cfg.num_layers, pc, pp_rank)
    tp = pc.tp
    counts = _in_flight(pc, pp_rank, m)
    per_layer = (saved["layers"] + saved["context_parallel_kv"]) / max(1, n_layers)
    # one micro-batch's saved bytes per stage of the rank: its layers, the embedding's with the first stage, the
    # head's and the loss's with the last; under pp each stage's forward computes its own RoPE tables
    # activation offload: the first ``activation_offload_layers`` of each stage hold their saved tensors in host
    # memory (parallel/offload.py), none on the device
    offloaded = [min(pc.activation_offload_layers, len(layers)) for _, layers in stages]
    sizes = [
        (len(layers) - o) * per_layer
        + (saved["embedding"] if st == 0 else 0)
        + (saved["head"] + saved["loss"] if st == pc.num_stages - 1 or pc.pp == 1 else 0)
        + (saved["rope"] if pc.pp > 1 and o < len(layers) else 0)
        for (st, layers), o in zip(stages, offloaded)
    ]
    whole = _offloaded_whole(cfg, pc, pp_rank)
    host = _offloaded_per_stage(pc, stages, per_layer, saved["rope"])
    if pc.pp > 1 and pc.pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
        # what stays alive after a micro-batch's weight pass, to the end of the step (stages after the first)
        s_loc = s // pc.cp
        layer_kept = (
            0
            if pc.activation_checkpointing == "full"
            else (
                _layer_input_grad_only(cfg, dt, b, s_loc, tp, pc.sp) + saved["context_parallel_kv"] / max(1, n_layers)
            )
        )
        # the loss' saved logits, log-sum-exp and labels (no weight gradient passes through the loss; the final norm's
        # saved tensors serve its weight gradient and are freed by the weight pass)
        head_kept = saved["loss"]
        retained = [
            0
            if st == 0
            else (len(layers) - o) * layer_kept + saved["rope"] + (head_kept if st == pc.num_stages - 1 else 0)
            for (st, layers), o in zip(stages, offloaded)
        ]
        peak, held = _zbv_peak(
            pc.pp, pp_rank, m, (sizes[0], sizes[1]), (retained[0], retained[1]), schedule=pc.pipeline_schedule
        )
        host_bytes = sum(c * x for c, x in zip(held, host))
    else:
        peak = sum(c * size for c, size in zip(counts, sizes))
        host_bytes = sum(c * x for c, x in zip(counts, host))
    # an offloaded layer's backward brings its saved tensors back node by node, each dropped after its node. Only a
    # stage offloaded whole adds that to its peak: otherwise its last layer (the first one backward) is not
    # offloaded, and by the time an offloaded layer's backward runs that layer's saved set (larger) is freed
    # (measured on CPU: tiny-test with 1 of 2 layers offloaded peaks exactly one layer's saved bytes below no
    # offload). Offloaded whole, the peak is in the last layer's SwiGLU product backward (measured, LiveTensorBytes at
    # the peak: ``aten.mul``): its two inputs brought back (``swiglu // 2``, here in ``recompute``) beside the
    # product's gradient and the two it makes (``_recompute_backward``), after the loss and the head freed their
    # saved tensors (``head_freed``)
    unpacked = 0
    if whole:
        unpacked = _layer_saved_parts(cfg, dt, b, s // pc.cp, tp, pc.sp)["swiglu"] // 2
    recompute = saved["recompute"] + unpacked
    activations = int(peak) + (saved["rope"] if pc.pp == 1 and not whole else 0) + recompute
    in_flight = sum(c * len(layers) for c, (_, layers) in zip(counts, stages)) / max(1, n_layers)
    # the loss's backward working set beyond its saved tensors (in activations, as saved_loss): the logits' gradient
    # in the compute dtype, + one chunk's float32 softmax unless that gradient is float32 (then computed in place)
    tokens, local_vocab = b * (s // pc.cp), cfg.padded_vocab_size // tp
    chunk = 4 * min(tokens, loss_chunk_tokens(local_vocab)) * local_vocab if dt.compute != 4 else 0
    logits = dt.compute * tokens * local_vocab + chunk if last else 0
    compute_weights = saved["compute_weights"]
    if pc.pp > 1:
        # autocast casts the weights again in every micro-batch's forward: one copy per in-flight micro-batch
        compute_weights = int(compute_weights * in_flight)
    loss_freed = saved["loss"] - 8 * tokens if last else 0  # the labels (int64) stay with the batch
    gradient = dt.compute * tokens * local_vocab if last else 0
    # the head's saved tensors, freed by its backward before any layer's (offloaded or recomputed) backward runs
    head_freed = saved["head"] if last and (unpacked or pc.activation_checkpointing != "none") else 0
    input_pass = 0
    if pc.pp > 1 and pc.pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
        # during an input pass of a stage (not the first: its input needs no gradient, a full backward runs) every
        # saved tensor is alive (retain_graph) beside the output gradients kept for its weight pass
        for chunk, (st, layers) in enumerate(stages):
            if st == 0:
                continue
            held_peak, _ = _zbv_peak(
                pc.pp,
                pp_rank,
                m,
                (sizes[0], sizes[1]),
                (retained[0], retained[1]),
                schedule=pc.pipeline_schedule,
                input_pass_of=chunk,
            )
            captured = _weight_pass_inputs(cfg, dt, b, s // pc.cp, tp, pc.sp, len(layers), st == pc.num_stages - 1)
            input_pass = max(input_pass, int(held_peak) + captured + recompute if held_peak else 0)
    return _Activations(
        activations,
        logits,
        compute_weights,
        in_flight,
        loss_freed,
        gradient,
        recompute,
        int(host_bytes),
        head_freed,
        input_pass,
    )


def _weight_pass_inputs(cfg: Any, dt: _Dtypes, b: int, s: int, tp: int, sp: bool, layers: int, last: bool) -> int:
    """Bytes one micro-batch's input-gradient pass (``stage_backward_input``) of a zero-bubble schedule (ZBV,
    DualPipeV) captures for its weight pass (``stage_backward_weight``): torch.distributed.pipelining keeps the
    gradient of the output of every node through which a parameter's gradient flows, from the input pass to the weight
    pass (``_backward.py``: ``param_groups``' ``grads``). Per layer (``s`` this rank's sequence length): the outputs
    of ``wq``/``wk``/``wv`` and ``w1``/``w3`` (c·b·s·((a + 2k)·d + 2f)/t), of ``wo`` and ``w2`` (their partial sums,
    c·b·s·h each) and of both RMSNorms (r·b·s'·h each); on the last stage also the final norm's and the head's
    (the logits' gradient, c·b·s·V/t). Measured (CPU, ``LiveTensorBytes``, the ``small`` preset pp2 ZBV b=2 s=1024
    ``bf16-mixed``): the peak is in the last stage's input pass, 23.3 MB above the estimate without this term, which
    counts 26.0 MB there. The first stage (its input needs no gradient) runs a full backward: 0 there. An MoE layer
    is counted as a dense one (its experts' captured gradients are not modelled)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    c, r = dt.compute, dt.residual
    s_sp = s // tp if sp else s
    per_layer = c * b * s * ((a + 2 * k) * d + 2 * (f // tp)) + 2 * c * b * s * h + 2 * r * b * s_sp * h
    head = r * b * s_sp * h + c * b * s * (cfg.padded_vocab_size // tp) if last else 0
    return layers * per_layer + head


@dataclass(frozen=True)
class _Buffers:
    """The transient buffers of one pp rank (bytes; module docstring, **Peak**)."""

    gathered_start: int  # FSDP2-gathered parameters at the start of backward
    gathered_end: int  # ... and at its end
    gradient_buffers: int  # gradient communication: flat bucket copies (ZeRO 0/1) or unsharded gradients (2/3)
    head_gradient: int  # the LM head's gradient, made at the start of backward
    pipeline: int  # PipelineStage's receive buffers
    context_parallel: int  # one layer's context-parallel attention backward
    expert_parallel: int  # one MoE layer's all-to-all receive buffers (expert parallelism)
    step_temporaries: int  # the optimizer's temporaries (none for fused AdamW) + ZeRO-1's all-gather buckets
    resident_gradients: int  # gradients that exist before backward starts (ZeRO 0/1 buckets, several micro-batches)
    #: tp > 1, the rank holding the embedding: torch's vocabulary-parallel embedding backward (DTensor's
    #: ``RowwiseParallel`` on ``nn.Embedding``) runs ``embedding_dense_backward`` with the whole vocabulary
    #: (``num_weights = V``; measured: tiny-test tp2 gave a [256, 64] gradient for its [128, 64] shard) and reduces
    #: the ``[V, h]`` partial sum to the rank's rows: ``V·h`` in the compute dtype at the end of backward
    embedding_gradient: int = 0
    #: ZeRO 0/1 with one micro-batch per step: the gradient bucket made for the first gradient of backward (the
    #: head's), beside it (the buckets are made as gradients arrive: :func:`_buffer_terms`)
    first_bucket: int = 0
    #: the last stage under tp with sp: the working set of the LM head's backward beyond its saved input
    #: (:func:`_head_backward_transient`), 0 elsewhere
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
    #: under activation checkpointing (no stage offloaded whole): the context-parallel attention backward runs after
    #: the layer's feed-forward backward has freed its recomputed SwiGLU tensors and kept ``w1``/``w3`` outputs (more
    #: than the output gradient ``recompute_backward`` also holds), so the recompute phase takes the larger of the two
    #: transients, not their sum (measured on CPU: tiny-test cp2 b=4 s=256 ``32-true``, the peak at the last layer's
    #: SwiGLU product backward, no cp buffer alive)
    recompute_apart_from_cp: bool = False


def _head_backward_transient(cfg: Any, pc: ParallelConfig, dt: _Dtypes, b: int, s: int) -> int:
    """Bytes the LM head's backward holds beyond its saved input and its weight gradient, under tp with sequence
    parallelism (``parallel/tensor.py``: ``_sequence_parallel_head``), with ``U = c·b·(s/cp)·h`` the gathered
    ``[b, s, h]`` input in the compute dtype:

    - without overlap (:class:`_SequenceParallelProjection`): the input all-gathered again (U), its gradient
      ``g @ W`` and the sum that holds it (U each, one freed), then the reduce-scatter: for b > 1 the rank-ordered
      copy of the gradient (U) and its ``[b, s/t, h]`` output (U/t): ``3·U (+ U/t for b > 1)``;
    - with ``tensor_parallel_overlap`` (:class:`_RingAllGatherMatmul`), at the last ring step: the shard at hand,
      the partial sum sent and the one received, this step's product (U/t each) and, for b > 1, the copy of the
      logits' gradient rows the product reads (``c·b·(s/(cp·t))·V/t``): ``4·U/t (+ rows)``.

    Measured on CPU (``lightning-4d measure``, tiny-test tp2 b=4 s=512 32-true): the peak of the step is in this
    backward and the model's figure is within 216 bytes of it, with and without overlap (``tests/test_measure.py``).
    0 without tp or without sp."""
    t = pc.tp
    if t == 1 or not pc.sp:
        return 0
    tokens = b * (s // pc.cp)
    full = dt.compute * tokens * cfg.hidden_size
    if pc.tensor_parallel_overlap:
        rows = dt.compute * tokens // t * (cfg.padded_vocab_size // t) if b > 1 else 0
        return 4 * full // t + rows
    return 3 * full + (full // t if b > 1 else 0)


def _buffer_terms(
    cfg: Any,
    pc: ParallelConfig,
    dt: _Dtypes,
    b: int,
    s: int,
    pp_rank: int,
    m: int,
    states: ModelStates,
    imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE,
    fused_optimizer: bool = True,
) -> _Buffers:
    """The transient buffers of pp rank ``pp_rank``: FSDP2's gathered parameters and unsharded gradients, gradient
    communication buckets, the head's gradient, pipeline receive buffers, context-parallel attention buffers, one MoE
    layer's expert-parallel all-to-all buffers (at load ``imbalance``) and the optimizer step's temporaries."""
    cfg = _as_held(cfg, pc)
    _, first, last = _rank_layout(cfg.num_layers, pc, pp_rank)
    has_moe = pc.ep > 1 and any(_is_moe_layer(cfg, i) for i in _rank_layers(cfg.num_layers, pc, pp_rank))
    params = _weighted_params(cfg, pc.tp, _rank_layers(cfg.num_layers, pc, pp_rank), first, last, pc.ep)
    world, zero = pc.dp_cp, pc.zero_stage
    # FSDP2: parameters gathered for compute (padded all-gather outputs; bf16 under MixedPrecisionPolicy),
    # unsharded gradients before reduce-scatter (bf16, then their float32 cast for the reduce-scatter)
    gather_bytes = dt.compute if dt.master else dt.param
    unsharded_grad_bytes = dt.compute + 4 if dt.master else dt.param
    reduce_bytes = 4 if dt.master else dt.param  # FSDP2's reduce dtype: its reduce-scatter input, gradient shards
    units: dict[str, list[int]] = {}  # representative layer -> [padded elements, layers like it, shard elements]
    for p, count in params:
        if p.unit != "root":
            unit = units.setdefault(p.unit, [0, count, 0])
            unit[0] += _padded_numel(p, world, pc.ep)
            unit[2] += _fsdp_shard_numel(p, world, 0, pc.ep)  # rank 0's shard, the largest
    layer_numel, _, layer_shard = max(units.values(), default=(0, 0, 0))  # the largest FSDP2 layer unit
    all_layers_numel = sum(n * count for n, count, _ in units.values())
    root_numel = sum(_padded_numel(p, world, pc.ep) for p, _ in params if p.unit == "root")
    largest_layer, root = layer_numel * gather_bytes, root_numel * gather_bytes
    head = next((p for p, _ in params if p.name == "output.weight"), None)
    tied = head is None and last and cfg.tie_word_embeddings
    if tied:
        head = next(p for p, _ in params if p.name == "tok_embeddings.weight")
    head_grad = head.numel * (dt.compute if dt.master and zero >= 2 else dt.param) if head is not None else 0
    gathered_start = gathered_end = grad_buffers = 0
    if zero >= 2 and pc.pp > 1:
        # under a pipeline schedule FSDP2 neither reshards after backward nor reduces gradients until the last
        # micro-batch (PipelineStage.backward_maybe_with_nosync): all the rank's parameters and their unsharded
        # gradients (accumulated in float32 under MixedPrecisionPolicy) are held from the first backward to the end
        # of the step
        gathered_start = gathered_end = root + all_layers_numel * gather_bytes
        grad_buffers = (root_numel + all_layers_numel) * (4 if dt.master else dt.param)
    elif zero == 2:
        gathered_start = root + all_layers_numel * gather_bytes  # kept unsharded from forward to backward
        gathered_end = root + largest_layer
    elif zero == 3:
        gathered_start = root + 2 * largest_layer  # root + the layer in backward + the prefetched one
        # the end of backward (measured tensor by tensor on CPU with lightning_4d.measure.LiveTensorBytes, tiny-test
        # dp2 ZeRO 3 bf16-mixed, tied and untied head; torch 2.13's FSDPParamGroup.post_backward): a unit's
        # unsharded gradients are copied, cast to the reduce dtype, into its reduce-scatter input, which FSDP2 keeps
        # until the next unit's reduce-scatter (``comm_ctx.reduce_scatter_states``); the root's unsharded
        # gradients are made by the head's backward and the embedding's and reduced last, when its gradient shard
        # is made. Two moments, beside the gradient shards made so far and the gathered root:
        # (a) the first layer's backward: the root's and the two layer units' gathered parameters (the layer in
        #     backward, the prefetched one), the previous layer's reduce-scatter input, the head's gradient; neither
        #     the root's gradient shard nor the first layer's exists yet;
        # (b) the embedding's backward: the previous layer's reduce-scatter input, the root's unsharded gradients
        #     (a tied weight: the head's gradient, the embedding's and their sum, AccumulateGrad adding out of
        #     place); the root's gradient shard does not exist yet
        grad_unsharded = dt.compute if dt.master else dt.param
        root_shard = sum(_fsdp_shard_numel(p, world, 0, pc.ep) for p, _ in params if p.unit == "root")
        root_grads = sum(p.numel for p, _ in params if p.unit == "root") * grad_unsharded
        root_grads += 2 * head_grad if tied else 0
        if m > 1:  # gradient accumulation: every gradient shard exists from the first micro-batch's backward on
            root_shard = layer_shard = 0
        common = layer_numel * reduce_bytes - root_shard * reduce_bytes
        first_layer = 2 * largest_layer + head_grad - layer_shard * reduce_bytes
        if first_layer >= root_grads:
            gathered_end, grad_buffers = root + 2 * largest_layer, common + head_grad - layer_shard * reduce_bytes
        else:
            gathered_end, grad_buffers = root, common + root_grads
    if zero == 2 and pc.pp == 1:
        # root's unsharded gradients live to the end; 2 units in flight
        grad_buffers = (root_numel + 2 * layer_numel) * unsharded_grad_bytes
    elif zero <= 1:
        # GradientBuckets: a parameter's fresh gradient (its dtype) exists until the hook adds it into its bucket
        grad_buffers = max((p.numel for p, _ in params), default=0) * dt.param
        if world > 1 and pc.gradient_compression == "bf16":  # every bucket's bfloat16 copy on the wire at once
            grad_buffers += states.gradients // dt.grad * 2
        elif world > 1 and pc.gradient_compression == "powersgd":
            # one bucket at a time: its float32 M (gradient + error), the approximation and the new error
            largest = max((p.numel for p, _ in params), default=0)
            grad_buffers += 3 * 4 * max(min(GRADIENT_BUCKET_BYTES // dt.setup, states.gradients // dt.grad), largest)
    # PipelineStage allocates, once, a receive buffer per micro-batch for the activations of every stage but the
    # first and for the gradients of every stage but the last (one micro-batch's hidden states each, in the residual
    # stream's dtype, sequence-sharded under sp)
    hidden = dt.residual * b * (s // pc.cp) * cfg.hidden_size // (pc.tp if pc.sp else 1)
    boundaries = sum((st != 0) + (st != pc.num_stages - 1) for st in pc.stage_indices(pp_rank)) if pc.pp > 1 else 0
    # fused AdamW steps in place; foreach AdamW: the sqrt of the second moments (one moment's bytes)
    step_temp = 0 if fused_optimizer else (states.optimizer_states - states.master_weights - states.compression) // 2
    if zero == 1 and world > 1:
        # ShardedOptimizer's all-gather of one bucket at a time: this rank's range and the gathered bucket (a bucket
        # holds at most GRADIENT_BUCKET_BYTES of parameters, or one larger parameter alone: the head, the embedding)
        largest = max((p.numel for p, _ in params), default=0)
        bucket = max(min(GRADIENT_BUCKET_BYTES // dt.setup, states.parameters // dt.param), largest) * dt.param
        step_temp += int(bucket * (1 + 1 / world))
    # ZeRO 0/1 gradient buckets exist from the first gradient of the step to the end of its optimizer step
    # (parallel/grad_buffers.py's GradientBuckets): with more than one micro-batch per step (a pipeline, gradient
    # accumulation), from the first backward on, so while later micro-batches' activations are built; with one, no
    # gradient exists in forward, and at the start of backward only the bucket that takes the first gradient (the
    # head's) is made, while the saved activations are all alive: the rest appear as backward frees the layers'
    # activations (the sum of the two is linear over the layers, largest at an end: the backward end phase)
    resident = first_bucket = 0
    if zero <= 1 and (pc.pp > 1 or m > 1) or zero >= 2 and pc.pp == 1 and m > 1:
        # (ZeRO 2/3 accumulating over m > 1 micro-batches: FSDP2's gradient shards, from the first backward on)
        resident = states.gradients
    elif zero <= 1:
        first_bucket = _first_bucket_elements(
            _Sizes.of(cfg, cfg.num_layers),
            pc.tp,
            cfg.num_layers,
            first,
            last,
            pc.ep,
            dt.setup,
            GRADIENT_BUCKET_BYTES,
            world,
        )
        first_bucket *= dt.grad
    head_transient = _head_backward_transient(cfg, pc, dt, b, s) if last else 0
    embedding_grad = dt.compute * cfg.padded_vocab_size * cfg.hidden_size if pc.tp > 1 and first else 0
    local_vocab = cfg.padded_vocab_size // pc.tp
    offloaded_whole = _offloaded_whole(cfg, pc, pp_rank)
    loss_forward = 4 * min(b * (s // pc.cp), loss_chunk_tokens(local_vocab)) * local_vocab if last else 0
    return _Buffers(
        gathered_start,
        gathered_end,
        grad_buffers,
        head_grad,
        m * boundaries * hidden,
        _context_parallel_buffers(cfg, pc, dt, b, s),
        _expert_parallel_buffers(cfg, pc, dt, b, s, imbalance) if has_moe else 0,
        step_temp,
        resident,
        embedding_grad,
        first_bucket=first_bucket,
        head_backward=head_transient,
        gathered_loss=0 if zero == 3 and pc.pp == 1 else gathered_start,
        root_regather=root if zero == 3 and pc.pp == 1 else 0,
        loss_forward=loss_forward,
        forward_gradients=states.gradients if zero >= 2 and pc.pp == 1 else 0,
        recompute_backward=_recompute_backward(cfg, pc, dt, b, s, offloaded_whole),
        recompute_apart_from_cp=pc.activation_checkpointing != "none" and not offloaded_whole,
    )


def _offloaded_whole(cfg: Any, pc: ParallelConfig, pp_rank: int) -> bool:
    """Whether pp rank ``pp_rank`` holds a pipeline stage whose layers are all offloaded
    (``activation_offload_layers``): the last layer's backward then brings saved tensors back from host."""
    k = pc.activation_offload_layers
    return bool(k) and any(0 < len(layers) <= k for _, layers in pc.rank_stages(cfg.num_layers, pp_rank))


def _recompute_backward(cfg: Any, pc: ParallelConfig, dt: _Dtypes, b: int, s: int, offloaded: bool = False) -> int:
    """Bytes the first backward ops of a checkpointed layer make beside its recomputed set (``_Buffers``'s
    ``recompute_backward``), and of an offloaded layer (``offloaded``: a stage offloaded whole) beside the saved
    tensors it brings back. Checkpointed (``T = b·s/cp`` tokens, ``c`` the compute dtype's bytes): the gradient of
    the layer's output (residual dtype, ``[T, h]``, ``/t`` under sp) and ``w2``'s input gradient (``c·T·f/t``), + the
    larger of the rest of ``w2``'s backward (its weight gradient ``c·h·f/t``, and under sp its output gradient
    all-gathered, ``c·T·h``) and the SwiGLU product's backward after it (the product, counted in the recomputed set,
    freed; its two input gradients made: one ``c·T·f/t`` more). Measured on CPU (``lightning-4d measure``,
    ``LiveTensorBytes``, tiny-test b=4 s=256 ``32-true``): tp2 (sp) full and selective peak at the last layer's
    ``w2`` backward with the output gradient ``[4, 128, 64]``, the gathered one ``[4, 256, 64]``, the weight gradient
    ``[64, 64]`` and the input gradient ``[1024, 64]`` alive; tp1 and ``bf16-mixed`` dp2 at the SwiGLU product's."""
    if pc.activation_checkpointing == "none" and not offloaded:
        return 0
    tokens = b * (s // pc.cp)
    output_grad = dt.residual * tokens * cfg.hidden_size // (pc.tp if pc.sp else 1)
    if not offloaded:
        ffn = dt.compute * tokens * cfg.intermediate_size // pc.tp  # one [T, f/t] tensor
        # w2's backward: its output gradient all-gathered under sp ([T, h]) and its weight gradient ([h, f/t]) beside
        # its input gradient; the SwiGLU product's backward after it: the product freed, its two input gradients
        # beside the product's gradient (one [T, f/t] more)
        w2 = (dt.compute * tokens * cfg.hidden_size if pc.sp and pc.tp > 1 else 0) + (
            dt.compute * cfg.hidden_size * cfg.intermediate_size // pc.tp
        )
        return output_grad + ffn + max(w2, ffn)
    # offloaded: the SwiGLU product's backward, the product's gradient and the two it makes (``[T, f/t]`` each); under
    # sp the w1/w3 backward after it also holds the input gathered again and the sum of the two partial input
    # gradients (``[T, h]`` each; measured: tiny-test tp2 b=2 s=256 bf16-mixed, both layers offloaded, the peak at
    # ``parallel/tensor.py``'s ``sum(g @ w)``)
    gathered = 2 * dt.compute * tokens * cfg.hidden_size if pc.sp else 0
    return output_grad + 3 * dt.compute * tokens * cfg.intermediate_size // pc.tp + gathered


def _initialization_bytes(
    cfg: Any, pc: ParallelConfig, dt: _Dtypes, pp_rank: int, states: ModelStates, buf: _Buffers
) -> int:
    """Bytes held at the peak of setup, before the first step (module docstring, **Peak**): the larger of
    initialization (the rank's parameters in their setup dtype + the largest whole float32 parameter of its stages:
    ``families/llama.py``'s ``_local_piece`` copies the rank's piece out of a view of it) and the cast that follows
    the optimizer's setup (setup-dtype parameters + master weights + the compute-dtype copy of the largest parameter
    being made; the gradient buckets are made by the first backward)."""
    cfg = _as_held(cfg, pc)
    layers = sorted(i for _, r in pc.rank_stages(cfg.num_layers, pp_rank) for i in r)
    _, first, last = _rank_layout(cfg.num_layers, pc, pp_rank)
    largest = max(p.numel for p, _ in _weighted_params(cfg, 1, layers, first, last))
    largest_local = max(p.numel for p, _ in _weighted_params(cfg, pc.tp, layers, first, last, pc.ep))
    params = states.parameters if pc.zero_stage >= 2 else states.parameters // dt.param * dt.setup
    cast = 0
    if pc.zero_stage < 2 and dt.master:
        cast = states.master_weights + largest_local * dt.param
    return params + max(4 * largest, cast)


def _phases(states: ModelStates, act: _Activations, buf: _Buffers, initialization: int = 0) -> dict[str, int]:
    """The bytes beyond parameters and optimizer states in each phase of a step (module docstring, **Peak**);
    ``initialization``: :func:`_initialization_bytes` (before the first step: no optimizer states yet)."""
    # alive through forward and backward: autocast's weight copies, pipeline receive buffers, one layer's
    # context-parallel transients (the expert-parallel ones: their own phase below)
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
        + buf.embedding_gradient,
        "optimizer step": states.gradients + buf.step_temporaries,
    }
    # a layer's backward once the loss' backward has freed what it saved but the labels
    after_loss = act.activations - act.loss_freed + layer_transients
    after_loss += buf.gathered_start + buf.resident_gradients + buf.first_bucket
    if buf.expert_parallel:
        # an MoE layer's backward under ep: its all-to-all buffers exist after the loss' backward (not beside the
        # loss' working set: measured on CPU, tiny-moe dp2 ep2 ZeRO 1 s=512 bf16-mixed, the peak at backward start
        # was the estimate's without these buffers, 0.7% apart)
        phases["expert-parallel backward"] = after_loss - act.recompute + buf.expert_parallel
    if act.input_pass:
        # a zero-bubble schedule's input pass keeps every saved tensor (retain_graph) and the output gradients its
        # weight pass will read (_weight_pass_inputs), the peak at its end
        phases["input pass"] = act.input_pass + layer_transients + buf.resident_gradients
    if act.recompute:
        # the first checkpointed layer's backward: its recomputed set, the first op's gradients, the gradient bucket
        # made for the head's gradient (ZeRO 0/1, one micro-batch); the loss' backward has freed what it saved but
        # the labels
        if buf.recompute_apart_from_cp:
            transient = max(buf.recompute_backward, buf.context_parallel) - buf.context_parallel
        else:
            transient = buf.recompute_backward
        phases["recompute"] = after_loss - act.head_freed + transient
    if buf.forward_gradients:
        # the loss' forward at ZeRO 2/3 without pp: every saved tensor but a recomputed layer's, the loss' chunk, the
        # previous step's gradient shards (freed by zero_grad only after the forward)
        phases["forward end"] = (
            act.activations
            - act.recompute
            + buf.loss_forward
            + buf.forward_gradients
            + layer_transients
            + buf.gathered_loss
        )
    if buf.head_backward:
        # the LM head's backward (tp with sp, last stage): the loss' backward has freed what it saved but the labels
        # (the batch holds them), the logits' gradient (compute dtype) is alive, the head's weight gradient is made;
        # no layer is recomputed yet
        phases["head backward"] = (
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
    return phases


def _estimate_pp_rank(
    cfg: Any,
    pc: ParallelConfig,
    b: int,
    s: int,
    precision: str,
    pp_rank: int,
    m: int,
    dp_cp_rank: int,
    device_type: str,
    overhead: Optional[OverheadAllowance],
    gpu_name: Optional[str],
    imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE,
    fused_optimizer: bool = True,
) -> MemoryEstimate:
    """:func:`estimate_memory` of one pp rank: model states, then activations, buffers and the three phases."""
    from lightning_4d.memory.hardware import overhead_allowance

    dt = _Dtypes.for_layout(precision, cfg, pc, device_type)
    states = model_state_bytes(cfg, pc, precision, pp_rank=pp_rank, dp_cp_rank=dp_cp_rank)
    saved = saved_activation_bytes(
        cfg, pc, b, s, precision, pp_rank=pp_rank, device_type=device_type, expert_load_imbalance=imbalance
    )
    act = _activation_terms(cfg, pc, dt, b, s, pp_rank, m, saved)
    buf = _buffer_terms(cfg, pc, dt, b, s, pp_rank, m, states, imbalance, fused_optimizer)
    phases = _phases(states, act, buf, _initialization_bytes(cfg, pc, dt, pp_rank, states, buf))
    peak_phase = max(phases, key=phases.get)
    tensors = states.parameters + states.optimizer_states + phases[peak_phase]
    allowance = overhead if overhead is not None else overhead_allowance(gpu_name, device_type)
    extra = allowance.bytes_for(tensors)
    gathered = max(buf.gathered_start, buf.gathered_end)
    buffers = (
        act.compute_weights
        + gathered
        + buf.gradient_buffers
        + buf.step_temporaries
        + buf.pipeline
        + buf.context_parallel
        + buf.expert_parallel
        + buf.embedding_gradient
    )
    details = {
        **{f"saved_{k}": val for k, val in saved.items()},
        "saved_for_backward": sum(saved.values()) - saved["recompute"],
        "in_flight_microbatches_x1000": int(act.in_flight * 1000),
        "num_microbatches": m if pc.pp > 1 else 1,
        "compute_weights": act.compute_weights,
        "master_weights": states.master_weights,
        "gathered_parameters": gathered,
        "gradient_buffers": buf.gradient_buffers,
        "optimizer_step_temporaries": buf.step_temporaries,
        "pipeline_buffers": buf.pipeline,
        "context_parallel_buffers": buf.context_parallel,
        "expert_parallel_buffers": buf.expert_parallel,
        "head_gradient": buf.head_gradient,
        "host_offloaded_activations": act.offloaded,
        "offload_unpacked": act.recompute - saved["recompute"],
        **{f"phase_{k.replace(' ', '_')}": val for k, val in phases.items()},
    }
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
        details=details,
    )
