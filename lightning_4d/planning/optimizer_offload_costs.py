"""The step-time term of optimizer offload (``optimizer_offload=True``, ``lightning_4d/parallel/optimizer_offload.py``):
the optimizer step on the host's CPU instead of the device, and the copies over the host link (PCIe) that the
layout cannot hide. The memory side is :func:`lightning_4d.planning.states.offloaded_states`.

Per optimizer step, on the pp rank with the most parameters, ``P`` its owned parameters (its ZeRO shard):

- the host step: ``P · BYTES_PER_PARAM / (CPU_ADAMW_BYTES_PER_SECOND · HOST_THREADS_PER_RANK)`` (torch's fused CPU
  AdamW reads gradient, weight, m, v and writes weight, m, v: 7 float32 values per parameter), exposed: the step
  waits for it;
- ZeRO 1: the owned gradient slices to the host and the updated slices back, ``P · (4 + 4)`` bytes at
  ``COLLECTIVE_EFFICIENCY · host_bandwidth``, exposed (the copies wait for the reduce-scatter and the clipping, and
  the all-gather waits for them);
- ZeRO 2/3 (FSDP2's ``CPUOffloadPolicy``): each all-gather first copies the unit's float32 shard to the device (once
  per micro-batch at ZeRO 2, twice at ZeRO 3: forward and backward) and each reduce-scatter's gradient shard goes
  back to the host (every micro-batch: FSDP2 accumulates the sharded gradients on the host), ``m · (gathers + 1) ·
  P · 4`` bytes, prefetched and copied on FSDP2's streams beside the compute: exposed, what exceeds the step's
  compute, at least one unit's share.

Sources and assumptions: ``CPU_ADAMW_BYTES_PER_SECOND`` is measured (``benchmarks/cpu_adamw.py``, below);
``HOST_THREADS_PER_RANK`` is an assumption (a 2-socket node of 96-112 cores serving 8 GPUs, with the host memory
bandwidth shared by the 8 ranks' steps), not a measurement on a GPU node; the host link is
:class:`~lightning_4d.planning.hardware.GpuSpec`'s ``host_bandwidth`` (PCIe, datasheets).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

#: torch's fused CPU AdamW, float32, one thread: bytes read and written per second (``BYTES_PER_PARAM`` per
#: parameter). Measured with ``benchmarks/cpu_adamw.py --threads 1`` (16,777,216 parameters, median of 10 steps) on an
#: AMD EPYC (2 cores shared with other jobs), torch 2.13.0+cpu: 21.0 ms per step = 798 M parameters/s = 22.35 GB/s wall
#: (30.06 GB/s by CPU time); ``foreach=True`` 4.60 GB/s. The wall figure is taken.
CPU_ADAMW_BYTES_PER_SECOND = 22.35e9
#: float32 bytes torch's AdamW step reads and writes per parameter: gradient, weight, m, v read; weight, m, v written
BYTES_PER_PARAM = 4 * 7
#: CPU threads one rank's host step runs on (an assumption, module docstring)
HOST_THREADS_PER_RANK = 4


def host_step_seconds(owned_params: float) -> float:
    """Seconds of the host's AdamW step over ``owned_params`` parameters (module docstring)."""
    return owned_params * BYTES_PER_PARAM / (CPU_ADAMW_BYTES_PER_SECOND * HOST_THREADS_PER_RANK)


def optimizer_offload_seconds(
    owned_params: float, zero_stage: int, num_microbatches: int, units: int, compute: float, gpu: Any, efficiency: float
) -> float:
    """Seconds of one step that optimizer offload adds in place of the device's optimizer step: the host step and the
    exposed host-link copies (module docstring), for ``owned_params`` owned parameters of the rank, ``units`` FSDP2
    units, ``compute`` seconds of the step's compute, on ``gpu`` (its ``host_bandwidth``), the copies at
    ``efficiency`` of it (the step-time model's ``COLLECTIVE_EFFICIENCY``)."""
    link = efficiency * gpu.host_bandwidth
    if zero_stage <= 1:
        copies = owned_params * (4 + 4) / link
    else:
        gathers = 1 if zero_stage == 2 else 2
        moved = num_microbatches * (gathers + 1) * owned_params * 4 / link
        copies = max(moved - compute, moved / max(1, units))
    return host_step_seconds(owned_params) + copies
