"""The parallel features, each owning itself: its layout fields, its rules against the other features, its rows of
the support matrix, its memory and step-time terms (torch-free) and its runtime, in one folder per feature, recorded
once in a :class:`~lightning_4d.features.feature.Feature`. :data:`FEATURES` is the one list of them:
:class:`~lightning_4d.config.ParallelConfig` runs their rules in its order, the support matrix
(:mod:`lightning_4d.support`) adds their rows and labels; ``tests/test_features.py`` checks that their terms import no
torch and their runtimes exist. ``docs/extending.md``, "Add a layout option".

Pure Python: importing this package imports no torch (a feature's runtime module does, and only it).
"""

from __future__ import annotations

from lightning_4d.features import context_parallel, moe, pipeline, tensor_parallel
from lightning_4d.features.feature import Feature

__all__ = ["FEATURES", "Feature"]

#: every parallel feature, in the order their rules run (``ParallelConfig``)
FEATURES: tuple[Feature, ...] = (moe.FEATURE, tensor_parallel.FEATURE, context_parallel.FEATURE, pipeline.FEATURE)
