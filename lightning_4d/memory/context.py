"""Context parallelism in the memory model (``lightning_4d/parallel/context.py``; :mod:`lightning_4d.memory.model`'s
docstring, **Context parallelism**): every sequence-sized tensor is divided by cp elsewhere; here what is not, per
method: ``"allgather"``'s gathered K/V (:func:`gathered_kv_bytes`), the query tokens the attention kernel calls of a
cp rank cover (:func:`selective_attention_tokens`) and one layer's attention-backward transients
(:func:`context_parallel_buffers`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.memory.tensors import Dtypes

__all__ = ["context_parallel_buffers", "gathered_kv_bytes", "selective_attention_tokens"]


def gathered_kv_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Bytes one layer saves of ``"allgather"``'s gathered K and V of the whole sequence (``2·c_b·b·s·k·d/t``), beside
    the local-K/V-sized tensors it saves as the ring does."""
    return 2 * dt.compute * b * seq_length * (cfg.num_kv_heads // pc.tp) * cfg.head_dim


def selective_attention_tokens(pc: ParallelConfig, s: int, seq_length: int) -> int:
    """Query tokens the attention kernel calls of one layer cover on the cp rank that keeps the most of their outputs
    under selective checkpointing (``s`` the local sequence): one call of ``s`` tokens without cp; under cp the last
    cp rank's calls: every block of the ring in full (``cp·s = seq_length``), or its two chunks against their
    diagonal and prefix blocks under allgather (``2·s``)."""
    if pc.cp == 1:
        return s
    return seq_length if pc.context_parallel_method == "ring" else 2 * s


def context_parallel_buffers(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Transient bytes of one layer's context-parallel attention backward (:mod:`lightning_4d.memory.model`'s
    docstring, **Context parallelism**), 0 without cp."""
    if pc.cp == 1:
        return 0
    s, tp = seq_length // pc.cp, pc.tp
    kv = b * (cfg.num_kv_heads // tp) * cfg.head_dim  # elements of K (or V) per token
    dq = 4 * b * s * (cfg.num_heads // tp) * cfg.head_dim
    if pc.context_parallel_method == "ring":
        return 2 * (2 * dt.compute + 3 * 4) * s * kv + dq
    return 2 * 4 * seq_length * kv + dq
