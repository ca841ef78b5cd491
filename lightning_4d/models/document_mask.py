"""Document masking: a packed training window holds several documents, and a token attends only to the earlier tokens
of its own document.

A window of ``s`` tokens cut from a stream of documents (each ended by an end-of-document token, EOS) is described by
its **document ids** ``LongTensor [b, s]``: tokens with equal ids belong to one document, and the ids never decrease
along a sequence (documents are contiguous). From them:

- the attention mask (:func:`document_mask`): query ``i`` attends to key ``j`` iff ``j <= i`` (causal) and
  ``doc[j] == doc[i]``, the "attention mask that prevents self-attention between different documents within the same
  sequence" of Llama 3's pretraining (Dubey et al. 2024, arXiv 2407.21783, section 3.2) and Megatron-LM's
  ``reset_attention_mask`` (``megatron/core/datasets/gpt_dataset.py``, ``_get_ltor_masks_and_position_ids``);
- the rotary positions restarting at each document (:func:`document_positions`; Megatron's ``reset_position_ids``);
- the loss of the EOS position, which predicts the next document's first token, masked (Megatron's
  ``eod_mask_loss``; ``lightning_4d.tasks.documents``).

The ids come from the data (a batch's ``"document_ids"``) or from the EOS tokens of ``input_ids``
(:func:`document_ids_from_eos`: the EOS ends its document, the token after it starts the next). Pure torch, no
process group: the strategy shards positions over cp and keeps the ids of the whole sequence on every cp rank
(``lightning_4d.features.context_parallel.runtime.shard_batch``), so each rank can mask any block of keys.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

#: the batch key of the document ids ``LongTensor [b, s]`` (whole sequence, also under cp)
DOCUMENT_IDS = "document_ids"


def document_ids_from_eos(input_ids: Tensor, eos_id: int) -> Tensor:
    """Document ids of a packed window from its end-of-document tokens.

    Args:
        input_ids: ``LongTensor [b, s]``.
        eos_id: the end-of-document token id (the one ``prepare-data`` appends after every document).

    Returns:
        ``LongTensor [b, s]``: 0 up to and including the first EOS, 1 after it up to and including the second, ...
        (the EOS belongs to the document it ends).
    """
    is_eos = (input_ids == eos_id).long()
    return torch.cumsum(is_eos, dim=-1) - is_eos


def check_document_ids(document_ids: Tensor, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``document_ids`` is an integer ``[b, s]`` tensor of ``shape`` whose ids never
    decrease along a sequence (each document one contiguous span)."""
    if document_ids.shape != torch.Size(shape) or document_ids.dtype.is_floating_point:
        raise ValueError(
            f"document_ids of shape {tuple(document_ids.shape)} and dtype {document_ids.dtype}: expected integer ids "
            f"of the batch's input_ids shape {tuple(shape)}."
        )
    if document_ids.shape[-1] > 1 and bool((document_ids[..., 1:] < document_ids[..., :-1]).any()):
        raise ValueError(
            "document_ids decrease along a sequence: expected each document to be one contiguous span, its id not "
            "smaller than the previous document's (e.g. 0 0 0 1 1 2)."
        )


def document_positions(document_ids: Tensor) -> Tensor:
    """Rotary positions restarting at 0 at every document's first token.

    Args:
        document_ids: ``LongTensor [b, s]`` (contiguous documents).

    Returns:
        ``LongTensor [b, s]``: ``i - start(i)``, ``start(i)`` the index of the first token of token ``i``'s document.
    """
    s = document_ids.shape[-1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    start_of = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    return index - start_of


def document_mask(query_positions: Tensor, key_positions: Tensor, query_docs: Tensor, key_docs: Tensor) -> Tensor:
    """The allowed (query, key) pairs of one block of attention: causal and within one document.

    Args:
        query_positions: ``LongTensor [s_q]``, the queries' positions in the whole sequence.
        key_positions: ``LongTensor [s_k]``, the keys' positions.
        query_docs: ``LongTensor [b, s_q]``, the queries' document ids.
        key_docs: ``LongTensor [b, s_k]``, the keys' document ids.

    Returns:
        ``BoolTensor [b, 1, s_q, s_k]`` (broadcast over heads), ``True`` where the query attends to the key.
    """
    causal = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)  # [s_q, s_k]
    same = query_docs.unsqueeze(-1) == key_docs.unsqueeze(-2)  # [b, s_q, s_k]
    return (same & causal).unsqueeze(1)


def window_mask(document_ids: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """The mask of a whole window (no cp): :func:`document_mask` of ``document_ids`` ``[b, s]`` against itself,
    ``BoolTensor [b, 1, s, s]``, or with ``dtype`` the additive form SDPA takes as it is (0 where allowed, ``-inf``
    elsewhere; a boolean mask is converted to it inside every SDPA call, one copy per layer, where the additive one
    is shared by every layer: ``b·s²`` elements of ``dtype`` per forward, which the memory model counts). ``None``
    without document ids (plain causal attention)."""
    if document_ids is None:
        return None
    positions = torch.arange(document_ids.shape[-1], device=document_ids.device)
    allowed = document_mask(positions, positions, document_ids, document_ids)
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attention_context(document_ids: Tensor) -> float:
    """The context a token's attention spans on average with document masking, ``Σ n_d² / (b·s)`` over the documents
    of the ``b`` windows ``[b, s]`` (lengths ``n_d``): what replaces the window length ``s`` in the attention FLOPs
    (``LlamaConfig.flops_per_token``; ``s`` for one document per window)."""
    total = 0
    for row in document_ids:
        counts = torch.unique_consecutive(row, return_counts=True)[1]
        total += int((counts * counts).sum())
    return total / document_ids.numel()
