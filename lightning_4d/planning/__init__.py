"""Memory estimators (pure Python, no torch): ``model`` (our strategy's own, ``estimate_memory``, which composes the
terms each feature module contributes: ``states``, ``activations``, ``offload_costs``,
``compression_costs``, ``buffers``, and the features' own: ``lightning_4d.features.moe.costs``,
``lightning_4d.features.tensor_parallel.costs``, ``lightning_4d.features.context_parallel.costs``,
``lightning_4d.features.pipeline.costs``) and ``fujii2024``
(the estimator of Fujii, Watanabe and Yokota 2024, arXiv 2411.06465). Formulas and sources: ``docs/memory.md``."""

from lightning_4d.planning.fujii2024 import (
    Fujii2024Estimate,
    Fujii2024Layout,
    Fujii2024Model,
    fujii2024_estimate,
    fujii2024_from_config,
)

__all__ = ["Fujii2024Estimate", "Fujii2024Layout", "Fujii2024Model", "fujii2024_estimate", "fujii2024_from_config"]
