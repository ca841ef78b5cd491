"""Hugging Face transformers' ``LlamaForCausalLM`` in 4D: everything the strategy needs to split one, in one file.

A LightningModule that holds a ``transformers`` ``LlamaForCausalLM`` (built in ``__init__``, loaded with
``from_pretrained``, or built with ``from_config`` on the meta device in ``configure_model``) gets, from the same
``FourDStrategy`` arguments as our own Llama:

- **dp + ZeRO 0-3**: ZeRO 0/1 through the strategy's gradient buckets and sharded optimizer; ZeRO 2/3 as FSDP2 units,
  one per ``LlamaDecoderLayer`` then the model (:func:`lightning_4d.parallel.zero.apply_fsdp`).
- **tp + sp** (Megatron-LM's split, Korthikanti et al. 2022, arXiv 2205.05198): transformers' own
  ``config.base_model_tp_plan`` decides which projections are column- and which row-parallel ("colwise" q/k/v,
  gate/up; "rowwise" o/down), applied with ``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` /
  ``RowwiseParallel``; under sp the embedding output, the RMSNorms and the residual stream are sharded over the
  sequence (``SequenceParallel``; ``PrepareModuleInput`` all-gathers before attention and the MLP, the row-parallel
  outputs are reduce-scattered). The LM head is column-parallel with its logits gathered (``[b, s, V]`` on every tp
  rank, so the module's own loss works unchanged). Attention heads split with the projections: transformers'
  attention reshapes with ``-1`` heads, so it runs on the local heads as is.
- **cp** (ring or all-gather, :mod:`lightning_4d.parallel.context`): an attention function registered in transformers'
  ``AttentionInterface`` under :data:`ATTENTION` (the model's ``_attn_implementation`` is set to it) runs
  :func:`~lightning_4d.parallel.context.context_parallel_attention` on the rank's zigzag shard; a forward pre-hook on
  the base ``LlamaModel`` feeds the model's own rotary embedding the shard's global positions
  (:func:`~lightning_4d.models.rope.context_parallel_positions`) and, under sp, the full-length positions.
  With tp or cp, the attention is always causal over the whole sequence: a padding ``attention_mask`` is refused.
- **pp** (every schedule of :mod:`lightning_4d.parallel.pipeline`, the same layer split as our Llama): the model is
  pruned to this rank's stages (other ranks' decoder layers become parameter-free placeholders, so parameter names
  stay the unsplit model's) and each stage runs as a :class:`StageChunk`. As for our Llama, the schedule runs inside
  ``training_step``: call ``self.trainer.strategy.pipeline.train_step(input_ids, labels)`` there (the mean loss of
  the batch; forward and backward of all micro-batches) when ``strategy.pipeline`` is set; the loss per micro-batch
  is the module's ``pipeline_loss(logits, labels)`` if it has one, else the mean cross-entropy.

The strategy calls :func:`parallelize_hf_llama` in ``setup`` (after ``configure_model``, before materialization).
Weights: ``init_from`` on the LightningModule (a Hugging Face directory) loads each rank's slices after
parallelization (:func:`lightning_4d.checkpoint.load_initial_weights`): the memory path for big models.
transformers is not imported here: the model is recognized by duck typing (``config.model_type == "llama"``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

#: the name of our attention function in transformers' ``AttentionInterface``
ATTENTION = "lightning_4d"
_TP_STYLES = ("colwise", "rowwise")


def _is(module: nn.Module, class_name: str) -> bool:
    """Whether ``module``'s class or a base is named ``class_name`` (FSDP2 subclasses the classes it shards)."""
    return any(c.__name__ == class_name for c in type(module).__mro__)


def is_hf_llama(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``LlamaForCausalLM`` (class name and ``config.model_type == "llama"``)."""
    config = getattr(module, "config", None)
    return _is(module, "LlamaForCausalLM") and getattr(config, "model_type", None) == "llama" \
        and isinstance(getattr(module, "model", None), nn.Module)


def find_hf_llamas(module: nn.Module) -> list[nn.Module]:
    """The transformers ``LlamaForCausalLM`` models inside ``module`` (itself included)."""
    return [m for m in module.modules() if is_hf_llama(m)]


def our_config(model: nn.Module) -> Any:
    """The ``lightning_4d`` :class:`~lightning_4d.models.LlamaConfig` of the same shape (for layout validation and the
    memory estimate). Raises ``ValueError`` for a Llama variant ours does not model (names the field)."""
    from lightning_4d.models.config import LlamaConfig

    return LlamaConfig.from_hf_dict(model.config.to_dict(), source=f"{type(model).__name__}.config")


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
              scaling: Optional[float] = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[b, heads, s_local, d]``, ``key`` / ``value``
    ``[b, kv_heads, s_local, d]`` (local heads under tp) -> ``([b, s_local, heads, d], None)``. Causal over the full
    sequence: under cp (``module._lightning_4d_cp = (group, method)``) through
    :func:`~lightning_4d.parallel.context.context_parallel_attention`, else ``F.scaled_dot_product_attention``
    (``is_causal``, grouped-query). The scale is ``1/sqrt(d)`` (Llama's ``scaling``).

    Raises:
        ValueError: a dropout probability > 0 or a scale other than ``1/sqrt(d)`` (not modelled).
    """
    d = query.shape[-1]
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under tp / cp (Llama trains without)")
    if scaling is not None and abs(scaling - d ** -0.5) > 1e-12 * d:
        raise ValueError(f"attention scaling={scaling} is not supported: expected 1/sqrt(head_dim) = {d ** -0.5}")
    cp = getattr(module, "_lightning_4d_cp", None)
    if cp is not None:
        from lightning_4d.parallel.context import context_parallel_attention

        group, method = cp
        out = context_parallel_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group,
                                         method, "sdpa")
        return out.contiguous(), None
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


class _Positions:
    """Forward pre-hook of the base ``LlamaModel``: passes ``position_ids`` of the full sequence (sp) or of the cp
    shard (zigzag) when the caller gave none, and refuses padding masks (the attention is causal over all tokens)."""

    def __init__(self, cp_rank: int, cp_size: int) -> None:
        self.cp_rank, self.cp_size = cp_rank, cp_size

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from lightning_4d.models.rope import context_parallel_positions

        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ValueError("a padding attention_mask is not supported with tensor or context parallelism: the "
                             "attention is causal over every token (pack sequences instead, or pass no mask)")
        if kwargs.get("position_ids") is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs["inputs_embeds"]
            local = ids.shape[1]
            positions = context_parallel_positions(local, self.cp_rank, self.cp_size, device=ids.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs


def _tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a ``LlamaForCausalLM`` (module docstring): transformers'
    ``base_model_tp_plan`` for the projections, plus the embedding, norms, LM head and, under sp, the inputs of
    attention and MLP; only for the modules this rank holds (a pipeline stage's layers, embedding, head)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    tp_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not tp_plan:
        raise ValueError(f"{type(model).__name__}.config has no base_model_tp_plan: transformers >= 4.45 is needed")
    residual = Shard(1) if sequence_parallel else Replicate()
    layer_plan: dict[str, Any] = {}
    for pattern, style in tp_plan.items():
        if style not in _TP_STYLES:
            raise ValueError(f"base_model_tp_plan[{pattern!r}] = {style!r} is not supported: expected {_TP_STYLES}")
        if not pattern.startswith("layers.*."):
            raise ValueError(f"base_model_tp_plan[{pattern!r}]: expected per-layer entries 'layers.*.<module>'")
        layer_plan[pattern[len("layers.*."):]] = (
            ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=residual))
    if sequence_parallel:
        layer_plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    plan: dict[str, Any] = {}
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer, _Pruned):
            plan.update({f"model.layers.{i}.{name}": style for name, style in layer_plan.items()})
    if model.model.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    if model.model.norm is not None and sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    return plan


class _Pruned(nn.Module):
    """The place of a decoder layer another pipeline rank holds (no parameters; keeps the others' indices)."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class StageChunk(nn.Module):
    """One pipeline stage of a ``LlamaForCausalLM``: its embedding (first stage), decoder layers, final norm and LM
    head (last stage), shared with the model (not copied). ``forward(x)``: token ids ``[b, s]`` on the first stage,
    else the previous stage's hidden states ``[b, s / sequence_shards, h]``; returns hidden states, or logits
    ``[b, s, V]`` on the last stage. The model's own rotary embedding gets the positions of the stage's ``s`` tokens
    (the cp shard's zigzag positions): ``torch.distributed.pipelining`` passes activations only."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool, sequence_shards: int,
                 cp: tuple[int, int]) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = model.model.rotary_emb
        self.sequence_shards, self.cp = sequence_shards, cp

    def forward(self, x: Tensor) -> Tensor:
        from lightning_4d.models.rope import context_parallel_positions

        if self.embed_tokens is not None:
            s, h = x.shape[1], self.embed_tokens(x)
        else:
            s, h = x.shape[1] * self.sequence_shards, x
        positions = context_parallel_positions(s, self.cp[0], self.cp[1], device=x.device).unsqueeze(0)
        rotary = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


def _split(model: nn.Module, config: Any, pp_rank: int, cp: tuple[int, int]) -> list[tuple[int, StageChunk]]:
    """Prune ``model`` to pp rank ``pp_rank``'s stages (:meth:`ParallelConfig.rank_stages`; the same layer split as
    our own Llama) and return ``[(stage index, chunk), ...]``."""
    layers = model.model.layers
    mine = config.rank_stages(len(layers), pp_rank)
    keep = {i for _, ls in mine for i in ls}
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = _Pruned()
    last_stage = config.num_stages - 1
    shards = config.tp if config.sp else 1
    chunks = [(s, StageChunk(model, list(ls), s == 0, s == last_stage, shards, cp)) for s, ls in mine]
    if not any(s == 0 for s, _ in mine):
        model.model.embed_tokens = None
    if not any(s == last_stage for s, _ in mine):
        model.model.norm = None
        model.lm_head = None
    return chunks


def pipeline_chunks(model: nn.Module) -> Optional[list[tuple[int, StageChunk]]]:
    """The stage chunks :func:`parallelize_hf_llama` made for this pp rank, else ``None`` (pp = 1)."""
    return getattr(model, "_lightning_4d_pipeline_chunks", None)


def validate(model: nn.Module, config: Any) -> None:
    """Check ``config`` (``ParallelConfig``) against the shape of the transformers Llama ``model``: heads, kv heads
    and vocabulary divisible by tp, layers into pp·v stages, no tied embeddings with pp
    (``ParallelConfig.validate_model``); tied embeddings are refused with tp too, attention dropout with any split.

    Raises:
        ValueError: naming the value and what would be valid.
    """
    ours = our_config(model)
    config.validate_model(ours)
    dropout = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
    if dropout and max(config.tp, config.cp, config.pp) > 1:
        raise ValueError(f"attention_dropout={dropout} is not supported with tp, cp or pp > 1 (the split attention "
                         "has no dropout; Llama trains without): set the model config's attention_dropout=0.0")
    if config.tp > 1 and ours.tie_word_embeddings:
        raise ValueError(f"tensor_parallel_size={config.tp}: a transformers Llama with tie_word_embeddings=True "
                         "(Llama 3.2 1B/3B) cannot be tensor-parallel yet; use tp=1 (dp, ZeRO, cp) or an untied model")


@torch.no_grad()
def reset_rotary(model: nn.Module, device: torch.device) -> None:
    """Recompute the rotary embedding's ``inv_freq`` buffers of a ``LlamaForCausalLM`` built on the meta device
    (non-persistent buffers: materialization leaves them empty and no checkpoint holds them), with transformers' own
    rope-initialization function for the config's rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if _is(m, "LlamaRotaryEmbedding"):
            kind = getattr(m, "rope_type", "default")
            fn = m.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
            with torch.device("cpu"):
                inv_freq, scaling = fn(m.config)
            m.inv_freq = inv_freq.to(device)
            m.original_inv_freq = inv_freq.clone().to(device)
            m.attention_scaling = scaling


def parallelize_hf_llama(model: nn.Module, mesh: Any, config: Any) -> None:
    """Split a transformers ``LlamaForCausalLM`` in place for ``config`` (``ParallelConfig``) on ``mesh``
    (``ParallelMesh``): pipeline split, tp + sp plan, cp attention and positions, then FSDP2 units at ZeRO 2/3 (per
    stage chunk under pp) (module docstring). :func:`pipeline_chunks` returns the stage chunks afterwards.
    The parameters may be real (every rank holds the same full weights: each keeps its shards) or on the meta
    device (materialized by the strategy afterwards; give ``init_from``).

    Raises:
        ValueError: see :func:`validate`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_4d.parallel.pipeline import reshard_after_forward
    from lightning_4d.parallel.zero import apply_fsdp, fsdp_reduce_dtype

    validate(model, config)
    cp_rank = mesh.cp.get_local_rank() if config.cp > 1 else 0
    chunks = _split(model, config, mesh.pp.get_local_rank(), (cp_rank, config.cp)) if config.pp > 1 else None
    split = config.tp > 1 or config.cp > 1 or config.pp > 1
    if split:
        _register_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTENTION)
        else:  # transformers 4.x
            model.config._attn_implementation = ATTENTION
        model.model.register_forward_pre_hook(_Positions(cp_rank, config.cp), with_kwargs=True)
    if config.tp > 1:
        parallelize_module(model, mesh.tp, _tp_plan(model, config.sp))
    if config.cp > 1:
        group = mesh.cp.get_group()
        for m in model.modules():
            if _is(m, "LlamaAttention"):
                m._lightning_4d_cp = (group, config.context_parallel_method)
    if config.zero_stage >= 2 and chunks is not None:  # each chunk is a root: the schedule calls the chunks
        for _, chunk in chunks:
            apply_fsdp(chunk, mesh.dp_cp, config.zero_stage, blocks=list(chunk.layers.values()),
                       reshard_after_forward=reshard_after_forward(config),
                       reduce_dtype=fsdp_reduce_dtype(config.gradient_compression))
    elif config.zero_stage >= 2:
        apply_fsdp(model, mesh.dp_cp, config.zero_stage, blocks=list(model.model.layers),
                   reduce_dtype=fsdp_reduce_dtype(config.gradient_compression))
    model._lightning_4d_pipeline_chunks = chunks
    model._lightning_4d_parallelized = True
