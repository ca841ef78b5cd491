"""The step-time model of the planner: predicted seconds per optimizer step of one layout, term by term.

An analytical model of FourDStrategy's step (``lightning_4d/parallel``), for ranking layouts and for the MFU
``lightning-4d plan`` predicts; it is calibrated on published runs (:data:`CALIBRATION_RUNS`, compared in
``docs/step_time.md`` and ``tests/test_step_time.py``), not measured here (we have no GPU). Symbols: h hidden size,
f FFN size, a heads, k kv heads, d head size, V vocabulary, L layers, s sequence length, b micro-batch size, m
micro-batches per step, tp/pp/cp/dp the layout, v pipeline stages per pp rank, D = dp·cp, P the dense bf16 peak,
T = b·s/cp tokens per micro-batch per GPU, c = 2 bytes (bf16 compute).

**Compute of one layer, one micro-batch** (forward + backward):

- matmuls: ``6·P_layer/tp·T`` FLOPs (``P_layer = h·(a + 2k)·d + a·d·h + 3·h·f``, every weight in one multiply-add
  per token forward and two backward: Kaplan et al. 2020 §2.1) at a fraction of the peak that depends on the GEMM
  shape (:func:`gemm_efficiency`, :data:`GEMM_EFFICIENCY`): the smallest of the layer's GEMM dimensions (T, h,
  f/tp, a·d/tp) picks the class;
- causal attention: ``6·a·d·s·T/tp`` FLOPs (half of the ``12·L·h·s`` of the MFU convention: PaLM appendix B) at
  :data:`ATTENTION_EFFICIENCY` of the peak; with document masking times the work its masked kernels do over
  that (:func:`attention_work`: 2.0 without cp and for all-to-all, less for the ring and all-gather, which skip
  the blocks no document spans);
- pointwise ops (norms, RoPE, SiLU and the SwiGLU product, residual additions, casts): memory-bound, ``bytes /
  (POINTWISE_EFFICIENCY · memory bandwidth)`` with the bytes our eager layer reads and writes per token, measured on
  it (:data:`POINTWISE_BYTES`; ``tests/test_step_time.py`` measures them again with a ``TorchDispatchMode``):
  ``348·h + 52·(a + 2k)·d + 28·f`` bytes per token forward + backward in bf16, the h term divided by tp under
  sequence parallelism (the norms and residuals run on s/tp tokens), the others by tp; that time multiplied by
  :data:`POINTWISE_FACTOR`, 1.62 eager (one kernel per op) or 0.80 with ``compile`` (inductor's fused kernels),
  calibrated on measured compiled and eager steps (ours on an H100, torchtitan's);
- the LM head on the last stage: ``6·V·h/tp·T`` FLOPs (a GEMM of the large class) and the chunked cross-entropy's
  pointwise work, :data:`LOSS_BYTES_PER_LOGIT` bytes per local logit.

Activation checkpointing adds, per layer: ``"full"`` the forward again (a third of the matmul, attention and
pointwise time) and its tp collectives; ``"selective"`` the forward pointwise ops (a third of the pointwise time)
and, under sp, the two all-gathers of the layer's saved sequence shards, and under tp the output projection's
matmul (its partial sum is not kept: :func:`wo_share` of the layer's forward matmuls).

**Tensor parallel** (not overlapped with compute by default: FourDStrategy issues the collectives synchronously):
per layer and micro-batch, under sp 2 all-gathers + 2 reduce-scatters forward, as many backward, and 2 more
all-gathers in backward (the matmul inputs saved as sequence shards, ``features/tensor_parallel/runtime.py``); without
sp 2 + 2 all-reduces (twice the volume each). Each moves ``(tp−1)/tp·T·h·c`` bytes per GPU over NVLink (``coll``
seconds, latency included). The LM head adds 3 (an all-gather forward, an all-gather and a reduce-scatter backward),
counted with the head's time in ``compute``.

With the tp ring overlap (sp only) each of those collectives runs as a ring of tp steps beside the matmul it feeds or
drains; its exposed seconds are the feature's time term
(:func:`lightning_4d.features.tensor_parallel.costs.ring_seconds`, its calibration there).

**Context parallel**: ``"ring"`` passes K and V (``T·k·d/tp·c`` bytes each) cp−1 times forward and K, V, dK, dV
backward, overlapped with the attention it feeds (exposed: what exceeds the attention time);
``"allgather"`` gathers K and V forward and reduce-scatters their float32 gradients backward, not overlapped;
``"alltoall"`` (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509 §3.2: an all-to-all of an ``M``-byte
buffer over P ranks sends ``(P−1)/P·M`` per rank; per layer "an aggregate message size of 3Nh" for q, k, v and
"Nh" for the output, forward) exchanges per layer and micro-batch, forward and again backward (the gradients),
q, k, v (``T·(a/tp + 2·k')·d·c`` bytes, ``k' = max(k/tp, cp)``: kv heads replicated when fewer than cp) and the
output (``T·a·d/tp·c``), each an all-to-all costed like a ring collective's ``(cp−1)/cp`` of the buffer plus
``(cp−1)`` latencies, not overlapped: ``2·(cp−1)/cp·T·(2a/tp + 2k')·d·c`` bytes per GPU; its attention is one
kernel over the whole sequence (block ``s``) for ``a/(tp·cp)`` heads.

**Pipeline** (the slowest pp rank t_max sets the pace): 1F1B and interleaved 1F1B ``(m + (p−1)/v)·t_max``
(bubble fraction ``(p−1)/(v·m + p−1)``: Narayanan et al. 2021, arXiv 2104.04473, §2.2); ZBV
``m·t_max + (p−1)·(t_chunk − t_mm,chunk)``: Qi et al. 2024 (arXiv 2401.10241) §3 give the ZB-V bubble as
``(p−1)·(T_F + T_B − 2·T_W)`` per chunk, which is a chunk's time less three times its weight-gradient pass, i.e.
less its matmul time. Stage-to-stage sends (``T·h·c`` bytes, ``/tp`` under sp), 2·v per micro-batch, are exposed.
Tied embeddings add, once per step and exposed, the all-reduce of the two copies' float32 gradients (``4·V·h/tp``
bytes, ``/(dp·cp)`` at ZeRO 2/3) between the first and the last stage's ranks (Megatron-Core's embedding group;
none on zbv / dualpipev, whose rank 0 holds both copies: ``features/pipeline/runtime.py``'s ``TiedEmbedding``).

**Data parallel** (bytes per GPU of the rank's ``P_r`` parameters, ring collectives: all-reduce ``2(D−1)/D``,
reduce-scatter and all-gather ``(D−1)/D`` of the buffer), as FourDStrategy overlaps them:

- ZeRO 0: float32 gradient all-reduce, bucket by bucket during the last micro-batch's backward (exposed: what
  exceeds that backward, at least the last bucket);
- ZeRO 1: float32 reduce-scatter as above + the all-gather of the updated parameters (c bytes) after the
  optimizer step (exposed);
- ZeRO 2 / 3 (FSDP2, one unit per layer): the parameters all-gathered once (ZeRO 2) or twice (ZeRO 3, forward and
  backward) per micro-batch, prefetched behind the previous unit's compute, the float32 reduce-scatter behind the
  last backward (exposed: what exceeds the compute it hides behind, plus the first unit's all-gather).

Under hybrid sharding (HSDP, r replicas of a shard group of ``D/r`` ranks) the collectives run over the shard
group, and the reduced float32 shard is all-reduced across the replicas (``2(r−1)/r`` of ``4·P/(D/r)`` bytes, on
the links between the replicas: other nodes when the shard group fills one).

Every collective also pays a latency of ``(n−1)·α`` over n ranks (ring steps; :data:`LINK_LATENCY`; the ring's
alpha-beta cost ``(n−1)·α + (n−1)/n·bytes·β``: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), §4), and the
data-parallel passes above are issued as many collectives, each paying it
(:func:`~lightning_4d.planning.rates.data_parallel_collectives`): at ZeRO 2/3 one per FSDP2 unit (L_r + 1: the
rank's layers and the root), at ZeRO 0/1 one per 25 MiB gradient bucket (``ceil(4·P_r / 25 MiB)``; the ZeRO 1
all-gather and the replicas' all-reduce bucket by bucket too), so a pass over n ranks costs
``(n−1)/n·bytes·β + k·(n−1)·α`` for k collectives; the exposed last unit or bucket is ``1/L_r`` of a pass. The optimizer
step is pointwise over the rank's optimizer states (float32 master, m, v, gradient: read and written); with
``optimizer_offload`` it runs on the host instead, and the host-link copies it needs are added to it
(:mod:`lightning_4d.planning.optimizer_offload_costs`).

**Mixture of Experts and ep**: :mod:`lightning_4d.features.moe.costs` (its module docstring) adds the terms of the
MoE layers, their all-to-alls and the data-parallel groups of their parameters.

Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

from lightning_4d.config import ParallelConfig
from lightning_4d.features.context_parallel.costs import allgather_masked_keys, ring_computed_blocks
from lightning_4d.features.moe import MoESizes, costs as moe_costs
from lightning_4d.features.moe.costs import all_to_all_time
from lightning_4d.features.pipeline import ZERO_BUBBLE_SCHEDULES
from lightning_4d.features.tensor_parallel.costs import ring_overlap, ring_seconds
from lightning_4d.layout import config_of_plan, plan_values, planned_dataclass
from lightning_4d.planning.float8_costs import FLOAT8_MATMUL_SPEEDUP
from lightning_4d.planning.optimizer_offload_costs import optimizer_offload_seconds
from lightning_4d.planning.rates import (
    COLLECTIVE_EFFICIENCY,
    GEMM_EFFICIENCY,
    LINK_LATENCY,
    POINTWISE_BYTES,
    POINTWISE_EFFICIENCY,
    LayerShape,
    MeshSizes,
    StageShape,
    by_class as _by_class,
    data_parallel_collectives,
    gemm_efficiency,
    link as _link,
    ring as _ring,
)

__all__ = [
    "ATTENTION_EFFICIENCY",
    "CALIBRATION_RUNS",
    "GEMM_EFFICIENCY",
    "LINK_LATENCY",
    "POINTWISE_BYTES",
    "Layout",
    "StepTime",
    "all_to_all_time",
    "attention_efficiency",
    "attention_work",
    "gemm_efficiency",
    "offload_exposed",
    "with_float8",
    "predict_step_time",
    "step_time_of",
    "step_time_parts",
]

#: Fraction of the peak of the fused attention kernel (FlashAttention 2, PyTorch's SDPA flash backend) forward +
#: backward, causal, head size 128, on H100 SXM5, by the length of the query/key blocks it runs on (s, or s/(2·cp)
#: under context parallelism): FlashAttention-2's measured TFLOP/s in Shah et al. 2024 (FlashAttention-3, arXiv
#: 2407.08608), Fig. 5-7, the FlashAttention-2 bars (forward, causal, head dim 128: 191, 260, 298, 319, 333, 335 at
#: 512 .. 16k tokens; backward, head dim 128: 214, 260, 291, 310, 318, 322), combined as the step runs them (the
#: backward does 2.5× the forward's FLOPs): ``3.5 / (1/fwd + 2.5/bwd)`` = 207, 260, 293, 312, 322, 326 TFLOP/s, over
#: the 989 TFLOP/s peak. (The table read 0.35 at 4k and above before: above FlashAttention-2's own forward rate.)
ATTENTION_EFFICIENCY = ((8192, 0.326), (4096, 0.316), (2048, 0.296), (1024, 0.263), (512, 0.209), (0, 0.15))
#: The decoder layers' pointwise time (``POINTWISE_BYTES`` at ``POINTWISE_EFFICIENCY`` of the memory bandwidth) is
#: multiplied by ``POINTWISE_FACTOR[compile]``: ``torch.compile`` (``FourDStrategy(compile=True)``, ``Layout.compile``)
#: fuses the layer's pointwise ops and changes nothing else the model charges (the matmuls stay cuBLAS calls, the
#: attention the flash kernel, the loss and the optimizer step are not compiled). Each factor is what makes the model's
#: other terms plus the layers' pointwise time equal a measured step:
#:
#: - compiled 0.80: FourDStrategy(compile=True), llama3.2-1b b=1 s=8192 on one H100 80GB, bf16-mixed: 0.805;
#:   torchtitan's Llama 3.1 8B on 8 H100 (``benchmarks/llama3_h100_202412_torchtitan.md`` Table 1, "FSDP +
#:   torch.compile"): 0.792. Two models, two GPUs, two code bases: fused kernels move about the bytes the model counts.
#: - eager 1.62: the geometric mean of FourDStrategy's eager step of the same 1B run (2.04) and torchtitan's eager
#:   "FSDP" row of the same Table 1 (1.29). The step times behind both factors: docs/validation.md, "Measurements
#:   behind constants in the code". Eager runs every pointwise op as its own kernel
#:   (RMSNorm's float32 upcast, the squares, the mean, the scale, ...), with a launch and a pass over memory each;
#:   the two code bases' eager layers differ (ours the slower), the fused ones agree.
#:
#: The measured ratio compile / eager of the 1B step, 187.7 / 254.1 = 0.74, is then predicted 0.80 / 1.62 of the
#: pointwise term plus the unchanged rest (``tests/test_step_time.py`` checks the GPU rows within 15%).
POINTWISE_FACTOR = {False: 1.62, True: 0.80}
#: Bytes per local logit the chunked cross-entropy reads and writes forward + backward (``parallel/loss.py``:
#: the bf16 logits read twice, a float32 chunk written and read, the bf16 gradient written).
LOSS_BYTES_PER_LOGIT = 20
#: float32 bytes the optimizer step reads and writes per owned parameter (gradient, master, m, v read; master,
#: m, v written) + the compute-dtype parameter written.
OPTIMIZER_BYTES_PER_PARAM = 4 * 7 + 2
#: Published runs the model is calibrated with and tested against (``tests/test_step_time.py``, ``docs/step_time.md``,
#: ``benchmarks/step_time_calibration.py``). ``mfu`` is the publication's figure; ``layout`` our FourDStrategy
#: equivalent; ``compile`` whether the run compiled its layers as its source says (True / False), or ``None`` where the
#: source does not say: Meta's stack is not PyTorch eager and the Llama 3 paper names no kernels, so its rows are
#: compared with the fused-pointwise (compiled) prediction, the eager one printed beside it
#: (:data:`POINTWISE_FACTOR`).
CALIBRATION_RUNS: tuple[dict[str, Any], ...] = (
    *(
        dict(
            name=f"torchtitan Llama 3.1 8B, 8 H100, FSDP, {'compiled' if compile else 'eager'}",
            model="llama3.1-8b",
            gpu="H100-96GB",
            num_gpus=8,
            gpus_per_node=8,
            seq_length=8192,
            global_batch_size=16,
            layout=dict(tp=1, pp=1, cp=1, dp=8, zero_stage=3, activation_checkpointing="selective", micro_batch_size=2),
            tokens_per_sec_per_gpu=published,
            mfu=None,
            compile=compile,
            source=f"torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 ({technique}, local batch 2, "
            f"selective AC): {published:,} tokens/s/GPU",
        )
        for compile, technique, published in ((False, "FSDP", 5762), (True, "FSDP + torch.compile", 6667))
    ),
    *(
        dict(
            name=f"Meta Llama 3.1 405B, {n:,} H100" + (", 128k context" if cp > 1 else ""),
            model="llama3.1-405b",
            gpu="H100-80GB",
            num_gpus=n,
            gpus_per_node=8,
            seq_length=s,
            global_batch_size=gb,
            layout=dict(tp=8, pp=16, cp=cp, dp=n // (8 * 16 * cp), micro_batch_size=1),
            tokens_per_sec_per_gpu=None,
            mfu=mfu,
            compile=None,
            source=f"Llama 3 paper (arXiv 2407.21783) Table 4: tp8 cp{cp} pp16 dp{n // (128 * cp)}, sequence {s:,}, "
            f"{gb // (n // (128 * cp))} sequences per dp rank, {tflops} TFLOP/s per GPU, {mfu:.0%} MFU"
            + ("; its cp all-gathers K and V (§3.3.2), our 'allgather'" if cp > 1 else ""),
        )
        for n, cp, s, gb, tflops, mfu in (
            (8192, 1, 8192, 2048, 430, 0.43),
            (16384, 1, 8192, 2048, 400, 0.41),
            (16384, 16, 131072, 128, 380, 0.38),
        )
    ),
)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step and its parts (all seconds, on the slowest pp rank).

    ``total = compute + recompute + bubble + tp + cp + pp + dp + ep + optimizer + offload``; ``compute`` is the
    forward + backward of the step's micro-batches (matmuls, attention, pointwise), ``recompute`` what activation
    checkpointing adds, ``bubble`` the pipeline's idle time, ``tp``/``cp``/``pp``/``dp``/``ep`` the exposed
    communication of each dimension (``ep``: the MoE layers' collectives, the token all-to-alls over ep and the
    latency of the routing counts' exchanges; 0 for a dense model), ``offload`` the host-link copies of
    ``activation_offload_layers`` (the part the compute does not hide: :func:`offload_exposed`; 0 without offload).
    """

    compute: float
    recompute: float
    bubble: float
    tp: float
    cp: float
    pp: float
    dp: float
    optimizer: float
    ep: float = 0.0
    offload: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.offload
            + self.compute
            + self.recompute
            + self.bubble
            + self.tp
            + self.cp
            + self.pp
            + self.dp
            + self.ep
            + self.optimizer
        )

    @property
    def exposed_communication(self) -> float:
        return self.tp + self.cp + self.pp + self.dp + self.ep


@planned_dataclass
class Layout(MoESizes):
    """One layout of a job as plain values: what the step-time model reads, and what the planner enumerates (a
    :class:`~lightning_4d.config.ParallelConfig` with its micro-batch shape, built without validation because the
    planner visits ~10^5 of them; :meth:`parallel_config` gives the validated one).

    Its fields are the planned fields of :data:`lightning_4d.layout.LAYOUT_FIELDS` (the mesh sizes by their mesh
    names ``tp``, ``pp``, ``cp``, ``dp``; resolved values: ``sequence_parallel`` whether sp is on, False with tp = 1;
    ``virtual_pipeline_stages`` v, 1 without pp; ``num_microbatches`` m, with pp = 1 the gradient-accumulation steps;
    ``pipeline_layer_split`` a tuple, or ``None`` for the even split; the MoE feature's ep, 1 without it, also as
    :attr:`~lightning_4d.features.moe.MoESizes.ep`), then ``micro_batch_size`` b
    (:func:`lightning_4d.layout.planned_dataclass`); every field a keyword.
    """

    @classmethod
    def of(cls, pc: ParallelConfig, micro_batch_size: int, num_microbatches: int) -> "Layout":
        """The layout of ``pc`` (a resolved ``data_parallel_size``) with micro-batch size b and m micro-batches."""
        return cls(**plan_values(pc, micro_batch_size, num_microbatches))

    def parallel_config(self) -> ParallelConfig:
        """The layout as a :class:`~lightning_4d.config.ParallelConfig` (with pp > 1: its schedule, v, layer split
        and m).

        Raises:
            ValueError: see :class:`~lightning_4d.config.ParallelConfig`.
        """
        return ParallelConfig(**config_of_plan(self))


def _layer_params(dims: tuple[int, ...]) -> int:
    """``P_layer``: the matmul weights of one decoder layer, ``h·(a + 2k)·d + a·d·h + 3·h·f``."""
    h, f, d, a, k = dims[:5]
    return h * (a + 2 * k) * d + a * d * h + 3 * h * f


def wo_share(dims: tuple[int, ...]) -> float:
    """The output projection's share of one layer's matmul FLOPs, ``a·d·h / P_layer``: what ``"selective"`` activation
    checkpointing recomputes under tp (its partial sum is not kept, ``parallel/activation_checkpoint.py``), as a
    fraction of the layer's forward matmuls."""
    h, f, d, a, k = dims[:5]
    return a * d * h / _layer_params(dims)


def selective_recomputed_matmul_fraction(model_config: Any, tp: int) -> float:
    """The matmul FLOPs ``"selective"`` activation checkpointing adds, as a fraction of the layers' matmul FLOPs of
    a step (forward + backward, 3× the forward): under tp the output projection's forward again
    (:func:`wo_share` / 3), 0 at tp = 1 (nothing but pointwise ops and all-gathers recomputed)."""
    return wo_share(model_dims(model_config)) / 3 if tp > 1 else 0.0


def model_dims(cfg: Any) -> tuple[int, ...]:
    """(h, f, d, a, k, V, L, E, top-k, f_e, n_s, MoE layers, tied) of a model config (E .. MoE layers 0 for a dense
    one: :func:`lightning_4d.features.moe.costs.model_dims`; tied 1 with ``tie_word_embeddings``, else 0): the
    ``dims`` of :func:`step_time_of`."""
    return (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.padded_vocab_size,
        cfg.num_layers,
        *moe_costs.model_dims(cfg),
        int(bool(getattr(cfg, "tie_word_embeddings", False))),
    )


_dims = model_dims  # the name the tests read


def attention_efficiency(block_tokens: float) -> float:
    """Fraction of the peak of the fused attention kernel on query/key blocks of ``block_tokens`` tokens
    (:data:`ATTENTION_EFFICIENCY`)."""
    return _by_class(ATTENTION_EFFICIENCY, block_tokens)


@functools.lru_cache(maxsize=4096)
def attention_work(seq_length: int, document_tokens: Optional[int], cp: int, method: str) -> float:
    """The attention work a layer's kernels do with document masking, over causal attention's (the step-time model's
    ``6·a·d·s·T/tp`` FLOPs, ``s²/(2·cp)`` (query, key) pairs per sample and cp rank), for windows of ``seq_length``
    tokens packed with documents of ``document_tokens`` tokens (``lightning-4d measure``'s windows; documents of
    ``s`` tokens or more: one document per window, still masked). 1.0 without masking (``None``).

    What the masked kernels run today (``features/context_parallel/runtime.py``, ``models/attention_backends.py``):
    SDPA with the mask (ATen's CPU flash kernel, CUDA's memory-efficient one) or explicit matmuls, each computing
    every (query, key) pair of the block it is given, masked ones included: no causal half skipped, no masked tile.

    - No cp, and ``"alltoall"`` (each rank's heads over the whole window): one masked call over the whole ``s × s``
      square, ``s²`` pairs against causal's ``s²/2``: 2.0, whatever the documents.
    - ``"ring"``: it skips a block no document spans and computes the others whole
      (:func:`~lightning_4d.features.context_parallel.costs.ring_computed_blocks`). Its ranks exchange K/V every
      step, so a step lasts as long as its slowest rank's block: the own block (step 0, always computed) is the
      ``2C × 2C`` square, ``4·C²`` pairs (``C = s/(2·cp)``), every other computed block ``2·C²``, the causal ring's
      ``2·C²`` per step: ``(2 + Σ_{steps ≥ 1} max_ranks computed) / cp``.
    - ``"allgather"``: query chunk ``i`` against its own chunk and the keys from the start of its first token's
      document (:func:`~lightning_4d.features.context_parallel.costs.allgather_masked_keys`); the gathers and
      reduce-scatters of every layer wait for the slowest rank: ``max_ranks keys / (2·cp·C)``.

    A kernel that skipped masked tiles (FlexAttention's block mask, flash-attn's varlen functions) would do the
    documents' own FLOPs, ``c/s`` with ``c`` their mean attention context
    (:func:`~lightning_4d.planning.workload.document_attention_context`), what MFU counts; none runs today.
    ``tests/test_document_masking.py`` checks these against torch's ``FlopCounterMode`` on the real kernel calls."""
    if document_tokens is None:
        return 1.0
    n = min(document_tokens, seq_length)
    if cp > 1 and method == "ring":
        blocks = ring_computed_blocks(seq_length, cp, n)
        return (2 + sum(max(rank[step] for rank in blocks) for step in range(1, cp))) / cp
    if cp > 1 and method == "allgather":
        return max(allgather_masked_keys(seq_length, cp, n)) / seq_length
    return 2.0


@functools.lru_cache(maxsize=65536)
def _layer_terms(dims: tuple[int, ...], shape: LayerShape, gpu: Any, gpus_per_node: int) -> tuple[float, ...]:
    """Seconds of one layer and one micro-batch of ``shape`` (the average over dense and MoE layers): (matmuls,
    attention, pointwise, exposed tp collectives, exposed cp exchange, one tp collective, head + loss, MoE collectives
    forward, MoE collectives forward + backward, the forward's exposed tp collectives); ``shape.overlap``:
    the tp ring overlap in effect; ``shape.compile``: the pointwise time at :data:`POINTWISE_FACTOR`'s
    compiled factor, else at its eager one."""
    tp, cp, b, s, sp, method, ep, dd, overlap, compile, attention = shape
    h, f, d, a, k, vocab, num_layers = dims[:7]
    c = 2
    peak, hbm = gpu.peak_flops * gpu.compute_fraction, POINTWISE_EFFICIENCY * gpu.memory_bandwidth
    tokens = b * s / cp
    t_mm = 6 * _layer_params(dims) / tp * tokens / (gemm_efficiency(min(tokens, h, f / tp, a * d / tp)) * peak)
    # the load-balanced causal split: 2·cp chunks; alltoall: one kernel call over the whole sequence
    block = s / (2 * cp) if cp > 1 and method != "alltoall" else s
    t_att = 6 * a * d * s * tokens / tp / (attention_efficiency(block) * peak)
    if attention != 1.0:  # document masking: the work its masked kernels do (attention_work)
        t_att *= attention
    ch, cq, cf = POINTWISE_BYTES
    t_pw = (ch * h / (tp if sp else 1) + (cq * (a + 2 * k) * d + cf * f) / tp) * tokens / hbm
    coll = _ring(tokens * h * c, tp, *_link(gpu, True))
    t_tp = ((10 if sp else 8) if tp > 1 else 0) * coll  # an all-reduce counted as two
    t_tp_fwd = 4 * coll if tp > 1 else 0.0
    t_head_tp = 3 * coll if tp > 1 else 0.0
    if overlap and sp and tp > 1:
        t_tp_fwd, t_tp, t_head_tp = ring_seconds(dims, coll, tp, tokens, peak)
    t_cp = 0.0
    if cp > 1:
        kv_bytes = tokens * k * d / tp * c
        b_cp, lat = _link(gpu, tp * cp <= gpus_per_node)
        if method == "ring":
            comm = 3 * 2 * kv_bytes * (cp - 1) / (COLLECTIVE_EFFICIENCY * b_cp) + 3 * (cp - 1) * lat
            t_cp = max(0.0, comm - t_att)
        elif method == "alltoall":
            # q, k, v (k' = max(k/tp, cp) kv heads: replicated when fewer than cp) and the output, forward and
            # backward, each an all-to-all sending (cp−1)/cp of the buffer: DeepSpeed-Ulysses, arXiv 2309.14509 §3.2
            qkv = tokens * (a / tp + 2 * max(k / tp, cp)) * d * c
            out = tokens * a / tp * d * c
            t_cp = 2 * (_ring(qkv, cp, b_cp, lat) + _ring(out, cp, b_cp, lat))
        else:
            t_cp = _ring(2 * kv_bytes * cp, cp, b_cp, lat) + _ring(2 * 2 * kv_bytes * cp, cp, b_cp, lat)
    t_head = (
        6 * vocab * h / tp * tokens / (gemm_efficiency(min(tokens, h, vocab / tp)) * peak)
        + LOSS_BYTES_PER_LOGIT * vocab / tp * tokens / hbm
        + t_head_tp
    )
    if not dims[7]:
        return t_mm, t_att, POINTWISE_FACTOR[compile] * t_pw, t_tp, t_cp, coll, t_head, 0.0, 0.0, t_tp_fwd
    t_mm, t_pw, forward, both = moe_costs.layer_times(dims, (t_mm, t_pw), shape, gpu, gpus_per_node)
    return t_mm, t_att, POINTWISE_FACTOR[compile] * t_pw, t_tp, t_cp, coll, t_head, forward, both, t_tp_fwd


@functools.lru_cache(maxsize=4096)
def _pipeline_layers(
    num_layers: int, pp: int, schedule: str, v: int, split: Optional[tuple[int, ...]]
) -> tuple[tuple[int, ...], int]:
    """(decoder layers of every pp rank, the pp rank holding the last stage)."""
    if pp == 1:
        return (num_layers,), 0
    pc = ParallelConfig(
        pipeline_parallel_size=pp,
        pipeline_schedule=schedule,
        virtual_pipeline_stages=v,
        pipeline_layer_split=list(split) if split else None,
    )
    layers = tuple(sum(len(r) for _, r in pc.rank_stages(num_layers, r)) for r in range(pp))
    return layers, next(r for r in range(pp) if pc.num_stages - 1 in pc.stage_indices(r))


@functools.lru_cache(maxsize=65536)
def _pipeline_terms(
    dims: tuple[int, ...], shape: LayerShape, stages: StageShape, gpu: Any, gpus_per_node: int
) -> tuple:
    """(t_max, compute of the slowest rank, its layers, bubble, recompute / tp / cp / MoE-collective seconds per
    layer, layers per rank) of one micro-batch of ``shape`` through the pipeline ``stages`` (module docstring,
    **Pipeline**)."""
    num_layers = dims[6]
    tp, sp = shape.tp, shape.sp
    pp, schedule, v, split, activation_checkpointing = stages
    t_mm, t_att, t_pw, t_tp, t_cp, coll, t_head, t_moe_fwd, t_moe, t_tp_fwd = _layer_terms(
        dims, shape, gpu, gpus_per_node
    )
    ac = activation_checkpointing
    if ac == "full":
        t_re = (t_mm + t_att + t_pw) / 3 + t_tp_fwd + t_moe_fwd
    elif ac == "selective":
        t_re = t_pw / 3 + (2 * coll if sp else 0.0) + (t_mm / 3 * wo_share(dims) if tp > 1 else 0.0)
    else:
        t_re = 0.0
    layers_of, last_rank = _pipeline_layers(num_layers, pp, schedule, v, split)
    layer = t_mm + t_att + t_pw
    best = None
    for r, n in enumerate(layers_of):  # the slowest pp rank sets the pace
        work = n * layer + (t_head if r == last_rank else 0.0)
        busy = work + n * (t_re + t_tp + t_cp + t_moe)
        if best is None or busy > best[0]:
            best = (busy, work, n)
    t_max, work, n_max = best
    if pp == 1:
        bubble = 0.0
    elif schedule in ZERO_BUBBLE_SCHEDULES:
        bubble = (pp - 1) * max(0.0, (t_max - n_max * t_mm) / v)
    else:
        bubble = (pp - 1) / v * t_max
    return t_max, work, n_max, bubble, t_re, t_tp, t_cp, t_moe, layers_of


def predict_step_time(
    model_config: Any,
    pc: ParallelConfig,
    micro_batch_size: int,
    num_microbatches: int,
    seq_length: int,
    gpu: Any,
    gpus_per_node: int,
    document_tokens: Optional[int] = None,
) -> StepTime:
    """Predicted :class:`StepTime` of one optimizer step (module docstring: every term and its source).

    With ``pc.activation_offload_layers`` (not enumerated by the planner) the part of the copies to host memory and
    back that the compute does not hide is added (:func:`offload_exposed`).

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig`.
        pc: the layout (schedule, v, layer split, sp, cp method, ZeRO stage, activation checkpointing, offload).
        micro_batch_size: b; num_microbatches: m (pipeline micro-batches or gradient-accumulation steps).
        seq_length: s, tokens per sample.
        gpu: a :class:`~lightning_4d.planning.hardware.GpuSpec`; gpus_per_node: GPUs per node.
        document_tokens: document masking with documents of this many tokens: the attention work they leave
            (:func:`attention_work`); ``None``: causal attention over the whole window.
    """
    step = step_time_of(
        model_dims(model_config),
        Layout.of(pc, micro_batch_size, num_microbatches),
        seq_length=seq_length,
        gpu=gpu,
        gpus_per_node=gpus_per_node,
        document_tokens=document_tokens,
    )
    if pc.float8 is not None:
        step = with_float8(step, model_config, pc, micro_batch_size, num_microbatches, seq_length, gpu, gpus_per_node)
    if not pc.activation_offload_layers:
        return step
    return dataclasses.replace(
        step, offload=offload_exposed(model_config, pc, micro_batch_size, num_microbatches, seq_length, gpu, step)
    )


def offload_exposed(
    model_config: Any, pc: Any, micro_batch_size: int, num_microbatches: int, seq_length: int, gpu: Any, step: StepTime
) -> float:
    """Seconds of activation offload's copies (``parallel/offload.py``) the compute of one step does not hide, on the
    pp rank that offloads most: per micro-batch and offloaded layer, ``max(0, t − t_f) + max(0, t − t_b)``, with
    ``t = B_l / (COLLECTIVE_EFFICIENCY · host_bandwidth)`` one layer's copy (``B_l``: its saved bytes and RoPE copy,
    :func:`~lightning_4d.planning.model.offloaded_bytes_per_microbatch` over the offloaded layers), ``t_f`` the forward
    of one layer the copy out overlaps (on the offload stream, behind the layers after it) and ``t_b = 2·t_f`` the
    backward of the next layer the prefetch overlaps; a stage offloaded whole brings its last layer back on demand,
    ``t`` exposed. ``t_f = step.compute / (3·m·L_r)``, ``L_r`` the rank's layers (forward : backward FLOPs = 1 : 2,
    Narayanan et al. 2021, arXiv 2104.04473, §5.1). Megatron-Core overlaps its ``cpu_offloading`` copies the same
    way (a side stream, one layer ahead). Not measured on a GPU yet (``docs/offload.md``)."""
    from lightning_4d.planning.model import offloaded_bytes_per_microbatch

    k, m = pc.activation_offload_layers, num_microbatches
    worst = 0.0
    for rank in range(pc.pp):
        stages = pc.rank_stages(model_config.num_layers, rank)
        layers = sum(len(r) for _, r in stages)
        offloaded = sum(min(k, len(r)) for _, r in stages)
        if not offloaded:
            continue
        moved = offloaded_bytes_per_microbatch(model_config, pc, micro_batch_size, seq_length, pp_rank=rank)
        t = moved / offloaded / (COLLECTIVE_EFFICIENCY * gpu.host_bandwidth)
        t_f = step.compute / (3 * m * max(1, layers))
        whole = sum(1 for _, r in stages if 0 < len(r) <= k)
        per_layer = max(0.0, t - t_f) + max(0.0, t - 2 * t_f)
        worst = max(worst, m * (offloaded * per_layer + whole * min(t, 2 * t_f)))
    return worst


def with_float8(
    step: StepTime, cfg: Any, pc: ParallelConfig, b: int, m: int, s: int, gpu: Any, gpus_per_node: int
) -> StepTime:
    """``step`` with the decoder layers' matmuls at :data:`~lightning_4d.planning.float8_costs.FLOAT8_MATMUL_SPEEDUP`
    times their rate (``pc.float8``, not enumerated by the planner): the slowest pp rank's layers, forward + backward
    and
    full checkpointing's recomputed forward; the bubble is not rescaled. A Mixture-of-Experts model (which float8
    refuses) is left as it is."""
    dims = model_dims(cfg)
    if dims[7]:
        return step
    shape = LayerShape(pc.tp, pc.cp, b, s, pc.sp, pc.context_parallel_method)
    t_mm = _layer_terms(dims, shape, gpu, gpus_per_node)[0]
    split = tuple(pc.pipeline_layer_split) if pc.pipeline_layer_split else None
    n_max = max(_pipeline_layers(dims[6], pc.pp, pc.pipeline_schedule, pc.v if pc.pp > 1 else 1, split)[0])
    saved = m * n_max * t_mm * (1 - 1 / FLOAT8_MATMUL_SPEEDUP[pc.float8])
    recompute = saved / 3 if pc.activation_checkpointing == "full" else 0.0
    return dataclasses.replace(step, compute=step.compute - saved, recompute=step.recompute - recompute)


def step_time_of(dims: tuple[int, ...], layout: Layout, **kw: Any) -> StepTime:
    """:func:`predict_step_time` on plain values (the planner's fast path; ``dims`` = (h, f, d, a, k, V, L, E,
    top-k, f_e, n_s, MoE layers, tied), as :func:`model_dims` reads them from a model config; ``kw``: the keywords of
    :func:`step_time_parts`, ``seq_length``, ``gpu``, ``gpus_per_node`` and ``document_tokens``)."""
    return StepTime(*step_time_parts(dims, layout, **kw))


def step_time_parts(
    dims: tuple[int, ...],
    layout: Layout,
    *,
    seq_length: int,
    gpu: Any,
    gpus_per_node: int,
    document_tokens: Optional[int] = None,
) -> tuple[float, ...]:
    """The fields of :func:`step_time_of`'s :class:`StepTime` as a tuple, in its field order (the planner times
    ~10^5 layouts and builds a ``StepTime`` only for those it keeps); ``document_tokens``: document masking's
    documents (:func:`attention_work`)."""
    tp, pp, cp, dp = layout.tp, layout.pp, layout.cp, layout.dp
    b, m, v = layout.micro_batch_size, layout.num_microbatches, layout.virtual_pipeline_stages
    s, sp, zero_stage = seq_length, layout.sequence_parallel, layout.zero_stage
    ep = layout.ep
    shape = LayerShape(
        tp,
        cp,
        b,
        s,
        sp,
        layout.context_parallel_method,
        *((ep, dp * cp) if dims[7] else (1, 1)),  # a dense model's terms do not depend on them: keep its cache hits
        ring_overlap(layout),
        layout.compile,
        attention_work(s, document_tokens, cp, layout.context_parallel_method),
    )
    stages = StageShape(pp, layout.pipeline_schedule, v, layout.pipeline_layer_split, layout.activation_checkpointing)
    t_max, work, n_max, bubble, t_re, t_tp, t_cp, t_moe, layers_of = _pipeline_terms(
        dims, shape, stages, gpu, gpus_per_node
    )
    t_pp = _pipeline_sends(dims, layout, s, gpu, gpus_per_node)
    rs, ag, units, t_opt, across = _data_parallel_terms(
        dims,
        MeshSizes(tp, pp, cp, dp, ep),
        zero_stage,
        max(layers_of),
        gpu,
        gpus_per_node,
        layout.data_parallel_replicate_size,
    )
    t_dp = 0.0
    if dp * cp > 1:
        last_backward = 2 / 3 * t_max
        # HSDP at ZeRO 0/1: the replicas' all-reduce runs after the shard group's reduce is waited for
        # (GradientBuckets.synchronize), exposed; FSDP2 (ZeRO 2/3) issues it inside each unit's post-backward reduce
        if zero_stage == 0:
            t_dp = max(2 * rs - last_backward, 2 * rs / units) + across
        elif zero_stage == 1:
            t_dp = max(rs - last_backward, rs / units) + across + ag
        else:
            gathers = 1 if zero_stage == 2 else 2
            rs += across
            t_dp = m * (max(0.0, gathers * ag - t_max) + ag / units) + max(rs - last_backward, rs / units)
    if layout.optimizer_offload:
        t_opt = _offloaded_optimizer(t_opt, layout, units, m * work, gpu)
    # StepTime's fields: compute, recompute, bubble, tp, cp, pp, dp, optimizer, ep
    return m * work, m * n_max * t_re, bubble, m * n_max * t_tp, m * n_max * t_cp, t_pp, t_dp, t_opt, m * n_max * t_moe


def _pipeline_sends(dims: tuple[int, ...], layout: Layout, s: int, gpu: Any, gpus_per_node: int) -> float:
    """Seconds per step of a pipeline's stage-to-stage sends (each micro-batch's activation forward and its gradient
    back, ``b·s/cp·h`` elements in the compute dtype, ``/t`` under sp, once per virtual stage) and, for tied
    embeddings outside the zero-bubble schedules, the tied copies' gradient all-reduce; 0 without pp."""
    tp, pp, cp, dp = layout.tp, layout.pp, layout.cp, layout.dp
    if pp == 1:
        return 0.0
    b, m, v, c = layout.micro_batch_size, layout.num_microbatches, layout.virtual_pipeline_stages, 2
    b_pp, lat = _link(gpu, tp * pp * cp * dp <= gpus_per_node)
    sp_split = tp if layout.sequence_parallel else 1
    t_pp = 2 * v * m * (b * s / cp * dims[0] * c / sp_split / (COLLECTIVE_EFFICIENCY * b_pp) + lat)
    if dims[12] and layout.pipeline_schedule not in ZERO_BUBBLE_SCHEDULES:  # the tied copies' gradient sum
        sharded = dp * cp // layout.data_parallel_replicate_size if layout.zero_stage >= 2 else 1
        t_pp += 2 * _ring(4 * dims[5] * dims[0] / tp / sharded, 2, b_pp, lat)  # all-reduce: reduce-scatter + all-gather
    return t_pp


def _offloaded_optimizer(t_opt: float, layout: Layout, units: int, compute: float, gpu: Any) -> float:
    """The optimizer term under ``optimizer_offload``: the host's step and the exposed host-link copies
    (:func:`lightning_4d.planning.optimizer_offload_costs.optimizer_offload_seconds`) in place of the device's step
    ``t_opt``, whose owned parameters it reads back from ``t_opt`` (``owned · OPTIMIZER_BYTES_PER_PARAM /
    (POINTWISE_EFFICIENCY · memory_bandwidth)``, :func:`_data_parallel_terms`)."""
    owned = t_opt * POINTWISE_EFFICIENCY * gpu.memory_bandwidth / OPTIMIZER_BYTES_PER_PARAM
    m = layout.num_microbatches
    return optimizer_offload_seconds(owned, layout.zero_stage, m, units, compute, gpu, COLLECTIVE_EFFICIENCY)


@functools.lru_cache(maxsize=65536)
def _data_parallel_terms(
    dims: tuple[int, ...],
    sizes: MeshSizes,
    zero_stage: int,
    layers: int,
    gpu: Any,
    gpus_per_node: int,
    replicas: int = 1,
) -> tuple[float, float, int, float, float]:
    """(gradient reduce-scatter seconds, parameter all-gather seconds, FSDP units, optimizer seconds, HSDP replicas'
    all-reduce seconds) of the pp rank
    holding ``layers`` decoder layers: the data-parallel collectives over dp·cp of its parameters (an MoE
    model's: :func:`lightning_4d.features.moe.costs.data_parallel_terms`) (module docstring, **Data parallel**);
    under HSDP (``replicas`` r > 1) over the shard group of dp·cp/r ranks, plus the all-reduce of each rank's
    float32 shard (``4·P/(D/r)`` bytes) across the r replicas (the fifth value): the shard group is
    ``tp·D/r`` consecutive ranks (inside a node when they fit), the replicas ``tp·D/r`` ranks apart (across nodes
    unless all of dp·cp·tp fits in one). An MoE model has no HSDP (``ParallelConfig`` refuses it)."""
    tp, pp, cp, dp, ep = sizes
    h, vocab = dims[0], dims[5]
    c = 2
    dd = dp * cp
    # data parallel over dp_cp: the parameters of the largest pp rank (an MoE model: moe.data_parallel_terms)
    vocabulary = vocab * h / tp * (2 if pp == 1 else 1)
    params = layers * _layer_params(dims) / tp + vocabulary
    b_dp, lat = _link(gpu, tp * dd <= gpus_per_node)
    owned_extra = rs_extra = ag_extra = 0.0
    if dims[7]:
        params, owned_extra, rs_extra, ag_extra = moe_costs.data_parallel_terms(
            dims, layers, (tp, ep, dd), zero_stage, (_layer_params(dims), vocabulary), (b_dp, lat)
        )
    shard = dd // replicas  # the ZeRO shard group
    owned = params / shard + owned_extra if zero_stage >= 1 else params + owned_extra
    # one collective per FSDP2 unit (the layers + the root) or per gradient bucket, each paying its ring's latency
    k = data_parallel_collectives(zero_stage, layers + 1, 4 * params)
    rs = ag = across = 0.0
    if replicas > 1:
        b_dp, lat = _link(gpu, tp * shard <= gpus_per_node)
        across = 2 * _ring(4 * params / shard, replicas, *_link(gpu, tp * dd <= gpus_per_node), k)
    if dd > 1:
        rs = _ring(4 * params, shard, b_dp, lat, k) + rs_extra
        ag = _ring(c * params, shard, b_dp, lat, k) + ag_extra
    t_opt = owned * OPTIMIZER_BYTES_PER_PARAM / (POINTWISE_EFFICIENCY * gpu.memory_bandwidth)
    return rs, ag, max(1, layers), t_opt, across
