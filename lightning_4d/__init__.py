"""lightning_4d: 4D-parallel (dp + ZeRO, tp + sp, pp, cp) training of Llama models for PyTorch Lightning.

The public face::

    from lightning_4d import FourDStrategy, ParallelConfig
    from lightning_4d.models import LlamaConfig
    from lightning_4d.tasks import CausalLMModule
    from lightning_4d.data import LMDataModule
"""

from lightning_4d.config import ParallelConfig
from lightning_4d.strategy import FourDStrategy

__all__ = ["FourDStrategy", "ParallelConfig"]
__version__ = "0.1.0"
