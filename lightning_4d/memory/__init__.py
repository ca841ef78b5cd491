"""Memory estimators (pure Python, no torch): see ``/work/shared/memory-model.md``."""

from lightning_4d.memory.fujii2024 import Fujii2024Estimate, fujii2024_estimate, fujii2024_from_config

__all__ = ["Fujii2024Estimate", "fujii2024_estimate", "fujii2024_from_config"]
