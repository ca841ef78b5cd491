"""torch.compile: Dynamo's graph counter and dynamic-scalar switches, the functional collectives' waiting tensor."""

from __future__ import annotations

from typing import Any

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
