"""ZeRO stage 1 and mixed precision with master weights: the sharded optimizer over the gradient buffers
(:class:`ShardedOptimizer`, Megatron-LM's distributed optimizer; Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054), its checkpoint state, and
:func:`setup_zero`, the ZeRO 0/1 entry point (buckets, then a ``ShardedOptimizer`` around each optimizer).

**Mixed precision** (``bf16-mixed`` for ``lightning_4d`` Llama models; Micikevicius et al. 2018, "Mixed Precision
Training", arXiv 1710.03740, as Megatron-LM and torchtitan do it): the weights the layers compute with are bfloat16,
the float32 master weights live with the optimizer states and are sharded like them, gradients are accumulated and
reduced in float32, the update runs in float32 and the bfloat16 weights are refreshed from the masters. Stages 0/1:
``setup_zero(masters=MasterWeights(torch.float32))`` (bf16 parameters, fp32 gradient buckets, fp32 masters in
:class:`ShardedOptimizer`: 2 + 4 + 12/D bytes per parameter at stage 1, 18 at stage 0); stages 2/3:
:func:`lightning_4d.parallel.fsdp.apply_fsdp`.

The gradients live in :mod:`lightning_4d.parallel.grad_buffers`; clipping by the global norm is
:func:`lightning_4d.parallel.clipping.clip_grad_norm_`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.config import check_training_precision
from lightning_4d.parallel._compat.collectives import all_gather_single
from lightning_4d.parallel._compat.dtensor import local_tensor as _local
from lightning_4d.parallel.fsdp import reduced_by_fsdp
from lightning_4d.parallel.grad_buffers import Bucket, GradientBuckets, GradientReduction
from lightning_4d.parallel.optimizer_offload import host_allocations, host_copy, host_empty_like, wait_for_copies
from lightning_4d.partition import gradient_buckets_needed


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a Lightning ``LightningOptimizer`` (or ``optimizer`` itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def mixed_precision_dtype(precision: Optional[str]) -> Optional[torch.dtype]:
    """The compute dtype of mixed precision with master weights for a Lightning ``precision`` flag:
    ``torch.bfloat16`` for ``"bf16-mixed"``, ``None`` for the others (``"16-mixed"`` keeps Lightning's autocast and
    gradient scaler)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def validate_precision(precision: Optional[str], zero_stage: int, full_file_checkpoints: bool = False) -> None:
    """Refuse a precision ZeRO cannot serve, before any process group exists.

    Raises:
        ValueError: ``"16-mixed"`` (:func:`lightning_4d.config.check_training_precision`); master weights
            (``"bf16-mixed"``) at ZeRO 0 with full-file checkpoints (``full_file_checkpoints``:
            ``save_distributed_checkpoint=False``; each rank's master weights and optimizer states are saved in the
            sharded folder's per-rank files only).
    """
    if precision is not None:
        check_training_precision(precision)
    if mixed_precision_dtype(precision) is not None and zero_stage == 0 and full_file_checkpoints:
        raise ValueError(
            f"save_distributed_checkpoint=False is not supported with precision={precision!r} and zero_stage=0: the "
            "fp32 master weights live with the optimizer states, saved per rank in a sharded folder. Use "
            "save_distributed_checkpoint=True, or zero_stage 2 or 3 (FSDP2: the fp32 parameters are the masters)."
        )


@dataclass(frozen=True)
class MasterWeights:
    """What every :class:`ShardedOptimizer` that :func:`setup_zero` makes steps, and where.

    Attributes:
        dtype: the dtype of master weights and gradients (``torch.float32`` under ``bf16-mixed`` for
            ``lightning_4d`` Llama models, whose parameters are then bfloat16), or ``None`` (the parameters are the
            master weights). The buckets' hooks are then not registered yet: cast the parameters, then call
            :meth:`GradientBuckets.register_hooks`.
        tp_rank: this rank's tensor-parallel rank (tp-replicated parameters count once in the clipping norm).
        offload: ``optimizer_offload``: every optimizer gets a :class:`ShardedOptimizer` whose owned slices, their
            gradients and the optimizer's states live on the host (:mod:`lightning_4d.parallel.optimizer_offload`;
            the gradients are then always in buckets).
    """

    dtype: Optional[torch.dtype] = None
    tp_rank: int = 0
    offload: bool = False


def setup_zero(
    model: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    group: dist.ProcessGroup,
    zero_stage: int,
    masters: MasterWeights = MasterWeights(),
    reduction: GradientReduction = GradientReduction(),
    pipelined: bool = False,
) -> Optional["GradientBuckets"]:
    """ZeRO 0/1 for the parameters FSDP2 does not own (:func:`zero_parameters`): their gradients in
    :class:`GradientBuckets` over ``group`` (``dp_cp``; returned, ``None`` when there is none, or when the gradients
    need no bucket: one rank, no master weights, no pipeline, no tensor-parallel parameter
    (:func:`lightning_4d.partition.gradient_buckets_needed`; they then stay in ``.grad``)), and a
    :class:`ShardedOptimizer` around every torch optimizer (found again with :meth:`ShardedOptimizer.of`) when
    ``zero_stage == 1`` (the states of 1/D of the buckets per rank) or when there are master weights
    (``masters.dtype``: the parameters are in a lower precision and the optimizer steps float32 copies of them).

    Args:
        model: the module whose parameters are trained.
        optimizers: the torch optimizers (not Lightning's wrappers) over those parameters.
        group: the group ZeRO shards over: ``dp_cp``, under HSDP ``dp_shard_cp`` (``reduction.replicas`` then the
            ``dp_replicate`` group).
        zero_stage: 0 or 1 (2, 3: the parameters FSDP2 owns are skipped, the rest get stage-0 treatment).
        masters: the master weights' dtype, the tensor-parallel rank and optimizer offload (:class:`MasterWeights`).
        reduction: the buckets' gradient compression and the groups other features reduce their parameters over
            (:class:`~lightning_4d.parallel.grad_buffers.GradientReduction`); with any such group every optimizer
            gets a :class:`ShardedOptimizer` (also at ZeRO 0: its clipping counts each gradient once).
        pipelined: a pipeline schedule runs the steps (its micro-batches accumulate in the buckets).
    Raises:
        ValueError: an optimizer holds a parameter the buckets do not (a frozen one or one FSDP2 owns) while it must
            be sharded or given a master weight.
    """
    params = zero_parameters(model)
    if not params:
        return None
    world, gradient_groups = dist.get_world_size(group), reduction.gradient_groups
    replicas = 1 if reduction.replicas is None else dist.get_world_size(reduction.replicas)  # HSDP
    tensor_parallel = any(isinstance(p, DTensor) for p in params)
    master_dtype, offload = masters.dtype, masters.offload
    needed = gradient_buckets_needed(world * replicas, bool(master_dtype), pipelined, tensor_parallel, offload)
    if not gradient_groups and not needed:
        return None
    shard = zero_stage == 1 and world > 1
    # with master weights the parameters are cast after this: their hooks are registered then (register_hooks)
    hooks = master_dtype is None
    buckets = GradientBuckets(
        params, group, reduce_scatter=shard, grad_dtype=master_dtype, hooks=hooks, reduction=reduction
    )
    # gradient groups live in buckets over other groups: only the ShardedOptimizer's clipping counts each once (and
    # torch's would mix plain and DTensor gradients)
    if shard or master_dtype is not None or gradient_groups or offload:
        for optimizer in optimizers:
            ShardedOptimizer(optimizer, buckets, master_dtype=master_dtype, tp_rank=masters.tp_rank, offload=offload)
    return buckets


def zero_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``model`` that FSDP2 does not own: those whose gradients ZeRO 0/1 handles
    (:func:`setup_zero`), in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad and not reduced_by_fsdp(p)]


#: ``{torch optimizer: the ShardedOptimizer around it}`` (:meth:`ShardedOptimizer.of`); weak keys: an entry goes
#: with its optimizer
_SHARDED_OPTIMIZERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, ShardedOptimizer]" = weakref.WeakKeyDictionary()


class ShardedOptimizer:
    """ZeRO stage 1 and mixed-precision master weights around an existing element-wise ``torch.optim.Optimizer``
    (SGD, Adam, AdamW, ...; not Shampoo or LAMB, which need whole tensors), over :class:`GradientBuckets`.

    Each parameter's *owned slice* is the part of its flat local tensor that falls in this rank's 1/D of its bucket
    (ZeRO 1, Megatron-LM's distributed optimizer; a parameter may straddle ranks or own nothing) or all of it (ZeRO 0
    with master weights). For each owned slice the optimizer steps one tensor: a float32 copy of the slice when
    ``master_dtype`` is given (the master weight; the model's parameter is bfloat16), else a view of the parameter
    itself. Per parameter that is, with D = dp·cp ranks: ZeRO 1 under ``bf16-mixed``, 2 (bf16 weight) + 4 (fp32
    gradient in its bucket) + 12/D (fp32 master, Adam m and v) bytes, Megatron-LM's distributed optimizer; ZeRO 0
    under ``bf16-mixed``, 18 bytes.

    At rest the optimizer's ``param_groups`` hold the model's parameters (so LR schedulers and checkpoints see the
    model). The optimizer itself is left untouched: :meth:`of` finds the ``ShardedOptimizer`` of an optimizer, and
    the strategy's precision plugin (:class:`lightning_4d.precision.FourDPrecision`) calls :meth:`step` in place of
    ``optimizer.step``, which

    1. runs the closure (forward, backward, gradient averaging, clipping),
    2. points the param groups at the owned tensors, their gradients at the owned slices of the buckets, and runs
       the wrapped optimizer's step (its states are those of the owned slices only; with ``offload`` the owned
       gradient slices are first copied into host tensors and the step runs on the host copies, on the CPU),
    3. restores the param groups, copies the updated masters into the parameters (cast to their dtype) and, at
       ZeRO 1, all-gathers every bucket's updated parameters (``all_gather_into_tensor`` of each rank's range).

    With ``offload`` (``optimizer_offload=True``, :mod:`lightning_4d.parallel.optimizer_offload`) every owned slice
    is stepped through a host copy (the float32 master under ``master_dtype``, else a copy in the parameter's dtype)
    with a host gradient tensor of its own: the optimizer's states are made beside them, on the host, and its step
    runs there.

    Raises:
        ValueError: an optimizer parameter that is not in the buckets, or a non-contiguous one.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: GradientBuckets,
        master_dtype: Optional[torch.dtype] = None,
        tp_rank: int = 0,
        offload: bool = False,
    ) -> None:
        self._optimizer = weakref.ref(optimizer)  # weak: the registry's value must not keep its key alive
        self.buckets = buckets
        self.master_dtype = master_dtype
        self.tp_rank = tp_rank
        self.world = buckets.world if buckets.reduce_scatter else 1
        self.rank = buckets.rank if buckets.reduce_scatter else 0
        self.sharded = buckets.reduce_scatter  # ZeRO 1: each rank owns its range of every bucket (over its group)
        self._full_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.owned: dict[int, tuple[int, int]] = {}  # id(param) -> [start, end) of its flat local tensor
        self.shard: dict[int, nn.Parameter] = {}  # id(param) -> the tensor the optimizer steps
        self.has_master: set[int] = set()  # id(param) of the parameters stepped through a separate master copy
        self.offload = offload  # the owned slices, their gradients and the optimizer's states on the host
        self.host_grad: dict[int, Tensor] = {}  # id(param) -> the host tensor its owned gradient slice is copied into
        for params in self._full_groups:
            for p in params:
                self._make_shard(p)
        # looked up by the optimizer (:meth:`of`) without touching it; the entry lives as long as the optimizer
        _SHARDED_OPTIMIZERS[optimizer] = self

    def _make_shard(self, p: Tensor) -> None:
        if not self.buckets.holds(p):
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is frozen or owned by FSDP2: ZeRO 1 "
                "and master weights need every optimizer parameter to be trainable and outside FSDP2 units."
            )
        local = _local(p.data)
        if not local.is_contiguous():
            raise ValueError("ZeRO 1 and master weights need contiguous parameters")
        bucket, offset = self.buckets.bucket_of(p)
        lo, hi = self._own_range(bucket)
        start, end = min(max(lo - offset, 0), local.numel()), min(max(hi - offset, 0), local.numel())
        self.owned[id(p)] = (start, end)
        flat = local.view(-1)[start:end]
        if self.offload:  # a host copy, never a view (also on the CPU): the master, or the parameter's own dtype
            flat = host_copy(flat.detach(), self.master_dtype or flat.dtype)
            self.host_grad[id(p)] = host_empty_like(flat, local.device)
            if self.master_dtype is not None:
                self.has_master.add(id(p))
        elif self.master_dtype is not None:  # the parameter is cast to the compute dtype after this
            flat = flat.detach().to(self.master_dtype, copy=True)
            self.has_master.add(id(p))
        self.shard[id(p)] = nn.Parameter(flat, requires_grad=p.requires_grad)

    def _own_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's range of ``bucket`` at ZeRO 1 (over the bucket's group), the whole bucket otherwise."""
        return bucket.own_range(bucket.rank, bucket.world) if self.sharded and bucket.world > 1 else (0, bucket.padded)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        optimizer = self._optimizer()
        assert optimizer is not None, "the wrapped optimizer no longer exists"
        return optimizer

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Optional["ShardedOptimizer"]:
        """The ``ShardedOptimizer`` wrapping ``optimizer`` (a torch optimizer, not Lightning's wrapper), or ``None``."""
        return _SHARDED_OPTIMIZERS.get(optimizer)

    def parameters(self) -> list[nn.Parameter]:
        """The model parameters of the wrapped optimizer."""
        return [p for params in self._full_groups for p in params]

    def owned_grad(self, p: Tensor) -> Optional[Tensor]:
        """The owned slice of ``p``'s averaged gradient in its bucket, ``None`` when ``p`` got no gradient."""
        if not self.buckets.has_grad(p):
            return None
        start, end = self.owned[id(p)]
        return self.buckets.main_grad(p)[start:end]

    def master_tensors(self) -> list[Tensor]:
        """The master weights (``[]`` without ``master_dtype``: the parameters are their own masters)."""
        return [self.shard[i] for i in self.shard if i in self.has_master]

    def host_tensors(self) -> list[Tensor]:
        """With ``offload``: the host copies of the owned slices (masters included) and their host gradients (the
        optimizer's states are in its ``state``); ``[]`` without."""
        if not self.offload:
            return []
        return [*self.shard.values(), *self.host_grad.values()]

    def _stepped_copy(self, p: Tensor) -> bool:
        """Whether ``p``'s owned slice is stepped through a separate tensor (a master, or a host copy) that is
        copied back into the parameter after the step."""
        return self.offload or id(p) in self.has_master

    def _grad_to_step(self, p: Tensor) -> Optional[Tensor]:
        """The gradient the wrapped optimizer reads for ``p``'s owned slice: the slice of its bucket, or with
        ``offload`` that slice copied (non-blocking) into its host tensor."""
        grad = self.owned_grad(p)
        if grad is None or not self.offload:
            return grad
        host = self.host_grad[id(p)]
        host.copy_(grad, non_blocking=True)
        return host

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step in place of the wrapped optimizer's (class docstring: closure, step of the owned slices,
        master write-back, ZeRO-1 all-gather); the wrapped ``optimizer.step`` runs inside it, so an LR scheduler
        that wrapped that method counts the step. Returns the closure's result (``None`` without closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, params in zip(self.optimizer.param_groups, self._full_groups):
            for p in params:
                self.shard[id(p)].grad = self._grad_to_step(p)
            group["params"] = [self.shard[id(p)] for p in params]
        try:
            if self.offload:  # the gradients' copies to the host done, the step on the host tensors
                wait_for_copies(self.buckets.buckets[0].device)
                with host_allocations():
                    self.optimizer.step()
            else:
                self.optimizer.step()
        finally:
            for group, params in zip(self.optimizer.param_groups, self._full_groups):
                group["params"] = params
                for p in params:
                    self.shard[id(p)].grad = None
        self._write_back()
        return loss

    @torch.no_grad()
    def _write_back(self) -> None:
        """Copy the updated masters into the parameters, then (ZeRO 1) all-gather every bucket's parameters."""
        for p in self.parameters():
            if self._stepped_copy(p):
                start, end = self.owned[id(p)]
                if end > start:  # with offload, host to device (non-blocking: ordered before the all-gather)
                    _local(p.data).view(-1)[start:end].copy_(self.shard[id(p)], non_blocking=self.offload)
        if not self.sharded:
            return
        mine = set(map(id, self.parameters()))
        for bucket in self.buckets.buckets:
            params = [p for p in bucket.params if id(p) in mine]
            if not params or bucket.world == 1:
                continue
            slices = {id(p): _local(p.data).view(-1)[slice(*self.owned[id(p)])] for p in params}
            gathered = self._gather_owned(bucket, params, slices, _local(params[0]).dtype)
            for p in params:
                offset = bucket.offsets[id(p)]
                local = _local(p.data).view(-1)
                local.copy_(gathered[offset : offset + local.numel()])
            del gathered  # one bucket's temporaries at a time

    def _gather_owned(
        self, bucket: Bucket, params: list[Tensor], slices: dict[int, Tensor], dtype: torch.dtype
    ) -> Tensor:
        """The whole bucket ``[padded]`` in ``dtype`` from every rank's owned slices: this rank's ``slices``
        (``{id(p): owned slice of p's tensor}``; a missing one counts as zeros) are placed at their bucket offsets
        in its own range, which is all-gathered over the bucket's group (without ZeRO 1 the range is the whole
        bucket)."""
        lo, hi = self._own_range(bucket)
        own = torch.zeros(hi - lo, dtype=dtype, device=bucket.device)
        for p in params:
            if id(p) in slices:
                start, end = self.owned[id(p)]
                at = bucket.offsets[id(p)] + start - lo
                own[at : at + end - start] = slices[id(p)]
        if not self.sharded or bucket.world == 1:
            return own
        gathered = torch.empty(bucket.padded, dtype=dtype, device=own.device)
        _all_gather_flat(gathered, own, bucket.group)
        return gathered

    # ------------------------------------------------------------------ clipping by value (by norm: clipping.py)
    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every averaged gradient element to ``[-clip_value, clip_value]``, in place."""
        for p in self.parameters():
            g = self.owned_grad(p)
            if g is not None:
                g.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ checkpoint support
    @torch.no_grad()
    def gathered_state(self, fqns: dict[int, str]) -> dict[str, Any]:
        """The optimizer state in the layout-free form of ``torch.distributed.checkpoint.state_dict``'s
        ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, the form ZeRO 0/2/3 save:
        ``{"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<hyper-parameter>": value}``. Collective over the
        ``dp_cp`` group (call it on every rank).

        Each element-wise state (Adam's ``exp_avg`` / ``exp_avg_sq``, the float32 ``master`` weight) is all-gathered
        over ``dp_cp``, one bucket and one state at a time, into the parameter's whole local (tp-shard) tensor, then
        copied into the CPU: for a DTensor parameter a DTensor with the parameter's mesh and placements whose local
        tensor stays on the CPU (:func:`host_zeros_like`; so the checkpoint reshards on load to any tp / pp / dp /
        ZeRO stage). Scalar states (``step``) are copied to the CPU. Transient memory: one bucket's gather on the
        device; on the CPU, this rank's tp-shard of every state (12 bytes per local parameter with masters, 8
        without), freed once the checkpoint is written.
        """
        out: dict[str, Any] = {}
        mine = set(map(id, self.parameters()))
        for bucket in self.buckets.buckets:
            params = [p for p in bucket.params if id(p) in mine]
            states = {id(p): self._state_with_master(p) for p in params}
            keys = sorted({k for st in states.values() for k, v in st.items() if v.ndim == 1})
            for key in keys:
                dtype = next(st[key].dtype for st in states.values() if key in st)
                slices = {id(p): st[key] for p in params if key in (st := states[id(p)])}
                gathered = self._gather_owned(bucket, params, slices, dtype)
                for p in params:
                    offset, full = bucket.offsets[id(p)], host_zeros_like(p, dtype)
                    host = _local(full).view(-1)
                    host.copy_(gathered[offset : offset + host.numel()])  # one device-to-host copy
                    out[f"state.{fqns[id(p)]}.{key}"] = full
                del gathered
            for p in params:
                for k, v in states[id(p)].items():
                    if v.ndim == 0:
                        out[f"state.{fqns[id(p)]}.{k}"] = v.detach().cpu().clone()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in group.items():
                    if k != "params":
                        out[f"param_groups.{fqns[id(p)]}.{k}"] = v
        return out

    def _state_with_master(self, p: Tensor) -> dict[str, Tensor]:
        shard = self.shard[id(p)]
        state = {
            k: (v if isinstance(v, Tensor) else torch.tensor(v))
            for k, v in (self.optimizer.state.get(shard) or {}).items()
        }
        if id(p) in self.has_master:
            state["master"] = shard.detach()
        return state

    @torch.no_grad()
    def load_gathered_state(
        self, fqns: dict[int, str], flat: dict[str, Any], weights: Optional[dict[str, Tensor]] = None
    ) -> None:
        """Inverse of :meth:`gathered_state` on any layout: ``flat`` holds, for this rank's parameters, whole local
        (tp-shard) states as the checkpoint loader filled them (:func:`lightning_4d.checkpoint.load_sharded`); each
        rank keeps its owned slices. The master weights come from ``flat``'s ``master`` entries when present, else
        from ``weights`` (``{fqn: the saved weight read in float32}``, what a folder holds since the masters are
        saved as the model's weights), else from the loaded parameters. The parameters are then refreshed from the
        masters."""
        weights = weights or {}
        by_fqn: dict[str, dict[str, Any]] = {}  # "state.<fqn>.<field>" -> {fqn: {field: value}}, one pass
        for key, value in flat.items():
            if key.startswith("state."):
                fqn, _, field = key[len("state.") :].rpartition(".")
                by_fqn.setdefault(fqn, {})[field] = value
        loaded: dict[int, dict[str, Tensor]] = {}
        for p in self.parameters():
            shard = self.shard[id(p)]
            start, end = self.owned[id(p)]
            state: dict[str, Tensor] = {}
            for field, value in by_fqn.get(fqns[id(p)], {}).items():
                value = _local(value)
                state[field] = (
                    value.clone()
                    if value.ndim == 0
                    else value.reshape(-1)[start:end].to(device=shard.device, copy=True)
                )
            master = state.pop("master", None)
            if master is None and fqns[id(p)] in weights:
                master = _local(weights[fqns[id(p)]]).reshape(-1)[start:end]
            if self._stepped_copy(p):
                shard.copy_(master if master is not None else _local(p.data).view(-1)[start:end])
            if state:
                loaded[id(p)] = state
        with host_allocations() if self.offload else contextlib.nullcontext():
            self._load_states(loaded)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key in group:
                    if key != "params" and f"param_groups.{fqns[id(p)]}.{key}" in flat:
                        group[key] = flat[f"param_groups.{fqns[id(p)]}.{key}"]
        if self.has_master or self.offload:
            self._write_back()

    @torch.no_grad()
    def load_sharded_state(self, names: dict[int, str], states: dict[str, dict[str, Tensor]]) -> None:
        """Load the per-rank ZeRO-1 files of folders saved before :meth:`gathered_state` existed
        (``{name: {"exp_avg": slice, ..., "master": slice}}``, same layout only); then the parameters are refreshed
        from the masters."""
        loaded: dict[int, dict[str, Tensor]] = {}
        for p in self.parameters():
            s = dict(states.get(names[id(p)]) or {})
            master = s.pop("master", None)
            if self._stepped_copy(p):  # no master saved (another precision): the loaded weights are the master
                start, end = self.owned[id(p)]
                self.shard[id(p)].copy_(master if master is not None else _local(p.data).view(-1)[start:end])
            if s:
                loaded[id(p)] = {k: v.clone() for k, v in s.items()}
        with host_allocations() if self.offload else contextlib.nullcontext():
            self._load_states(loaded)
        if self.has_master or self.offload:
            self._write_back()

    def _load_states(self, states: dict[int, dict[str, Tensor]]) -> None:
        """Make ``states`` (``{id(model parameter): {"step": scalar, "exp_avg": owned slice, ...}}``) the wrapped
        optimizer's states of those parameters' owned shards, through torch's own ``Optimizer.load_state_dict``: each
        tensor gets the device and dtype torch gives it on a resume (``step`` as it is, or in float32 on the shard's
        device for a ``fused`` or ``capturable`` optimizer, whose kernels read it there; the element-wise states in
        the shard's dtype on its device). The other shards keep their states; the param groups keep their
        hyper-parameters and, once done, hold the model's parameters again."""
        optimizer = self.optimizer
        for group, params in zip(optimizer.param_groups, self._full_groups):
            group["params"] = [self.shard[id(p)] for p in params]
        try:
            packed = optimizer.state_dict()  # the shards numbered as load_state_dict numbers them
            index = {id(p): i for i, p in enumerate(p for params in self._full_groups for p in params)}
            packed["state"].update({index[i]: state for i, state in states.items()})
            optimizer.load_state_dict(packed)
        finally:
            for group, params in zip(optimizer.param_groups, self._full_groups):
                group["params"] = params


def host_zeros_like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """A zero tensor shaped like ``p``'s local (tp-shard) tensor, in ``dtype``, in host (CPU) memory.

    For a DTensor ``p`` the result is a DTensor with ``p``'s mesh, placements, global shape and stride whose local
    tensor is on the CPU whatever the mesh's device type: ``DTensor.from_local`` would copy a CPU tensor to the
    device of a CUDA mesh, so the DTensor is made on the meta device (which ``from_local`` leaves where it is) and
    then on the CPU by ``torch.zeros_like``. DCP saves such a DTensor and loads into one (torch's asynchronous save
    stages its DTensors in CPU memory the same way). Bytes: ``p``'s local element count times ``dtype``'s size.
    """
    local = _local(p)
    if not isinstance(p, DTensor):
        return torch.zeros(local.shape, dtype=dtype, device="cpu")
    meta = torch.empty(local.shape, dtype=dtype, device="meta")
    spec = DTensor.from_local(meta, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.zeros_like(spec, device="cpu")


def _all_gather_flat(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """``output = cat(input of every rank)``."""
    all_gather_single(output, input, group=group)
