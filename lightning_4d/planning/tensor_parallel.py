"""Tensor parallelism's own transients in the memory model (``lightning_4d/parallel/tensor.py``): the LM head's
backward under sequence parallelism, with and without ``tensor_parallel_overlap`` (:func:`head_backward_transient`),
and the vocabulary-parallel embedding's whole-vocabulary gradient (:func:`embedding_gradient_bytes`). The
tp-local shapes of the parameters: :mod:`lightning_4d.planning.params`; what the layers save under tp and sp:
:mod:`lightning_4d.planning.activations`.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.planning.tensors import Dtypes

__all__ = ["embedding_gradient_bytes", "head_backward_transient"]


def embedding_gradient_bytes(cfg: Any, pc: ParallelConfig, dt: Dtypes, first: bool) -> int:
    """Bytes of the embedding's backward under tp on the rank holding the embedding (``first``), 0 elsewhere: torch's
    vocabulary-parallel embedding backward (DTensor's ``RowwiseParallel`` on ``nn.Embedding``) runs
    ``embedding_dense_backward`` with the whole vocabulary (``num_weights = V``; measured: tiny-test tp2 gave a
    ``[256, 64]`` gradient for its ``[128, 64]`` shard) and reduces the ``[V, h]`` partial sum to the rank's rows:
    ``V·h`` in the compute dtype at the end of backward."""
    return dt.compute * cfg.padded_vocab_size * cfg.hidden_size if pc.tp > 1 and first else 0


def head_backward_transient(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int) -> int:
    """Bytes the LM head's backward holds beyond its saved input and its weight gradient, under tp with sequence
    parallelism (``parallel/tensor.py``: ``_sequence_parallel_head``), with ``U = c·b·(s/cp)·h`` the gathered
    ``[b, s, h]`` input in the compute dtype:

    - without overlap (:class:`_SequenceParallelProjection`): the input all-gathered again (U), its gradient
      ``g @ W`` and the sum that holds it (U each, one freed), then the reduce-scatter: for b > 1 the rank-ordered
      copy of the gradient (U) and its ``[b, s/t, h]`` output (U/t): ``3·U (+ U/t for b > 1)``;
    - with ``tensor_parallel_overlap`` (:class:`_RingAllGatherMatmul`), at the last ring step: the shard at hand,
      the partial sum sent and the one received, this step's product (U/t each) and, for b > 1, the copy of the
      logits' gradient rows the product reads (``c·b·(s/(cp·t))·V/t``): ``4·U/t (+ rows)``.

    Measured on CPU (``lightning-4d measure``, tiny-test tp2 b=4 s=512 32-true): the peak of the step is in this
    backward and the model's figure is within 216 bytes of it, with and without overlap (``tests/test_measure.py``).
    0 without tp or without sp."""
    t = pc.tp
    if t == 1 or not pc.sp:
        return 0
    tokens = b * (s // pc.cp)
    full = dt.compute * tokens * cfg.hidden_size
    if pc.tensor_parallel_overlap:
        rows = dt.compute * tokens // t * (cfg.padded_vocab_size // t) if b > 1 else 0
        return 4 * full // t + rows
    return 3 * full + (full // t if b > 1 else 0)
