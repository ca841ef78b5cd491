"""ZeRO stages 0-3 over the ``dp_cp`` group (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", arXiv 1910.02054).

=====  ===========================================  ===============================================================
stage  what is sharded over dp_cp (size D)           how
=====  ===========================================  ===============================================================
0      nothing (plain data parallel)                 :class:`GradientSynchronizer`: bucketed all-reduce of gradients,
                                                     averaged over D, once per optimizer step
1      optimizer states (Adam m, v, step)            stage 0 + :class:`ShardedOptimizer`: each rank keeps the states
                                                     of a 1/D slice of every (flattened) parameter, steps that slice
                                                     and all-gathers the updated parameters (one bucketed all-gather)
2      + gradients                                   FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients
                                                     reduce-scattered, parameters kept gathered between forward and
                                                     backward, sharded between steps
3      + parameters                                  FSDP2 ``fully_shard(reshard_after_forward=True)`` per layer
=====  ===========================================  ===============================================================

Parameters are replicated across dp and cp, so the group is the flattened ``("dp", "cp")`` mesh. Gradients are
*averaged* over the group at every stage (the loss is a per-rank mean over equally many tokens); for FSDP2 the
divide factor is set explicitly so that the result does not depend on the backend's reduce op (on gloo FSDP2 has
been reported to sum instead of average, pytorch issue 162338; the parity tests check this).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_4d.parallel._compat import local_tensor as _local
from lightning_4d.parallel._compat import mark_wrapped_by_lr_scheduler

_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket size


def _buckets(
    tensors: list[Tensor], bucket_bytes: int, key: Callable[[Tensor], Tensor] = lambda t: t
) -> Iterable[list[Tensor]]:
    """Group tensors of the same dtype and device (of ``key(t)``) into buckets of at most ``bucket_bytes`` of
    ``key(t)`` (one tensor may exceed), keeping their order."""
    by_key: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        k = key(t)
        by_key.setdefault((k.dtype, k.device), []).append(t)
    for group in by_key.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = key(t).numel() * key(t).element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


# ---------------------------------------------------------------------------------------------------- stage 2, 3
def apply_fsdp(
    model: nn.Module,
    dp_cp_mesh: DeviceMesh,
    zero_stage: int,
    blocks: Optional[Iterable[nn.Module]] = None,
    reshard_after_forward: Optional[bool] = None,
) -> None:
    """Shard ``model`` with FSDP2 for ZeRO stage 2 or 3, one FSDP unit per transformer block, then the root.

    Args:
        model: the module (DTensor tensor-parallel parameters are fine: FSDP2 shards their local dim 0).
        dp_cp_mesh: the 1D ``dp_cp`` mesh.
        zero_stage: 2 (``reshard_after_forward=False``) or 3 (``True``).
        blocks: the submodules that become their own FSDP units (default: ``model.layers.values()``).
        reshard_after_forward: override the stage's default (``zero_stage == 3``); the zero-bubble pipeline
            schedules pass ``False`` for stage 3 (see ``parallelize_llama``).

    Raises:
        ValueError: ``zero_stage`` is not 2 or 3.
    """
    from torch.distributed.fsdp import fully_shard

    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, got zero_stage={zero_stage}")
    reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
    if blocks is None:
        layers = getattr(model, "layers", None)
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    units = [fully_shard(b, mesh=dp_cp_mesh, reshard_after_forward=reshard) for b in blocks]
    root = fully_shard(model, mesh=dp_cp_mesh, reshard_after_forward=reshard)
    for unit in [*units, root]:
        # average over dp_cp explicitly (pre-divide by 1, post-divide by D): independent of the backend's ReduceOp
        unit.set_gradient_divide_factor(float(dp_cp_mesh.size()))


# ---------------------------------------------------------------------------------------------------- stage 0, 1
def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a Lightning ``LightningOptimizer`` (or ``optimizer`` itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def reduced_by_fsdp(p: Tensor) -> bool:
    """Whether FSDP2 (ZeRO 2/3 over ``dp_cp``) already averages this parameter's gradient."""
    return isinstance(p, DTensor) and "dp_cp" in (p.device_mesh.mesh_dim_names or ())


def setup_zero(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], group: dist.ProcessGroup, zero_stage: int
) -> Optional["GradientSynchronizer"]:
    """ZeRO 0/1 for the parameters FSDP2 does not own: a :class:`GradientSynchronizer` averaging their gradients
    over ``group`` (``dp_cp``; returned, ``None`` when there is none), and with ``zero_stage=1`` (group size > 1) a
    :class:`ShardedOptimizer` around every torch optimizer (found again with :meth:`ShardedOptimizer.of`)."""
    params = [p for p in model.parameters() if p.requires_grad and not reduced_by_fsdp(p)]
    if zero_stage == 1 and dist.get_world_size(group) > 1:
        for optimizer in optimizers:
            ShardedOptimizer(optimizer, group)
    return GradientSynchronizer(params, group) if params else None


class GradientSynchronizer:
    """Averages gradients over the ``dp_cp`` group (ZeRO stages 0 and 1): bucketed ``all_reduce``, overlapped with
    the backward pass.

    Parameters are grouped into buckets of about ``bucket_bytes`` in reverse order (the order in which backward
    produces their gradients, as in PyTorch DDP). Inside :meth:`overlap_with_backward` a post-accumulate-grad hook
    launches a bucket's asynchronous all-reduce as soon as all its gradients are ready, so communication runs while
    backward computes the earlier layers. :meth:`synchronize` launches what was not launched (a backward outside the
    context: gradient accumulation's earlier micro-batches, manual optimization), waits, divides by the group size
    and writes the averages back. The strategy opens the context only around the backward of the micro-batch that
    is followed by an optimizer step, so accumulated micro-batches communicate once.

    Parameters whose gradient is ``None`` are skipped (they must be ``None`` on every rank). A tensor-parallel
    gradient whose placement differs from its parameter's (the vocabulary-parallel embedding's gradient comes back
    partial over tp) is first redistributed to the parameter's placement, so every gradient has its parameter's
    local shape (and no more memory than it).
    """

    def __init__(
        self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: Optional[int] = None
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        bucket_bytes = _BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[list[nn.Parameter]] = list(_buckets(self.params[::-1], bucket_bytes, key=_local))
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, tuple[Any, Tensor, list[nn.Parameter]]] = {}
        self._overlap = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params] if self.world > 1 else []

    def close(self) -> None:
        """Remove the backward hooks (the strategy calls it before building a new synchronizer)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @contextmanager
    def overlap_with_backward(self) -> Iterator[None]:
        """Launch each bucket's all-reduce from the backward pass that runs inside this context."""
        self._ready = [0] * len(self.buckets)
        self._overlap = True
        try:
            yield
        finally:
            self._overlap = False

    def _grad_ready(self, p: Tensor) -> None:
        if not self._overlap:
            return
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._launch(i)

    @staticmethod
    @torch.no_grad()
    def _normalize(params: Iterable[nn.Parameter]) -> None:
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        if i in self._pending:
            return
        bucket = [p for p in self.buckets[i] if p.grad is not None]
        self._normalize(bucket)
        if not bucket:
            return
        flat = torch.cat([_local(p.grad).reshape(-1) for p in bucket])
        self._pending[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Finish the averaging: launch the remaining buckets, wait for all, write the averages back."""
        if self.world == 1:
            self._normalize(self.params)
            return
        for i in range(len(self.buckets)):
            self._launch(i)
        for i in sorted(self._pending):
            work, flat, bucket = self._pending[i]
            work.wait()
            flat.div_(self.world)
            offset = 0
            for p in bucket:
                g = _local(p.grad)
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._pending = {}


class ShardedOptimizer:
    """ZeRO stage 1: shard the states of an existing ``torch.optim.Optimizer`` over a data-parallel group.

    Every parameter's local tensor (the tensor-parallel shard for a DTensor) is flattened and split into D equal
    chunks of ``ceil(n / D)`` elements (the last ones shorter or empty); rank r keeps optimizer states only for its
    chunk. At rest the optimizer's ``param_groups`` hold the real parameters (so gradient clipping and LR
    schedulers see the model); ``optimizer.step`` is replaced by a step that

    1. runs the closure (forward, backward, gradient synchronization, clipping),
    2. points the param groups at this rank's chunk views (which share storage with the parameters) and their
       gradient slices, runs the wrapped optimizer's step (so Adam's states are 1/D of the parameters),
    3. restores the param groups and all-gathers the updated chunks into every rank's parameters (one bucketed
       ``all_gather_into_tensor`` per dtype).

    Any element-wise optimizer works (SGD, Adam, AdamW, ...); optimizers that need whole tensors (Shampoo, LAMB's
    per-tensor trust ratio) are not element-wise and must not be sharded this way.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup):
        self.optimizer = optimizer
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._full_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.chunk: dict[int, int] = {}  # id(param) -> chunk length (padded)
        self.shard: dict[int, nn.Parameter] = {}  # id(param) -> this rank's chunk view
        for params in self._full_groups:
            for p in params:
                self._make_shard(p)
        self._inner_step = optimizer.step

        def step(closure: Optional[Callable[[], Any]] = None) -> Any:
            return self.step(closure)

        # the inner step is still the one an LR scheduler wrapped (it counts the calls), so keep the marker that
        # tells the scheduler its wrapper is in place
        mark_wrapped_by_lr_scheduler(step)
        optimizer.step = step  # type: ignore[method-assign]
        optimizer._lightning_4d_zero1 = self  # type: ignore[attr-defined]

    def _make_shard(self, p: Tensor) -> None:
        local = _local(p.data)
        if not local.is_contiguous():
            raise ValueError("ZeRO-1 needs contiguous parameters")
        n = local.numel()
        chunk = math.ceil(n / self.world) if n else 0
        start, end = min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)
        self.chunk[id(p)] = chunk
        self.shard[id(p)] = nn.Parameter(local.view(-1)[start:end], requires_grad=p.requires_grad)

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Optional["ShardedOptimizer"]:
        """The ``ShardedOptimizer`` wrapping ``optimizer`` (a torch optimizer), or ``None``."""
        return getattr(optimizer, "_lightning_4d_zero1", None)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, params in zip(self.optimizer.param_groups, self._full_groups):
            shards = []
            for p in params:
                s = self.shard[id(p)]
                if p.grad is not None:
                    n, chunk = s.numel(), self.chunk[id(p)]
                    start = min(self.rank * chunk, _local(p.grad).numel())
                    s.grad = _local(p.grad).reshape(-1)[start : start + n]
                else:
                    s.grad = None
                shards.append(s)
            group["params"] = shards
        try:
            self._inner_step()
        finally:
            for group, params in zip(self.optimizer.param_groups, self._full_groups):
                group["params"] = params
                for p in params:
                    self.shard[id(p)].grad = None
        self.all_gather()
        return loss

    @torch.no_grad()
    def all_gather(self) -> None:
        """Copy every rank's updated chunk into every rank's parameters (bucketed ``all_gather_into_tensor``)."""
        if self.world == 1:
            return
        params = [p for params in self._full_groups for p in params if self.chunk[id(p)] > 0]
        for bucket in _buckets([_local(p.data) for p in params], 4 * _BUCKET_BYTES):
            chunks = [math.ceil(t.numel() / self.world) for t in bucket]
            total = sum(chunks)
            mine = torch.zeros(total, dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for t, c in zip(bucket, chunks):
                flat = t.reshape(-1)[self.rank * c : (self.rank + 1) * c]
                mine[offset : offset + flat.numel()] = flat
                offset += c
            gathered = torch.empty(self.world * total, dtype=mine.dtype, device=mine.device)
            _all_gather_flat(gathered, mine, self.group)
            gathered = gathered.view(self.world, total)
            offset = 0
            for t, c in zip(bucket, chunks):
                t.view(-1).copy_(gathered[:, offset : offset + c].reshape(-1)[: t.numel()])
                offset += c

    # ------------------------------------------------------------------ checkpoint support
    def sharded_state(self, names: dict[int, str]) -> dict[str, dict[str, Tensor]]:
        """This rank's optimizer states keyed by parameter name: ``{name: {"exp_avg": chunk, ...}}``."""
        out: dict[str, dict[str, Tensor]] = {}
        for params in self._full_groups:
            for p in params:
                state = self.optimizer.state.get(self.shard[id(p)])
                if state:
                    out[names[id(p)]] = {
                        k: (v if isinstance(v, Tensor) else torch.tensor(v)) for k, v in state.items()
                    }
        return out

    def load_sharded_state(self, names: dict[int, str], states: dict[str, dict[str, Tensor]]) -> None:
        for params in self._full_groups:
            for p in params:
                s = states.get(names[id(p)])
                if s is not None:
                    self.optimizer.state[self.shard[id(p)]] = {k: v.clone() for k, v in s.items()}


def _all_gather_flat(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """``output = cat(input of every rank)`` (``all_gather_single`` where torch has it, else the older name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def local_bytes(tensors: Iterable[Optional[Tensor]]) -> int:
    """Bytes held on this rank by ``tensors`` (the local shard of a DTensor; ``None`` counts 0).

    A tensor seen twice (same data pointer and size, e.g. a tied weight) is counted once.
    """
    seen: set = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = (t.data_ptr(), t.numel()) if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
