"""Document masking for :class:`~lightning_4d.tasks.CausalLMModule`: the settings, the batch it prepares (document
ids, per-document positions, the labels that cross documents masked) and the loss scale that makes the loss the
mean over the trained tokens of the whole global batch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.models.attention_backends import MASK_BACKEND_ERROR
from lightning_4d.models.document_mask import (
    DOCUMENT_IDS,
    check_document_ids,
    document_ids_from_eos,
    document_positions,
)


@dataclass(frozen=True)
class DocumentMasking:
    """What ``CausalLMModule(document_masking=True)`` does to every batch (its Args give the meaning of each).

    Attributes:
        eos_token_id: the end-of-document token, or ``None`` until the DataModule's tokenizer gives it
            (:meth:`with_eos`); without one, batches must carry ``"document_ids"``.
        reset_position_ids: positions restart at each document.
        eod_mask_loss: the labels that cross into the next document are not trained.
    """

    eos_token_id: Optional[int]
    reset_position_ids: bool
    eod_mask_loss: bool

    @classmethod
    def of(
        cls,
        enabled: bool,
        eos_token_id: Optional[int],
        reset_position_ids: Optional[bool],
        eod_mask_loss: Optional[bool],
        attention_backend: str,
    ) -> Optional["DocumentMasking"]:
        """The settings of ``CausalLMModule``'s arguments, or ``None`` when masking is off.

        Raises:
            ValueError: ``reset_position_ids``, ``eod_mask_loss`` or ``eos_token_id`` set without ``enabled``; a
                negative or non-integer ``eos_token_id``; masking with ``attention_backend='flash'``.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"document_masking={enabled!r} is not valid: expected True or False.")
        if not enabled:
            for name, value in (
                ("reset_position_ids", reset_position_ids),
                ("eod_mask_loss", eod_mask_loss),
                ("eos_token_id", eos_token_id),
            ):
                if value is not None:
                    raise ValueError(f"{name}={value!r} applies to document masking only: set document_masking=True.")
            return None
        if attention_backend == "flash":
            raise ValueError(MASK_BACKEND_ERROR)
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)):
            raise ValueError(f"eos_token_id={eos_token_id!r} is not valid: expected a token id (an int >= 0).")
        if eos_token_id is not None and eos_token_id < 0:
            raise ValueError(f"eos_token_id={eos_token_id!r} is not valid: expected a token id (an int >= 0).")
        return cls(
            eos_token_id,
            True if reset_position_ids is None else bool(reset_position_ids),
            True if eod_mask_loss is None else bool(eod_mask_loss),
        )

    def with_eos(self, tokenizer: Any) -> "DocumentMasking":
        """These settings with the EOS of ``tokenizer`` (its ``eos_id``, as ``lightning_4d.data.tokenizers`` define
        it) when none was given."""
        if self.eos_token_id is not None or tokenizer is None:
            return self
        # a user's DataModule may hold any tokenizer object: ours have eos_id (None when they define no EOS)
        eos = getattr(tokenizer, "eos_id", None)
        return replace(self, eos_token_id=int(eos)) if isinstance(eos, int) else self

    def prepare(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` with ``"document_ids"`` (kept, checked, or from the EOS tokens), ``"positions"`` ``[b, s]``
        (unless the batch has them: restarting at each document with ``reset_position_ids``, else the window's
        ``0 .. s-1``) and ``"labels"`` at ``-100`` where
        the next token belongs to another document (``eod_mask_loss``: at each EOS, and at the last token of each
        document the ids end).

        Raises:
            ValueError: no ``"document_ids"`` and no EOS token known; ids of another shape than ``input_ids`` or
                decreasing along a sequence.
        """
        input_ids = batch["input_ids"]
        ids = batch.get(DOCUMENT_IDS)
        if ids is None:
            if self.eos_token_id is None:
                raise ValueError(
                    "document_masking=True needs the documents' boundaries: the batch has no 'document_ids' and no "
                    "end-of-document token is known (the DataModule's tokenizer has no eos_id): pass "
                    "eos_token_id=ID (--model.eos_token_id=ID) or batches with 'document_ids'."
                )
            ids = document_ids_from_eos(input_ids, self.eos_token_id)
        else:
            check_document_ids(ids, tuple(input_ids.shape))
        out = dict(batch)
        out[DOCUMENT_IDS] = ids
        if "positions" not in batch:  # per micro-batch under pp, sharded with the tokens under cp
            out["positions"] = document_positions(ids) if self.reset_position_ids else _window_positions(ids)
        if self.eod_mask_loss and "labels" in batch:
            crossing = torch.zeros_like(ids, dtype=torch.bool)
            crossing[..., :-1] = ids[..., 1:] != ids[..., :-1]
            if self.eos_token_id is not None:
                crossing |= input_ids == self.eos_token_id
            out["labels"] = batch["labels"].masked_fill(crossing, -100)
        return out


def _window_positions(ids: Tensor) -> Tensor:
    """``0 .. s-1`` for every sequence of ``ids`` ``[b, s]``."""
    return torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).contiguous()


def token_weight(labels: Tensor, group: Optional[Any]) -> Tensor:
    """The weight of one trained token in a rank's loss so that the average over the ranks of ``group`` (the dp x
    cp group, which the gradient all-reduce takes; ``None``: the whole world, or one process) of ``weight · Σ`` (the
    rank's summed token losses) is the mean over the trained tokens of every rank: ``size / n_total``, with ``n`` the
    labels other than -100 summed over the group. A float32 scalar.
    """
    count = (labels != -100).sum().to(torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
        return dist.get_world_size(group) / count.clamp_min(1.0)
    return 1.0 / count.clamp_min(1.0)
