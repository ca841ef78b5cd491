"""The memory and step-time terms of tensor parallelism (runtime: ``lightning_4d/features/tensor_parallel/runtime.py``).

**Memory.** Its own transients: the LM head's backward under sequence parallelism, with and without the ring overlap
(:func:`head_backward_transient`), and the vocabulary-parallel embedding's whole-vocabulary gradient
(:func:`embedding_gradient_bytes`). The tp-local shapes of the parameters: :mod:`lightning_4d.planning.params`; what
the layers save under tp and sp: :mod:`lightning_4d.planning.activations`.

**Step time.** The tp collectives themselves are the step-time model's (:mod:`lightning_4d.planning.step_time`, module
docstring, **Tensor parallel**; ``coll`` seconds each). With the ring overlap (sp only; :func:`ring_overlap`) each of
those collectives runs as a ring of tp steps beside the matmul it feeds or drains (``_RingAllGatherMatmul`` /
``_RingMatmulReduceScatter``): step k multiplies 1/tp of the matmul (``M/tp`` seconds) while one shard travels
(``n·coll/(tp−1)``, for the n streams the ring carries: 2 in the column-parallel backward, the input shards and the
input-gradient accumulator), and one of the tp steps has nothing in flight. Ideally a step exposes ``max(0,
n·coll/(tp−1) − M/tp)``, the ring ``(tp−1)·max(0, …) = n·coll − min(n·coll, (tp−1)/tp·M)``; of the overlappable
``min(n·coll, (tp−1)/tp·M)`` only :data:`TP_OVERLAP_EFFICIENCY` is hidden (the split GEMMs run below the whole GEMM's
efficiency and share the GPU with the copies; backward patterns overlap less), so a ring exposes ``n·coll −
η·min(n·coll, (tp−1)/tp·M)`` (:func:`tp_exposed`; :func:`ring_seconds`). The rings and their matmuls (M: the forward
matmul of the group, ``2·P_g/tp·T`` FLOPs at the layer's GEMM efficiency): forward wq/wk/wv, wo, w1/w3, w2 one stream
each beside their forward matmul; backward wq/wk/wv and w1/w3 two streams beside their two backward matmuls (input and
weight gradients, 2M), wo and w2 one stream beside 2M; the head one stream forward, two backward. Full checkpointing
recomputes the forward's exposed part; selective's two re-gathers stay exposed (the strategy refuses selective with the
overlap). η = 0.5 is calibrated on torchtitan's async TP (torch's symmetric-memory ``fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``; torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``, H100 96 GB at
500 W, bf16, torch.compile): Llama 3.1 8B on 64 H100, FSDP 8 × TP 8, per-op selective AC, local batch 12, 4,378 → 4,809
tokens/s/GPU (+9.8%; predicted +9.9%), Llama 3.1 70B on 256 H100, FSDP 32 × TP 8, full AC, local batch 16, 597.3 →
652.4 (+9.2%; predicted +10.1%) (:data:`TP_OVERLAP_RUNS`, predicted compiled as they ran, ``tests/test_step_time.py``);
η = 1 would predict +22% and +22%. The least-squares η of the two runs is 0.48; held out, η fitted on either run
alone (0.498, 0.462) predicts the other within 0.80 points (two runs only: the test also checks the fit on synthetic
gains of known η).

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.planning.rates import gemm_efficiency
from lightning_4d.planning.tensors import Dtypes

__all__ = [
    "TP_OVERLAP_EFFICIENCY",
    "TP_OVERLAP_RUNS",
    "embedding_gradient_bytes",
    "head_backward_transient",
    "ring_choices",
    "ring_overlap",
    "ring_seconds",
    "tp_exposed",
    "without_rings",
]

#: Fraction of the overlappable tp communication a ring hides (module docstring, **Step time**):
#: calibrated on torchtitan's async-TP runs (:data:`TP_OVERLAP_RUNS`).
TP_OVERLAP_EFFICIENCY = 0.5
#: torchtitan's async tensor parallel against vanilla TP (``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``
#: of pytorch/torchtitan, June 2025: Grand Teton, H100 96 GB HBM2e at 500 W, bf16, torch.compile, s = 8192), the
#: calibration of :data:`TP_OVERLAP_EFFICIENCY` (``tests/test_step_time.py``); ``layout``: our equivalent; ``compile``:
#: its commands pass ``--training.compile`` (predicted with the compiled
#: :data:`~lightning_4d.planning.step_time.POINTWISE_FACTOR`).
TP_OVERLAP_RUNS: tuple[dict[str, Any], ...] = tuple(
    dict(
        gpu="H100-96GB",
        seq_length=8192,
        name=f"torchtitan async TP, Llama 3.1 {size}, {n} H100",
        model=model,
        num_gpus=n,
        layout=dict(tp=8, dp=n // 8, zero_stage=3, activation_checkpointing=ac, micro_batch_size=b),
        tokens_per_sec_per_gpu=published,
        compile=True,
    )  # fmt: skip
    for size, model, n, ac, b, published in (
        ("8B", "llama3.1-8b", 64, "selective", 12, (4378.0, 4809.4)),
        ("70B", "llama3.1-70b", 256, "full", 16, (597.3, 652.4)),
    )
)


def embedding_gradient_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, first: bool) -> int:
    """Bytes of the embedding's backward under tp on the rank holding the embedding (``first``), 0 elsewhere: torch's
    vocabulary-parallel embedding backward (DTensor's ``RowwiseParallel`` on ``nn.Embedding``) runs
    ``embedding_dense_backward`` with the whole vocabulary (``num_weights = V``; measured: tiny-test tp2 gave a
    ``[256, 64]`` gradient for its ``[128, 64]`` shard) and reduces the ``[V, h]`` partial sum to the rank's rows:
    ``V·h`` in the compute dtype at the end of backward."""
    return dt.compute * cfg.padded_vocab_size * cfg.hidden_size if pc.tp > 1 and first else 0


def head_backward_transient(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int) -> int:
    """Bytes the LM head's backward holds beyond its saved input and its weight gradient, under tp with sequence
    parallelism (``features/tensor_parallel/runtime.py``: ``_sequence_parallel_head``), with ``U = c·b·(s/cp)·h`` the
    gathered
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


def tp_exposed(coll: float, matmul: float, tp: int, streams: int = 1) -> float:
    """Exposed seconds of one ring over tp ranks carrying ``streams`` collectives of
    ``coll`` seconds each beside ``matmul`` seconds of matmuls: ``n·coll − η·min(n·coll, (tp−1)/tp·matmul)``, η =
    :data:`TP_OVERLAP_EFFICIENCY` (module docstring, **Step time**: tp − 1 of the tp steps carry a shard)."""
    comm = streams * coll
    return comm - TP_OVERLAP_EFFICIENCY * min(comm, (tp - 1) / tp * matmul)


def ring_overlap(layout: Any) -> bool:
    """Whether a planned layout (``planning/step_time.Layout``) runs the tp projections as rings: asked for, with sp
    and tp > 1."""
    return layout.tensor_parallel_overlap and layout.sequence_parallel and layout.tp > 1


def ring_seconds(dims: tuple[int, ...], coll: float, tp: int, tokens: float, peak: float) -> tuple[float, float, float]:
    """The exposed tp seconds of one layer and one micro-batch with the rings beside their matmuls (module docstring,
    **Step time**): (forward, forward + backward, the LM head's), for the step-time model's
    :func:`~lightning_4d.planning.step_time._layer_terms` (``dims``: its model dims; ``coll``: seconds of one tp
    collective; ``tokens``: T = b·s/cp; ``peak``: the FLOP/s the GEMM efficiencies scale)."""
    h, f, d, a, k, vocab = dims[:6]
    # forward matmul seconds per group of projections
    scale = 2 / tp * tokens / (gemm_efficiency(min(tokens, h, f / tp, a * d / tp)) * peak)
    qkv, o, w13, w2 = (scale * p for p in (h * (a + 2 * k) * d, a * d * h, 2 * h * f, h * f))
    t_tp_fwd = sum(tp_exposed(coll, mm, tp) for mm in (qkv, o, w13, w2))
    backward = tp_exposed(coll, 2 * qkv, tp, 2) + tp_exposed(coll, 2 * w13, tp, 2)
    t_tp = t_tp_fwd + backward + tp_exposed(coll, 2 * o, tp) + tp_exposed(coll, 2 * w2, tp)
    head = 2 * vocab * h / tp * tokens / (gemm_efficiency(min(tokens, h, vocab / tp)) * peak)
    t_head_tp = tp_exposed(coll, head, tp) + tp_exposed(coll, 2 * head, tp, 2)
    return t_tp_fwd, t_tp, t_head_tp


def ring_choices(search: Any, sp: bool, activation_checkpointing: str) -> tuple[dict[str, bool], ...]:
    """The planner's values of the ring overlap for one layout (``planning/planner.py``; ``search``: its
    :class:`~lightning_4d.planning.workload.Search`): off, and right after it on when ``search`` asks for the overlap
    and the layout has sp and checkpointing other than selective (the overlap's rules, :func:`check
    <lightning_4d.features.tensor_parallel.check>`)."""
    on = search.tensor_parallel_overlap and sp and activation_checkpointing != "selective"
    return (
        ({"tensor_parallel_overlap": False}, {"tensor_parallel_overlap": True})
        if on
        else ({"tensor_parallel_overlap": False},)
    )


def without_rings(search: Any) -> Any:
    """``search`` (a :class:`~lightning_4d.planning.workload.Search`) without the overlapped layouts."""
    return replace(search, tensor_parallel_overlap=False)
