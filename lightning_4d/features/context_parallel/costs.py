"""Context parallelism in the memory model (``lightning_4d/features/context_parallel/runtime.py``;
:mod:`lightning_4d.planning.model`'s docstring, **Context parallelism**): every sequence-sized tensor is divided by cp
elsewhere; here what is not, per method: what a layer saves beyond the ring's local tensors (:func:`extra_saved_bytes`:
``"allgather"``'s gathered K/V, ``"alltoall"``'s second output copy and replicated kv heads), the query tokens the
attention kernel calls of a cp rank cover (:func:`selective_attention_tokens`), one layer's attention-backward
transients (:func:`context_parallel_buffers`) and, with document masking, the ring's backward with its block masks
(:func:`ring_masked_backward`), the blocks it computes (:func:`ring_computed_blocks`) and the keys the all-gather
method's masked kernel calls cover (:func:`allgather_masked_keys`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_4d.config import ParallelConfig
from lightning_4d.features.context_parallel import alltoall_heads
from lightning_4d.planning.tensors import Dtypes

__all__ = [
    "allgather_backward",
    "allgather_masked_keys",
    "alltoall_buffers",
    "alltoall_masked_backward",
    "alltoall_saved_extra",
    "context_parallel_buffers",
    "extra_saved_bytes",
    "gathered_kv_bytes",
    "ring_computed_blocks",
    "ring_masked_backward",
    "selective_attention_tokens",
]


def gathered_kv_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int) -> int:
    """Bytes one layer saves under ``"allgather"`` beyond the ring's saved set (``a' = a/t`` query heads, ``k' = k/t``
    kv heads, ``L = s/cp`` local tokens, ``c_b`` the compute dtype's bytes; ``runtime.py``'s
    ``_AllGatherAttention``): the gathered K and V of the whole sequence (``full``, ``[2, b, k', s, d]``) in place of
    the local K and V the ring saves (nothing else keeps those), ``2·c_b·b·(s − L)·k'·d``, and ``wo``'s input, a copy:
    the output is ``[b, a', L, d]``-contiguous (a concatenation of the chunks' results), so merging its heads back
    copies it, where the ring's output is laid out so that this is a view of the saved output: ``c_b·b·L·a'·d``.
    Together ``c_b·b·d·(2·k'·(s − L) + a'·L)``; with ``a' = 2·k'`` this equals the whole gathered K/V,
    ``2·c_b·b·s·k'·d``, which the model counted before. Measured (``saved_tensors_hooks`` over one ``Attention``
    layer on a fake process group, each storage once: ``tests/test_context_parallel.py``, 4 query heads with 1, 2
    and 4 kv heads, cp2 and cp4, first and last cp rank): exactly this."""
    a, k, d = cfg.num_heads // pc.tp, cfg.num_kv_heads // pc.tp, cfg.head_dim
    local = seq_length // pc.cp
    return dt.compute * b * d * (2 * k * (seq_length - local) + a * local)


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


def alltoall_masked_backward(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int, eager: bool) -> int:
    """Bytes one layer's ``"alltoall"`` attention backward holds with document masking while its kernel runs: the
    whole sequence's mask for this rank's ``a' = a/(tp·cp)`` heads, rebuilt from the saved document ids
    (``window_mask``: boolean ``[b, 1, s, s]``), beside the output gradient of the whole sequence ``[b, a', s, d]``,
    K and V repeated to the query heads (when ``a' > k'``), and the kernel's dq, dK, dV of the repeated heads, each
    ``c·b·s·a'·d`` (``c`` the compute dtype's bytes):

    - ATen's CPU flash kernel (``"sdpa"`` on CPU): the larger of the additive copy's making (``_additive``: the
      mask, its negation and the copy in the compute dtype, ``(2 + c)·b·s²``, before the gradients exist) and the
      kernel's run (the mask and the copy, ``(1 + c)·b·s²``, beside dq, dK, dV);
    - explicit matmuls (``eager``: the ``"eager"`` backend, and every backend on CUDA): the mask and five float32
      ``[b, a', s, s]`` tensors (the scores, P, dP, dP − D, dS), as :func:`ring_masked_backward` reads them (read
      from the code, not measured).

    Measured on CPU (``lightning-4d measure --document-tokens 128``, tiny-test ``32-true`` cp2 alltoall, b=2
    s=2048: 65,975,512 B): the phase it makes (``planning/buffers.py``'s ``masked_ring_phase``) is the estimate's
    peak, 1.024 of the measured one. 0 without cp and for the other methods."""
    if pc.cp == 1 or pc.context_parallel_method != "alltoall":
        return 0
    nq, kv = alltoall_heads(cfg.num_heads, cfg.num_kv_heads, pc.tp, pc.cp)
    c, s = dt.compute, seq_length
    head = c * b * s * nq * cfg.head_dim  # one [b, a', s, d] tensor
    before = (1 + (2 if nq > kv else 0)) * head  # the output gradient, K and V repeated
    square = b * s * s
    if eager:
        return before + 3 * head + square + 5 * 4 * nq * square
    return before + max((2 + c) * square, (1 + c) * square + 3 * head)


def allgather_backward(
    cfg: Any,
    pc: ParallelConfig,
    dt: Dtypes,
    b: int,
    seq_length: int,
    eager: bool,
    masked: Optional[int] = None,
    nccl: bool = False,
) -> int:
    """Bytes one layer's ``"allgather"`` attention backward (``runtime.py``'s ``_AllGatherAttention.backward``) holds
    at its largest moment, beside the gradient of its output, on cp rank 0 (its last query chunk, index
    ``2·cp − 1``, meets the most keys of any rank). With ``a' = a/t`` query heads, ``k' = k/t`` kv heads, head dim
    ``d``, ``L = s/cp`` local tokens, query chunks of ``C = s/(2·cp)`` tokens, ``P = s − C`` keys before the last
    one, ``c`` the compute dtype's bytes, held throughout: the output gradient made contiguous ``c·b·L·a'·d``,
    float32 dq ``4·b·L·a'·d`` and float32 dK/dV of the whole sequence ``2·4·b·s·k'·d``. Then the larger of

    - the last call's kernel run (``sdpa``): the previous call's dq, dK, dV, still bound (``c·b·C·(a' + 2·k')·d``),
      the call's log-sum-exp made contiguous ``4·b·a'·C``, its dq ``c·b·C·a'·d``, dK and dV of every query head
      ``2·c·b·P·a'·d`` and, with grouped-query attention (``a' > k'``), K and V repeated to the query heads
      ``2·c·b·P·a'·d`` and dK, dV summed back ``2·c·b·P·k'·d``; ``eager`` (the ``"eager"`` backend, and float32 on
      CUDA): the five float32 ``[b, a', C, P]`` tensors of the explicit matmuls' backward and, for a compute dtype
      narrower than float32, float32 copies of q, K, V and dO (as :func:`ring_masked_backward` reads them; read from
      the code, not measured); ``masked`` (document masking, the documents' length in tokens, 0 when unknown): the
      call covers the keys from its first query's document's start only (``P = i·C − ⌊i·C/N⌋·N`` for ``N``-token
      documents from the window's start, :func:`allgather_masked_keys`; ``s − C`` when unknown), at least its own
      chunk's ``C``, and holds the boolean mask, its negation and the additive copy ``(2 + c)·b·C·P`` (read from the
      code, not measured: at tiny-test cp2 and cp4 the step's peak is elsewhere);
    - the end: the last call's dq, dK, dV still bound (``c·b·C·a'·d + 2·c·b·P·k'·d``), this rank's dK/dV
      taken out ``2·4·b·L·k'·d`` (gloo: all-reduce, then a copy; ``nccl``: also the reduce-scatter's send buffer,
      ``2·4·b·s·k'·d``) and, for a compute dtype narrower than float32, the gradients cast ``c·b·L·(a' + 2·k')·d``.

    Measured on CPU (``LiveTensorBytes``, ``sdpa``, float32, a fake process group: ``tests/test_context_parallel.py``,
    4 query heads with 2 and 4 kv heads, cp2 and cp4): exactly this. 0 without cp and for the other methods."""
    if pc.cp == 1 or pc.context_parallel_method != "allgather":
        return 0
    a, k, d, c = cfg.num_heads // pc.tp, cfg.num_kv_heads // pc.tp, cfg.head_dim, dt.compute
    local, chunk = seq_length // pc.cp, seq_length // (2 * pc.cp)
    keys = seq_length - chunk
    if masked:
        keys = max(chunk, keys - keys // masked * masked)
    held = c * b * local * a * d + 4 * b * local * a * d + 2 * 4 * b * seq_length * k * d
    call = c * b * chunk * (a + 2 * k) * d + 4 * b * a * chunk + c * b * chunk * a * d + 2 * c * b * keys * a * d
    if a > k:
        call += 2 * c * b * keys * a * d + 2 * c * b * keys * k * d
    if eager:
        call += 5 * 4 * a * b * chunk * keys + (4 * 4 * a * d * b * keys if c != 4 else 0)
    if masked is not None:
        call += (2 + c) * b * chunk * keys
    end = c * b * chunk * a * d + 2 * c * b * keys * k * d + 2 * 4 * b * local * k * d
    end += (2 * 4 * b * seq_length * k * d if nccl else 0) + (c * b * local * (a + 2 * k) * d if c != 4 else 0)
    return held + max(call, end)


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
    docstring, **Context parallelism**), counted beside every phase of the step; 0 without cp and for
    ``"allgather"``, whose backward has a phase of its own (:func:`allgather_backward`): nothing of it is alive at
    the loss, where the step's peak is at cp2 (measured, ``lightning-4d measure``, tiny-test ``32-true`` b=2
    s=2048: counting its float32 dK/dV and dq there put the estimate 6% above the measured peak)."""
    if pc.cp == 1 or pc.context_parallel_method == "allgather":
        return 0
    s, tp = seq_length // pc.cp, pc.tp
    kv = b * (cfg.num_kv_heads // tp) * cfg.head_dim  # elements of K (or V) per token
    dq = 4 * b * s * (cfg.num_heads // tp) * cfg.head_dim
    if pc.context_parallel_method == "ring":
        return 2 * (2 * dt.compute + 3 * 4) * s * kv + dq
    return alltoall_buffers(cfg, pc, dt.compute, b, seq_length)


def ring_masked_backward(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, seq_length: int, eager: bool) -> int:
    """Bytes one layer's ``"ring"`` attention backward holds with document masking, at its largest moment: the rank's
    own block (step 0: all ``L = s/c`` local queries against all ``L`` local keys, the largest block of the zigzag
    ring, ``runtime.py``'s ``_ring_block``), its boolean mask and the kernel's working set, beside the ring's buffers.

    With ``a' = a/t`` query heads, ``k' = k/t`` kv heads, head dim ``d``, ``c_b`` the compute dtype's bytes, the
    ring's buffers when the own block's kernel runs (``runtime.py``'s ``_ring_backward``; bytes per token of the
    ``b·L`` local tokens)::

        W0 = d·(c_b·a' + 4·a' + 2·c_b·k' + 2·c_b·k' + 2·4·k' + 2·c_b·a'·[a' > k'])

    the output gradient made contiguous, float32 dq, the K/V block in hand and the one arriving, the block's float32
    dK/dV, and K/V repeated to the query heads (grouped-query attention only). The block's mask
    (``_Documents.mask``) is ``BoolTensor [b, 1, L, L]``: ``b·L²`` bytes, alive until the next step's mask replaces
    it, and only one block's at a time. Then per kernel (``_Kernel.backward``):

    - ``sdpa`` on CPU (ATen's flash kernel with an additive mask): the larger of the moment ``_additive`` makes the
      additive mask (the boolean mask, its negation and the additive mask in the compute dtype,
      ``(2 + c_b)·b·L²``) and the kernel's return (the mask, the additive one and dq, dK, dV of every query head,
      ``(1 + c_b)·b·L² + 3·c_b·a'·d·b·L``);
    - explicit matmuls (``eager``: the ``"eager"`` backend, and every backend on CUDA, whose fused kernels take no
      mask): the mask and, at ``dS = P·(dP − D)`` (FlashAttention's backward, Dao et al. 2022, arXiv 2205.14135,
      Algorithm 4), five float32 ``[b, a', L, L]`` tensors (the scores, P, dP, dP − D, dS):
      ``b·L² + 5·4·a'·b·L²``, plus the float32 copies of q, K, V (repeated) and dO for a compute dtype narrower than
      float32, ``4·4·a'·d·b·L``.

    Measured on CPU (``LiveTensorBytes`` over one layer's ring backward, tiny-test ``32-true`` cp2 with 128-token
    documents): b=2 s=1024 5,242,880 B and b=2 s=2048 16,252,928 B, both equal to this formula. The eager form is
    read from the code, not measured. 0 without cp and for the other methods."""
    if pc.cp == 1 or pc.context_parallel_method != "ring":
        return 0
    L, c = seq_length // pc.cp, dt.compute
    a, k, d = cfg.num_heads // pc.tp, cfg.num_kv_heads // pc.tp, cfg.head_dim
    repeated = 2 * c * a if a > k else 0
    ring = b * L * d * (c * a + 4 * a + 4 * c * k + 8 * k + repeated)
    block = b * L * L
    if eager:
        copies = 4 * 4 * a * d * b * L if c != 4 else 0
        return ring + block + 5 * 4 * a * block + copies
    return ring + max((2 + c) * block, (1 + c) * block + 3 * c * a * d * b * L)


def ring_computed_blocks(seq_length: int, cp: int, document_tokens: int) -> tuple[tuple[bool, ...], ...]:
    """Which (query, key) blocks the zigzag ring computes with document masking, ``[rank][step]`` (``True``: computed,
    ``False``: skipped, no document spans it), for windows packed with documents of ``document_tokens`` tokens from
    the window's start (``lightning-4d measure``'s): ``runtime.py``'s ``ring_blocks`` of such document ids, without
    torch. At chunk granularity (``2·cp`` chunks of ``C = s/(2·cp)`` tokens, rank ``r`` holding chunks ``r`` and
    ``2·cp − 1 − r``): step ``t`` gives rank ``r`` the K/V of rank ``q = (r − t) mod cp``; its block is its own
    (``q = r``: always computed, every query attends to itself), both local query chunks against ``q``'s first chunk
    (``q < r``), or its second query chunk against both of ``q``'s chunks (``q > r``). Every key chunk ``j`` of such
    a block is earlier than its query chunks ``i``, and the block is computed iff some document spans a query chunk
    and a key chunk: the document holding chunk ``i``'s first token starts at or before chunk ``j``'s last,
    ``⌊i·C/N⌋·N ≤ (j + 1)·C − 1``."""
    chunk = seq_length // (2 * cp)

    def spans(i: int, j: int) -> bool:
        return (i * chunk) // document_tokens * document_tokens <= (j + 1) * chunk - 1

    def computed(rank: int, source: int) -> bool:
        if source == rank:
            return True
        rows = (rank, 2 * cp - 1 - rank) if source < rank else (2 * cp - 1 - rank,)
        cols = (source,) if source < rank else (source, 2 * cp - 1 - source)
        return any(spans(i, j) for i in rows for j in cols)

    return tuple(tuple(computed(r, (r - t) % cp) for t in range(cp)) for r in range(cp))


def allgather_masked_keys(seq_length: int, cp: int, document_tokens: int) -> tuple[int, ...]:
    """The keys the ``"allgather"`` method's masked kernel calls give a query token of each cp rank, summed over the
    rank's two query chunks, per rank, for windows packed with documents of ``document_tokens`` tokens from the
    window's start (``lightning-4d measure``'s): ``runtime.py``'s ``_allgather_blocks`` without torch. Query chunk
    ``i`` (``C = s/(2·cp)`` tokens) attends to its own chunk, masked (``C`` keys: the whole block, the mask holds
    the causal one), and to the keys from the start of the document holding its first token up to the chunk,
    masked (``i·C − ⌊i·C/N⌋·N`` keys); a masked call computes its whole ``[C, keys]`` block. Rank ``r`` holds
    chunks ``r`` and ``2·cp − 1 − r``: ``Σ_i C + i·C − ⌊i·C/N⌋·N``."""
    chunk, n = seq_length // (2 * cp), document_tokens
    return tuple(sum(chunk + i * chunk - (i * chunk) // n * n for i in (r, 2 * cp - 1 - r)) for r in range(cp))
