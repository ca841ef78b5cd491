"""``torch.distributed.pipelining``'s private schedule state: the flags that make a schedule re-infer its stages'
shapes, and the V schedules' per-rank action lists."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules

#: the flags a ``torch.distributed.pipelining`` schedule sets once its stages' shapes are inferred, by the base class
#: of its schedules (single-stage schedules: ``_stage_*``; multi-stage schedules: ``_stages_*``)
SCHEDULE_INIT_FLAGS = {
    schedules.PipelineScheduleSingle: ("_stage_forward_initialized", "_stage_backward_initialized"),
    schedules.PipelineScheduleMulti: ("_stages_forward_initialized", "_stages_backward_initialized"),
}


def reset_schedule_metadata(schedule: Any) -> None:
    """Make ``schedule`` re-infer its stages' metadata (shapes, receive buffers) on its next step, after another
    schedule over the same stages ran in between.

    Raises:
        RuntimeError: the schedule's class derives from neither ``PipelineScheduleSingle`` nor
            ``PipelineScheduleMulti``, or lacks the flags :data:`SCHEDULE_INIT_FLAGS` names (torch changed them).
    """
    for base, flags in SCHEDULE_INIT_FLAGS.items():
        if isinstance(schedule, base):
            missing = [f for f in flags if f not in vars(schedule)]
            if missing:
                raise RuntimeError(
                    f"{type(schedule).__name__} has no attribute(s) {missing}: this torch version changed the "
                    "pipelining schedules' private state; update lightning_4d/parallel/_compat/pipeline.py."
                )
            for f in flags:
                setattr(schedule, f, False)
            return
    raise RuntimeError(f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule this package knows.")


#: the attributes torch's V schedules' private ``_calculate_single_rank_operations(rank)`` (one rank's actions) reads
SCHEDULE_RANK_OPERATIONS_ATTRIBUTES = ("pp_group_size", "_n_microbatches", "num_stages")


def schedule_rank_actions(class_name: str, pp: int, rank: int, n_microbatches: int) -> list[tuple[int, str]]:
    """One rank's action list of a V-shaped ``torch.distributed.pipelining`` schedule (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``: two stages per rank, ``2·pp`` stages), computed without stages or a process group by the
    schedule's private ``_calculate_single_rank_operations``, as
    ``(stage index, kind)`` with kind ``F`` (forward), ``I`` (input gradient), ``W`` (weight gradient) or ``B`` (full
    backward); an overlapped forward + backward action is listed as its two sub-actions, in order. Idle slots
    (``None``) are dropped. ``tests/test_memory_model.py`` compares the memory model's lists with these.

    Raises:
        KeyError: ``class_name`` is neither ``ScheduleZBVZeroBubble`` nor ``ScheduleDualPipeV``.
    """
    v_schedules = {
        "ScheduleZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
        "ScheduleDualPipeV": schedules.ScheduleDualPipeV,
    }
    cls = v_schedules[class_name]
    schedule = cls.__new__(cls)  # no stages: the method reads only the attributes set here
    for name, value in zip(SCHEDULE_RANK_OPERATIONS_ATTRIBUTES, (pp, n_microbatches, 2 * pp)):
        setattr(schedule, name, value)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out: list[tuple[int, str]] = []
    for action in schedule._calculate_single_rank_operations(rank):
        if action is None:
            continue
        for sub in action.sub_actions or (action,):
            out.append((sub.stage_index, kinds[sub.computation_type.name]))
    return out
