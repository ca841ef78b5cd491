"""Expert parallelism (ep): the routed experts of every Mixture-of-Experts layer split over ``ep`` ranks, tokens
sent to the ranks holding their experts and back by all-to-all (GShard, Lepikhin et al. 2020, arXiv 2006.16668;
DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv 2201.05596; torchtitan's ``distributed/expert_parallel.py``;
Megatron-core's ``MoEAlltoAllTokenDispatcher``).

**Placement.** The ep group is ``ep`` consecutive ranks of the flattened ``dp_cp`` mesh (:mod:`lightning_4d.mesh`).
Each stacked expert weight ``[E, ...]`` becomes a DTensor ``Shard(0)`` on the 1D ep mesh: ep rank ``j`` holds experts
``[j·E/ep, (j+1)·E/ep)``, replicated over the expert data-parallel group ``edp`` (``dp_cp / ep``). A DTensor rather
than a plain local tensor, because the rest of the strategy already speaks DTensor: initialization keeps the rank's
rows of the full tensor by the DTensor's offset (:meth:`LlamaModel.init_weights`, the same weights as one process),
the sharded checkpoints save global shapes (DCP writes each expert once and reads any other ep back), the Hugging Face
loader fills only the rank's experts (``families/native_llama.py``), and the byte counts take the local shard.

**Dispatch** (:class:`ExpertDispatch`, called by ``GroupedExperts.forward`` with the assignments of the rank's own
tokens sorted by global expert, ``counts[e]`` rows for expert ``e``, after the router, top-k and the capacity rule ran
locally: the router is a dense, replicated parameter):

1. the counts ``[E]`` go through an all-to-all of equal splits (``E/ep`` each): rank ``j`` learns how many rows every
   source rank sends to each of its experts;
2. the rows go through an autograd-aware all-to-all with variable split sizes (:func:`all_to_all`: its backward is
   the reverse all-to-all): rank ``j`` receives, source by source, the rows of its experts;
3. they are regrouped expert-major (expert ``e``'s rows of source 0, then of source 1, ...), run through the local
   experts (``GroupedExperts.run``: the loop, or grouped GEMMs on CUDA in bfloat16), put back in received order and
   returned by the reverse all-to-all, in the caller's order; ``MoEFeedForward`` then weights and combines them as
   without ep.

Every row meets the same expert weights as on one process and the combine is unchanged, so the outputs are those of
ep = 1 (each expert's matmul sees its rows in another order: ``F.linear`` is row-wise).

**Capacity** (``capacity_factor``): applied by the source rank to its own ``T`` tokens before dispatch (``ceil(cf ·
T · k / E)`` per expert, token order), exactly as at ep = 1 with the same dp·cp; ep changes nothing in which
assignments drop (GShard applies the capacity per source group in the same way).

**Gradients.** The backward of the all-to-all brings each expert the gradients of the rows of every rank of its ep
group, so an expert's local gradient is already the sum over the ep group's losses; ZeRO 0/1 then sum it over the
expert data-parallel group and divide by dp·cp (not by the group's size), the mean of the per-rank losses as for the
dense parameters (:class:`lightning_4d.parallel.grad_buffers.GradientBuckets`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with split sizes, differentiable: the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> Tensor:
    """Rows ``x[sum(input_splits[:j]) : sum(input_splits[:j+1])]`` go to rank ``j`` of ``group``; the result holds
    ``output_splits[j]`` rows from each rank ``j``, in rank order. Differentiable (the backward sends the gradients
    back the same way). Our own autograd function around ``dist.all_to_all_single`` (``docs/moe_design.md``: the
    ``torch.distributed.nn`` collectives mis-handle sub-groups on gloo, see ``design.md``)."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def _expert_major(counts: Tensor) -> Tensor:
    """The row order that regroups rows received source-major (``counts[s, e]`` rows of source ``s`` for local expert
    ``e``, sources in order, each source's rows by expert) into expert-major order (expert 0's rows of source 0, of
    source 1, ...; then expert 1's ...): ``received[perm]`` is expert-major."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().reshape(-1)  # block starts, (expert, source)
    lengths = counts.t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(lengths.numel(), device=counts.device), lengths)
    within = torch.arange(block.numel(), device=counts.device) - (torch.cumsum(lengths, 0) - lengths)[block]
    return starts[block] + within


class ExpertDispatch:
    """``GroupedExperts.dispatch`` under expert parallelism over ``ep_mesh`` (module docstring: counts, tokens,
    local experts, back). ``__call__(experts, x, counts)``: ``x`` ``[N, h]`` this rank's assignments sorted by global
    expert (``counts`` ``[E]``); returns their expert outputs ``[N, h]`` in the same order.

    After each exchange (a forward; a recomputation repeats it): ``sent_rows`` (``N``, the rows this rank routed) and
    ``received_rows`` (the rows its experts ran: the sum over the ep group's sources of their rows for this rank's
    experts), host ints read off the split sizes (no extra collective). ``received_rows`` over the ep group's mean of
    it is the load imbalance the memory model's ``expert_load_imbalance`` stands for
    (:class:`lightning_4d.features.moe.runtime.ExpertLoadMonitor` logs it)."""

    def __init__(self, ep_mesh: Any) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.sent_rows = 0
        self.received_rows = 0

    def __call__(self, experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
        weights = [differentiable_local(w) for w in (experts.w1, experts.w3, experts.w2)]
        return self.exchange(x, counts, lambda rows, local_counts: experts.run(rows, local_counts, *weights))

    def exchange(self, x: Tensor, counts: Tensor, compute: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """Send ``x`` ``[N, h]`` (this rank's assignments sorted by global expert, ``counts`` ``[E]`` rows each) to
        the ranks holding their experts, run ``compute(rows, local_counts)`` there on the received rows grouped by
        local expert (``local_counts`` ``[E/ep]``; returns ``[rows, h_out]``) and bring the outputs back in ``x``'s
        order (module docstring, steps 1-3). Any expert implementation plugs in through ``compute``: ours
        (``GroupedExperts.run``) or a foreign model's (:mod:`lightning_4d.features.moe.hf_mixtral`)."""
        ep = self.size
        local = counts.numel() // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts.contiguous(), group=self.group)
        received_counts = received_counts.view(ep, local)  # [source, local expert]
        input_splits = counts.view(ep, local).sum(1).tolist()
        output_splits = received_counts.sum(1).tolist()
        self.sent_rows, self.received_rows = sum(input_splits), sum(output_splits)
        received = all_to_all(x, output_splits, input_splits, self.group)
        perm = _expert_major(received_counts)
        y = compute(received[perm], received_counts.sum(0))
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return all_to_all(y[back], input_splits, output_splits, self.group)


def differentiable_local(w: Tensor) -> Tensor:
    """The local shard of a DTensor weight, differentiable (its gradient comes back as a DTensor of the same
    placements); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def shard_experts(experts: nn.Module, ep_mesh: Any, names: tuple[str, ...] = ("w1", "w3", "w2")) -> None:
    """Replace ``experts``' stacked weights ``names`` (``[E, ...]``, meta or real) by DTensors ``Shard(0)`` on
    ``ep_mesh`` (this rank's ``E/ep`` rows: experts ``[j·E/ep, (j+1)·E/ep)`` on ep rank ``j``) and set its
    ``dispatch`` to an :class:`ExpertDispatch` over ``ep_mesh``.

    Raises:
        ValueError: ``E`` not divisible by the ep size (``ParallelConfig.validate_model`` says it first).
    """
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in names:
        p = experts.get_parameter(name)
        if p.shape[0] % ep:
            raise ValueError(f"{name}: {p.shape[0]} experts cannot be split over expert_parallel_size={ep}")
        rows = p.shape[0] // ep
        local = p.detach()[rank * rows : (rank + 1) * rows].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        experts.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
    experts.dispatch = ExpertDispatch(ep_mesh)


def is_expert_parameter(p: Tensor) -> bool:
    """Whether ``p`` is an expert weight sharded over the ep mesh (:func:`shard_experts`): its gradient is reduced
    over the expert data-parallel group, not ``dp_cp``."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


#: the modules whose 3-D parameters are stacked expert weights ``[E, d1, d2]``: ours
#: (:class:`~lightning_4d.features.moe.layer.GroupedExperts`), transformers' ``MixtralExperts`` and its expert-parallel
#: replacement (:mod:`lightning_4d.features.moe.hf_mixtral`)
EXPERT_MODULES = ("GroupedExperts", "MixtralExperts", "ExpertParallelMixtralExperts")


def stacked_expert_weights(model: nn.Module) -> list[Tensor]:
    """The stacked expert weights of ``model`` (``[E, d1, d2]``, or ``[E/ep, d1, d2]`` local DTensors under ep): the
    3-D parameters held directly by a module of a class in :data:`EXPERT_MODULES`, and every
    :func:`is_expert_parameter`. ZeRO 2/3 may shard them on dim 1
    (:func:`lightning_4d.features.moe.costs.expert_shard_dim`)."""
    out: dict[int, Tensor] = {}
    for m in model.modules():
        named = type(m).__name__ in EXPERT_MODULES
        for p in m.parameters(recurse=False):
            if (named and p.ndim == 3) or is_expert_parameter(p):
                out[id(p)] = p
    return list(out.values())
