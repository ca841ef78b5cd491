"""Activation offload in the memory model (``activation_offload_layers``, ``parallel/offload.py``): the first k
layers of each pipeline stage keep their saved tensors in host memory, copied there in forward and back in
backward (:func:`offloaded_per_stage`); a stage offloaded whole brings them back in the backward of its last layer,
the first one backward (:func:`offloaded_whole`, :func:`unpacked_bytes`); on CUDA the device storages of the last
offloaded layer stay allocated until its copy to host has completed (:func:`copies_in_flight`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.planning.activations import layer_saved_parts
from lightning_4d.planning.tensors import Dtypes

__all__ = [
    "OFFLOAD_LAYERS_IN_FLIGHT",
    "copies_in_flight",
    "offloaded_per_stage",
    "offloaded_whole",
    "prefetch_moments",
    "unpacked_bytes",
]


def offloaded_per_stage(pc: ParallelConfig, stages: list, per_layer: float, rope: int) -> list[float]:
    """Bytes one micro-batch's forward copies to host memory per pipeline stage of a rank (``stages``:
    ``rank_stages``), under ``activation_offload_layers`` (``parallel/offload.py``): its offloaded layers' saved
    sets (``per_layer`` each), and each one's copy of the RoPE tables (``rope``: the device shares them between
    layers, each offloaded layer copies those it saves). The same bytes come back in backward."""
    return [min(pc.activation_offload_layers, len(layers)) * (per_layer + rope) for _, layers in stages]


#: offloaded layers whose device storages may still be held for their copies to host (``parallel/offload.py``'s
#: ``LAYERS_IN_FLIGHT``; ``tests/test_activation_offload.py`` checks that the two agree)
OFFLOAD_LAYERS_IN_FLIGHT = 1


def copies_in_flight(pc: ParallelConfig, stages: list, per_layer: float, rope: int, device_type: str) -> int:
    """Bytes activation offload holds on the device beyond the saved tensors the rank keeps, on CUDA: the device
    storages of the last :data:`OFFLOAD_LAYERS_IN_FLIGHT` offloaded layer(s), one micro-batch's saved set each
    (``per_layer``, plus ``rope`` where the caller counts the shared RoPE tables as held: a stage offloaded whole), stay
    allocated until their copies to host have completed and the next offloaded layer's forward starts, or until
    backward reaches that layer (``parallel/offload.py``: no ``record_stream``, the storages freed on the stream that
    allocated them). The last offloaded layer of a forward is therefore still held when the loss' backward starts
    whenever kept layers follow it, or when its copy is slower than the forward after it; ``model.py`` counts it in
    every phase until backward reaches that layer (a worst case: ``max_memory_allocated`` shows it when the copies
    lag), not in the prefetch, which drops it before it allocates. 0 on a CPU (the copies run in program order,
    nothing is held) and without offloaded layers (``stages``: ``rank_stages``)."""
    if device_type != "cuda" or not any(min(pc.activation_offload_layers, len(layers)) for _, layers in stages):
        return 0
    return int(OFFLOAD_LAYERS_IN_FLIGHT * (per_layer + rope))


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
    the two it makes (:func:`lightning_4d.planning.activations.recompute_backward`), after the loss and the head freed
    their saved tensors."""
    return layer_saved_parts(cfg, dt, b, s // pc.cp, pc.tp, pc.sp)["swiglu"] // 2


def prefetch_moments(
    stages: list, offloaded: list[int], per_layer: int, rope: int, backward: int
) -> list[tuple[int, int]]:
    """The moments of activation offload's prefetch (``parallel/offload.py``) on one pp rank that can make its peak
    (``stages``: ``rank_stages``; ``offloaded``: how many of each stage's layers are offloaded; ``per_layer``: one
    layer's saved bytes; ``rope``: the RoPE tables an offloaded layer copies; ``backward``: a layer's first backward
    ops, :func:`lightning_4d.planning.activations.kept_layer_backward`), each as ``(bytes, layers done)``: the bytes it
    holds beyond the activations after the loss and the head's backward (one micro-batch in backward), and how many
    layers of that micro-batch ran their backward before it (their gradients exist then, when they are not resident
    from backward start: the caller adds them).

    An offloaded layer followed by another in its stage comes back whole (``per_layer + rope``) while that next layer
    runs its backward. Two moments per stage: the first kept layer's backward (index ``o``: its own set, the one
    below prefetched, the ``len - o - 1`` layers above it freed) and, with two or more offloaded layers, layer 1's
    (its own set and layer 0's both prefetched, every kept layer freed, the most gradients made: the deepest moment
    of the chain). The last layer of a stage offloaded whole is counted apart (its nodes brought back one by one,
    the layer before it prefetched: ``Activations.recompute``)."""
    out = []
    prefetched = per_layer + rope
    for (_, layers), o in zip(stages, offloaded):
        n = len(layers)
        if o == 0 or n < 2:
            continue
        if o < n:
            out.append((prefetched - (n - o - 1) * per_layer + backward, n - o - 1))
        if o >= 2 and not (o == n == 2):
            out.append((2 * prefetched - (n - o) * per_layer + backward, n - 2))
    return out
