"""The record of one parallel feature (:class:`Feature`): the layout fields it owns, its rules against the other
features, its rows of the support matrix, the labels a layout of it gets there, and where its torch-free memory and
step-time terms and its torch runtime live. :data:`lightning_4d.features.FEATURES` lists them.

Pure Python: no torch import (the config, the memory model and the support matrix read it on a laptop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from lightning_4d.layout import LAYOUT_FIELDS

__all__ = ["Feature"]


def _no_rules(config: Any) -> None:
    """A feature without rules of its own."""


def _no_labels(options: Mapping[str, Any]) -> frozenset[str]:
    """A feature the support matrix does not tell apart."""
    return frozenset()


@dataclass(frozen=True)
class Feature:
    """One parallel feature: what the rest of the package asks of it.

    Attributes:
        name: its name (``tp``, ``moe``, ...).
        owns: the owners (:attr:`lightning_4d.layout.LayoutField.feature`) of the layout fields it owns
            (:attr:`fields`).
        check: its rules against the other features, ``check(config)`` on a :class:`~lightning_4d.config.ParallelConfig`
            whose fields have passed their own checks (:func:`lightning_4d.config.check_values`); raises
            ``ValueError`` naming the bad value and the fix. A rule between two features belongs to one of them.
        rows: its rows of the support matrix (:class:`lightning_4d.support_rows.Row`), after the matrix's own.
        labels: ``labels(options)``: the labels of :func:`lightning_4d.support.layout_features` a layout (``measure``'s
            option names, or ``plan``'s ``--json`` names) gets from this feature.
        costs: the module of its memory and step-time terms (torch-free: ``tests/test_imports.py``).
        runtime: the module of its torch runtime (imported by the strategy's parallelization, never by the planner).
    """

    name: str
    owns: tuple[str, ...]
    check: Callable[[Any], None] = _no_rules
    rows: tuple = ()
    labels: Callable[[Mapping[str, Any]], frozenset[str]] = _no_labels
    costs: Optional[str] = None
    runtime: Optional[str] = None

    @classmethod
    def of_package(cls, package: str, name: str, owns: tuple[str, ...], **record: Any) -> "Feature":
        """The record of a feature in its own folder, ``package`` (its ``__init__``'s ``__name__``): its terms in the
        folder's ``costs.py``, its runtime in its ``runtime.py`` (``record``: the other attributes)."""
        return cls(name, owns, costs=f"{package}.costs", runtime=f"{package}.runtime", **record)

    @property
    def fields(self) -> tuple[str, ...]:
        """The layout fields it owns, in registry order."""
        return tuple(f.name for f in LAYOUT_FIELDS if f.feature in self.owns)
