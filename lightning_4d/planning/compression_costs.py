"""Gradient compression in the memory model (``parallel/compression.py``, ZeRO 0/1 gradient buckets over dp·cp):
PowerSGD's state, held with the optimizer states, and the buffers each compression puts on the wire.

Pure Python: no torch import.
"""

from __future__ import annotations

from lightning_4d.config import ParallelConfig
from lightning_4d.partition import GRADIENT_BUCKET_BYTES, powersgd_compressible
from lightning_4d.planning.tensors import Dtypes, Param

__all__ = ["compression_buffer_bytes", "powersgd_state_bytes"]


def powersgd_state_bytes(pc: ParallelConfig, weighted: tuple[tuple[Param, int], ...], world: int) -> int:
    """Bytes of PowerSGD's state on one rank (``gradient_compression="powersgd"`` over ``world`` > 1 ranks): every
    rank's own float32 error feedback ``m·n`` and warm start ``n·r`` per compressed matrix (whole local matrices,
    :func:`lightning_4d.partition.powersgd_compressible`); 0 otherwise. ``weighted``: the rank's parameters and their
    counts (:func:`lightning_4d.planning.params.weighted_params`)."""
    if pc.gradient_compression != "powersgd" or world <= 1:
        return 0
    r = pc.powersgd_rank
    return sum(
        count * 4 * (p.rows * p.cols + p.cols * r)
        for p, count in weighted
        if p.matrix and powersgd_compressible((p.rows, p.cols), r)
    )


def compression_buffer_bytes(pc: ParallelConfig, dt: Dtypes, gradients: int, world: int, largest: int) -> int:
    """Bytes the gradient compression holds on the wire at the end of backward (ZeRO 0/1 over ``world`` > 1 ranks),
    0 without it: ``"bf16"`` every bucket's bfloat16 copy at once (2 bytes per gradient element, ``gradients`` bytes
    of them); ``"powersgd"`` one bucket at a time, its float32 M (gradient + error), the approximation and the new
    error (a bucket holds at most ``GRADIENT_BUCKET_BYTES`` of parameters, or ``largest``, the largest parameter's
    elements, alone)."""
    if world <= 1:
        return 0
    if pc.gradient_compression == "bf16":
        return gradients // dt.grad * 2
    if pc.gradient_compression == "powersgd":
        return 3 * 4 * max(min(GRADIENT_BUCKET_BYTES // dt.setup, gradients // dt.grad), largest)
    return 0
