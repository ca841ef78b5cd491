"""Context parallelism (``cp``, ``context_parallel_method``): the feature's record (:data:`FEATURE`), its rule
against the model's heads (:func:`check_heads`, with :func:`alltoall_heads`; run by
:meth:`~lightning_4d.config.ParallelConfig.validate_model`), its rows of the support matrix and its labels there. Its
memory terms: :mod:`lightning_4d.features.context_parallel.costs` (torch-free; its step-time terms are the step-time
model's, :mod:`lightning_4d.planning.step_time`, **Context parallel**); its runtime, the ring, all-gather and
all-to-all attention on zigzag shards and the batch sharding: :mod:`lightning_4d.features.context_parallel.runtime`.
The zigzag split itself (:func:`lightning_4d.config.zigzag_chunks`) stays in the config: the rotary positions and the
partition rules read it too.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_4d.features.feature import Feature
from lightning_4d.models.llama_config import divisors
from lightning_4d.support_rows import Row

__all__ = ["FEATURE", "alltoall_heads", "check_heads", "labels"]


def alltoall_heads(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> tuple[int, int]:
    """``(query heads, kv heads)`` one cp rank attends with under ``context_parallel_method="alltoall"``
    (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509): the tp rank's ``a/tp`` query heads split over cp,
    ``a/(tp·cp)`` each; its ``k/tp`` kv heads split over cp when cp divides them, else (``k/tp < cp``, cp a multiple
    of ``k/tp``) each kv head replicated ``cp·tp/k`` times before the all-to-all, so every cp rank receives the one kv
    head its query heads share (the kv-head expansion of ``long-context-attention``'s Ulysses): ``max(k/tp, cp)/cp``.

    Raises:
        ValueError: ``a/tp`` not divisible by cp, or ``k/tp`` neither divisible by cp nor dividing it.
    """
    q, kv = num_heads // tp, num_kv_heads // tp
    if q % cp != 0:
        valid = [c for c in divisors(q) if kv % c == 0 or c % kv == 0]
        raise ValueError(
            f"context_parallel_method='alltoall' needs the query heads of a tp rank, num_heads/tensor_parallel_size "
            f"= {num_heads}/{tp} = {q}, divisible by context_parallel_size={cp} (heads are split over cp); valid "
            f"context_parallel_size values for alltoall here: {valid}, or use context_parallel_method='ring'."
        )
    if kv % cp != 0 and cp % kv != 0:
        raise ValueError(
            f"context_parallel_method='alltoall' needs the kv heads of a tp rank, num_kv_heads/tensor_parallel_size "
            f"= {num_kv_heads}/{tp} = {kv}, divisible by context_parallel_size={cp} or dividing it (then replicated); "
            "use context_parallel_method='ring' or 'allgather'."
        )
    return q // cp, max(kv, cp) // cp


def check_heads(config: Any, model_config: Any) -> None:
    """The heads of ``model_config`` split over tp·cp under ``context_parallel_method="alltoall"`` with cp > 1
    (:func:`alltoall_heads`; ``config``: a :class:`~lightning_4d.config.ParallelConfig`, ``model_config``: a
    :class:`~lightning_4d.models.llama_config.LlamaConfig`).

    Raises:
        ValueError: as :func:`alltoall_heads`.
    """
    if config.cp > 1 and config.context_parallel_method == "alltoall":
        alltoall_heads(model_config.num_heads, model_config.num_kv_heads, config.tp, config.cp)


def labels(options: Mapping[str, Any]) -> frozenset[str]:
    """``cp``, and ``cp allgather`` or ``cp alltoall`` for a method other than the ring
    (:func:`lightning_4d.support.layout_features`)."""
    if options.get("cp", 1) <= 1:
        return frozenset()
    method = options.get("cp_method") or options.get("context_parallel_method") or "ring"
    return frozenset({"cp"} if method == "ring" else {"cp", f"cp {method}"})


P = "tests/test_parity.py::"
CP = "tests/test_context_parallel.py::"

ROWS = (
    Row(
        "cp2-ring",
        "cp2 ring attention (zigzag shards, K/V passed around)",
        {"cp": 2},
        cpu_tests=(CP + "test_context_parallel_world2", CP + "test_context_parallel_bf16_close_to_float32"),
    ),
    Row(
        "cp2-allgather-z3",
        "cp2 all-gather attention, ZeRO 3",
        {"cp": 2, "cp_method": "allgather", "zero_stage": 3},
        cpu_tests=(CP + "test_context_parallel_world2",),
    ),
    Row(
        "cp2-ring-selective",
        "cp2 ring attention, selective checkpointing",
        {"cp": 2, "zero_stage": 0, "activation_checkpointing": "selective"},
        cpu_tests=(CP + "test_context_parallel_world2",),
    ),
    Row(
        "cp2-tp2",
        "cp2 x tp2 ring attention on head shards",
        {"cp": 2, "tp": 2},
        cpu_tests=(CP + "test_context_parallel_world4", P + "test_bf16_mixed_parity_world4"),
    ),
    Row(
        "cp2-pp2-tp2",
        "cp2 x pp2 x tp2, 1F1B",
        {"cp": 2, "pp": 2, "tp": 2, "num_microbatches": 2},
        cpu_tests=(CP + "test_context_parallel_world8",),
    ),
    Row(
        "cp2-alltoall",
        "cp2 all-to-all (Ulysses) attention: heads sharded, whole sequence per rank",
        {"cp": 2, "cp_method": "alltoall", "zero_stage": 0},
        cpu_tests=(CP + "test_context_parallel_world2", CP + "test_attention_equals_full_causal_attention"),
    ),
    Row(
        "cp4-alltoall",
        "cp4 all-to-all attention (fewer kv heads than cp replicated: tiny-test's 2 in the CPU tests)",
        {"cp": 4, "cp_method": "alltoall"},
        cpu_tests=(CP + "test_context_parallel_world4", CP + "test_cp_activations_within_5_percent"),
    ),
    Row(
        "cp2-tp2-alltoall",
        "cp2 x tp2 all-to-all attention (heads over tp, then cp), ZeRO 3",
        {"cp": 2, "tp": 2, "cp_method": "alltoall", "zero_stage": 3},
        cpu_tests=(CP + "test_context_parallel_world4",),
    ),
    Row(
        "cp2-pp2-alltoall",
        "cp2 x pp2 all-to-all attention, 1F1B",
        {"cp": 2, "pp": 2, "cp_method": "alltoall", "num_microbatches": 2},
        cpu_tests=(CP + "test_context_parallel_world4",),
    ),
    Row(
        "cp4-tp4-alltoall-bad-heads",
        "cp4 x tp4 all-to-all with 8 heads (2 per tp rank: too few for cp4)",
        {"cp": 4, "tp": 4, "cp_method": "alltoall"},
        refused=(
            "context_parallel_method='alltoall' needs the query heads of a tp rank, num_heads/tensor_parallel_size "
            "= 8/4 = 2, divisible by context_parallel_size=4 (heads are split over cp); valid context_parallel_size "
            "values for alltoall here: [1, 2], or use context_parallel_method='ring'."
        ),
    ),
    Row(
        "cp2-bad-sequence",
        "cp2 with a sequence that does not split into 2*cp chunks",
        {"cp": 2, "seq_length": 1022},
        refused="seq_length=1022 is not a multiple of 4 (2*cp=4); use e.g. seq_length=1024.",
    ),
)

FEATURE = Feature.of_package(__name__, "cp", ("cp",), rows=ROWS, labels=labels)
