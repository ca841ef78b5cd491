"""Collectives and process groups: torch's current names of the flat collectives, and the process group behind a
``torch.ops.c10d`` argument or a functional collective's ``group_name`` (the communication meter)."""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist

#: ``all_gather_single(output, input, group=, async_op=)``: torch's current name of the flat all-gather (its older
#: name ``all_gather_into_tensor``, same signature, warns a FutureWarning on every call since torch 2.10)
try:
    from torch.distributed import all_gather_single  # noqa: F401  (re-exported)
except ImportError:  # pragma: no cover - torch < 2.10
    from torch.distributed import all_gather_into_tensor as all_gather_single  # noqa: F401  (re-exported)
#: ``reduce_scatter_single(output, input, op=, group=, async_op=)``: the current name of ``reduce_scatter_tensor``
try:
    from torch.distributed import reduce_scatter_single  # noqa: F401  (re-exported)
except ImportError:  # pragma: no cover - torch < 2.10
    from torch.distributed import reduce_scatter_tensor as reduce_scatter_single  # noqa: F401  (re-exported)


def unbox_process_group(obj: Any) -> Any:
    """The ``ProcessGroup`` a ``torch.ops.c10d`` operator receives as a ``torch.ScriptObject`` argument, else
    ``None`` (a ``ReduceOp`` or ``Work`` object) (``ProcessGroup.unbox``: a TorchScript binding, not documented)."""
    try:
        return _dist.ProcessGroup.unbox(obj)
    except (RuntimeError, TypeError):
        return None


def process_group_of_name(name: str) -> Any:
    """The ``ProcessGroup`` registered under ``name`` (the ``group_name`` functional collectives carry)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
