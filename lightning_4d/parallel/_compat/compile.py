"""torch.compile: Dynamo's graph counter and dynamic-scalar switches, the functional collectives' waiting tensor,
inductor's CPU buffer allocations."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

#: ``AsyncCollectiveTensor``: the wrapper in which a functional collective's result waits to be read
#: (``torch.distributed._functional_collectives``); DTensor's redistributions return one as the local tensor (the
#: sequence-sharded embedding output of tensor parallelism). ``lightning_4d/parallel/compile.py`` resolves it before
#: a compiled layer: AOTAutograd, given one as an input, traces its waited inner tensor, which does not require grad
#: (torch 2.13)
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # noqa: F401  (re-exported)


def compiled_graph_count() -> int:
    """Graphs Dynamo has compiled in this process so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``,
    counted once the backend has returned the compiled graph: a frame whose compilation failed and silently fell back
    to eager adds none). The tests read it before and after a ``compile=True`` run."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def dynamo_dynamic_scalars() -> Any:
    """A context in which Dynamo traces host reads of tensor values (``.tolist()``, ``.item()``) as unbacked
    symbolic integers and ops with data-dependent output shapes (``bincount``, ``nonzero``) instead of breaking the
    graph there (``torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)``):
    the dynamic-shape alternative ``benchmarks/compile_moe.py`` measures for Mixture-of-Experts layers."""
    import torch._dynamo.config as config

    return config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


#: the callbacks :func:`inductor_cpu_buffers` passes each inductor CPU buffer to, innermost last
_BUFFER_CALLBACKS: list[Callable[[Any], None]] = []
_ORIGINAL_EMPTY_STRIDED_CPU: Any = None


def _empty_strided_cpu(*args: Any, **kwargs: Any) -> Any:
    buffer = _ORIGINAL_EMPTY_STRIDED_CPU(*args, **kwargs)
    for callback in _BUFFER_CALLBACKS:
        callback(buffer)
    return buffer


@contextlib.contextmanager
def inductor_cpu_buffers(callback: Callable[[Any], None]) -> Iterator[None]:
    """A context in which ``callback(tensor)`` sees every CPU buffer inductor's generated code allocates.

    Inductor's CPU code allocates its buffers with ``empty_strided_cpu``, bound from
    ``torch._C._dynamo.guards._empty_strided_cpu`` when the compiled module is loaded: a direct call into the
    allocator that no ``TorchDispatchMode`` sees (measured on torch 2.13 CPU: a fused GELU's output reached no mode).
    While entered, that name is a wrapper calling ``callback`` on each buffer; a compiled module loaded while some
    such context was entered keeps the wrapper, which calls the callbacks entered at the time of the call (none
    later). A module loaded before any (inductor caches loaded modules per process) keeps the plain function: its
    buffers reach ``callback`` only through the ops that take them (``mm.out``, ...).
    """
    global _ORIGINAL_EMPTY_STRIDED_CPU
    guards = torch._C._dynamo.guards
    if not hasattr(guards, "_empty_strided_cpu"):  # another torch: nothing to follow (the ops still are)
        yield
        return
    if _ORIGINAL_EMPTY_STRIDED_CPU is None:
        _ORIGINAL_EMPTY_STRIDED_CPU = guards._empty_strided_cpu
    guards._empty_strided_cpu = _empty_strided_cpu
    _BUFFER_CALLBACKS.append(callback)
    try:
        yield
    finally:
        _BUFFER_CALLBACKS.remove(callback)
        if not _BUFFER_CALLBACKS:
            guards._empty_strided_cpu = _ORIGINAL_EMPTY_STRIDED_CPU
