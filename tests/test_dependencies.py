"""No declared dependency or extra that nothing uses (issue 26): every package of pyproject.toml's
``dependencies`` and of each ``optional-dependencies`` extra is imported somewhere in lightning_4d/, benchmarks/,
examples/ or tests/, or used in a way named below (a pytest plugin configured in pyproject, a linter configured in
pyproject and run by the Makefile, a library that a Lightning API we import needs, the docs site's generator and the
theme and plugins mkdocs.yml names)."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from tests._launch import ROOT

#: where a declared package may be imported
SOURCE_DIRS = ("lightning_4d", "benchmarks", "examples", "tests")
#: distribution name (normalized) -> the module it installs, where they differ
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "flash-attn": "flash_attn",
    "pytest-timeout": "pytest_timeout",
    "scikit-learn": "sklearn",
    "pillow": "PIL",
}
#: mkdocs.yml's theme / plugin name -> the distribution that provides it (mkdocs' own `search` plugin: none)
MKDOCS_THEMES = {"material": "mkdocs-material"}
MKDOCS_PLUGINS = {"mkdocstrings": "mkdocstrings", "search": None}


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _normalize(requirement: str) -> str:
    """The distribution name of a requirement string (``"jsonargparse[signatures]>=4.30"`` -> ``jsonargparse``),
    normalized as PEP 503 does."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def _sources() -> str:
    here = ROOT / "tests" / "test_dependencies.py"
    texts = [p.read_text(encoding="utf-8") for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p != here]
    return "\n".join(texts)


def _imported(module: str, sources: str) -> bool:
    pattern = (
        rf"^\s*(?:import|from)\s+{re.escape(module)}(?:\.|\s|,|$)"
        rf"|import_module\(\s*[\"']{re.escape(module)}(?:\.|[\"'])"
    )
    return re.search(pattern, sources, flags=re.MULTILINE) is not None


def _recipe(makefile: str, target: str) -> str:
    """The commands of ``target`` in the Makefile text (``""`` when there is no such target)."""
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    return m.group(1) if m else ""


def _docs_site_packages(mkdocs_yml: str | None, makefile: str) -> set[str]:
    """The distributions the docs site needs: mkdocs when the Makefile's ``docs`` target runs ``mkdocs build`` on a
    mkdocs.yml, and the theme and plugins that mkdocs.yml names."""
    if mkdocs_yml is None or "mkdocs build" not in _recipe(makefile, "docs"):
        return set()
    config = yaml.safe_load(mkdocs_yml) or {}
    theme = config.get("theme")
    theme = theme.get("name") if isinstance(theme, dict) else theme
    plugins = config.get("plugins") or []
    plugins = [next(iter(p)) if isinstance(p, dict) else p for p in plugins]
    return ({"mkdocs", MKDOCS_THEMES.get(theme, theme)} | {MKDOCS_PLUGINS.get(p, p) for p in plugins}) - {None}


def _used_indirectly(name: str, pyproject: dict) -> bool:
    """Packages that serve without an import statement of their own, each with the check that it still does."""
    if name == "pytest-timeout":  # a pytest plugin: pyproject's [tool.pytest.ini_options] sets its `timeout`
        return "timeout" in pyproject.get("tool", {}).get("pytest", {}).get("ini_options", {})
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    if name == "ruff":  # a linter: pyproject's [tool.ruff] configures it and the Makefile's `lint` target runs it
        return "ruff" in pyproject.get("tool", {}) and "ruff check" in _recipe(makefile, "lint")
    if name == "jsonargparse":  # LightningCLI (lightning.pytorch.cli) needs it; lightning does not install it
        return _imported("lightning.pytorch.cli", _sources())
    mkdocs_yml = ROOT / "mkdocs.yml"
    # the docs site (`make docs`): mkdocs, and the theme and plugins of mkdocs.yml
    return name in _docs_site_packages(
        mkdocs_yml.read_text(encoding="utf-8") if mkdocs_yml.is_file() else None, makefile
    )


def _declared() -> list[tuple[str, str]]:
    """(where, distribution name) of every declared package: ``dependencies`` and each extra."""
    project = _pyproject()["project"]
    out = [("dependencies", _normalize(r)) for r in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        out += [(f"extra-{extra}", _normalize(r)) for r in requirements]
    return out


def test_pyproject_is_valid_and_names_are_parsed():
    names = [name for _, name in _declared()]
    assert "torch" in names and "lightning" in names
    assert _normalize("jsonargparse[signatures]>=4.30") == "jsonargparse"
    assert _normalize("Flash_Attn>=2.7,<2.9") == "flash-attn"


def test_docs_site_packages_come_from_mkdocs_yml_and_the_makefile():
    """The docs extra counts as used only through what mkdocs.yml names and `make docs` runs: a theme or plugin
    that mkdocs.yml does not name, or mkdocs without a `docs` target, is unused."""
    makefile = "docs: install\n\t$(BIN)/python -m mkdocs build --strict\n"
    config = "site_name: x\ntheme:\n  name: material\nplugins:\n  - search\n  - mkdocstrings:\n      handlers: {}\n"
    assert _docs_site_packages(config, makefile) == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert _docs_site_packages("site_name: x\ntheme: readthedocs\n", makefile) == {"mkdocs", "readthedocs"}
    assert _docs_site_packages(config, "lint: install\n\truff check .\n") == set()
    assert _docs_site_packages(None, makefile) == set()
    assert _docs_site_packages("site_name: x\n", makefile) == {"mkdocs"}  # mkdocs' own theme, no plugin named
    # this repository: the docs extra is exactly what the site uses, and a package it does not use is not excused
    docs_extra = {_normalize(r) for r in _pyproject()["project"]["optional-dependencies"]["docs"]}
    assert docs_extra == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert all(_used_indirectly(name, _pyproject()) for name in docs_extra)
    assert not _used_indirectly("mkdocs-gen-files", _pyproject())


def test_every_extra_has_packages():
    extras = _pyproject()["project"].get("optional-dependencies", {})
    assert all(extras.values()), {k: v for k, v in extras.items() if not v}


@pytest.mark.parametrize("where,name", _declared(), ids=lambda x: x)
def test_declared_package_is_used(where, name):
    module = IMPORT_NAMES.get(name, name.replace("-", "_"))
    assert _imported(module, _sources()) or _used_indirectly(name, _pyproject()), (
        f"{name} ({where} in pyproject.toml) is declared but nothing in {', '.join(SOURCE_DIRS)} imports "
        f"{module!r}: remove it, or use it"
    )


def test_benchmark_extra_is_what_its_benchmark_imports():
    """An extra named for a benchmark (``peers``: ``benchmarks/peers.py``) holds what that script imports: its
    packages count as used because that file imports them, not because something else happens to."""
    extras = _pyproject()["project"].get("optional-dependencies", {})
    for extra, requirements in extras.items():
        script = ROOT / "benchmarks" / f"{extra}.py"
        if not script.is_file():
            continue
        source = script.read_text(encoding="utf-8")
        for name in (_normalize(r) for r in requirements):
            module = IMPORT_NAMES.get(name, name.replace("-", "_"))
            assert _imported(module, source), f"extra {extra!r}: {script.name} does not import {module!r} ({name})"
    assert "peers" in extras and (ROOT / "benchmarks" / "peers.py").is_file()
