"""The rates the step-time model (:mod:`lightning_4d.planning.step_time`) and its feature terms charge work at: the
fraction of the GPU's peak a GEMM reaches by its shape, the pointwise bytes of one layer, and the alpha-beta cost of
a ring collective over NVLink or across nodes (sources beside each constant).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from lightning_4d.partition import GRADIENT_BUCKET_BYTES

__all__ = [
    "COLLECTIVE_EFFICIENCY",
    "GEMM_EFFICIENCY",
    "LINK_LATENCY",
    "POINTWISE_BYTES",
    "POINTWISE_EFFICIENCY",
    "LayerShape",
    "MeshSizes",
    "StageShape",
    "by_class",
    "data_parallel_collectives",
    "gemm_efficiency",
    "link",
    "ring",
]


class LayerShape(NamedTuple):
    """What the seconds of one decoder layer and one micro-batch depend on besides the model and the GPU (the
    step-time model's cache key: a tuple, so hashed as fast as one).

    ``b`` micro-batch size, ``s`` tokens per sample (before cp), ``sp`` sequence parallelism on, ``method`` the
    context-parallel method, ``ep`` the ep size and ``dd`` = dp·cp (both 1 for a dense model, whose terms do
    not depend on them), ``overlap`` the tp ring overlap in effect (tp > 1 with sp), ``compile`` the layers
    ``torch.compile``d, ``attention`` the fraction of causal attention's work done (below 1 with document masking:
    :func:`lightning_4d.planning.step_time.attention_work`)."""

    tp: int
    cp: int
    b: int
    s: int
    sp: bool
    method: str
    ep: int = 1
    dd: int = 1
    overlap: bool = False
    compile: bool = False
    attention: float = 1.0


class StageShape(NamedTuple):
    """How the decoder layers split into pipeline stages and what their backward recomputes: pp, the schedule, v
    stages per rank (1 without pp), the layers per stage (``None``: the even split) and the activation
    checkpointing mode."""

    pp: int
    schedule: str
    v: int
    split: Optional[tuple[int, ...]]
    activation_checkpointing: str


class MeshSizes(NamedTuple):
    """The parallel sizes the data-parallel terms depend on: tp, pp, cp, dp and ep."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int


#: Fraction of the dense bf16 peak a GEMM reaches, by the class of its smallest dimension (>= 2048, >= 1024, below).
#: The large class is the maximum achievable matmul throughput measured on H100 SXM and A100 (about 0.8 of the
#: datasheet peak: S. Bekman, "Machine Learning Engineering", chapter compute/accelerator, "Maximum Achievable
#: Matmul FLOPS"); the smaller classes lose to wave and tile quantization (NVIDIA, "Matrix Multiplication
#: Background User's Guide"); all three are calibrated with :data:`lightning_4d.planning.step_time.CALIBRATION_RUNS`.
GEMM_EFFICIENCY = ((2048, 0.78), (1024, 0.70), (0, 0.55))
#: Pointwise bytes per token of one decoder layer, forward + backward, bf16 (eager, our layer): coefficients of
#: (h, (a + 2k)·d, f), measured with a TorchDispatchMode over every non-matmul op (``tests/test_step_time.py``).
POINTWISE_BYTES = (348, 52, 28)
#: Fraction of the memory bandwidth eager pointwise kernels reach (large contiguous tensors).
POINTWISE_EFFICIENCY = 0.8
#: Fraction of the link bandwidth NCCL's ring collectives reach (bus bandwidth of nccl-tests on NVLink 4 / NDR).
COLLECTIVE_EFFICIENCY = 0.8
#: Seconds per ring step of a collective (alpha of the alpha-beta model): inside a node, across nodes.
LINK_LATENCY = (3e-6, 8e-6)


def by_class(table: tuple[tuple[float, float], ...], value: float) -> float:
    """The fraction of the first class of ``table`` (``(lower bound, fraction)``, bounds descending) ``value``
    reaches."""
    return next((eta for bound, eta in table if value >= bound), table[-1][1])


def gemm_efficiency(smallest_dimension: float) -> float:
    """Fraction of the peak of a GEMM whose smallest dimension is ``smallest_dimension`` (:data:`GEMM_EFFICIENCY`)."""
    return by_class(GEMM_EFFICIENCY, smallest_dimension)


def ring(nbytes: float, ranks: int, bandwidth: float, latency: float, collectives: int = 1) -> float:
    """Seconds of ring all-gathers / reduce-scatters of ``nbytes`` in all, issued as ``collectives`` collectives
    (e.g. one per FSDP unit or gradient bucket), over ``ranks`` ranks: per GPU ``(n−1)/n·nbytes`` at
    ``COLLECTIVE_EFFICIENCY·bandwidth``, plus ``(n−1)·latency`` for each collective (the alpha-beta cost of the ring
    algorithm, ``(p−1)·α + (p−1)/p·n·β``: Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
    Communication Operations in MPICH", IJHPCA 19(1), §4)."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (COLLECTIVE_EFFICIENCY * bandwidth) + collectives * (ranks - 1) * latency


def data_parallel_collectives(zero_stage: int, units: int, gradient_bytes: float) -> int:
    """How many collectives one pass of a data-parallel reduction (or all-gather) of a pp rank's parameters is
    issued as: at ZeRO 2/3 one per FSDP2 unit (``units``: ``fully_shard`` per decoder layer + the root,
    ``parallel/fsdp.py``); at ZeRO 0/1 one per gradient bucket (``parallel/grad_buffers.py``, the ZeRO 1 all-gather
    of the updated parameters too: ``parallel/sharded_optimizer.py``), ``ceil(gradient_bytes /
    GRADIENT_BUCKET_BYTES)`` of the float32 gradients (``gradient_bytes``: 4 bytes per parameter); at least 1."""
    if zero_stage >= 2:
        return max(1, units)
    return max(1, math.ceil(gradient_bytes / GRADIENT_BUCKET_BYTES))


def link(gpu: Any, inside_node: bool) -> tuple[float, float]:
    """(bandwidth, ring-step latency) of a collective whose group is inside one node (NVLink) or spans nodes."""
    return (gpu.intra_node_bandwidth, LINK_LATENCY[0]) if inside_node else (gpu.inter_node_bandwidth, LINK_LATENCY[1])
