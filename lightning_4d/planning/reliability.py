"""How often to checkpoint: Young's optimal interval for a job's checkpoint write time and failure rate.

A job of G GPUs that fails every M seconds on average and takes C seconds to write a checkpoint loses, per unit of
time, ``C/τ`` to writing checkpoints every τ seconds and ``τ/(2M)`` to redoing half an interval of work after each
failure; the sum is smallest at Young's interval

    τ = sqrt(2·C·M)                                  (Young 1974, "A first order approximation to the optimum
                                                      checkpoint interval", CACM 17(9), 530-531)

where the fraction of time lost is ``C/τ + τ/(2M) = sqrt(2·C/M)``. Daly 2006 ("A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3)) refines it when C is not small against M; for C/M
below 1% the two differ by under 5%, and the restart time after a failure (relaunch, reload), which adds ``R/M``
whatever τ is, is not counted here.

- C: the bytes of one checkpoint of the whole job, written in parallel by its nodes: the unique model states, every
  parameter once in the training dtype plus the float32 master weights and Adam's two moments
  (:func:`checkpoint_bytes`), divided by the nodes' aggregate write bandwidth ``nodes × checkpoint_write_gbps``;
- M: ``mtbf_gpu_hours · 3600 / G`` seconds, failures being independent per GPU. The default
  :data:`DEFAULT_MTBF_GPU_HOURS` is Meta's Llama 3 405B pre-training (Dubey et al. 2024, arXiv 2407.21783, §3.3.4):
  419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. 16,384 · 54 · 24 / 419 = 50,677 GPU-hours per
  interruption (a job of 16,384 GPUs fails every 3.1 hours).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_CHECKPOINT_WRITE_GBPS",
    "DEFAULT_MTBF_GPU_HOURS",
    "CheckpointInterval",
    "checkpoint_bytes",
    "checkpoint_interval",
]

#: GPU-hours between unexpected interruptions: Llama 3 paper §3.3.4, 419 in 54 days on 16,384 GPUs
DEFAULT_MTBF_GPU_HOURS = 16384 * 54 * 24 / 419
#: write bandwidth of one node to the checkpoint storage, GB/s (10^9 bytes/s): an assumption (a parallel file
#: system client, e.g. Lustre or GPFS over one 100-200 Gb/s NIC, sustains about this); measure yours and pass
#: ``--checkpoint-write-gbps``
DEFAULT_CHECKPOINT_WRITE_GBPS = 10.0


@dataclass(frozen=True)
class CheckpointInterval:
    """Young's interval for one job: ``write_s`` (C), ``mtbf_s`` (M), ``interval_s`` (τ = sqrt(2CM)),
    ``lost_fraction`` (sqrt(2C/M): writing plus redone work), all seconds or fractions; ``interval_steps`` the
    interval in optimizer steps of ``step_time`` seconds (at least 1)."""

    checkpoint_bytes: int
    write_s: float
    mtbf_s: float
    interval_s: float
    interval_steps: int
    lost_fraction: float


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is not valid: expected a finite number > 0.")
    return float(value)


def checkpoint_bytes(model_config: Any, precision: str = "bf16-mixed") -> int:
    """Bytes of one checkpoint of the whole job: every parameter once in the training dtype, + the float32 master
    weights where they are separate, + Adam's m and v (the dtypes of :mod:`lightning_4d.planning.model`:
    ``bf16-mixed`` 2 + 4 + 8 = 14 bytes per parameter, ``32-true`` 4 + 8 = 12).

    Raises:
        ValueError: an unknown precision.
    """
    from lightning_4d.planning.model import checkpoint_bytes_per_parameter

    return model_config.num_parameters() * checkpoint_bytes_per_parameter(precision)


def checkpoint_interval(
    model_config: Any,
    num_gpus: int,
    gpus_per_node: int,
    step_time: float,
    *,
    precision: str = "bf16-mixed",
    checkpoint_write_gbps: float = DEFAULT_CHECKPOINT_WRITE_GBPS,
    mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS,
) -> CheckpointInterval:
    """Young's optimal checkpoint interval of a job (module docstring: formula, defaults, what is not counted).

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig`.
        num_gpus, gpus_per_node: the job's GPUs (nodes = ceil(num_gpus / gpus_per_node)).
        step_time: seconds per optimizer step (the planner's prediction, or a measurement).
        precision: the training precision (the checkpoint's dtypes).
        checkpoint_write_gbps: GB/s (10^9 bytes/s) each node writes to the checkpoint storage.
        mtbf_gpu_hours: GPU-hours between failures of one GPU.

    Raises:
        ValueError: a non-positive or non-finite argument, an unknown precision.
    """
    for name, value in (
        ("num_gpus", num_gpus),
        ("gpus_per_node", gpus_per_node),
        ("step_time", step_time),
        ("checkpoint_write_gbps", checkpoint_write_gbps),
        ("mtbf_gpu_hours", mtbf_gpu_hours),
    ):
        _positive(name, value)
    nbytes = checkpoint_bytes(model_config, precision)
    nodes = math.ceil(num_gpus / gpus_per_node)
    write = nbytes / (nodes * checkpoint_write_gbps * 1e9)
    mtbf = mtbf_gpu_hours * 3600 / num_gpus
    interval = math.sqrt(2 * write * mtbf)
    return CheckpointInterval(
        nbytes, write, mtbf, interval, max(1, round(interval / step_time)), write / interval + interval / (2 * mtbf)
    )
