"""Hugging Face transformers' ``MixtralForCausalLM`` in a LightningModule: data parallelism with ZeRO 0-3 and expert
parallelism (ep), from the same ``FourDStrategy`` arguments as our own Mixture-of-Experts Llama.

- **dp + ZeRO 0-3**: as for a transformers Llama (:mod:`lightning_4d.adapters.hf_llama`): ZeRO 0/1 through the
  strategy's gradient buckets and sharded optimizer, ZeRO 2/3 as FSDP2 units, one per ``MixtralDecoderLayer`` then
  the model.
- **ep** (``expert_parallel_size``, ZeRO 0/1): every layer's ``MixtralExperts`` (stacked ``gate_up_proj``
  ``[E, 2f, h]`` and ``down_proj`` ``[E, h, f]``) is replaced by :class:`ExpertParallelMixtralExperts`, which holds
  the same two weights as DTensors ``Shard(0)`` on the ep mesh (this rank's ``E/ep`` experts, the parameter names
  unchanged) and sends each token to the ranks holding its top-k experts and back with the all-to-all of
  :class:`lightning_4d.features.moe.expert.ExpertDispatch`. transformers' router (``MixtralTopKRouter``: softmax, top-k,
  renormalized) runs unchanged on every rank's own tokens; the experts' gradients are reduced over the expert
  data-parallel group (``dp_cp / ep``) like ours
  (:mod:`lightning_4d.parallel.grad_buffers`, :mod:`lightning_4d.parallel.fsdp`).
- **tp, pp, cp** are not offered for a transformers Mixtral: its ``base_model_tp_plan`` splits each expert over tp
  (``packed_colwise`` / ``moe_tp_experts``, a plan our tp applier does not take), and its router logits leave the
  model as an output that a pipeline stage cannot return; :meth:`HFMixtralFamily.validate` refuses them with a
  ``ValueError`` naming what is supported (our Llama family trains Mixtral checkpoints with those: ``init_from``).

The load-balancing loss stays the model's own (``output_router_logits=True`` adds ``router_aux_loss_coef`` times
transformers' ``load_balancing_loss_func`` to ``outputs.loss``): it is computed from each rank's own tokens, as under
``DDPStrategy`` (our Llama's MoE layers sum the counts over the data-parallel group instead, ``docs/moe_design.md``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from lightning_4d.adapters.hf_llama import HFLlamaFamily, has_class_name
from lightning_4d.features.moe.expert import differentiable_local, shard_experts
from lightning_4d.features.moe.runtime import ExpertParallelFamily


class ExpertParallelMixtralExperts(nn.Module):
    """transformers' ``MixtralExperts`` under expert parallelism: the same parameters ``gate_up_proj`` ``[E, 2f, h]``
    and ``down_proj`` ``[E, h, f]`` (DTensors ``Shard(0)`` on the ep mesh once :func:`shard_experts` ran), the same
    activation and the same forward signature.

    ``forward(hidden_states, top_k_index, top_k_weights)``: ``hidden_states`` ``[T, h]``, ``top_k_index`` and
    ``top_k_weights`` ``[T, k]`` (transformers' router outputs) -> ``[T, h]``, ``sum_j w_j · expert_{i_j}(x)`` as
    ``MixtralExperts.forward`` computes it: the assignments are sorted by expert (token order within one), exchanged
    with the experts' ranks (:meth:`~lightning_4d.features.moe.expert.ExpertDispatch.exchange`), weighted and summed
    back per token.
    """

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.dispatch: Any = None

    def run(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The local experts (``len(counts)`` of them) on ``rows`` ``[N, h]`` grouped by expert (``counts[e]`` rows
        each): ``down[e] (act(gate[e] x) * up[e] x)``, transformers' per-expert math."""
        gate_up, down = differentiable_local(self.gate_up_proj), differentiable_local(self.down_proj)
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):  # experts without rows too: see GroupedExperts.run
            gate, up = nn.functional.linear(rows[start : start + n], gate_up[e]).chunk(2, dim=-1)
            out.append(nn.functional.linear(self.act_fn(gate) * up, down[e]))
            start += n
        return torch.cat(out)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within each
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // k
        rows = self.dispatch.exchange(hidden_states[token_of], counts, self.run)
        rows = rows * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, token_of, rows.to(out.dtype))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, expert_parallel=True"


class HFMixtralFamily(ExpertParallelFamily, HFLlamaFamily):
    """transformers' ``MixtralForCausalLM`` (module docstring), recognized by duck typing: its class (or a base) is
    named ``MixtralForCausalLM``, ``config.model_type == "mixtral"`` and it has a ``model``."""

    name = "transformers MixtralForCausalLM"

    def is_model(self, module: nn.Module) -> bool:
        config = getattr(module, "config", None)
        return (
            has_class_name(module, "MixtralForCausalLM")
            and getattr(config, "model_type", None) == "mixtral"
            and isinstance(getattr(module, "model", None), nn.Module)
        )

    def validate(self, model: nn.Module, config: Any) -> None:
        """ep dividing ``num_local_experts`` and dp·cp (``ParallelConfig.validate_model``); tp, pp, cp and
        activation checkpointing refused (module docstring).

        Raises:
            ValueError: naming the value and what is supported.
        """
        for name, size in (
            ("tensor_parallel_size", config.tp),
            ("pipeline_parallel_size", config.pp),
            ("context_parallel_size", config.cp),
        ):
            if size > 1:
                raise ValueError(
                    f"{name}={size} is not supported for a transformers MixtralForCausalLM: it trains with data "
                    "parallelism, ZeRO stages 0-3 and expert parallelism (data_parallel_size, zero_stage, "
                    f"expert_parallel_size); set {name}=1, or train the checkpoint as a lightning_4d Llama "
                    "(CausalLMModule with init_from=<the Hugging Face directory>), which takes tp, pp and cp."
                )
        if config.activation_checkpointing != "none":
            raise ValueError(
                f"activation_checkpointing={config.activation_checkpointing!r} is not supported for a "
                "transformers MixtralForCausalLM yet: use activation_checkpointing='none' (or call the "
                "model's gradient_checkpointing_enable() yourself)"
            )
        config.validate_model(self.model_config(model))

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: Any) -> None:
        """Every ``MixtralExperts`` becomes an :class:`ExpertParallelMixtralExperts` whose weights are DTensors
        ``Shard(0)`` on ``ep_mesh`` (this rank's ``E/ep`` experts;
        :func:`lightning_4d.features.moe.expert.shard_experts`)."""
        for block in [m for m in model.modules() if has_class_name(m, "MixtralSparseMoeBlock")]:
            experts = ExpertParallelMixtralExperts(block.experts)
            shard_experts(experts, ep_mesh, names=("gate_up_proj", "down_proj"))
            block.experts = experts

    def load_hf(self, model: nn.Module, path: Path) -> None:
        raise ValueError(
            f"init_from={str(path)!r}: a transformers MixtralForCausalLM loads its weights itself "
            "(MixtralForCausalLM.from_pretrained in the LightningModule's __init__); to start a model built on "
            "the meta device from a Hugging Face Mixtral directory, train it as a lightning_4d Llama "
            "(CausalLMModule with init_from=<the directory>)"
        )


#: the family instance the registry lists
HF_MIXTRAL = HFMixtralFamily()


def mixtral_of(cfg: Any, sizes: dict[str, Any]) -> nn.Module:
    """transformers' ``MixtralForCausalLM`` of our ``LlamaConfig`` ``cfg``'s sizes, on the current device (the support
    matrix's stand-in for a row of this family; ``sizes``: the dense sizes, by transformers' names)."""
    import transformers

    config = transformers.MixtralConfig(
        **sizes,
        intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token,
    )
    return transformers.MixtralForCausalLM(config)
