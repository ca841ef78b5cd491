"""Tensor and sequence parallelism (``tp``, ``sp``) and the ring overlap of the tp projections: the feature's record
(:data:`FEATURE`), its rules against the other features (:func:`check`), its rows of the support matrix and its labels
there. Its memory and step-time terms: :mod:`lightning_4d.features.tensor_parallel.costs` (torch-free); its runtime,
the tp plans applied with DTensor and the ring projections: :mod:`lightning_4d.features.tensor_parallel.runtime`.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_4d.features.feature import Feature
from lightning_4d.support_rows import Row

__all__ = ["FEATURE", "check", "labels", "plan_cell"]


def check(config: Any) -> None:
    """The ring overlap's rules: a bool; needs tp with sp; not with selective checkpointing; not with float8 (its ring
    projections multiply the weight shards themselves, outside torchao's ``Float8Linear``; under tp with float8 the
    linears of the tp plan run through ``Float8Linear.forward``, ``lightning_4d/parallel/float8.py``).

    Raises:
        ValueError: the first rule broken, naming the value and the fix.
    """
    overlap = config.tensor_parallel_overlap
    if not isinstance(overlap, bool):
        raise ValueError(f"tensor_parallel_overlap={overlap!r} is not valid: expected True or False.")
    if overlap and (config.tensor_parallel_size == 1 or config.sequence_parallel is False):
        raise ValueError(
            f"tensor_parallel_overlap=True is not valid with tensor_parallel_size={config.tensor_parallel_size} and "
            f"sequence_parallel={config.sequence_parallel!r}: the ring overlaps the sequence-parallel all-gathers "
            "and reduce-scatters, so it needs tensor_parallel_size > 1 and sequence_parallel None or True "
            "(or set tensor_parallel_overlap=False)."
        )
    if overlap and config.activation_checkpointing == "selective":
        raise ValueError(
            "tensor_parallel_overlap=True is not supported with activation_checkpointing='selective' yet: the "
            "selective policy keeps wo's reduced output and nothing of w2 by marking those modules, and the rings "
            "run them elsewhere (their chunk products would be kept, the [b, s, h] partial sums the policy avoids, "
            "and the memory estimate would be low). Use activation_checkpointing='none' or 'full' with the "
            "overlap, or tensor_parallel_overlap=False with 'selective'."
        )
    if config.float8 is not None and overlap is True:
        raise ValueError(
            f"float8={config.float8!r} is not supported with tensor_parallel_overlap=True yet (its ring projections "
            "multiply the weights outside torchao's Float8Linear): use tensor_parallel_overlap=False with float8, "
            "or float8=None."
        )


def labels(options: Mapping[str, Any]) -> frozenset[str]:
    """``tp``, ``sp off`` and ``tp overlap`` (:func:`lightning_4d.support.layout_features`)."""
    if options.get("tp", 1) == 1:
        return frozenset()
    out = {"tp"}
    if options.get("sequence_parallel") is False:
        out.add("sp off")
    if options.get("tensor_parallel_overlap"):
        out.add("tp overlap")
    return frozenset(out)


def plan_cell(options: Mapping[str, Any]) -> str:
    """The feature's cell of ``lightning-4d plan``'s table (its ``sp`` column): ``-`` without tp, else sp ``on``,
    ``on, overlap`` (the rings) or ``off``."""
    if options["tp"] == 1:
        return "-"
    return "on, overlap" if options.get("tensor_parallel_overlap") else "on" if options["sequence_parallel"] else "off"


COMPILE = "tests/test_compile.py::test_compiled_layout_matches_one_process"

ROWS = (
    Row(
        "tp2-overlap",
        "tp2 with the overlapped tp rings (sp all-gathers / reduce-scatters inside the matmuls)",
        {"tp": 2, "dp": 2, "tensor_parallel_overlap": True},
        cpu_tests=("tests/test_tp_overlap.py::test_parity_world2", "tests/test_tp_overlap.py::test_parity_world4"),
    ),
    Row(
        "tp2-overlap-nosp",
        "the tp overlap without sequence parallelism",
        {"tp": 2, "tensor_parallel_overlap": True, "sequence_parallel": False},
        refused="tensor_parallel_overlap=True is not valid with tensor_parallel_size=2 and sequence_parallel=False: "
        "the ring overlaps the sequence-parallel all-gathers and reduce-scatters, so it needs tensor_parallel_size > 1 "
        "and sequence_parallel None or True (or set tensor_parallel_overlap=False).",
    ),
    Row(
        "tp2-overlap-selective",
        "the tp overlap with selective checkpointing",
        {"tp": 2, "tensor_parallel_overlap": True, "activation_checkpointing": "selective"},
        refused=(
            "tensor_parallel_overlap=True is not supported with activation_checkpointing='selective' yet: the"
            " selective policy keeps wo's reduced output and nothing of w2 by marking those modules, and the "
            "rings run them elsewhere (their chunk products would be kept, the [b, s, h] partial sums the "
            "policy avoids, and the memory estimate would be low). Use activation_checkpointing='none' or "
            "'full' with the overlap, or tensor_parallel_overlap=False with 'selective'."
        ),
    ),
    Row(
        "compile-tp2-overlap-z3",
        "torch.compile per layer, dp2 tp2 with the tp overlap (its rings break the graph), ZeRO 3, full checkpointing",
        {
            "tp": 2,
            "dp": 2,
            "tensor_parallel_overlap": True,
            "zero_stage": 3,
            "compile": True,
            "activation_checkpointing": "full",
        },
        cpu_tests=(COMPILE,),
    ),
    Row(
        "float8-tp2-overlap",
        "float8 under tp2 with tensor_parallel_overlap",
        {"tp": 2, "tensor_parallel_overlap": True, "float8": "tensorwise"},
        refused=(
            "float8='tensorwise' is not supported with tensor_parallel_overlap=True yet (its ring projections "
            "multiply the weights outside torchao's Float8Linear): use tensor_parallel_overlap=False with float8, or "
            "float8=None."
        ),
    ),
    Row(
        "hf-llama-overlap",
        "transformers LlamaForCausalLM with the tp overlap",
        {"tp": 2, "tensor_parallel_overlap": True},
        family="hf-llama",
        refused=(
            "tensor_parallel_overlap=True is not supported for a transformers LlamaForCausalLM yet (the ring "
            "projections hook into lightning_4d's own Llama modules): use tensor_parallel_overlap=False"
        ),
    ),
)

FEATURE = Feature.of_package(__name__, "tp", ("tp", "sp"), check=check, rows=ROWS, labels=labels)
