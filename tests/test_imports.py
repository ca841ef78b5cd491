"""The import graph of ``lightning_4d``: no circle, and the one-way rules of the design (``docs/architecture.md``).

Every module is parsed with ``ast``; every import counts, also one inside a function (a lazy import closes a circle
as surely as a top-level one, only later), except those under ``if TYPE_CHECKING:`` (never executed). Relative
imports are resolved, ``from package import name`` is an edge to ``package.name`` when that is a module (else to
the package), and ``import_module("lightning_4d.x." + ...)`` with a constant prefix is an edge to every module under
that prefix. The implicit import of a module's parent packages is not an edge (every module would otherwise sit in
a circle with ``lightning_4d/__init__.py``).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_4d"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST):
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs, and is walked)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub
                yield from _walk(sub)
            continue
        yield child
        yield from _walk(child)


def _resolve_relative(module: str, level: int, name: Optional[str]) -> str:
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _dynamic_prefix(call: ast.Call) -> Optional[str]:
    """The constant prefix of ``import_module(<str or f-string>)``, or ``None``."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    if isinstance(arg, ast.BinOp) and isinstance(arg.left, ast.Constant) and isinstance(arg.left.value, str):
        return arg.left.value
    return None


@lru_cache(maxsize=None)
def imports_of(module: str) -> frozenset[str]:
    """Every module ``module`` imports: ``lightning_4d`` modules by their module name, others (torch, ...) by the
    dotted name written."""
    tree = ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))
    out: set[str] = set()
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_relative(module, node.level, node.module) if node.level else node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in _modules() else target)
        elif isinstance(node, ast.Call):
            prefix = _dynamic_prefix(node)
            if prefix is not None and prefix.startswith(PACKAGE):
                under = [m for m in _modules() if m == prefix or m.startswith(prefix)]
                out.update(under or [prefix])
            elif prefix:
                out.add(prefix)
    out.discard(module)
    return frozenset(out)


def graph() -> dict[str, set[str]]:
    """``lightning_4d`` module -> the ``lightning_4d`` modules it imports."""
    mods = _modules()
    return {m: {i for i in imports_of(m) if i in mods} for m in mods}


def find_cycle(edges: dict[str, set[str]]) -> Optional[list[str]]:
    """One circle of ``edges`` as ``[a, b, ..., a]``, or ``None`` (iterative depth-first search)."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(edges, white)
    for start in sorted(edges):
        if color[start] != white:
            continue
        path = [start]
        stack = [iter(sorted(edges[start]))]
        color[start] = grey
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                color[path.pop()] = black
                stack.pop()
            elif color.get(nxt, black) == grey:
                return path[path.index(nxt) :] + [nxt]
            elif color.get(nxt, black) == white:
                color[nxt] = grey
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(modules: str, allowed) -> list[str]:  # noqa: ANN001 - a predicate on (importer, imported)
    return sorted(f"{m} -> {i}" for m, deps in graph().items() if _in(m, modules) for i in deps if not allowed(m, i))


# ---------------------------------------------------------------------------------------------------- tests
def test_the_graph_sees_every_kind_of_import():
    mods = _modules()
    assert {
        "lightning_4d",
        "lightning_4d.config",
        "lightning_4d.strategy",
        "lightning_4d.features.context_parallel.runtime",
    } <= set(mods)
    # an import inside a function (lightning_4d.__getattr__) counts
    assert "lightning_4d.strategy" in graph()["lightning_4d"]
    tree = ast.parse("from . import config\nfrom ..models import config as c\nif TYPE_CHECKING:\n    import x\n")
    assert [type(n).__name__ for n in _walk(tree)].count("Import") == 0
    assert _resolve_relative("lightning_4d.parallel.fsdp", 2, "models") == "lightning_4d.models"
    assert _resolve_relative("lightning_4d.parallel", 1, "fsdp") == "lightning_4d.parallel.fsdp"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_memory_never_imports_torch_nor_lightning():
    """planning/ is the estimator that runs on a laptop: no module of it imports torch or Lightning, not even inside a
    function (the pre-fit check, a Lightning callback, lives beside the strategy: ``lightning_4d/memory_check.py``)."""
    bad = []
    for m in _modules():
        if not _in(m, f"{PACKAGE}.planning"):
            continue
        bad += [f"{m} -> {i}" for i in imports_of(m) if _in(i, "torch") or _in(i, "lightning")]
    assert not bad, "planning/ runs on a laptop without torch and Lightning: " + ", ".join(sorted(bad))


def test_importing_every_memory_module_loads_neither_torch_nor_lightning():
    """The same, at run time: a fresh interpreter imports every ``lightning_4d.planning`` module (and with them the
    package's own ``__init__``, ``config``, ``layout``, ``partition`` and ``models.config``) and neither torch nor
    Lightning ends up in ``sys.modules``."""
    import subprocess
    import sys

    names = sorted(m for m in _modules() if _in(m, f"{PACKAGE}.planning"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning'))\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {names} loaded: {out.stdout.strip()}"


def test_models_import_only_config_and_models():
    """models/ knows nothing of parallelism: it imports config and models/ only, ``module_tree.py`` (which imports
    nothing of ours) for the one definition of the module levels wrappers insert into parameter names, and the MoE
    feature's layer (``features/moe/layer.py``, the feed-forward of an MoE decoder layer), which imports models/
    only."""
    allowed = {f"{PACKAGE}.config", f"{PACKAGE}.module_tree", f"{PACKAGE}.features.moe.layer"}
    bad = _violations(f"{PACKAGE}.models", lambda m, i: i in allowed or _in(i, f"{PACKAGE}.models"))
    bad += _violations(f"{PACKAGE}.features.moe.layer", lambda m, i: _in(i, f"{PACKAGE}.models"))
    assert not bad, (
        "models/ may import lightning_4d.config, lightning_4d.module_tree, lightning_4d.features.moe.layer and "
        "lightning_4d.models.* only, and that layer models/ only: " + ", ".join(bad)
    )


def test_compat_and_module_tree_import_nothing_of_ours():
    """``parallel/_compat/``'s modules and ``module_tree.py`` sit below everything that imports them (``mesh`` imports
    ``_compat.dtensor``; ``models``, ``families/base.py`` and ``parallel/*`` import ``module_tree``)."""
    edges = graph()
    compat = [m for m in edges if _in(m, f"{PACKAGE}.parallel._compat")]
    assert len(compat) > 1, compat
    for m in (*compat, f"{PACKAGE}.module_tree"):
        bad = edges[m]
        assert not bad, f"{m} imports " + ", ".join(sorted(bad))


def _strategy_layer(module: str) -> Optional[int]:
    """The place of ``module`` in the strategy's chain of ``docs/architecture.md`` ("Dependencies point one way"),
    lowest first: ``layout`` <- ``config`` <- ``mesh`` <- ``parallel/*`` <- ``checkpoint`` <- ``families/*`` and
    ``adapters/*`` <- ``parallel/parallelize.py`` <- ``strategy``; ``None`` off the chain (``parallel/_compat/``
    imports nothing of ours, :func:`test_compat_and_module_tree_import_nothing_of_ours`, so it sits below it all)."""
    chain = (
        f"{PACKAGE}.layout",
        f"{PACKAGE}.config",
        f"{PACKAGE}.mesh",
        f"{PACKAGE}.parallel",
        f"{PACKAGE}.checkpoint",
        (f"{PACKAGE}.families", f"{PACKAGE}.adapters"),
        f"{PACKAGE}.parallel.parallelize",
        f"{PACKAGE}.strategy",
    )
    if _in(module, f"{PACKAGE}.parallel._compat"):
        return None
    found = [
        i for i, place in enumerate(chain) for p in ((place,) if isinstance(place, str) else place) if _in(module, p)
    ]
    return max(found, default=None)


def test_the_strategy_chain_imports_only_downward():
    """No module of the strategy's chain imports one higher up it (docs/architecture.md)."""

    def upward(m: str, i: str) -> bool:
        lm, li = _strategy_layer(m), _strategy_layer(i)
        return lm is not None and li is not None and li > lm

    bad = _violations(PACKAGE, lambda m, i: not upward(m, i))
    assert not bad, "a module imports one higher up the strategy's chain: " + ", ".join(bad)


def _torch_free_feature_module(module: str) -> bool:
    """A torch-free module of ``lightning_4d/features/``: a package (the list, a feature's record with its rules, rows
    and labels), ``feature.py``, a feature's ``costs.py`` (its memory and step-time terms); the rest of a feature's
    folder is its torch runtime."""
    return _in(module, f"{PACKAGE}.features") and (
        _is_package(module) or module.rsplit(".", 1)[-1] in ("feature", "costs")
    )


def test_memory_imports_only_config_and_model_config():
    """planning/ is the torch-free estimator: it imports config, the layout registry (``lightning_4d.layout``, the
    torch-free declaration of config's fields, below config itself), the partition rules, the model config and the
    features' torch-free modules (their memory and step-time terms) only. The pre-fit check that reads a Trainer, a
    DataModule and the model-family registry is ``lightning_4d/memory_check.py``."""
    allowed = {f"{PACKAGE}.config", f"{PACKAGE}.layout", f"{PACKAGE}.partition", f"{PACKAGE}.models.llama_config"}
    bad = _violations(
        f"{PACKAGE}.planning",
        lambda m, i: i in allowed or _in(i, f"{PACKAGE}.planning") or _torch_free_feature_module(i),
    )
    assert not bad, (
        "planning/ may import lightning_4d.config, lightning_4d.layout, lightning_4d.partition, "
        "lightning_4d.models.llama_config, planning/ and the features' torch-free modules only: " + ", ".join(bad)
    )


def test_features_records_and_terms_import_no_torch():
    """A feature's record, rules, rows and terms (:func:`_torch_free_feature_module`) are read by the config, the
    support matrix and planning/ on a laptop: none imports torch, Lightning or another module of a feature, not even
    inside a function; a fresh interpreter importing them all loads neither torch nor Lightning."""
    import subprocess
    import sys

    names = sorted(m for m in _modules() if _torch_free_feature_module(m))
    assert f"{PACKAGE}.features.tensor_parallel.costs" in names
    assert f"{PACKAGE}.features.context_parallel.costs" in names
    assert f"{PACKAGE}.features.pipeline.costs" in names
    bad = [
        f"{m} -> {i}"
        for m in names
        for i in imports_of(m)
        if _in(i, "torch")
        or _in(i, "lightning")
        or (_in(i, f"{PACKAGE}.features") and not _torch_free_feature_module(i))
    ]
    assert not bad, "a feature's torch-free modules import: " + ", ".join(sorted(bad))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {names} loaded: {out.stdout.strip()}"


def test_tasks_import_no_strategy():
    edges = graph()
    bad = []
    for m in edges:
        if not _in(m, f"{PACKAGE}.tasks"):
            continue
        seen, todo = set(), [m]
        while todo:  # transitively: through another module is still importing the strategy
            cur = todo.pop()
            for i in edges[cur] - seen:
                seen.add(i)
                todo.append(i)
                if i == f"{PACKAGE}.strategy":
                    bad.append(f"{m} -> ... -> {cur} -> {i}" if cur != m else f"{m} -> {i}")
    assert not bad, "tasks/ must not import the strategy: " + ", ".join(sorted(bad))


def test_the_pipeline_splitter_imports_no_model():
    """``features/pipeline/runtime.py`` is the one splitter of every family: what a model computes (its positions,
    rotary embedding, layers, head) it asks the family (issue 33: it imported our Llama's RoPE)."""
    bad = sorted(i for i in graph()[f"{PACKAGE}.features.pipeline.runtime"] if _in(i, f"{PACKAGE}.models"))
    assert not bad, "features/pipeline/runtime.py imports " + ", ".join(bad)
