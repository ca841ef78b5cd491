"""Context parallelism in the memory model (``lightning_4d/features/context_parallel/runtime.py``;
:mod:`lightning_4d.planning.model`'s docstring, **Context parallelism**): every sequence-sized tensor is divided by cp
elsewhere; here what is not, per method: what a layer saves beyond the ring's local tensors (:func:`extra_saved_bytes`:
``"allgather"``'s gathered K/V, ``"alltoall"``'s second output copy and replicated kv heads), the query tokens the
attention kernel calls of a cp rank cover (:func:`selective_attention_tokens`) and one layer's attention-backward
transients (:func:`context_parallel_buffers`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.features.context_parallel import alltoall_heads
from lightning_4d.planning.tensors import Dtypes

__all__ = [
    "alltoall_buffers",
    "alltoall_saved_extra",
    "context_parallel_buffers",
    "extra_saved_bytes",
    "gathered_kv_bytes",
    "selective_attention_tokens",
]


def gathered_kv_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Bytes one layer saves of ``"allgather"``'s gathered K and V of the whole sequence (``2·c_b·b·s·k·d/t``), beside
    the local-K/V-sized tensors it saves as the ring does."""
    return 2 * dt.compute * b * seq_length * (cfg.num_kv_heads // pc.tp) * cfg.head_dim


def extra_saved_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Bytes one layer saves under cp beyond the ring's local-sized tensors: 0 for ``"ring"`` (and without cp),
    :func:`gathered_kv_bytes` for ``"allgather"``, :func:`alltoall_saved_extra` for ``"alltoall"``."""
    if pc.cp == 1 or pc.context_parallel_method == "ring":
        return 0
    if pc.context_parallel_method == "alltoall":
        return alltoall_saved_extra(cfg, pc, dt.compute, b, seq_length)
    return gathered_kv_bytes(cfg, pc, dt, b, seq_length)


def alltoall_saved_extra(cfg: Any, pc: ParallelConfig, compute_bytes: int, b: int, seq_length: int) -> int:
    """Bytes one layer saves under ``context_parallel_method="alltoall"`` beyond plain attention on its local tokens
    (``features/context_parallel/runtime.py``). q, the output and the log-sum-exp of the whole sequence ``s`` for
    ``a/(tp·cp)`` heads have the bytes of the local ones, but (1) the output the kernel saves and the local output the
    second all-to-all returns (``wo``'s saved input) are two tensors, where plain attention's output *is* ``wo``'s
    input: ``c_b·b·(s/cp)·(a/tp)·d`` more; (2) K and V are saved for ``k' = max(k/tp, cp)/cp`` kv heads of the whole
    sequence (:func:`~lightning_4d.features.context_parallel.alltoall_heads`): ``2·c_b·b·d·(s·k' − (s/cp)·k/tp)`` more,
    0 when cp divides ``k/tp``, the replicated kv heads' bytes otherwise. Measured (tiny-test, 32-true,
    saved_tensors_hooks, ``tests/test_context_parallel.py``): without (1) the estimate was 5.2% (cp2) and 4.9% (cp4)
    under.
    Raises ``ValueError`` as :func:`~lightning_4d.features.context_parallel.alltoall_heads`."""
    _, kv = alltoall_heads(cfg.num_heads, cfg.num_kv_heads, pc.tp, pc.cp)
    s = seq_length // pc.cp
    output = compute_bytes * b * s * (cfg.num_heads // pc.tp) * cfg.head_dim
    return output + 2 * compute_bytes * b * cfg.head_dim * (seq_length * kv - s * (cfg.num_kv_heads // pc.tp))


def alltoall_buffers(cfg: Any, pc: ParallelConfig, compute_bytes: int, b: int, seq_length: int) -> int:
    """Transient bytes of one layer's ``"alltoall"`` attention backward: at the all-to-all of the packed dq, dk, dv,
    the gradients of the whole sequence for this rank's heads, the send buffer and the receive buffer, each
    ``c_b·b·s·(a/(tp·cp) + 2·k')·d`` bytes (``k'`` kv heads per rank, :func:`alltoall_saved_extra`): three of them
    (the output gradient's exchange before it moves ``c_b·b·s·a/(tp·cp)·d`` three times, less)."""
    nq, kv = alltoall_heads(cfg.num_heads, cfg.num_kv_heads, pc.tp, pc.cp)
    return 3 * compute_bytes * b * seq_length * (nq + 2 * kv) * cfg.head_dim


def selective_attention_tokens(pc: ParallelConfig, s: int, seq_length: int) -> int:
    """Query tokens the attention kernel calls of one layer cover on the cp rank that keeps the most of their outputs
    under selective checkpointing (``s`` the local sequence): one call of ``s`` tokens without cp; under cp the last
    cp rank's calls: every block of the ring in full (``cp·s = seq_length``), or its two chunks against their
    diagonal and prefix blocks under allgather (``2·s``); alltoall: one call over the whole sequence for
    ``a/(tp·cp)`` heads, the bytes of ``s`` tokens of ``a/tp`` heads."""
    if pc.cp == 1 or pc.context_parallel_method == "alltoall":
        return s
    return seq_length if pc.context_parallel_method == "ring" else 2 * s


def context_parallel_buffers(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Transient bytes of one layer's context-parallel attention backward (:mod:`lightning_4d.planning.model`'s
    docstring, **Context parallelism**), 0 without cp."""
    if pc.cp == 1:
        return 0
    s, tp = seq_length // pc.cp, pc.tp
    kv = b * (cfg.num_kv_heads // tp) * cfg.head_dim  # elements of K (or V) per token
    dq = 4 * b * s * (cfg.num_heads // tp) * cfg.head_dim
    if pc.context_parallel_method == "ring":
        return 2 * (2 * dt.compute + 3 * 4) * s * kv + dq
    if pc.context_parallel_method == "alltoall":
        return alltoall_buffers(cfg, pc, dt.compute, b, seq_length)
    return 2 * 4 * seq_length * kv + dq
