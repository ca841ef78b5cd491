"""The Mixture-of-Experts feed-forward of our Llama (``LlamaConfig.num_experts`` > 0): a router, routed SwiGLU
experts held as stacked weights ``[E, ...]``, optional shared experts, the load-balancing loss and the routing
statistics, and the layer's parameter names in transformers' ``MixtralForCausalLM`` (at the end). ``docs/moe.md``
describes the arguments, what is measured and the limits.

Sources: Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer",
arXiv 1701.06538; Lepikhin et al. 2020, "GShard", arXiv 2006.16668 (capacity); Fedus et al. 2021, "Switch
Transformers", arXiv 2101.03961 (load-balancing loss, Eq. 4-6); Jiang et al. 2024, "Mixtral of Experts", arXiv
2401.04088, and transformers' ``modeling_mixtral.py`` (softmax top-k router, renormalized); transformers'
``modeling_llama4.py`` (sigmoid top-k router scaling the experts' input, shared expert); torchtitan's
``models/moe`` (stacked expert weights, ``torch._grouped_mm``).

One MoE layer, for the ``T`` tokens ``x`` ``[T, h]`` of one forward::

    logits  = router(x)                                   # [T, E], nn.Linear(h, E, bias=False)
    softmax: p = softmax(float32(logits)); w, idx = topk(p, k); w = w / sum(w)     (Mixtral)
             y = sum_j w_j · expert_{idx_j}(x)
    sigmoid: l, idx = topk(logits, k); w = sigmoid(float32(l))                      (Llama 4)
             y = sum_j expert_{idx_j}(w_j · x)
    out     = y + shared(x)                               # shared: one SwiGLU of width n_s · f_e (if n_s > 0)

``expert_e(x) = w2[e] (silu(w1[e] x) * w3[e] x)`` with ``w1``, ``w3`` ``[E, f_e, h]`` and ``w2`` ``[E, h, f_e]`` (each
expert's slice in ``nn.Linear``'s ``[out, in]`` layout, so expert parallelism can shard dim 0).

**Capacity** (``capacity_factor`` not ``None``): each expert takes at most ``C = ceil(capacity_factor · T · k / E)``
assignments; its assignments are taken in token order (token 0 first) and those past ``C`` are dropped (the
expert's contribution to that token is zero; the token keeps its other experts, their weights not renormalized,
and the residual). ``T`` is the tokens of one forward on one rank, so which tokens drop depends on the layout (as in
GShard and Megatron-LM); dropless routing (the default) does not.

**Load-balancing loss** of one layer (Switch Transformer Eq. 4-6 with top-k, transformers'
``load_balancing_loss_func`` for one layer): ``aux = E · sum_e f_e · P_e`` with ``f_e`` the fraction of the ``T``
tokens whose top-k includes expert ``e`` (counted before capacity drops; ``sum_e f_e = k``) and ``P_e`` the mean over
tokens of ``softmax(logits)_e`` (also for the sigmoid router: the softmax of its logits, as transformers computes
it for Llama 4). Perfect balance gives ``aux = k``. The model's loss is the mean over its MoE layers (transformers'
Mixtral pools the counts and probabilities of all layers into one term instead: equal for one MoE layer).

Under data parallelism the counts ``f_e`` are those of the global batch (summed over the ``dp_cp`` group, one
all-reduce of ``E + 2`` integers per layer and forward, :attr:`MoEFeedForward.stats_group`) while ``P_e`` is this
rank's mean: every rank's term ``E · sum_e f_e^global · P_e^local`` then averages (as the gradients do) to the
single-process loss, and its gradient to the single-process gradient, whatever dp and cp are.

Under tensor parallelism the layer runs token parallel (:attr:`MoEFeedForward.token_parallel`, set by
``lightning_4d.features.tensor_parallel.runtime``): each tp rank routes and computes its own ``s/t`` tokens with the
whole layer, so the counts are summed over ``dp_cp x tp`` (the stats group) and ``P_e`` is the mean over the tp group's
tokens (a differentiable mean over tp, whose backward gives each rank ``1/t`` of the gradient for its own tokens): the
term is then the same on every tp rank, like the language-model loss, and still averages over ``dp_cp`` to the
single-process loss; summed over tp by the gradient reduction (the parameters see only their rank's tokens), its
gradient is the single-process gradient.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.models.llama_config import LlamaConfig


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` of width ``intermediate_size`` (the shared experts; ``FeedForward``'s math)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as stacked weights: ``w1``, ``w3`` ``[E, f_e, h]``, ``w2`` ``[E, h, f_e]``.

    ``forward(x, counts)``: ``x`` ``[N, h]`` holds the tokens sorted by expert (``counts[e]`` rows for expert ``e``,
    in expert order); returns ``[N, h]``, row ``i`` the output of its expert.

    ``grouped_mm``: ``None`` (a loop over the experts, the reference path), or ``torch._grouped_mm`` as
    :data:`lightning_4d.parallel._compat.grouped_mm` finds it (``LlamaModel.set_grouped_mm``; ``CausalLMModule``
    sets it): then on CUDA with bfloat16 weights the three matmuls are grouped GEMMs over the experts' row groups
    (the loop elsewhere). The models package imports nothing of ``parallel/``, so the private name is handed in.

    ``dispatch``: ``None`` (every expert here), or under expert parallelism the callable ``dispatch(experts, x,
    counts)`` of :mod:`lightning_4d.features.moe.expert` (set by the family): ``w1``, ``w3``, ``w2`` are then DTensors
    sharded on dim 0 over the ep mesh (this rank's ``E/ep`` experts), and it sends the rows to the ranks holding
    their experts, runs :meth:`run` on the rows it received and sends the outputs back, in ``x``'s order.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.grouped_mm: Optional[Callable[..., Tensor]] = None
        self.dispatch: Optional[Callable[["GroupedExperts", Tensor, Tensor], Tensor]] = None
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        if self.dispatch is not None:  # expert parallelism: the tokens travel to the ranks holding their experts
            return self.dispatch(self, x, counts)
        return self.run(x, counts, self.w1, self.w3, self.w2)

    def run(self, x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """The experts of the stacked weights ``w1``, ``w3``, ``w2`` (plain tensors of ``len(counts)`` experts: all of
        them, or under expert parallelism this rank's) on ``x`` sorted by expert (``counts[e]`` rows each)."""
        if self.grouped_mm is not None and grouped_mm_takes(x, w1):
            return self._grouped(x, counts, w1, w3, w2)
        # every expert, those without rows too (zero-row matmuls): the output then always depends on ``x`` and on
        # the weights, so that under expert parallelism a rank whose experts received no row still runs the
        # backward of the all-to-all that brought them (the other ranks of the ep group wait in it) and still
        # produces the weights' (zero) gradients its buckets wait for
        out = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            out.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
            start += n
        return torch.cat(out)

    def _grouped(self, x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """The three matmuls as grouped GEMMs over the experts' row groups (``offs``: cumulative row counts)."""
        mm, offs = self.grouped_mm, torch.cumsum(counts, 0, dtype=torch.int32)
        gate = mm(x, w1.transpose(-2, -1), offs=offs)
        up = mm(x, w3.transpose(-2, -1), offs=offs)
        return mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)

    def extra_repr(self) -> str:
        e, f, h = self.w1.shape
        return f"num_experts={e}, hidden_size={h}, intermediate_size={f}"


def grouped_mm_takes(x: Tensor, w1: Tensor) -> bool:
    """Whether the experts run as grouped GEMMs (``torch._grouped_mm``) on ``x`` ``[N, h]`` with ``w1``
    ``[E, f, h]``: on CUDA, both bfloat16, and ``h`` and ``f`` multiples of 8 (the kernel wants every row stride a
    multiple of 16 bytes: ``RuntimeError: strides should be multiple of 16 bytes`` otherwise); else the loop over the
    experts (the same numbers, one matmul per expert)."""
    f, h = w1.shape[-2], w1.shape[-1]
    return x.is_cuda and x.dtype == torch.bfloat16 and w1.dtype == torch.bfloat16 and h % 8 == 0 and f % 8 == 0


def capacity(config: LlamaConfig, tokens: int) -> Optional[int]:
    """Assignments one expert takes from ``tokens`` tokens: ``ceil(capacity_factor · tokens · k / E)``, ``None``
    when dropless."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * tokens * config.num_experts_per_token / config.num_experts)


class AuxLossInjection(torch.autograd.Function):
    """``forward(output, aux, scale)`` returns ``output`` unchanged; ``backward`` passes ``output``'s gradient through
    and gives ``aux`` the gradient ``scale`` (a float): as if ``scale * aux`` had been added to the loss whose
    backward reaches ``output``, wherever that loss is computed (Megatron-Core's ``MoEAuxLossAutoScaler``,
    ``megatron/core/transformer/moe/moe_utils.py``). A pipeline stage's MoE layers thus train on their
    load-balancing terms although the loss lives on the last stage: only activations travel between stages, and the
    schedule's backward of each micro-batch runs this node once (also under activation checkpointing, whose
    recomputation replays the forward but not the graph). ``output`` ``[..., h]`` any dtype; ``aux`` a scalar."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MoEFeedForward(nn.Module):
    """The Mixture-of-Experts feed-forward (module docstring): ``router`` (``nn.Linear(h, E, bias=False)``),
    ``experts`` (:class:`GroupedExperts`), ``shared_experts`` (:class:`SwiGLU` of width ``n_s · f_e``, or
    ``None``).

    Shapes: ``[b, s, h]`` -> ``[b, s, h]``.

    After each forward (detached unless said): ``aux_loss`` (the layer's load-balancing term, differentiable: this
    rank's share, module docstring), ``tokens_per_expert`` (int64 ``[E]``, top-k assignments per expert of the
    global batch, before drops), ``dropped`` (assignments dropped by the capacity, summed over the group) and
    ``assignments`` (all assignments, ``T · k`` summed over the group). A recomputation (activation checkpointing)
    overwrites them with the same values.

    ``stats_group``: ``None`` (one process), or the process group the counts are summed over: the ranks holding
    disjoint tokens, ``dp_cp`` (``dp_cp x tp`` under tensor parallelism; set by
    :meth:`lightning_4d.families.native_llama.LlamaFamily.apply_data_parallel`).

    ``metadata_inference``: set (``LlamaModel.set_metadata_inference``) while a pipeline schedule infers its stages'
    shapes on placeholder activations: the layer then returns its input (the local tensor of a DTensor, as the layer
    returns its output), with no collective and no routing record (``PipelineRunner.metadata_inference``).

    ``token_parallel``: ``None``, or under tensor parallelism an object with ``__call__(x, run)`` that runs ``run``
    (this layer's computation) on this tp rank's ``s/t`` tokens of ``x`` and returns the output in ``x``'s layout,
    and ``mean(t)`` (a differentiable mean over the tp ranks) for the load-balancing loss
    (:class:`lightning_4d.features.tensor_parallel.runtime.TokenParallel`; the models package imports nothing of
    ``parallel/``).

    **How the load-balancing term trains.** In a forward with gradients the output carries the term through
    :class:`AuxLossInjection`: the backward that reaches the output gives the term the gradient ``aux_grad_scale``,
    d(training loss)/d(this layer's term). Default ``router_aux_loss_coef / num_moe_layers`` (the model's loss is the
    mean of its layers' terms, weighted by the coefficient); whoever scales the language-model loss per backward
    (``1/m`` for a pipeline's ``m`` micro-batches, ``1/A`` for ``A`` accumulated batches) scales it alike
    (:meth:`lightning_4d.models.llama.LlamaModel.set_aux_loss_scale`). The averaging over data-parallel ranks is
    the gradient reduction's, as for the language-model loss.

    ``aux_loss_terms``: the detached terms (float32 scalars) of the forwards with gradients since
    :meth:`reset_aux_loss`, in order; their mean is the mean over a pipeline step's micro-batches (a recomputation
    repeats every micro-batch's term once: the mean stays). Under pp the reset comes just before the step's first
    micro-batch (``PipelineRunner.before_microbatches``), after the schedule's metadata inference (at the first step
    a forward, with gradients, of every stage on placeholder activations, and under activation checkpointing its
    recomputation).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        h, e, fe = config.hidden_size, config.num_experts, config.expert_intermediate_size
        self.top_k = config.num_experts_per_token
        self.router = nn.Linear(h, e, bias=False)
        self.experts = GroupedExperts(e, h, fe)
        self.shared_experts = SwiGLU(h, config.num_shared_experts * fe) if config.num_shared_experts else None
        self.stats_group: Any = None
        self.token_parallel: Any = None
        self.metadata_inference = False
        self.aux_loss: Optional[Tensor] = None
        self.aux_grad_scale = config.router_aux_loss_coef / max(1, config.num_moe_layers)
        self.aux_loss_terms: list[Tensor] = []
        self.tokens_per_expert: Optional[Tensor] = None
        self.dropped: Optional[Tensor] = None
        self.assignments: Optional[Tensor] = None

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(weights, experts, probs)``: the float32 weights and the chosen experts of every token (``[T, k]``
        each; module docstring: softmax or sigmoid) and the float32 ``softmax(logits)`` ``[T, E]`` the
        load-balancing loss averages (for the softmax router, the very tensor it routed with: saved once)."""
        dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 (float64 stays float64)
        probs = torch.softmax(logits.to(dtype), dim=-1)
        if self.config.router_score == "softmax":
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            return weights / weights.sum(dim=-1, keepdim=True), experts, probs
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.sigmoid(top.to(dtype)), experts, probs

    def forward(self, x: Tensor) -> Tensor:
        if self.metadata_inference:  # a pipeline schedule's shape inference: no collective, no record
            return x.to_local() if isinstance(x, DTensor) else x
        if self.token_parallel is not None:  # tp: this rank's s/t tokens (module docstring)
            return self.token_parallel(x, self._forward)
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n_tokens, k, n_experts = tokens.shape[0], self.top_k, self.config.num_experts
        logits = self.router(tokens)
        weights, experts, probs = self.route(logits)
        flat_expert = experts.reshape(-1)  # assignment i = (token i // k, slot i % k)
        counts = torch.bincount(flat_expert, minlength=n_experts)
        # group the assignments by expert, each expert's in token order (a stable sort of token-major indices)
        order = torch.argsort(flat_expert, stable=True)
        cap = capacity(self.config, n_tokens)
        kept_counts = counts
        if cap is not None:
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[flat_expert[order]]
            order = order[position < cap]
            kept_counts = counts.clamp(max=cap)
        token_of = order // k
        routed_in = tokens[token_of]
        w = weights.reshape(-1)[order].unsqueeze(-1)
        if self.config.router_score == "sigmoid":  # Llama 4: the score scales the expert's input
            routed_out = self.experts((routed_in * w).to(routed_in.dtype), kept_counts)
        else:  # Mixtral: the weight scales the expert's output
            routed_out = self.experts(routed_in, kept_counts) * w
        # combine: every assignment's output into its (token, slot) row, then the sum over the k slots (a dropped
        # assignment's row stays zero); index_put_ saves only the indices for backward (index_add_ would keep a copy
        # of the outputs)
        slots = tokens.new_zeros(n_tokens * k, shape[-1])
        slots[order] = routed_out.to(tokens.dtype)
        # the sum in the residual stream's dtype, named: CUDA autocast runs an unnamed sum in float32 (CPU autocast
        # does not), and the layer would hand float32 on (a pipeline's shape check fails; the stream doubles)
        out = slots.view(n_tokens, k, shape[-1]).sum(dim=1, dtype=tokens.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self._record(probs, counts, n_tokens, n_tokens * k - order.numel())
        out = out.reshape(shape)
        if self.aux_loss.requires_grad and self.aux_grad_scale:
            out = AuxLossInjection.apply(out, self.aux_loss, self.aux_grad_scale)
        return out

    def reset_aux_loss(self) -> None:
        """Forget the terms kept in ``aux_loss_terms`` (class docstring)."""
        self.aux_loss_terms = []

    def _record(self, probs: Tensor, counts: Tensor, n_tokens: int, dropped: int) -> None:
        """The load-balancing term and the routing statistics of this forward (class docstring)."""
        stats = torch.cat([counts, counts.new_tensor([dropped, n_tokens * self.top_k])])
        if self.stats_group is not None:
            torch.distributed.all_reduce(stats, group=self.stats_group)
        counts, self.dropped, self.assignments = stats[:-2], stats[-2], stats[-1]
        self.tokens_per_expert = counts
        # f_e: fraction of the global batch's tokens routed to e (T_global = assignments / k); P_e: this rank's mean
        f = counts.to(probs.dtype) * self.top_k / self.assignments.to(probs.dtype)
        p = probs.mean(dim=0)
        if self.token_parallel is not None:  # the tp group's tokens (equal shards): the same term on every tp rank
            p = self.token_parallel.mean(p)
        self.aux_loss = self.config.num_experts * (f * p).sum()
        if self.aux_loss.requires_grad:  # a forward that trains (not evaluation)
            self.aux_loss_terms.append(self.aux_loss.detach().float())

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"top_k={self.top_k}, router_score={c.router_score!r}, capacity_factor={c.capacity_factor}, "
            f"shared={c.num_shared_experts}"
        )


class MoEModel:
    """The Mixture-of-Experts methods of a decoder holding :class:`MoEFeedForward` layers (mixed into
    :class:`~lightning_4d.models.llama.LlamaModel`, an ``nn.Module`` with a ``config``): the load-balancing loss, its
    injected gradient's scale, the routing statistics, the pipeline's shape inference and the grouped GEMMs of the
    routed experts. Each is a no-op (or ``None``, ``{}``) for a dense model."""

    config: LlamaConfig
    modules: Callable[[], Any]  # nn.Module's

    def moe_layers(self) -> list[MoEFeedForward]:
        """The Mixture-of-Experts feed-forwards of the layers this (possibly pruned) model holds, in layer order."""
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def moe_aux_loss(self) -> Optional[Tensor]:
        """The load-balancing loss of the last forward (differentiable): the sum of this model's MoE layers' terms
        divided by the config's number of MoE layers (the mean over all of them; a pipeline stage's share), ``None``
        for a dense model or before a forward (:mod:`lightning_4d.features.moe.layer`). Not multiplied by
        ``router_aux_loss_coef``. Training needs no addition of it to the loss: the layers inject its gradient
        themselves (:meth:`set_aux_loss_scale`)."""
        terms = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if not terms:
            return None
        return torch.stack([t.float() for t in terms]).sum() / self.config.num_moe_layers

    def set_aux_loss_scale(self, scale: float) -> None:
        """Train the load-balancing loss as if ``scale * moe_aux_loss()`` were added to the loss of every backward:
        each MoE layer's output injects ``scale / num_moe_layers`` into its term's gradient
        (:class:`~lightning_4d.features.moe.layer.AuxLossInjection`; ``MoEFeedForward.aux_grad_scale``). ``scale`` is
        ``router_aux_loss_coef`` times the factor the language-model loss of one backward carries (``1/m`` for a
        pipeline micro-batch, ``1/A`` under ``A`` accumulated batches); the default, set at construction, is
        ``router_aux_loss_coef``. No-op for a dense model."""
        for m in self.moe_layers():
            m.aux_grad_scale = scale / self.config.num_moe_layers

    def set_metadata_inference(self, flag: bool) -> None:
        """While ``flag``, this model's MoE layers pass their input through (a pipeline schedule's shape inference:
        :attr:`lightning_4d.features.moe.layer.MoEFeedForward.metadata_inference`)."""
        for m in self.moe_layers():
            m.metadata_inference = flag

    def reset_moe_aux_loss(self) -> None:
        """Start a new mean for :meth:`moe_step_aux_loss` (every MoE layer forgets the terms it summed)."""
        for m in self.moe_layers():
            m.reset_aux_loss()

    def moe_step_aux_loss(self) -> Optional[Tensor]:
        """This model's share of the load-balancing loss averaged over the forwards with gradients since
        :meth:`reset_moe_aux_loss` (a pipeline step's micro-batches; detached float32 scalar): the sum over its
        MoE layers of each layer's mean term, divided by the config's number of MoE layers, so that the shares of
        the pipeline stages add up to the model's loss. ``None`` when the model holds no MoE layer that ran."""
        means = [torch.stack(m.aux_loss_terms).mean() for m in self.moe_layers() if m.aux_loss_terms]
        if not means:
            return None
        return torch.stack(means).sum() / self.config.num_moe_layers

    @torch.no_grad()
    def moe_stats(self) -> dict[str, Tensor]:
        """Routing statistics of the last forward over this model's MoE layers (summed over the data-parallel group
        when one is set), float32 scalars: ``tokens_per_expert_max`` (the most assignments one expert received in one
        layer), ``tokens_per_expert_mean`` (assignments per expert: ``T·k/E``), ``dropped_fraction`` (assignments
        dropped by the capacity over all assignments). Empty for a dense model."""
        layers = [m for m in self.moe_layers() if m.tokens_per_expert is not None]
        if not layers:
            return {}
        counts = torch.stack([m.tokens_per_expert for m in layers]).float()
        dropped = sum(m.dropped.float() for m in layers)
        total = sum(m.assignments.float() for m in layers)
        return {
            "tokens_per_expert_max": counts.max(),
            "tokens_per_expert_mean": counts.mean(),
            "dropped_fraction": dropped / total,
        }

    def set_grouped_mm(self, fn: Optional[Callable[..., Tensor]]) -> None:
        """Let the routed experts use ``fn`` (``torch._grouped_mm``, :data:`lightning_4d.parallel._compat.grouped_mm`)
        on CUDA with bfloat16 weights (:class:`~lightning_4d.features.moe.layer.GroupedExperts`); ``None``: the loop."""
        for m in self.modules():
            if isinstance(m, GroupedExperts):
                m.grouped_mm = fn

    @staticmethod
    def is_residual_output(canonical: str) -> bool:
        """Whether the parameter ``canonical`` (its name without wrapper prefixes) is a routed or shared expert's
        output projection ``w2``: a residual branch's output, initialized with std / sqrt(2 L) like ``attention.wo``
        and ``feed_forward.w2`` (:meth:`lightning_4d.models.llama.LlamaModel._init_std`)."""
        owner = canonical.rsplit(".", 1)[0]
        return owner.endswith("shared_experts.w2") or canonical.endswith("experts.w2")


# ---------------------------------------------------------------------------------------------- Mixtral names
# The layer's parameters in transformers' ``MixtralForCausalLM``: the MoE part of our Llama's Hugging Face
# state-dict adapter (:mod:`lightning_4d.models.hf_mapping` asks these for every MoE layer). transformers 5 (5.24
# measured) holds the experts of a layer fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2f, h]``,
# ``mlp.experts.down_proj`` ``[E, h, f]``, router ``mlp.gate.weight``) but ``save_pretrained`` writes, and
# ``from_pretrained`` reads, the per-expert names of the released checkpoints:
# ``model.layers.<i>.block_sparse_moe.gate.weight`` ``[E, h]`` and
# ``model.layers.<i>.block_sparse_moe.experts.<e>.{w1,w2,w3}.weight`` (``w1`` gate ``[f, h]``, ``w3`` up ``[f, h]``,
# ``w2`` down ``[h, f]``). Those are the names here: our stacked ``feed_forward.experts.w1`` ``[E, f, h]`` is expert
# ``e``'s ``w1.weight`` at index ``e`` of dim 0 (:func:`hf_stacked_slices`).
#: our MoE layer's router (Mixtral's ``block_sparse_moe.gate``) and routed experts' stacked weights
HF_MOE_ROUTER = ("feed_forward.router", "block_sparse_moe.gate")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def hf_layer_name(name: str, layer: str, module: str, leaf: str) -> Optional[str]:
    """The transformers Mixtral key of our parameter ``name`` (canonical) of decoder layer ``layer``, module path
    ``module`` in the layer and ``leaf`` (``weight``), when it is the MoE layer's router; ``None`` when ``module`` is
    not the MoE layer's.

    Raises:
        ValueError: a routed experts' stacked weight (one Hugging Face tensor per expert: :func:`hf_stacked_slices`)
            or a shared expert's (Mixtral has none).
    """
    if module == HF_MOE_ROUTER[0]:
        return f"model.layers.{layer}.{HF_MOE_ROUTER[1]}.{leaf}"
    if module == "feed_forward.experts" and leaf in EXPERT_WEIGHTS:
        raise ValueError(f"{name!r} is stacked over the experts: one Hugging Face tensor per expert (hf_slices)")
    if module.startswith("feed_forward.shared_experts"):
        raise ValueError(f"{name!r}: shared experts have no transformers Mixtral name (Mixtral has none)")
    return None


def expert_weight(name: str) -> bool:
    """Whether ``name`` is a routed experts' stacked weight (``layers.<i>.feed_forward.experts.w1`` ...)."""
    parts = name.split(".")
    return (
        len(parts) == 5
        and parts[0] == "layers"
        and parts[2:4] == ["feed_forward", "experts"]
        and parts[4] in EXPERT_WEIGHTS
    )


def hf_stacked_slices(name: str, config: Any) -> Optional[list[tuple[str, int]]]:
    """The Hugging Face tensors of a routed experts' stacked weight ``name``, one per expert:
    ``[("model.layers.<i>.block_sparse_moe.experts.<e>.w1.weight", e), ...]`` for ``e`` in ``0 .. E-1``
    (``config.num_experts`` = E; ``config``: a ``LlamaConfig``); ``None`` for any other parameter."""
    if not expert_weight(name):
        return None
    _, layer, _, _, w = name.split(".")
    return [(f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight", e) for e in range(config.num_experts)]


def hf_param_names(config: Any, layer: int) -> list[str]:
    """The canonical names of MoE decoder layer ``layer``'s feed-forward parameters (``config``: a ``LlamaConfig``):
    the router, the routed experts' stacked weights, the shared experts' weights (as our Llama's Hugging Face
    mapping lists them, :func:`lightning_4d.models.hf_mapping.param_names`)."""
    names = [f"layers.{layer}.{HF_MOE_ROUTER[0]}.weight"]
    names += [f"layers.{layer}.feed_forward.experts.{w}" for w in EXPERT_WEIGHTS]
    if config.num_shared_experts:
        names += [f"layers.{layer}.feed_forward.shared_experts.{w}.weight" for w in EXPERT_WEIGHTS]
    return names
