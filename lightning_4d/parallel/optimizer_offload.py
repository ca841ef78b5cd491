"""Optimizer-state offload (``optimizer_offload=True``): the optimizer's states in host memory and its step on the CPU
(ZeRO-Offload: Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", arXiv 2101.06840; FSDP2's
``CPUOffloadPolicy``; Megatron-Core's optimizer CPU offload). The step is torch's own ``AdamW`` (whatever optimizer the
task configured) run on host tensors: a well-kept implementation over our own.

=====  ===================================================  ========================================================
stage  on the host                                          how
=====  ===================================================  ========================================================
1      this rank's owned slice of every bucket: a float32   :class:`~lightning_4d.parallel.sharded_optimizer
       copy (the master under ``bf16-mixed``, else the      .ShardedOptimizer` ``(offload=True)``: after the closure
       parameter's own copy), its gradient, Adam's m, v     (backward, reduce-scatter, clipping) each owned gradient
                                                            slice is copied into its host tensor (non-blocking, into
                                                            pinned memory on CUDA; one synchronize), the wrapped
                                                            optimizer steps the host tensors, the updated slices are
                                                            copied back (non-blocking) before the all-gather
2, 3   the sharded parameters (the masters under            FSDP2 ``fully_shard(offload_policy=CPUOffloadPolicy(
       ``bf16-mixed``), their sharded gradients, Adam's     pin_memory=<CUDA>))``: each unit's shard is copied to the
       m, v                                                 device for its all-gather, each reduce-scattered
                                                            gradient shard copied to the host as the unit's backward
                                                            ends (overlapped with the next units' backward)
=====  ===================================================  ========================================================

What stays on the device: the parameters the layers compute with (all of them at ZeRO 1, the gathered units at ZeRO
2/3) and, at ZeRO 1, the gradient buckets (reduce-scatter needs them there). ZeRO 0 is refused
(:meth:`lightning_4d.config.ParallelConfig._check_optimizer_offload`): every dp rank would hold every state.

On a CPU run (the tests, ``lightning-4d measure --device cpu``) the host and the device are one memory, and the host
tensors are still separate tensors (copies, never views of the parameters or of the buckets), so that what runs is
what the memory model splits into device and host bytes. Tensors allocated for the host are made inside
:func:`host_allocations`, which ``lightning-4d measure``'s tracker reads (:func:`allocating_on_host`) to count them
as host bytes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

_HOST_DEPTH = [0]


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """The tensors allocated inside are host memory of the offloaded optimizer (its copies, its states, its step's
    temporaries): :func:`allocating_on_host` is true inside."""
    _HOST_DEPTH[0] += 1
    try:
        yield
    finally:
        _HOST_DEPTH[0] -= 1


def allocating_on_host() -> bool:
    """Whether the offloaded optimizer is allocating host memory now (inside :func:`host_allocations`)."""
    return _HOST_DEPTH[0] > 0


def pin_host_memory(device: torch.device) -> bool:
    """Whether host copies for ``device`` are page-locked: on CUDA (non-blocking copies need pinned memory), not on
    the CPU (there is no device to copy to)."""
    return torch.device(device).type == "cuda"


def host_copy(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A new host (CPU) tensor holding ``t`` in ``dtype``, page-locked when ``t`` is on CUDA; never a view of ``t``
    (even on the CPU)."""
    with host_allocations():
        out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pin_host_memory(t.device))
        out.copy_(t)
    return out


def host_empty_like(t: Tensor, device: torch.device) -> Tensor:
    """An uninitialized host tensor shaped like ``t`` in its dtype, page-locked when ``device`` is CUDA."""
    with host_allocations():
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin_host_memory(device))


def wait_for_copies(device: torch.device) -> None:
    """Wait until the non-blocking copies issued on ``device``'s current stream are done (nothing to wait for on the
    CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def cpu_offload_policy(device_type: str) -> object:
    """FSDP2's ``CPUOffloadPolicy`` for a mesh of ``device_type``: pinned host memory on CUDA (its non-blocking copies
    and FSDP2's move of freshly materialized shards to the host need it), plain host memory on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda")
