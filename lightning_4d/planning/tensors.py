"""The vocabulary of the memory model: the training precisions and the bytes they store per element
(:class:`Dtypes`), one parameter tensor as a rank holds it (:class:`Param`) and ``torch.chunk``'s split
(:func:`chunk`). Every feature module of ``lightning_4d/planning/`` counts bytes in these terms.

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from lightning_4d.config import ParallelConfig

__all__ = ["PRECISIONS", "Dtypes", "Param", "checkpoint_bytes_per_parameter", "chunk", "normalize_precision"]

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
class Dtypes:
    """Bytes per element of each kind of tensor a precision stores (``lightning_4d/parallel/sharded_optimizer.py``,
    ``lightning_4d/precision.py``; the rules: :mod:`lightning_4d.planning.model`'s docstring, **Dtypes**). Build it with
    :meth:`of` (a precision of :data:`PRECISIONS`) or :meth:`for_layout` (with the ``sdpa`` backend's kv repeat)."""

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
    def for_layout(precision: str, model_config: Any, pc: ParallelConfig, device_type: str) -> "Dtypes":
        """:meth:`of` ``precision``, with ``kv_repeated`` where the ``sdpa`` backend repeats the kv heads."""
        dt = Dtypes.of(precision)
        repeats = (
            device_type == "cuda"
            and precision == "32-true"
            and pc.cp == 1
            and getattr(model_config, "attention_backend", "sdpa") == "sdpa"
            and model_config.num_kv_heads != model_config.num_heads
        )
        return replace(dt, kv_repeated=True) if repeats else dt

    @staticmethod
    def of(precision: str) -> "Dtypes":
        """The bytes of ``precision`` (a name of :data:`PRECISIONS`, as :func:`normalize_precision` returns it)."""
        if precision == "32-true":
            return Dtypes(4, 4, 0, 4, 4, False)
        if precision == "bf16-mixed":  # bf16 weights, fp32 gradients and master weights (parallel/sharded_optimizer.py)
            return Dtypes(2, 4, 4, 2, 2, False)
        if precision == "16-mixed":  # Lightning's autocast with a gradient scaler: fp32 weights
            return Dtypes(4, 4, 0, 2, 4, True)
        return Dtypes(2, 2, 0, 2, 2, False)

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
    ``32-true`` 4 + 8 = 12); :func:`lightning_4d.planning.reliability.checkpoint_bytes` multiplies it by the parameters.

    Raises:
        ValueError: an unknown precision (:func:`normalize_precision`).
    """
    dt = Dtypes.of(normalize_precision(precision))
    return dt.param + dt.master + 2 * dt.moment


@dataclass(frozen=True)
class Param:
    """One parameter tensor as a rank holds it, its tp-local shape read as ``rows x cols`` (dim 0 x the rest).

    Attributes:
        rows: dim 0 of the tp-local tensor (a stacked ``[n, d1, d2]`` weight: the ``n`` this rank holds).
        cols: elements per row (1 for a vector).
        matrix: a matrix (PowerSGD compresses it, autocast casts it).
        unit: its FSDP2 unit: ``"layers.<i>"`` or ``"root"``.
        role: ``"embedding"`` or ``"head"`` for the vocabulary tensors, ``""`` otherwise (the memory model finds them
            by role, never by a parameter name).
        group: the layout dims beside ``dp·cp`` that set its data-parallel group (ZeRO sharding, gradient
            reduction): ``"tp"`` replicated over tp (reduced over ``dp·cp·tp``), ``"ep"`` split over ep (reduced over
            ``dp·cp/ep``, with ``"tp"`` over ``dp·cp·tp/ep``: ep folded over tp); ``()``: ``dp·cp``
            (``lightning_4d/mesh.py``'s ``dp_cp``; ``lightning_4d/features/moe/runtime.py``'s ``dp_cp_tp`` and ``edp``).
        dim1: a stacked ``[n, d1, d2]`` weight's ``d1`` (``cols = d1·d2``), which ZeRO 2/3 may shard instead of dim 0;
            0 for any other tensor.
    """

    rows: int
    cols: int
    matrix: bool
    unit: str
    role: str = ""
    group: tuple[str, ...] = ()
    dim1: int = 0

    @property
    def numel(self) -> int:
        """Elements of the tp-local tensor."""
        return self.rows * self.cols


def chunk(n: int, world: int, rank: int) -> int:
    """Length of rank ``rank``'s piece when ``n`` is cut in pieces of ``ceil(n/world)`` (``torch.chunk``)."""
    size = math.ceil(n / world) if n else 0
    return max(0, min(n - rank * size, size))
