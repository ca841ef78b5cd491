"""Hugging Face transformers' ``LlamaForCausalLM`` in 4D: everything the strategy needs to split one, in one file.

A LightningModule that holds a ``transformers`` ``LlamaForCausalLM`` (built in ``__init__``, loaded with
``from_pretrained``, or built with ``from_config`` on the meta device in ``configure_model``) gets, from the same
``FourDStrategy`` arguments as our own Llama:

- **dp + ZeRO 0-3**: ZeRO 0/1 through the strategy's gradient buckets and sharded optimizer; ZeRO 2/3 as FSDP2 units,
  one per ``LlamaDecoderLayer`` then the model (:func:`lightning_4d.parallel.fsdp.apply_fsdp`).
- **tp + sp** (Megatron-LM's split, Korthikanti et al. 2022, arXiv 2205.05198): transformers' own
  ``config.base_model_tp_plan`` decides which projections are column- and which row-parallel ("colwise" q/k/v,
  gate/up; "rowwise" o/down), applied with ``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` /
  ``RowwiseParallel``; under sp the embedding output, the RMSNorms and the residual stream are sharded over the
  sequence (``SequenceParallel``; ``PrepareModuleInput`` all-gathers before attention and the MLP, the row-parallel
  outputs are reduce-scattered). The LM head is column-parallel with its logits gathered (``[b, s, V]`` on every tp
  rank, so the module's own loss works unchanged). Attention heads split with the projections: transformers'
  attention reshapes with ``-1`` heads, so it runs on the local heads as is.
- **cp** (ring or all-gather, :mod:`lightning_4d.features.context_parallel.runtime`): an attention function registered
  in transformers' ``AttentionInterface`` under :data:`ATTENTION` (the model's ``_attn_implementation`` is set to it)
  runs :func:`~lightning_4d.features.context_parallel.runtime.context_parallel_attention` on the rank's zigzag shard; a
  forward pre-hook on the base ``LlamaModel`` feeds the model's own rotary embedding the shard's global positions
  (:func:`~lightning_4d.models.rope.context_parallel_positions`) and, under sp, the full-length positions. With tp or
  cp, the attention is always causal over the whole sequence: a padding ``attention_mask`` is refused.
- **pp** (every schedule of :mod:`lightning_4d.features.pipeline.runtime`, the same layer split as our Llama): the model
  is pruned to this rank's stages (other ranks' decoder layers become parameter-free placeholders, so parameter names
  stay the unsplit model's) and each stage runs as a :class:`~lightning_4d.features.pipeline.runtime.StageChunk`. As for
  our Llama, the schedule runs inside ``training_step``: call ``self.trainer.strategy.pipeline.train_step(input_ids,
  labels)`` there (the mean loss of the batch; forward and backward of all micro-batches) when ``strategy.pipeline`` is
  set; the loss per micro-batch is the module's ``pipeline_loss(logits, labels)`` if it has one, else the mean
  cross-entropy.

The strategy's one parallelization path (:func:`lightning_4d.parallel.parallelize.parallelize_model`) applies
this family's answers (:class:`HFLlamaFamily`) in ``setup``, after ``configure_model``, before materialization.
Weights: ``init_from`` on the LightningModule (a Hugging Face directory) loads each rank's slices after
parallelization (:func:`lightning_4d.families.registry.load_initial_weights`): the memory path for big models.
transformers is imported only inside the functions that call it: the model is recognized by duck typing.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_4d.families.base import ModelFamily, PipelineLayout
from lightning_4d.families.hf_io import hf_load, hf_reader
from lightning_4d.features.context_parallel.runtime import context_parallel_attention
from lightning_4d.features.tensor_parallel.runtime import TensorParallelPlan, refuse_rings
from lightning_4d.models.attention_backends import sdpa_causal
from lightning_4d.models.rope import context_parallel_positions
from lightning_4d.parallel._compat.hf import set_attention_implementation
from lightning_4d.parallel._compat.lightning import materialize_distributed_module

#: the name of our attention function in transformers' ``AttentionInterface``
ATTENTION = "lightning_4d"
_TP_STYLES = ("colwise", "rowwise")
#: the attention modules ``apply_context_parallel`` put under cp -> ``(cp process group, cp method)``, read by
#: :func:`attention` (a registry, so that nothing is written onto transformers' modules; weak, so that it keeps no
#: model alive)
_CONTEXT_PARALLEL: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, str]]" = weakref.WeakKeyDictionary()


def has_class_name(module: nn.Module, class_name: str) -> bool:
    """Whether ``module``'s class or a base is named ``class_name`` (FSDP2 subclasses the classes it shards)."""
    return any(c.__name__ == class_name for c in type(module).__mro__)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[b, heads, s_local, d]``, ``key`` / ``value``
    ``[b, kv_heads, s_local, d]`` (local heads under tp) -> ``([b, s_local, heads, d], None)``. Causal over the full
    sequence: under cp (``module`` in ``_CONTEXT_PARALLEL``, set by ``apply_context_parallel``) through
    :func:`~lightning_4d.features.context_parallel.runtime.context_parallel_attention`, else
    :func:`~lightning_4d.models.attention_backends.sdpa_causal` (our Llama's SDPA call: grouped-query by ``enable_gqa``,
    or with the kv heads repeated in float32 on CUDA, where ``enable_gqa`` takes the math kernel). The scale is
    ``1/sqrt(d)`` (Llama's ``scaling``).

    Raises:
        ValueError: a dropout probability > 0 or a scale other than ``1/sqrt(d)`` (not modelled).
    """
    d = query.shape[-1]
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under tp / cp (Llama trains without)")
    if scaling is not None and abs(scaling - d**-0.5) > 1e-12 * d:
        raise ValueError(f"attention scaling={scaling} is not supported: expected 1/sqrt(head_dim) = {d**-0.5}")
    cp = _CONTEXT_PARALLEL.get(module)
    if cp is not None:
        group, method = cp
        out = context_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group, method, "sdpa"
        )
        return out.contiguous(), None
    out = sdpa_causal(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class _Positions:
    """Forward pre-hook of the base ``LlamaModel``: passes ``position_ids`` of the full sequence (sp) or of the cp
    shard (zigzag) when the caller gave none, and refuses padding masks (the attention is causal over all tokens)."""

    def __init__(self, cp_rank: int, cp_size: int) -> None:
        self.cp_rank, self.cp_size = cp_rank, cp_size

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ValueError(
                "a padding attention_mask is not supported with tensor or context parallelism: the "
                "attention is causal over every token (pack sequences instead, or pass no mask)"
            )
        if kwargs.get("position_ids") is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs["inputs_embeds"]
            local = ids.shape[1]
            positions = context_parallel_positions(local, self.cp_rank, self.cp_size, device=ids.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs


@torch.no_grad()
def reset_rotary(model: nn.Module, device: torch.device) -> None:
    """Recompute the rotary embedding's ``inv_freq`` buffers of a ``LlamaForCausalLM`` built on the meta device
    (non-persistent buffers: materialization leaves them empty and no checkpoint holds them), with transformers' own
    rope-initialization function for the config's rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if has_class_name(m, "LlamaRotaryEmbedding"):
            fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
            with torch.device("cpu"):
                inv_freq, scaling = fn(m.config)
            m.inv_freq = inv_freq.to(device)
            m.original_inv_freq = inv_freq.clone().to(device)
            m.attention_scaling = scaling


class HFLlamaFamily(ModelFamily):
    """transformers' ``LlamaForCausalLM`` (module docstring), recognized without importing transformers: its class
    (or a base) is named ``LlamaForCausalLM``, ``config.model_type == "llama"`` and its ``model`` is a module."""

    name = "transformers LlamaForCausalLM"
    compile = True  # each LlamaDecoderLayer compiled (Mixtral's too: its MoE loop graph-breaks)

    def is_model(self, module: nn.Module) -> bool:
        return (
            has_class_name(module, "LlamaForCausalLM")
            and module.config.model_type == "llama"
            and isinstance(module.model, nn.Module)
        )

    def model_config(self, model: nn.Module) -> Any:
        """Our ``LlamaConfig`` of the same shape; ``ValueError`` for a Llama variant ours does not model."""
        from lightning_4d.models.llama_config import LlamaConfig

        return LlamaConfig.from_hf_dict(model.config.to_dict(), source=f"{type(model).__name__}.config")

    def validate(self, model: nn.Module, config: Any) -> None:
        """Heads, kv heads and vocabulary divisible by tp, layers into pp·v stages (``ParallelConfig.validate_model``);
        tied embeddings are refused with pp and tp, attention dropout with any
        split, activation checkpointing and the tp ring overlap always (not applied to transformers' layers
        yet).

        Raises:
            ValueError: naming the value and what would be valid.
        """
        ours = self.model_config(model)
        config.validate_model(ours)
        dropout = float(model.config.attention_dropout or 0.0)
        if dropout and max(config.tp, config.cp, config.pp) > 1:
            raise ValueError(
                f"attention_dropout={dropout} is not supported with tp, cp or pp > 1 (the split attention "
                "has no dropout; Llama trains without): set the model config's attention_dropout=0.0"
            )
        if config.pp > 1 and ours.tie_word_embeddings:
            raise ValueError(
                f"pipeline_parallel_size={config.pp}: a transformers Llama with tie_word_embeddings=True "
                "(Llama 3.2 1B/3B) cannot be pipelined yet (our own Llama can: lightning_4d.models.LlamaModel); "
                "use pp=1 or an untied model"
            )
        if config.tp > 1 and ours.tie_word_embeddings:
            raise ValueError(
                f"tensor_parallel_size={config.tp}: a transformers Llama with tie_word_embeddings=True "
                "(Llama 3.2 1B/3B) cannot be tensor-parallel yet; "
                "use tp=1 (dp, ZeRO, cp) or an untied model"
            )
        refuse_rings(config, "a transformers LlamaForCausalLM")
        if config.activation_checkpointing != "none":
            raise ValueError(
                f"activation_checkpointing={config.activation_checkpointing!r} is not supported for a "
                "transformers LlamaForCausalLM yet: use activation_checkpointing='none' (or call the "
                "model's gradient_checkpointing_enable() yourself)"
            )

    def pipeline_layout(self, model: nn.Module) -> PipelineLayout:
        return PipelineLayout(embedding="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head")

    def positions(self, model: nn.Module, seq_len: int, cp: tuple[int, int], device: torch.device) -> Tensor:
        return context_parallel_positions(seq_len, cp[0], cp[1], device=device)

    def rotary(self, model: nn.Module, h: Tensor, positions: Tensor) -> Any:
        return model.model.rotary_emb(h, positions.unsqueeze(0))

    def run_layer(
        self, model: nn.Module, layer: nn.Module, h: Tensor, rotary: Any, positions: Tensor, documents: Any = None
    ) -> Tensor:
        # documents: always None (document_inputs refuses document masking for transformers' models)
        return layer(h, attention_mask=None, position_ids=positions.unsqueeze(0), position_embeddings=rotary)

    def tensor_parallel_plan(self, model: nn.Module) -> TensorParallelPlan:
        """transformers' own ``config.base_model_tp_plan`` decides which projections are column- and which
        row-parallel ("colwise" q/k/v, gate/up; "rowwise" o/down); the LM head's logits are gathered (``[b, s, V]``
        on every tp rank, so the module's own loss works unchanged).

        Raises:
            ValueError: no ``base_model_tp_plan`` (transformers < 4.45), or a style or pattern not supported.
        """
        tp_plan = dict(model.config.base_model_tp_plan or {})  # None on transformers < 4.45
        if not tp_plan:
            raise ValueError(f"{type(model).__name__}.config has no base_model_tp_plan: transformers >= 4.45 is needed")
        colwise, rowwise = [], []
        for pattern, style in tp_plan.items():
            if style not in _TP_STYLES:
                raise ValueError(f"base_model_tp_plan[{pattern!r}] = {style!r} is not supported: expected {_TP_STYLES}")
            if not pattern.startswith("layers.*."):
                raise ValueError(f"base_model_tp_plan[{pattern!r}]: expected per-layer entries 'layers.*.<module>'")
            (colwise if style == "colwise" else rowwise).append(pattern[len("layers.*.") :])
        return TensorParallelPlan(
            embedding="model.embed_tokens",
            layers="model.layers",
            norm="model.norm",
            head="lm_head",
            colwise=tuple(colwise),
            rowwise=tuple(rowwise),
            layer_norms=("input_layernorm", "post_attention_layernorm"),
            gathered_inputs=(("self_attn", ("kwarg", "hidden_states")), ("mlp", ("args", 1))),
            vocab_parallel_logits=False,
        )

    def prepare(self, model: nn.Module, config: Any, mesh: Any) -> None:
        """Register :func:`attention` in transformers' ``AttentionInterface`` and make the model use it; a forward
        pre-hook on the base ``LlamaModel`` feeds the model's own rotary embedding the positions of the rank's tokens
        (:class:`_Positions`)."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, attention)
        set_attention_implementation(model, ATTENTION)
        cp_rank = mesh.cp.get_local_rank() if config.cp > 1 else 0
        model.model.register_forward_pre_hook(_Positions(cp_rank, config.cp), with_kwargs=True)

    def apply_context_parallel(self, model: nn.Module, cp_mesh: Any, method: str) -> None:
        group = cp_mesh.get_group()
        for m in model.modules():
            if has_class_name(m, "LlamaAttention"):
                _CONTEXT_PARALLEL[m] = (group, method)

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Lightning's materialization (``to_empty`` then each module's ``reset_parameters``), then the rotary tables,
        which no checkpoint holds (:func:`reset_rotary`); weights come from ``init_from``."""
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            materialize_distributed_module(model, device)
            reset_rotary(model, device)

    @torch.no_grad()
    def load_hf(self, model: nn.Module, path: Path) -> None:
        """The file's keys are the model's own state-dict keys, so DCP's ``HuggingFaceStorageReader`` fills each
        (DTensor) shard in place. A tied ``lm_head.weight`` absent from the file is the embedding."""
        reader, available = hf_reader(path)
        state = model.state_dict()
        tied = bool(model.config.tie_word_embeddings)
        missing = [k for k in state if k not in available and not (tied and k == "lm_head.weight")]
        if missing:
            raise ValueError(
                f"init_from={str(path)!r} holds no tensor {missing[0]!r} ({len(missing)} missing): "
                "is it a "
                "checkpoint of this model?"
            )
        hf_load({k: v for k, v in state.items() if k in available}, reader, path)

    def load_checkpoint_weights(self, prefix: str, model: nn.Module, path: Path) -> None:
        raise ValueError(
            f"init_from={str(path)!r}: a transformers LlamaForCausalLM starts from a Hugging Face "
            "directory (config.json + model.safetensors[.index.json]); resume from our checkpoints with "
            "the Trainer's ckpt_path"
        )


#: the family instance the registry lists
HF_LLAMA = HFLlamaFamily()
