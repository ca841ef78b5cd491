"""Mixture-of-Experts and expert parallelism (``ep``): the feature's record (:data:`FEATURE`) and its files, the whole
of MoE in one folder (``docs/moe.md``; ``docs/architecture.md``, "The MoE component"):

- ``rules.py``: its rules of a layout (:func:`~lightning_4d.features.moe.rules.check_moe_layout`, run by
  ``ParallelConfig`` as this feature's ``check``, and against the model from ``validate_model``), float8's refusal of
  an MoE model; torch-free;
- ``costs.py``: its memory and step-time terms; torch-free;
- ``layer.py``: the MoE feed-forward (router, stacked experts, shared experts, capacity, load-balancing loss) and the
  model's MoE methods;
- ``expert.py``: ep placement of the experts and the all-to-all dispatch and combine;
- ``runtime.py``: what the rest of the strategy asks of MoE (meshes, gradient groups, its parallelization step, its
  ZeRO 2/3 units, the task's aux-loss logic, the load monitor);
- ``hf_mixtral.py``: transformers' ``MixtralForCausalLM`` as a model family.

This module is pure Python: no torch import.
"""

from __future__ import annotations

from lightning_4d.features.feature import Feature
from lightning_4d.features.moe.rules import check_moe_layout

__all__ = ["FEATURE"]

FEATURE = Feature(
    "moe",
    ("ep",),
    check=check_moe_layout,
    costs="lightning_4d.features.moe.costs",
    runtime="lightning_4d.features.moe.runtime",
)
