"""Pipeline parallelism (``pp``: ``pipeline_parallel_size``, the schedule, virtual stages, micro-batches, the layer
split): the feature's record (:data:`FEATURE`), the schedules' tables (:data:`SCHEDULE_STAGES`,
:data:`ZERO_BUBBLE_SCHEDULES`, :data:`SINGLE_STAGE_SCHEDULES`), its rules (:func:`check`), its rows of the support
matrix and its labels there. Its memory terms (in-flight micro-batches of every schedule, receive buffers):
:mod:`lightning_4d.features.pipeline.costs` (torch-free); its runtime, the one splitter of every family, the schedules
and tied embeddings: :mod:`lightning_4d.features.pipeline.runtime`. The layout facts the strategy and the memory model
share (stage indices per pp rank, layer ranges per stage, the layer split, the default number of micro-batches) stay
:class:`~lightning_4d.config.ParallelConfig`'s methods, read from :data:`SCHEDULE_STAGES`.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_4d.features.feature import Feature
from lightning_4d.layout import PIPELINE_SCHEDULES, check_positive_int
from lightning_4d.support_rows import DUALPIPEV, Row

__all__ = [
    "FEATURE",
    "SCHEDULE_STAGES",
    "SINGLE_STAGE_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "check",
    "labels",
]

#: schedules that split backward into input- and weight-gradient passes and run a micro-batch's weight pass after
#: later forwards (zero bubble, V placement)
ZERO_BUBBLE_SCHEDULES = ("zbv", "dualpipev")
#: schedules that run one stage per pp rank (torch.distributed.pipelining's PipelineScheduleSingle)
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
#: pipeline schedule -> (stages per rank allowed, default stages per rank, rank style)
SCHEDULE_STAGES = {
    "gpipe": ((1,), 1, "loop"),
    "1f1b": ((1,), 1, "loop"),
    "interleaved_1f1b": (None, 2, "loop"),  # any v >= 1
    "zbv": ((2,), 2, "v"),
    "dualpipev": ((2,), 2, "v"),
}


def check(config: Any) -> None:
    """The pipeline's options (``config``: a :class:`~lightning_4d.config.ParallelConfig` whose fields passed their
    own checks): virtual stages per schedule, selective checkpointing with a zero-bubble schedule, micro-batches, the
    layer split (stored back as a list).

    Raises:
        ValueError: the first rule broken, naming the value and the fix.
    """
    allowed, _, _ = SCHEDULE_STAGES[config.pipeline_schedule]
    if config.virtual_pipeline_stages is not None:
        check_positive_int("virtual_pipeline_stages", config.virtual_pipeline_stages)
        if allowed is not None and config.virtual_pipeline_stages not in allowed:
            fits = [
                name for name, (a, _, _) in SCHEDULE_STAGES.items() if a is None or config.virtual_pipeline_stages in a
            ]
            raise ValueError(
                f"virtual_pipeline_stages={config.virtual_pipeline_stages} is not supported by pipeline_schedule="
                f"{config.pipeline_schedule!r}, which runs {allowed[0]} stage(s) per rank; schedules that take "
                f"{config.virtual_pipeline_stages} stages per rank: {fits}."
            )
    if (
        config.activation_checkpointing == "selective"
        and config.pipeline_parallel_size > 1
        and config.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
    ):
        raise ValueError(
            f"activation_checkpointing='selective' does not work with pipeline_schedule="
            f"{config.pipeline_schedule!r}: a zero-bubble schedule runs each layer's backward in two passes (input "
            "gradients, then weight gradients) and PyTorch's selective checkpointing can recompute a layer only "
            "once. Use activation_checkpointing='full' with it, or 'selective' with one of "
            f"{[x for x in PIPELINE_SCHEDULES if x not in ZERO_BUBBLE_SCHEDULES]}."
        )
    if config.num_microbatches is not None:
        check_positive_int("num_microbatches", config.num_microbatches)
    if config.pipeline_layer_split is not None:
        split = list(config.pipeline_layer_split)
        if not split or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in split):
            raise ValueError(
                f"pipeline_layer_split={config.pipeline_layer_split!r} is not valid: expected a list of layer counts "
                "(non-negative integers), one per pipeline stage."
            )
        config.pipeline_layer_split = split


def labels(options: Mapping[str, Any]) -> frozenset[str]:
    """``pp``, and ``pp <schedule>`` for a schedule other than 1F1B (:func:`lightning_4d.support.layout_features`)."""
    if not options.get("pp", 1) > 1:
        return frozenset()
    schedule = options.get("pipeline_schedule") or "1f1b"
    return frozenset({"pp"} if schedule == "1f1b" else {"pp", f"pp {schedule}"})


P = "tests/test_parity.py::"
PP = "tests/test_pipeline.py::"
TIED = "tests/test_tied_pipeline.py::"

ROWS = (
    Row(
        "pp2-gpipe",
        "pp2 GPipe, m=2",
        {"pp": 2, "pipeline_schedule": "gpipe", "num_microbatches": 2},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row("pp2-1f1b", "pp2 1F1B, m=4", {"pp": 2, "num_microbatches": 4}, cpu_tests=(PP + "test_pipeline_world2",)),
    Row(
        "pp2-interleaved",
        "pp2 interleaved 1F1B, v=3 (one layer per stage), m=2",
        {"pp": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 3, "num_microbatches": 2},
        cpu_tests=(PP + "test_pipeline_world2", PP + "test_pipeline_world4"),
    ),
    Row(
        "pp2-zbv",
        "pp2 ZBV zero bubble (V-shape, two stages per rank), m=4, uneven split 2,1,1,2",
        {"pp": 2, "pipeline_schedule": "zbv", "num_microbatches": 4, "pipeline_layer_split": [2, 1, 1, 2]},
        cpu_tests=(PP + "test_pipeline_world2", PP + "test_pipeline_world4"),
    ),
    Row(
        "pp2-dualpipev",
        "pp2 DualPipeV, m=4, uneven split 2,1,1,2",
        {"pp": 2, "pipeline_schedule": "dualpipev", "num_microbatches": 4, "pipeline_layer_split": [2, 1, 1, 2]},
        cpu_tests=(PP + "test_pipeline_world2", PP + "test_pipeline_checkpoint_resume"),
    ),
    *(
        Row(row_id, f"pp2 DualPipeV {what}", {"pp": 2, **extra, **DUALPIPEV}, cpu_tests=(PP + "test_pipeline_world4",))
        for row_id, what, extra in (
            ("pp2-dualpipev-dp2", "dp2 ZeRO 1 (ZeRO 2 with clipping on CPU too)", {"dp": 2}),
            (
                "pp2-dualpipev-dp2-z3",
                "dp2 ZeRO 3 (FSDP2 per stage chunk, two chunks per rank)",
                {"dp": 2, "zero_stage": 3},
            ),
            ("pp2-dualpipev-tp2", "tp2", {"tp": 2}),
        )
    ),
    Row(
        "pp2-uneven",
        "pp2 1F1B with an uneven layer split (4 + 2: fewer layers beside the head)",
        {"pp": 2, "num_microbatches": 2, "pipeline_layer_split": [4, 2]},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "pp2-dp2-z3",
        "pp2 dp2 ZeRO 3 bf16-mixed: FSDP2 per stage chunk",
        {"pp": 2, "dp": 2, "zero_stage": 3, "num_microbatches": 2},
        cpu_tests=(P + "test_bf16_mixed_parity_world4", PP + "test_pipeline_world4"),
    ),
    Row("pp2-tp2", "pp2 tp2 1F1B", {"pp": 2, "tp": 2, "num_microbatches": 2}, cpu_tests=(PP + "test_pipeline_world4",)),
    Row(
        "pp2-tied",
        "pp2 1F1B, tied embeddings: the last stage's copy of the [V, h] matrix, gradients summed over the embedding "
        "group; checkpoints hold it once",
        {"model": "small-tied", "pp": 2, "num_microbatches": 2},
        cpu_tests=(
            TIED + "test_tied_pp_world2_equals_one_process",
            TIED + "test_tied_pp2_checkpoint_holds_the_weight_once_and_reshards_to_pp1_and_back",
        ),
    ),
    Row(
        "pp2-tied-zbv",
        "pp2 ZBV, tied embeddings: rank 0 holds the first and last stage, the weight truly tied there (ZeRO 0/1)",
        {"model": "small-tied", "pp": 2, "pipeline_schedule": "zbv", "num_microbatches": 4},
        cpu_tests=(TIED + "test_tied_pp_world2_equals_one_process", TIED + "test_tied_pp_world4_equals_one_process"),
    ),
    Row(
        "pp2-tp2-tied",
        "pp2 tp2, tied embeddings (both copies vocabulary-sharded over tp)",
        {"model": "small-tied", "pp": 2, "tp": 2, "num_microbatches": 2},
        cpu_tests=(TIED + "test_tied_pp_world4_equals_one_process", TIED + "test_tied_pp_measure_equals_estimate"),
    ),
    Row(
        "pp2-tp2-cp2-tied-selective",
        "pp2 tp2 cp2, tied embeddings, selective checkpointing: the first stage's peak is the embedding's backward "
        "beside the next micro-batch's saved tensors",
        {
            "model": "small-tied",
            "pp": 2,
            "tp": 2,
            "cp": 2,
            "activation_checkpointing": "selective",
            "num_microbatches": 2,
        },
        cpu_tests=("tests/test_memory_model.py::test_pipeline_backward_end_counts_the_micro_batches_in_flight",),
    ),
    Row(
        "pp2-1f1b-m1",
        "1F1B with fewer micro-batches than stages",
        {"pp": 2, "num_microbatches": 1},
        refused=(
            "num_microbatches=1 is too small for pipeline_schedule='1f1b' with pipeline_parallel_size=2: 1F1B"
            " needs at least p=2 micro-batches (use num_microbatches >= 2, ideally several times p to shrink "
            "the bubble (p-1)/(m+p-1), or pipeline_schedule='gpipe')."
        ),
    ),
    Row(
        "pp2-1f1b-v2",
        "1F1B with two virtual stages per rank",
        {"pp": 2, "virtual_pipeline_stages": 2, "num_microbatches": 2},
        refused=(
            "virtual_pipeline_stages=2 is not supported by pipeline_schedule='1f1b', which runs 1 stage(s) "
            "per rank; schedules that take 2 stages per rank: ['interleaved_1f1b', 'zbv', 'dualpipev']."
        ),
    ),
    Row(
        "pp2-zbv-selective",
        "a zero-bubble schedule with selective checkpointing",
        {
            "pp": 2,
            "pipeline_schedule": "zbv",
            "num_microbatches": 4,
            "pipeline_layer_split": [2, 1, 1, 2],
            "activation_checkpointing": "selective",
        },
        refused=(
            "activation_checkpointing='selective' does not work with pipeline_schedule='zbv': a zero-bubble "
            "schedule runs each layer's backward in two passes (input gradients, then weight gradients) and "
            "PyTorch's selective checkpointing can recompute a layer only once. Use "
            "activation_checkpointing='full' with it, or 'selective' with one of ['gpipe', '1f1b', "
            "'interleaved_1f1b']."
        ),
    ),
)

FEATURE = Feature.of_package(__name__, "pp", ("pp",), check=check, rows=ROWS, labels=labels)
