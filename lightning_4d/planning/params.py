"""The parameters one rank holds: which decoder layers a pp rank's pipeline stages hold (:func:`rank_layout`), and
every parameter tensor of them with its tensor-parallel local shape (:func:`stage_params`: ``wq``/``wk``/``wv``/
``w1``/``w3``/the head split on rows, ``wo``/``w2`` on columns, the embedding by vocabulary rows, RMSNorm weights
replicated; an MoE layer's feed-forward from :func:`lightning_4d.features.moe.costs.layer_params`), as the ranks of
a layout hold them (tied embeddings under pp: :func:`as_held`).

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from lightning_4d.config import ParallelConfig
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.planning.tensors import Param

__all__ = [
    "Sizes",
    "StageKey",
    "as_held",
    "folded_params",
    "rank_layers",
    "rank_layout",
    "stage_params",
    "weighted_params",
]


def rank_layout(num_layers: int, pc: ParallelConfig, pp_rank: int) -> tuple[int, bool, bool]:
    """(decoder layers, holds the embedding, holds the final norm + head) of pp rank ``pp_rank``."""
    stages = pc.rank_stages(num_layers, pp_rank)
    indices = {st for st, _ in stages}
    return sum(len(r) for _, r in stages), 0 in indices, pc.num_stages - 1 in indices or pc.pp == 1


@dataclass(frozen=True)
class Sizes:
    """The model sizes :func:`stage_params` reads, hashable (for the caches of :func:`folded_params` and
    :mod:`lightning_4d.planning.states`); ``moe_shape`` those of its MoE layers (``None``: none)."""

    hidden_size: int
    head_dim: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    moe_shape: Optional[moe_costs.MoeShape] = None

    @staticmethod
    def of(cfg: Any, num_layers: int, moe_layers: Optional[tuple[int, ...]] = None) -> "Sizes":
        """The sizes of ``cfg``; ``moe_layers``: its MoE layers among ``range(num_layers)`` (default: found), or
        those of the layers the caller will ask about."""
        return Sizes(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.padded_vocab_size,
            bool(cfg.tie_word_embeddings),
            moe_costs.moe_shape(cfg, num_layers, moe_layers),
        )


class StageKey(NamedTuple):
    """Which parameters a pp rank holds, hashable (a cache key of :mod:`lightning_4d.planning.states`): tp, its decoder
    layers, whether it holds the embedding (``first``) and the final norm and head (``last``), ep."""

    tp: int
    layers: tuple[int, ...]
    first: bool
    last: bool
    ep: int = 1


def stage_params(sizes: Sizes, tp: int, layers: Any, first: bool, last: bool, ep: int = 1) -> list[Param]:
    """The parameters of layers ``layers`` (+ embedding / final norm and head), in the model's order (the order
    ``model.parameters()`` yields them: ZeRO 1's buckets follow it); an MoE layer's feed-forward:
    :func:`lightning_4d.features.moe.costs.layer_params` (split over ``ep``)."""
    h, d, f = sizes.hidden_size, sizes.head_dim, sizes.intermediate_size
    a, k, vocab = sizes.num_heads, sizes.num_kv_heads, sizes.padded_vocab_size
    out: list[Param] = []
    if first:
        out.append(Param(vocab // tp, h, True, "root", role="embedding"))
    for i in layers:
        u = f"layers.{i}"
        out += [
            Param(h, 1, False, u),  # attention norm
            Param(a * d // tp, h, True, u),  # wq
            Param(k * d // tp, h, True, u),  # wk
            Param(k * d // tp, h, True, u),  # wv
            Param(h, a * d // tp, True, u),  # wo
            Param(h, 1, False, u),  # ffn norm
        ]
        if sizes.moe_shape is not None and i in sizes.moe_shape.layers:
            out += moe_costs.layer_params(sizes.moe_shape, u, h, ep)
        else:
            out += [Param(f // tp, h, True, u), Param(f // tp, h, True, u), Param(h, f // tp, True, u)]  # w1 w3 w2
    if last:
        out.append(Param(h, 1, False, "root"))  # final norm
        if not (sizes.tie_word_embeddings and first):  # tied at pp = 1: one tensor (pp > 1: as_held)
            out.append(Param(vocab // tp, h, True, "root", role="head"))
    return out


class UntiedView:
    """A model config read as untied (``tie_word_embeddings`` false), every other attribute the config's own."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg
        self.tie_word_embeddings = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def as_held(cfg: Any, pc: ParallelConfig) -> Any:
    """``cfg`` as the ranks of layout ``pc`` hold its tensors. Tied embeddings under pp > 1 are two tensors, the
    first stage's embedding and the last stage's copy as the LM head (``features/pipeline/runtime.py``'s
    ``TiedEmbedding``), parameters, gradients and optimizer states alike, as in an untied model: a rank holding only one
    of the two stages holds one tensor either way; a V schedule's rank 0, which holds both stages, keeps the one tied
    weight at ZeRO 0/1 and two copies at ZeRO 2/3 (each stage chunk its own FSDP2 root), read here as untied. ``cfg``
    itself otherwise."""
    if pc.pp > 1 and pc.zero_stage >= 2 and getattr(cfg, "tie_word_embeddings", False):
        return UntiedView(cfg)
    return cfg


def rank_layers(num_layers: int, pc: ParallelConfig, pp_rank: int) -> list[int]:
    """The indices of the decoder layers pp rank ``pp_rank`` holds, in order."""
    return sorted(i for _, r in pc.rank_stages(num_layers, pp_rank) for i in r)


def weighted_params(
    cfg: Any, tp: int, layers: list[int], first: bool, last: bool, ep: int = 1
) -> tuple[tuple[Param, int], ...]:
    """:func:`stage_params` of ``layers`` with the identical layers folded into one representative layer and a
    count: one dense layer and, in an MoE config, one MoE layer (cached: the planner asks for the same stages
    thousands of times)."""
    dense, moe_layers = moe_costs.split_layers(cfg, layers)
    reps = tuple((group[0], len(group)) for group in (dense, moe_layers) if group)
    sizes = Sizes.of(cfg, 0, moe_layers=tuple(moe_layers[:1]))
    return folded_params(sizes, tp, reps, first, last, ep)


@functools.lru_cache(maxsize=8192)
def folded_params(
    sizes: Sizes, tp: int, reps: tuple[tuple[int, int], ...], first: bool, last: bool, ep: int
) -> tuple[tuple[Param, int], ...]:
    """:func:`weighted_params` on hashable values: ``reps`` = ``((representative layer, layers like it), ...)``."""
    counts = dict(reps)
    return tuple(
        (p, counts[int(p.unit.split(".")[1])] if p.unit != "root" else 1)
        for p in stage_params(sizes, tp, sorted(counts), first, last, ep)
    )
