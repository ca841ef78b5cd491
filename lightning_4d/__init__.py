"""lightning_4d: 4D-parallel (dp + ZeRO, tp + sp, pp, cp) training of Llama models for PyTorch Lightning.

The public face::

    from lightning_4d import FourDStrategy, ParallelConfig
    from lightning_4d.models import LlamaConfig
    from lightning_4d.tasks import CausalLMModule
    from lightning_4d.data import LMDataModule

``FourDStrategy`` and ``MemoryEstimatorCallback`` are imported lazily so that the pure-Python parts (``config``,
``planning``: ``estimate_memory`` of a ``Workload``) load without torch.
"""

from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.planning.model import MemoryEstimate, estimate_memory
from lightning_4d.planning.workload import Workload

__all__ = [
    "FourDStrategy",
    "MemoryBudgetExceeded",
    "MemoryEstimate",
    "MemoryEstimatorCallback",
    "ParallelConfig",
    "Workload",
    "estimate_memory",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "FourDStrategy":
        from lightning_4d.strategy import FourDStrategy

        return FourDStrategy
    if name in ("MemoryEstimatorCallback", "MemoryBudgetExceeded"):
        from lightning_4d import memory_check

        return getattr(memory_check, name)
    raise AttributeError(f"module 'lightning_4d' has no attribute {name!r}")
