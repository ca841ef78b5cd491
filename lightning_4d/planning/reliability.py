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
- with asynchronous checkpoints (``async_checkpoint=True``, :func:`async_blocking_seconds`) training stops only while
  each GPU copies its states to host memory: that blocking part C_b replaces C in the cost of a save, ``C_b/τ``; the
  write goes on for C seconds more, during which the newest complete checkpoint is the one before, so a failure
  redoes ``τ/2 + C − C_b`` seconds of work on average; and a save cannot start before the previous write ended
  (it would wait), so ``τ ≥ C``. Then τ = max(sqrt(2·C_b·M), C) and the fraction lost is
  ``C_b/τ + (τ/2 + C − C_b)/M`` (C_b = C gives Young's above);
- M: ``mtbf_gpu_hours · 3600 / G`` seconds, failures being independent per GPU. The default
  :data:`DEFAULT_MTBF_GPU_HOURS` is Meta's Llama 3 405B pre-training (Dubey et al. 2024, arXiv 2407.21783, §3.3.4):
  419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. 16,384 · 54 · 24 / 419 = 50,677 GPU-hours per
  interruption (a job of 16,384 GPUs fails every 3.1 hours).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "DEFAULT_CHECKPOINT_WRITE_GBPS",
    "DEFAULT_MTBF_GPU_HOURS",
    "CheckpointInterval",
    "async_blocking_seconds",
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
    interval in optimizer steps of ``step_time`` seconds (at least 1); ``blocking_s`` the seconds a save stops
    training (C, or C_b with asynchronous checkpoints: module docstring)."""

    checkpoint_bytes: int
    write_s: float
    mtbf_s: float
    interval_s: float
    interval_steps: int
    lost_fraction: float
    blocking_s: float


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


def async_blocking_seconds(
    model_config: Any, layout: Any, host_bandwidth: float, precision: str = "bf16-mixed"
) -> float:
    """Seconds an asynchronous save (``async_checkpoint=True``) stops training: the states one GPU holds at a save
    copied to host memory at ``host_bandwidth`` bytes/s (the GPU's host link, ``GpuSpec.host_bandwidth``; pinned
    staging runs at about the link's rate). At a save a GPU holds the checkpoint's states (:func:`checkpoint_bytes`)
    of its tp and pp shard, and under ZeRO 2/3 (FSDP2) only its ``1/(dp·cp)`` of those; ZeRO 0 replicates them and
    ZeRO 1 gathers its optimizer chunks over dp for the save (``docs/checkpoints.md``), so those stage the whole
    tp/pp shard. Expert parallelism and the staging's fixed costs are not counted.

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig`.
        layout: anything with ``tp``, ``pp``, ``dp``, ``cp`` and ``zero_stage`` (a planner candidate, a resolved
            ``ParallelConfig``).
        host_bandwidth: bytes/s of one GPU's link to host memory, one direction.
        precision: the training precision (the checkpoint's dtypes).

    Raises:
        ValueError: a non-positive ``host_bandwidth``, an unknown precision.
    """
    _positive("host_bandwidth", host_bandwidth)
    shards = layout.tp * layout.pp * (layout.dp * layout.cp if layout.zero_stage >= 2 else 1)
    return checkpoint_bytes(model_config, precision) / shards / host_bandwidth


def checkpoint_interval(
    model_config: Any,
    num_gpus: int,
    gpus_per_node: int,
    step_time: float,
    *,
    precision: str = "bf16-mixed",
    checkpoint_write_gbps: float = DEFAULT_CHECKPOINT_WRITE_GBPS,
    mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS,
    blocking_s: Optional[float] = None,
) -> CheckpointInterval:
    """Young's optimal checkpoint interval of a job (module docstring: formula, defaults, what is not counted).

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig`.
        num_gpus, gpus_per_node: the job's GPUs (nodes = ceil(num_gpus / gpus_per_node)).
        step_time: seconds per optimizer step (the planner's prediction, or a measurement).
        precision: the training precision (the checkpoint's dtypes).
        checkpoint_write_gbps: GB/s (10^9 bytes/s) each node writes to the checkpoint storage.
        mtbf_gpu_hours: GPU-hours between failures of one GPU.
        blocking_s: with asynchronous checkpoints, the seconds a save stops training (C_b,
            :func:`async_blocking_seconds`; at most the write's C, which it is capped to); ``None``: synchronous
            saves, which block for the whole write.

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
    blocking = write if blocking_s is None else min(_positive("blocking_s", blocking_s), write)
    interval = max(math.sqrt(2 * blocking * mtbf), write)
    lost = blocking / interval + (interval / 2 + write - blocking) / mtbf
    return CheckpointInterval(nbytes, write, mtbf, interval, max(1, round(interval / step_time)), lost, blocking)
