"""ZeRO stages 0 and 1: the gradient buffers over the ``dp_cp`` group (:class:`GradientBuckets`), with their gradient
compression (bf16 on the wire, PowerSGD: :mod:`lightning_4d.parallel.compression`).

=====  ===========================================  ===============================================================
stage  what is sharded over dp_cp (size D)           how
=====  ===========================================  ===============================================================
0      nothing (plain data parallel)                 :class:`GradientBuckets`: gradients live in flat buckets,
                                                     each all-reduced (averaged over D) as soon as backward filled it
1      optimizer states (Adam m, v, step; master     stage 0 with ``reduce_scatter_tensor`` instead of all-reduce
       weights)                                      + :class:`~lightning_4d.parallel.sharded_optimizer
                                                     .ShardedOptimizer` (each rank steps its 1/D of every bucket)
=====  ===========================================  ===============================================================

Parameters are replicated across dp and cp, so the group is the flattened ``("dp", "cp")`` mesh. Gradients are
*averaged* over the group (the loss is a per-rank mean over equally many tokens). Under master weights
(``bf16-mixed``) the buckets hold float32 gradients of the bfloat16 parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.parallel._compat.collectives import reduce_scatter_single
from lightning_4d.parallel._compat.dtensor import local_tensor as _local
from lightning_4d.parallel.compression import PowerSGD, compressible
from lightning_4d.partition import GRADIENT_BUCKET_BYTES, bucket_lengths, bucket_shard

_BUCKET_BYTES = GRADIENT_BUCKET_BYTES  # the one definition is in partition.py (the memory model reads it)


@dataclass(frozen=True)
class GradientGroup:
    """Parameters whose gradients are reduced over a process group of their own instead of the buckets' default
    group (``dp_cp``): a feature that places its parameters on other ranks declares them (the MoE
    component, :func:`lightning_4d.features.moe.runtime.gradient_groups`). Their buckets hold only them and go over
    ``group``; the sum over it is divided by D (the default group's size) all the same, the mean of the per-rank
    losses' gradients.

    Attributes:
        group: the process group their gradients are summed over (and their ZeRO 1 states sharded over).
        params: the parameters (a parameter named by several groups belongs to the first).
        tp_partial: each tp rank holds the gradient of its own tokens (a module run token parallel): the tp
            ranks' gradients are disjoint parts of the sum, so the global-norm clipping counts every tp rank's,
            where it counts a tp-replicated parameter's once (:mod:`lightning_4d.parallel.clipping`).
    """

    group: dist.ProcessGroup
    params: tuple[Tensor, ...]
    tp_partial: bool = False


@dataclass(frozen=True)
class GradientReduction:
    """How :class:`GradientBuckets` reduce beyond averaging over their group: ``ParallelConfig``'s gradient options
    and the groups other features declare.

    Attributes:
        compression: ``"none"``, ``"bf16"`` (the buckets sent in bfloat16) or ``"powersgd"``
            (``ParallelConfig.gradient_compression``; :class:`~lightning_4d.parallel.compression.PowerSGD`).
        powersgd_rank, powersgd_start_step, powersgd_comm_dtype: PowerSGD's rank, first compressed step and wire
            dtype (``ParallelConfig.powersgd_rank``, ...).
        gradient_groups: the parameters reduced over other groups than the buckets' default one
            (:class:`GradientGroup`; the MoE component's :func:`lightning_4d.features.moe.runtime.gradient_groups`):
            they get buckets of their own over their group (averaged over D all the same), and every optimizer a
            :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` when there is any (also at ZeRO 0: its
            global-norm clipping counts each gradient once, and torch's would mix plain and DTensor gradients).
        replicas: HSDP's ``dp_replicate`` group (``ParallelConfig.data_parallel_replicate_size`` > 1), else
            ``None``: each bucket of the default group, reduced (scattered) over the shard group, is then all-reduced
            over the replicas, and every bucket divided by D = the default group's size x the replicas'.
    """

    compression: str = "none"
    powersgd_rank: int = 4
    powersgd_start_step: int = 0
    powersgd_comm_dtype: Optional[torch.dtype] = None
    gradient_groups: Sequence[GradientGroup] = ()
    replicas: Optional[dist.ProcessGroup] = None


def _buckets(
    tensors: list[Tensor],
    bucket_bytes: int,
    key: Callable[[Tensor], Tensor] = lambda t: t,
    group_of: Callable[[Tensor], Any] = lambda t: None,
) -> Iterable[list[Tensor]]:
    """Group tensors of the same dtype, device (of ``key(t)``) and ``group_of(t)`` (the parameters of each
    :class:`GradientGroup` apart: other process groups) into buckets of at most ``bucket_bytes`` of ``key(t)`` (one
    tensor may exceed), keeping their order (:func:`lightning_4d.partition.bucket_lengths`)."""
    by_key: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        k = key(t)
        by_key.setdefault((k.dtype, k.device, group_of(t)), []).append(t)
    for group in by_key.values():
        start = 0
        for length in bucket_lengths([key(t).numel() * key(t).element_size() for t in group], bucket_bytes):
            yield group[start : start + length]
            start += length


class Bucket:
    """One communication bucket: parameters in backward order and a flat gradient buffer ``[padded]`` holding their
    gradients back to back (``padded`` = their local elements rounded up to a multiple of the group size), reduced
    over ``group`` (``dp_cp``, or a :class:`GradientGroup`'s) of ``world`` ranks, this one ``rank``; ``index``: 0 for
    the default group, ``i`` for the ``i``-th gradient group (:attr:`GradientBuckets.groups`).

    The buffer exists from the first gradient that reaches the bucket to the end of the optimizer step
    (:meth:`allocate`, :meth:`release`): ``None`` in between."""

    def __init__(
        self, params: list[nn.Parameter], dtype: torch.dtype, group: dist.ProcessGroup, index: int = 0
    ) -> None:
        self.group = group
        self.index = index
        self.world = world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = params
        self.offsets: dict[int, int] = {}
        n = 0
        for p in params:
            self.offsets[id(p)] = n
            n += _local(p).numel()
        self.numel = n
        self.padded = bucket_shard(n, world, world - 1)[1]  # the end of the last rank's range
        self.dtype = dtype
        self.device = _local(params[0]).device
        self.buffer: Optional[Tensor] = None

    def allocate(self) -> Tensor:
        """The buffer, made (zeros) if it does not exist."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        return self.buffer

    def release(self) -> None:
        """Drop the buffer (its memory goes back to the allocator; the next gradient makes a new one)."""
        self.buffer = None

    def own_range(self, rank: int, world: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s 1/world of the bucket (:func:`lightning_4d.partition.bucket_shard`)."""
        return bucket_shard(self.numel, world, rank)


class GradientBuckets:
    """ZeRO stages 0 and 1 gradients: every parameter's gradient lives in a flat communication bucket (PyTorch DDP's
    ``gradient_as_bucket_view``, Megatron-LM's contiguous gradient buffer), averaged over the ``dp_cp`` group by an
    asynchronous collective per bucket overlapped with the backward pass.

    Parameters are grouped into buckets of about ``bucket_bytes`` of parameters (default 25 MiB, DDP's) in reverse
    order, the order backward produces their gradients. ``main_grad(p)`` is ``p``'s slice of its bucket (flat, the
    local shard's elements, in ``grad_dtype``: float32 under master weights, else the parameter's dtype). A
    post-accumulate-grad hook adds each fresh gradient into it (a copy at the first accumulation after an optimizer
    step) and frees the parameter's own ``.grad``, so a gradient exists once, in its bucket (plus the one gradient
    just produced).

    A bucket's buffer is made when the first gradient reaches it and dropped by :meth:`start_accumulation` after the
    optimizer step (PyTorch's ``zero_grad(set_to_none=True)``, bucket by bucket). Megatron-LM keeps its contiguous
    gradient buffer for the whole run; here, without gradient accumulation (no pipeline, one batch per step), no
    gradient exists while the forward pass builds the activations, and during backward a layer's gradients appear as
    its saved activations are freed, so the step's peak holds the larger of the two rather than their sum
    (``lightning_4d/planning/model.py``, **Peak**).

    Inside :meth:`overlap_with_backward` a bucket's collective starts as soon as all its gradients arrived:

    - ZeRO 0: ``all_reduce`` of the bucket;
    - ZeRO 1 (``reduce_scatter``): ``reduce_scatter_tensor`` into the rank's own 1/D of the bucket (Megatron-LM's
      distributed optimizer; with the all-gather of the updated parameters 2/3 of the bytes of all-reduce +
      all-gather per element, as all-reduce is itself a reduce-scatter and an all-gather).

    :meth:`synchronize` takes in gradients set outside the hook (the zero-bubble schedules assign ``.grad``), starts
    what was not started, waits and divides by D. Without master weights at ZeRO 0, each parameter's ``.grad`` is
    then its bucket slice (a DTensor of the parameter's placements for a tensor-parallel one), for a plain torch
    optimizer, clipping and user hooks. Otherwise ``.grad`` stays ``None`` and the :class:`ShardedOptimizer` hands
    the bucket slices to the optimizer. :meth:`start_accumulation` (after each optimizer step) makes the next
    gradient overwrite instead of add.

    ``reduction`` (:class:`GradientReduction`) gives the compression and the ``gradient_groups``
    (:class:`GradientGroup`): parameters reduced over other groups, their buckets go over
    their group, and the sum over it divided by D (the default group's size). A feature whose parameters are held by
    other ranks than ``dp_cp``'s declares them so (the MoE component,
    :func:`lightning_4d.features.moe.runtime.gradient_groups`: a module run token parallel under tp sums over ``dp_cp x
    tp``, the sum over tp of the mean over ``dp_cp``). (A DTensor ``Replicate`` parameter used through
    ``to_local(grad_placements=Partial)`` would say the same, but its gradient would be all-reduced over tp per
    parameter, synchronously, before the bucket's own collective; a bucket over the combined group is one collective,
    overlapped with backward, and lets ZeRO 1 shard these states over ``D·t`` ranks.)

    A tensor-parallel gradient whose placement differs from its parameter's (the vocabulary-parallel embedding's
    comes back partial over tp) is redistributed to the parameter's placement first. A parameter that got no
    gradient since the last step has none at the optimizer step (its slice is zeroed before the collective).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        reduce_scatter: bool = False,
        grad_dtype: Optional[torch.dtype] = None,
        bucket_bytes: Optional[int] = None,
        hooks: bool = True,
        reduction: GradientReduction = GradientReduction(),
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.compression = compression = reduction.compression
        self.powersgd = (
            PowerSGD(reduction.powersgd_rank, group, reduction.powersgd_start_step, reduction.powersgd_comm_dtype)
            if compression == "powersgd"
            else None
        )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: HSDP's replicas of ``group`` (:class:`GradientReduction`), their count, and D, the ranks averaged over
        self.replicas = reduction.replicas
        self.num_replicas = 1 if self.replicas is None else dist.get_world_size(self.replicas)
        self.divisor = self.world * self.num_replicas
        self.reduce_scatter = reduce_scatter
        self.grad_dtype = grad_dtype
        bucket_bytes = _BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        #: the gradient groups, index 0 the default group's (``group``, not tp-partial)
        self.gradient_groups = [GradientGroup(group, ()), *reduction.gradient_groups]
        index_of: dict[int, int] = {}
        for i in range(len(self.gradient_groups) - 1, 0, -1):  # the first group naming a parameter wins
            index_of.update({id(p): i for p in self.gradient_groups[i].params})

        def group_of(p: Tensor) -> int:  # index into self.gradient_groups
            return index_of.get(id(p), 0)

        self.buckets = [
            Bucket(ps, grad_dtype or _local(ps[0]).dtype, self.gradient_groups[group_of(ps[0])].group, group_of(ps[0]))
            for ps in _buckets(self.params[::-1], bucket_bytes, key=_local, group_of=group_of)
        ]
        self._reduces = self.num_replicas > 1 or any(b.world > 1 for b in self.buckets)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._numel = {id(p): _local(p).numel() for p in self.params}
        self._fresh = {id(p) for p in self.params}  # no gradient since the last optimizer step
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, Any] = {}
        self._overlap = False
        self._step = 0  # the optimizer step being accumulated (overlap_with_backward): PowerSGD's start
        self._suspended = False
        self._hooks: list[Any] = []
        if hooks:
            self.register_hooks()

    def register_hooks(self) -> None:
        """Register the post-accumulate-grad hooks on the parameters. With ``hooks=False`` at construction, call it
        once the parameters have their final dtype: ``Module.to`` swaps a DTensor parameter's tensor in place
        (``torch.utils.swap_tensors``), and a hook registered before (even removed and registered again) no longer
        fires (measured, torch 2.13)."""
        self.close()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def close(self) -> None:
        """Remove the backward hooks (the strategy calls it before building new buckets)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """A backward inside this context leaves the buckets alone (its gradients stay in ``.grad``): for backward
        passes whose gradients are discarded, such as a pipeline schedule run for evaluation."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def main_grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient slice of its bucket (flat, ``[local numel]``, ``grad_dtype``); the bucket's buffer is made
        (zeros) if it does not exist yet."""
        b = self.buckets[self._bucket_of[id(p)]]
        start = b.offsets[id(p)]
        return b.allocate()[start : start + self._numel[id(p)]]

    @torch.no_grad()
    def take_in(self, p: Tensor) -> Tensor:
        """``p``'s gradient slice of its bucket (:meth:`main_grad`) with any gradient still in ``p.grad`` added into it
        first, zeros if ``p`` got none; ``p`` then counts as having a gradient. For a sum over other ranks before
        :meth:`synchronize` (tied embeddings under pp:
        :class:`lightning_4d.features.pipeline.runtime.TiedEmbedding`)."""
        self._accumulate(p)
        main = self.main_grad(p)
        if id(p) in self._fresh:
            main.zero_()
            self._fresh.discard(id(p))
        return main

    def has_grad(self, p: Tensor) -> bool:
        """Whether ``p`` received a gradient since the last optimizer step."""
        return id(p) not in self._fresh

    def existing_grads(self) -> list[Tensor]:
        """Every parameter's gradient slice (:meth:`main_grad`) in the buckets whose buffer exists now (for byte
        counts: makes no buffer)."""
        return [self.main_grad(p) for b in self.buckets if b.buffer is not None for p in b.params]

    def buffers(self) -> list[Tensor]:
        """The flat gradient buffers that exist now (for byte counts)."""
        return [b.buffer for b in self.buckets if b.buffer is not None]

    def holds(self, p: Tensor) -> bool:
        """Whether ``p`` (a parameter, by identity) has a place in one of the buckets."""
        return id(p) in self._bucket_of

    def bucket_of(self, p: Tensor) -> tuple[Bucket, int]:
        """(the bucket holding ``p``, ``p``'s offset in it)."""
        b = self.buckets[self._bucket_of[id(p)]]
        return b, b.offsets[id(p)]

    def start_accumulation(self) -> None:
        """The next gradient of every parameter overwrites its slice (called after each optimizer step): the buckets'
        buffers are dropped (and ``.grad`` views of them, ZeRO 0 without master weights), made again by the next
        backward."""
        self._fresh = {id(p) for p in self.params}
        if self._pending:
            raise RuntimeError("start_accumulation with bucket collectives in flight: call synchronize first")
        for p in self.params:
            if p.grad is not None and self._is_bucket_view(p):
                p.grad = None
        for b in self.buckets:
            b.release()

    def _is_bucket_view(self, p: Tensor) -> bool:
        """Whether ``p.grad`` is a view of its bucket (:meth:`_expose`)."""
        b = self.buckets[self._bucket_of[id(p)]]
        grad = _local(p.grad)
        return b.buffer is not None and grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()

    @contextmanager
    def overlap_with_backward(self, step: int = 0) -> Iterator[None]:
        """Start each bucket's collective from the backward pass that runs inside this context. ``step``: the
        optimizer step (``trainer.global_step``); PowerSGD's steps reduce in :meth:`synchronize` instead (its two
        all-reduces need every matrix of the bucket), its start steps overlap like uncompressed ones."""
        self._ready = [0] * len(self.buckets)
        self._step = step
        self._overlap = True
        try:
            yield
        finally:
            self._overlap = False

    @torch.no_grad()
    def _accumulate(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        local = _local(g).reshape(-1)
        main = self.main_grad(p)
        if local.data_ptr() != main.data_ptr():  # not accumulated in place into an exposed slice
            if id(p) in self._fresh:
                main.copy_(local)
            else:
                main.add_(local)
        self._fresh.discard(id(p))
        p.grad = None

    def _grad_ready(self, p: Tensor) -> None:
        if self._suspended:
            return
        self._accumulate(p)
        if not self._overlap or not self._reduces or (self.powersgd is not None and self.powersgd.active(self._step)):
            return  # PowerSGD reduces in synchronize (its two all-reduces need every matrix of the bucket)
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i].params):
            self._launch(i)

    def _zero_missing(self, b: Bucket) -> None:
        """Zero the slices of ``b``'s parameters that got no gradient this step (not the last step's values)."""
        for p in b.params:
            if id(p) in self._fresh:
                self.main_grad(p).zero_()

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        if i in self._pending:
            return
        b = self.buckets[i]
        b.allocate()  # a bucket none of whose parameters got a gradient still takes part in the collective
        self._zero_missing(b)
        if b.world == 1:  # a gradient group of one rank (divided by D in synchronize all the same)
            self._pending[i] = (None, b.buffer)
            return
        wire = b.buffer.to(torch.bfloat16) if self.compression == "bf16" else b.buffer  # the bytes sent
        if self.reduce_scatter:
            start, end = b.own_range(b.rank, b.world)
            work = reduce_scatter_single(wire[start:end], wire, group=b.group, async_op=True)
        else:
            work = dist.all_reduce(wire, group=b.group, async_op=True)
        self._pending[i] = (work, wire)

    @torch.no_grad()
    def synchronize(self, step: int = 0) -> None:
        """Finish the averaging: take in gradients assigned outside the hook, start the remaining buckets' collectives,
        wait, divide by D (ZeRO 1: the rank's own ranges only are meaningful afterwards). ``step``: the optimizer
        step (``trainer.global_step``), which tells PowerSGD whether it compresses yet."""
        for p in self.params:
            if p.grad is not None:
                self._accumulate(p)
        if self.world > 1 and self.powersgd is not None and self.powersgd.active(step):
            self._powersgd_reduce()
        elif self._reduces:  # some bucket's group has other ranks (tp alone: a tp-partial gradient group's)
            for i in range(len(self.buckets)):
                self._launch(i)
            for i in sorted(self._pending):
                work, wire = self._pending[i]
                if work is not None:
                    work.wait()
                b = self.buckets[i]
                start, end = b.own_range(b.rank, b.world) if self.reduce_scatter else (0, b.padded)
                if self.num_replicas > 1 and b.index == 0:  # HSDP: the shard's sum over the replicas too
                    dist.all_reduce(wire[start:end], group=self.replicas)
                if wire is not b.buffer:  # bf16 on the wire: back into the float32 bucket
                    b.buffer[start:end].copy_(wire[start:end])
                b.buffer[start:end].div_(self.divisor)  # D also for a gradient group's buckets (GradientGroup)
            self._pending = {}
        if self.grad_dtype is None and not self.reduce_scatter:
            self._expose()

    @torch.no_grad()
    def _powersgd_reduce(self) -> None:
        """Every bucket's mean gradient through :class:`~lightning_4d.parallel.compression.PowerSGD` (the whole
        bucket, on every rank: at ZeRO 1 the rank then reads its own range)."""
        for b in self.buckets:
            self._zero_missing(b)
            matrices, vectors = [], []
            for p in b.params:
                shape = _local(p).shape
                if compressible(shape, self.powersgd.rank):
                    matrices.append((id(p), self.main_grad(p).view(shape)))
                else:
                    vectors.append(self.main_grad(p))
            self.powersgd.reduce(matrices, vectors)

    def compression_state(self, names: dict[int, str]) -> Optional[dict[str, dict[str, Tensor]]]:
        """PowerSGD's error-feedback and warm-start state by parameter name (``None`` without PowerSGD)."""
        return self.powersgd.state(names) if self.powersgd is not None else None

    def load_compression_state(self, names: dict[int, str], state: dict[str, dict[str, Tensor]]) -> None:
        """Restore :meth:`compression_state`."""
        if self.powersgd is not None:
            self.powersgd.load_state(
                {id(p): names[id(p)] for p in self.params if id(p) in names}, state, self.buckets[0].device
            )

    def _expose(self) -> None:
        """``p.grad`` = ``p``'s bucket slice (shaped and placed like ``p``) for every parameter with a gradient."""
        for p in self.params:
            if id(p) in self._fresh:
                continue
            view = self.main_grad(p).view(_local(p).shape)
            if isinstance(p, DTensor):
                view = DTensor.from_local(
                    view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            p.grad = view
