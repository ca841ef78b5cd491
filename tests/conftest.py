"""How ``make test`` splits the suite between pytest-xdist's workers (``-n 2 --dist loadgroup``).

A launch (``tests/_launch.py``: 2-8 CPU processes training a tiny model) leaves the CPU idle while its ranks wait for
each other and while the launch starts; two workers overlap one launch's waits with another's work. What must hold:

* **One work unit per test file**, so a module-scoped fixture (a launch every test of the file reads) runs once: an
  ungrouped test would go to either worker, and each would run the fixture.
* **A file that imports from another test file at module level shares its unit** (their union, transitively): that
  is how files share launches (``test_parity.shared()``, ``test_pipeline.REFERENCES``,
  ``test_expert_parallel.moe_runs``: ``launched`` and ``trained`` cache a launch per process, keyed by its
  arguments), which two workers would each run. Some of those imports are only constants, which costs balance, never
  a launch; an import inside a function (a helper called at test time) does not join units.
* **The heaviest unit first**, so the last to finish is a short one (longest-processing-time-first order): a unit's
  weight is the seconds its files took in a measured run of the suite (``tests/durations.json``, written by
  ``benchmarks/test_durations.py`` from a junit file; a file it does not list weighs as its slow tests,
  :data:`UNMEASURED_SLOW_S` each). A stale table only slows the run: every test runs whatever the order.

Without xdist (``make check``, one file) none of this applies: the order stays pytest's.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: the seconds a slow test of a file ``tests/durations.json`` does not list is taken to take (its median there)
UNMEASURED_SLOW_S = 2.0


def imported_test_modules(path: Path) -> set[str]:
    """The test files (``test_*.py`` names: the ``tests`` folder's) that the module ``path`` imports from at module
    level: ``from tests.test_x import ...``, ``from tests import test_x`` or ``import tests.test_x`` (not inside a
    function or class)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("tests.test_"):
                found.add(node.module.split(".")[1] + ".py")
            elif node.module == "tests":
                found |= {a.name + ".py" for a in node.names if a.name.startswith("test_")}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] + ".py" for a in node.names if a.name.startswith("tests.test_")}
    return found


def work_units(files: list[str], imports: dict[str, set[str]]) -> dict[str, str]:
    """The work unit of each test file of ``files`` (names), named by the first of its unit in sorted order: a file
    and every file it imports from (``imports``: by file, test files it imports) share one, transitively (union-find).
    An imported file outside ``files`` (a run of a few files) is left out."""
    parent = {f: f for f in files}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for f in files:
        for other in imports.get(f, ()):
            if other in parent:
                a, b = sorted((root(f), root(other)))
                parent[b] = a
    return {f: root(f) for f in files}


def unit_order(units: dict[str, str], seconds: dict[str, float]) -> list[str]:
    """The units of ``units`` (file -> unit), heaviest first: a unit weighs the sum of its files' ``seconds``;
    ties by name."""
    weight: dict[str, float] = {}
    for f, unit in units.items():
        weight[unit] = weight.get(unit, 0.0) + seconds[f]
    return sorted(weight, key=lambda u: (-weight[u], u))


def measured_seconds() -> dict[str, float]:
    """``tests/durations.json``'s seconds by test file (its path under ``tests/``; ``{}`` when absent)."""
    path = TESTS / "durations.json"
    return json.loads(path.read_text())["seconds"] if path.is_file() else {}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns each test's xdist_group into its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (in each worker and the controller: the same order everywhere, which xdist checks): give
    each test its file's work unit as its ``xdist_group``, and order the tests unit by unit, heaviest first (the
    files of a unit, and the tests of a file, in pytest's order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("dist", "no") == "no":
        return
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path.relative_to(TESTS).as_posix(), []).append(item)
    files = list(by_file)
    imports = {f: imported_test_modules(TESTS / f) for f in files if (TESTS / f).is_file()}
    units = work_units(files, imports)
    measured = measured_seconds()
    seconds = {
        f: measured.get(f, UNMEASURED_SLOW_S * sum(1 for i in by_file[f] if i.get_closest_marker("slow")))
        for f in files
    }
    rank = {unit: i for i, unit in enumerate(unit_order(units, seconds))}
    for f, tests in by_file.items():
        for item in tests:
            item.add_marker(pytest.mark.xdist_group(units[f]))
    position = {f: i for i, f in enumerate(files)}
    items.sort(key=lambda item: (rank[units[name := item.path.relative_to(TESTS).as_posix()]], position[name]))
