"""Activation offload in the memory model (``activation_offload_layers``, ``parallel/offload.py``): the first k
layers of each pipeline stage keep their saved tensors in host memory, copied there in forward and back in
backward (:func:`offloaded_per_stage`); a stage offloaded whole brings them back in the backward of its last layer,
the first one backward (:func:`offloaded_whole`, :func:`unpacked_bytes`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.memory.activations import layer_saved_parts
from lightning_4d.memory.tensors import Dtypes

__all__ = ["offloaded_per_stage", "offloaded_whole", "unpacked_bytes"]


def offloaded_per_stage(pc: ParallelConfig, stages: list, per_layer: float, rope: int) -> list[float]:
    """Bytes one micro-batch's forward copies to host memory per pipeline stage of a rank (``stages``:
    ``rank_stages``), under ``activation_offload_layers`` (``parallel/offload.py``): its offloaded layers' saved
    sets (``per_layer`` each), and each one's copy of the RoPE tables (``rope``: the device shares them between
    layers, each offloaded layer copies those it saves). The same bytes come back in backward."""
    return [min(pc.activation_offload_layers, len(layers)) * (per_layer + rope) for _, layers in stages]


def offloaded_whole(cfg: Any, pc: ParallelConfig, pp_rank: int) -> bool:
    """Whether pp rank ``pp_rank`` holds a pipeline stage whose layers are all offloaded
    (``activation_offload_layers``): the last layer's backward then brings saved tensors back from host."""
    k = pc.activation_offload_layers
    return bool(k) and any(0 < len(layers) <= k for _, layers in pc.rank_stages(cfg.num_layers, pp_rank))


def unpacked_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int) -> int:
    """Bytes a stage offloaded whole (:func:`offloaded_whole`) adds to its peak by bringing saved tensors back.

    An offloaded layer's backward brings its saved tensors back node by node, each dropped after its node. Only a
    stage offloaded whole adds that to its peak: otherwise its last layer (the first one backward) is not offloaded,
    and by the time an offloaded layer's backward runs that layer's saved set (larger) is freed (measured on CPU:
    tiny-test with 1 of 2 layers offloaded peaks exactly one layer's saved bytes below no offload). Offloaded whole,
    the peak is in the last layer's SwiGLU product backward (measured, LiveTensorBytes at the peak: ``aten.mul``):
    its two inputs brought back (``swiglu // 2``, counted with the recomputed set) beside the product's gradient and
    the two it makes (:func:`lightning_4d.memory.activations.recompute_backward`), after the loss and the head freed
    their saved tensors."""
    return layer_saved_parts(cfg, dt, b, s // pc.cp, pc.tp, pc.sp)["swiglu"] // 2
