"""Stand-ins for Lightning objects in function-level tests."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_4d.contract import LayoutStrategy


@LayoutStrategy.register
class FakeLayoutStrategy(SimpleNamespace):
    """A :class:`~lightning_4d.contract.LayoutStrategy` (``FourDStrategy`` to the code under test) that has only the
    members it is given as keywords, e.g. ``FakeLayoutStrategy(parallel_config=ParallelConfig())``."""
