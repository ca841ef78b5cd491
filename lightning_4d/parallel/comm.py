"""Bytes on the wire: :class:`CommMeter` counts what each rank sends, per mesh dimension and collective kind, and
:class:`CommMeterCallback` logs it per training step as ``comm_bytes/<dim>``.

**What it sees.** The meter is a ``TorchDispatchMode``. Every eager ``torch.distributed`` call dispatches to a
``torch.ops.c10d`` operator (``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``, ``broadcast_``,
``alltoall_base_``, ``send``, ``recv_``, their list and coalesced forms): what our gradient buckets, FSDP2
(``fully_shard``'s all-gathers and reduce-scatters), ``torch.distributed.pipelining`` (``batch_isend_irecv``) and
our context-parallel ring issue. DTensor (tensor parallelism, its redistributions) issues functional collectives
(``torch.ops._c10d_functional``): the meter lets DTensor run first (it returns ``NotImplemented`` for ops on tensor
subclasses, as ``torch.distributed.tensor.debug.CommDebugMode`` does) and counts the collectives DTensor desugars
into. Asynchronous collectives are counted when issued. It does not see collectives issued by code it does not
wrap: another thread without the mode (the mode is thread-local; autograd's CPU backward runs on the calling
thread), or a C++ extension calling NCCL directly.

**What it counts** (bytes one rank sends, the volume of the bandwidth-optimal algorithm; NCCL and gloo may choose
another, e.g. a tree for small all-reduces), for a collective over a group of D ranks and a buffer of n bytes
(Thakur, Rabenseifner and Gropp 2005, "Optimization of collective communication operations in MPICH"; Patarasuk
and Yuan 2009 for the ring all-reduce):

- all-reduce of n bytes: ``2·(D−1)/D·n`` (a reduce-scatter and an all-gather);
- all-gather into n bytes, reduce-scatter of n bytes, all-to-all of n bytes in equal splits: ``(D−1)/D·n``;
- all-to-all with split sizes (the MoE component's token dispatch and combine,
:mod:`lightning_4d.features.moe.runtime`):
  the rows sent to the other ranks, ``(Σ_j input_splits[j] − input_splits[own rank])·row bytes`` (exact: every rank
  sends each peer its block directly, the pairwise exchange of Thakur et al. §4.5);
- broadcast of n bytes: ``(D−1)/D·n`` (scatter + all-gather, the large-message algorithm);
- send: n; a receive sends nothing (its bytes are counted under ``recv`` in :attr:`CommMeter.received`).

A group is named by the mesh dimension it belongs to (``tp``, ``cp``, ``dp``, ``pp``, ``dp_cp``, and the groups the
MoE component adds, :func:`lightning_4d.features.moe.runtime.comm_groups`: the groups of
:class:`~lightning_4d.mesh.ParallelMesh`), else ``"other"``; groups of one rank send nothing. Where two dimensions
share one group (cp = 1: ``dp`` is ``dp_cp``; dp = 1: ``cp`` is ``dp_cp``), collectives count under ``dp_cp``
(gradient reduction, ZeRO, the load-balancing counts), point-to-point traffic under ``cp`` or ``pp`` (the ring, the
pipeline) and all-to-alls under the first of :class:`CommMeter`'s ``all_to_all`` dimensions whose group it is
(:meth:`CommMeter.for_mesh`: the MoE component's, :data:`lightning_4d.features.moe.runtime.ALL_TO_ALL_DIMS`, then
``cp``, whose all-to-alls are ``context_parallel_method="alltoall"``'s: per layer and micro-batch, forward and backward,
one all-to-all of the packed q, k, v and one of the attention output, each sending ``(cp−1)/cp`` of its buffer;
``planning/step_time.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional, Sequence

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_4d.contract import layout_strategy
from lightning_4d.parallel._compat.collectives import process_group_of_name, unbox_process_group
from lightning_4d.parallel._compat.dispatch import TorchDispatchMode, tree_flatten

__all__ = ["COLLECTIVE_KINDS", "CommMeter", "CommMeterCallback", "bytes_sent"]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")

# operator name -> (kind, index of the argument holding the n bytes); c10d ops carry the process group as an
# argument, functional ops its name
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}
# functional ops: the all-gathers' argument is the input (n = input × D)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_": ("broadcast", 0),
    "isend": ("send", 0),
    "irecv": ("recv", 0),
}


def bytes_sent(kind: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective ``kind`` over ``group_size`` ranks on a buffer of ``nbytes`` bytes
    (module docstring; integer division, exact for the buffers our layouts use: multiples of D)."""
    d = group_size
    if kind == "recv" or d <= 1 and kind != "send":
        return 0
    if kind == "all_reduce":
        return 2 * (d - 1) * nbytes // d
    if kind == "send":
        return nbytes
    return (d - 1) * nbytes // d


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _split_bytes(inp: torch.Tensor, input_splits: Any, group: Any) -> Optional[int]:
    """Bytes this rank sends in an all-to-all of ``inp`` with ``input_splits`` rows for each rank of ``group``: every
    row but those of its own block (``None`` for equal splits, ``input_splits`` empty: :func:`bytes_sent`)."""
    if not input_splits:
        return None
    rows = int(sum(input_splits))
    row_bytes = inp.numel() * inp.element_size() // rows if rows else 0
    return (rows - int(input_splits[group.rank()])) * row_bytes


class CommMeter(TorchDispatchMode):
    """Count the bytes this rank sends inside the ``with`` block, per mesh dimension and collective kind.

    Args:
        groups: ``{dimension name: process group}`` (e.g. :meth:`for_mesh`); groups not named count as ``"other"``.
        all_to_all: the dimensions whose groups carry all-to-all traffic, the first that names a group wins
            (module docstring).

    Attributes:
        sent: ``{dim: {kind: bytes}}`` sent by this rank (module docstring: the conventions).
        received: ``{dim: bytes}`` received by point-to-point receives.
        calls: ``{dim: {kind: count}}``.
        events: ``[(dim, kind, buffer bytes n, group size D), ...]`` in the order issued.
    """

    def __init__(self, groups: Optional[dict[str, Any]] = None, all_to_all: Sequence[str] = ("cp",)) -> None:
        super().__init__()
        self._dims: dict[str, str] = {}
        self._p2p_dims: dict[str, str] = {}
        self._a2a_dims: dict[str, str] = {}
        for dim, group in (groups or {}).items():
            self._dims.setdefault(group.group_name, dim)  # the first name given wins (dp_cp before dp)
            if dim in ("cp", "pp"):  # point-to-point traffic: the cp ring and the pipeline
                self._p2p_dims.setdefault(group.group_name, dim)
        for dim in all_to_all:  # all-to-all traffic (cp: Ulysses' q/k/v and output exchange)
            if dim in (groups or {}):
                self._a2a_dims.setdefault(groups[dim].group_name, dim)
        self.sent: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.received: dict[str, int] = defaultdict(int)
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.events: list[tuple[str, str, int, int]] = []

    @staticmethod
    def for_mesh(mesh: Any) -> "CommMeter":
        """A meter naming the groups of a :class:`~lightning_4d.mesh.ParallelMesh` (``dp_cp`` first, then tp, cp, dp,
        pp, and the MoE component's, :func:`lightning_4d.features.moe.runtime.comm_groups`)."""
        from lightning_4d.features.moe import runtime as moe

        return CommMeter(
            {
                "dp_cp": mesh.dp_cp.get_group(),
                "tp": mesh.tp.get_group(),
                "cp": mesh.cp.get_group(),
                "dp": mesh.dp.get_group(),
                "pp": mesh.pp.get_group(),
                **moe.comm_groups(mesh),
            },
            all_to_all=(*moe.ALL_TO_ALL_DIMS, "cp"),
        )

    def total(self, dim: Optional[str] = None) -> int:
        """Bytes sent in all, or over one dimension."""
        dims: Iterable[str] = [dim] if dim is not None else list(self.sent)
        return sum(sum(self.sent[d].values()) for d in dims)

    def by_dim(self) -> dict[str, int]:
        """``{dim: bytes sent}``."""
        return {d: sum(kinds.values()) for d, kinds in self.sent.items()}

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.calls.clear()
        self.events.clear()

    def _record(self, kind: str, nbytes: int, group: Any, sent: Optional[int] = None) -> None:
        """Count one collective of ``kind`` on a buffer of ``nbytes`` over ``group``; ``sent``: the bytes this rank
        sends when the buffer alone does not say (an all-to-all with split sizes), else :func:`bytes_sent`."""
        name = group.group_name
        if kind in ("send", "recv"):
            dim = self._p2p_dims.get(name, self._dims.get(name, "other"))
        elif kind == "all_to_all":
            dim = self._a2a_dims.get(name, self._dims.get(name, "other"))
        else:
            dim = self._dims.get(name, "other")
        size = group.size()
        if kind == "recv":
            self.received[dim] += nbytes
        else:
            self.sent[dim][kind] += bytes_sent(kind, nbytes, size) if sent is None else sent
        self.calls[dim][kind] += 1
        self.events.append((dim, kind, nbytes, size))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain-tensor collectives first (as CommDebugMode does)
        namespace = func.namespace  # an OpOverload's: "aten", "c10d", "_c10d_functional", ...
        if namespace == "c10d":
            entry = _C10D.get(func._opname)
            if entry is not None:
                kind, index = entry
                group = next(
                    unbox_process_group(a)
                    for a in args
                    if isinstance(a, torch.ScriptObject) and unbox_process_group(a) is not None
                )
                sent = _split_bytes(args[1], args[4], group) if func._opname == "alltoall_base_" else None
                self._record(kind, _nbytes(args[index]), group, sent)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd"):
            if func._opname == "batch_p2p_ops":
                ops, _, _, tensors, name = args[:5]
                group = process_group_of_name(name)
                for op, tensor in zip(ops, tensors):
                    self._record("send" if "send" in op else "recv", _nbytes(tensor), group)
            else:
                entry = _FUNCTIONAL.get(func._opname)
                if entry is not None:
                    kind, index = entry
                    group = process_group_of_name(args[-1] if not isinstance(args[-1], int) else kwargs["group_name"])
                    nbytes = _nbytes(args[index])
                    if kind == "all_gather":
                        nbytes *= group.size()
                    sent = _split_bytes(args[0], args[2], group) if func._opname == "all_to_all_single" else None
                    self._record(kind, nbytes, group, sent)
        return func(*args, **kwargs)


class CommMeterCallback(L.Callback):
    """Log the bytes this rank sends per training step and mesh dimension: ``comm_bytes/<dim>`` (and
    ``comm_bytes/total``), measured by a :class:`CommMeter` around each ``training_step`` and optimizer step (a
    step's collectives: FSDP2's, the pipeline's and the tensor-parallel ones in the step, the gradient reduction
    before the optimizer). Needs a strategy with a ``mesh`` (:class:`~lightning_4d.FourDStrategy`).

    Args:
        per_kind: also log ``comm_bytes/<dim>/<kind>``.
        every_n_steps: measure one step in this many (the first included): the meter slows the steps it measures.

    The meter slows the step (every operator passes through a Python dispatch mode): for measuring, not for
    production runs.
    """

    def __init__(self, per_kind: bool = False, every_n_steps: int = 1) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} is not valid: expected an integer >= 1.")
        self.per_kind = per_kind
        self.every_n_steps = every_n_steps
        self.meter: Optional[CommMeter] = None
        self.history: list[dict[str, int]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        layout = layout_strategy(trainer.strategy)
        if layout is None:
            raise ValueError(
                "CommMeterCallback needs a strategy with a mesh (lightning_4d.FourDStrategy); got "
                f"{type(trainer.strategy).__name__}."
            )
        self.meter = CommMeter.for_mesh(layout.mesh)
        self.meter.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.meter is None:
            return
        self.meter.__exit__(None, None, None)
        meter, self.meter = self.meter, None
        row = {f"comm_bytes/{d}": v for d, v in meter.by_dim().items()}
        row["comm_bytes/total"] = meter.total()
        if self.per_kind:
            row.update({f"comm_bytes/{d}/{k}": v for d, kinds in meter.sent.items() for k, v in kinds.items()})
        row["step"] = trainer.global_step
        self.history.append(row)
        pl_module.log_dict(
            {k: float(v) for k, v in row.items() if k != "step"},
            on_step=True,
            on_epoch=False,
            sync_dist=False,
            rank_zero_only=True,
        )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.meter = None
