"""The docs site's own code (issue 26): docs/hooks.py (README.md as the home page with its links rebased, page names
linked, the commands whose ``--help`` the CLI reference prints) and docs/griffe_rst.py (the reStructuredText of the
docstrings as Markdown). ``make docs`` builds the site itself, strictly; these check the pieces without mkdocs."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests._launch import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("hooks")
DOCS = ROOT / "docs"


def test_included_readme_links_are_rebased_onto_the_page():
    text = (
        "[g](docs/glossary.md) [m](docs/memory.md#from-a-row-to-a-config) [w](https://example.org/a.md) "
        "[here](#fourdstrategy-arguments) [c](configs/tiny.yaml) ![i](docs/x.png)"
    )
    out = hooks._rebase(text, ROOT / "README.md", DOCS / "index.md", DOCS)
    assert out == (
        "[g](glossary.md) [m](memory.md#from-a-row-to-a-config) [w](https://example.org/a.md) "
        "[here](#fourdstrategy-arguments) [c](configs/tiny.yaml) ![i](x.png)"
    )
    # from a page one folder down
    assert (
        hooks._rebase("[g](docs/glossary.md)", ROOT / "README.md", DOCS / "reference" / "cli.md", DOCS)
        == "[g](../glossary.md)"
    )


def test_page_names_in_code_become_links_outside_code_blocks():
    text = (
        "See `docs/memory.md` and `pipeline.md`, not `docs/nowhere.md` nor `glossary.md` (this page).\n"
        "```bash\ncat `docs/memory.md`\n```\n[`docs/data.md`](data.md)\n- a list:\n\n    ```text\n    `data.md`\n"
        "    ```\n"
    )
    out = hooks._link_page_names(text, DOCS / "glossary.md", DOCS)
    assert out == (
        "See [`docs/memory.md`](memory.md) and [`pipeline.md`](pipeline.md), not `docs/nowhere.md` nor "
        "`glossary.md` (this page).\n```bash\ncat `docs/memory.md`\n```\n[`docs/data.md`](data.md)\n"
        "- a list:\n\n    ```text\n    `data.md`\n    ```\n"
    )


def test_cli_reference_covers_every_command():
    from lightning_4d.cli import COMMANDS

    assert hooks._commands() == list(COMMANDS)


def test_rest_tables_and_literal_blocks_become_markdown():
    pytest.importorskip("griffe")  # the docs extra
    rst = _load("griffe_rst")
    table = (
        "Intro:\n\n"
        "=====================  ==========\n"
        "the family answers     used by\n"
        "=====================  ==========\n"
        ":meth:`~F.rotary`,     the chunk's\n"
        ":meth:`~F.run_layer`   forward\n"
        "``x | y``              one\n"
        "                       two\n"
        "=====================  ==========\n"
    )
    assert rst._tables(table) == (
        "Intro:\n\n| the family answers | used by |\n| --- | --- |\n"
        "| :meth:`~F.rotary`, :meth:`~F.run_layer` | the chunk's forward |\n"
        "| ``x \\| y`` | one two |\n"
    )
    assert rst._literal_blocks("Formula::\n\n    a = b\n\nDone.") == "Formula:\n\n    a = b\n\nDone."
    # the table of families/base.py (on the reference's "Model families" page): 10 rows of methods, the first cells
    # that end in a comma merged with the next (rotary, run_layer, run_head; load_hf, load_checkpoint_weights)
    doc = (ROOT / "lightning_4d" / "families" / "base.py").read_text(encoding="utf-8").split('"""')[1]
    rows = [line for line in rst._tables(doc).split("\n") if line.startswith("| :meth:")]
    assert len(rows) == 10, rows
    assert rows[4].startswith("| :meth:`~ModelFamily.rotary`, :meth:`~ModelFamily.run_layer`, :meth:`~ModelFamily.run")
    assert rows[9].startswith("| :meth:`~ModelFamily.load_hf`, :meth:`~ModelFamily.load_checkpoint_weights` | ")


def test_roles_link_what_the_reference_shows_and_name_the_rest(tmp_path, monkeypatch):
    griffe = pytest.importorskip("griffe")  # the docs extra
    rst = _load("griffe_rst")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        '"""See :class:`~pkg.a.Shown`, :meth:`pkg.a.Shown.go`, :func:`~pkg.a.hidden` and :mod:`os`."""\n'
    )
    (tmp_path / "pkg" / "a.py").write_text(
        "class Shown:\n    '''Uses :meth:`go` and :attr:`_private`.'''\n\n"
        "    #: the limit, in tokens\n    LIMIT = 4\n\n"
        "    def go(self):\n        '''Go.'''\n\n    def _private(self):\n        '''No.'''\n\n\n"
        "def hidden():\n    '''Not on a reference page.'''\n"
    )
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "api.md").write_text("# API\n\n::: pkg.a.Shown\n")
    monkeypatch.setattr(rst, "REFERENCE", tmp_path / "reference")
    pkg = griffe.load("pkg", search_paths=[str(tmp_path)], extensions=griffe.load_extensions(rst.RestToMarkdown()))
    assert pkg.docstring.value == ("See [`Shown`][pkg.a.Shown], [`pkg.a.Shown.go`][pkg.a.Shown.go], `hidden` and `os`.")
    shown = pkg["a.Shown"]
    assert shown.docstring.value == "Uses [`go`][pkg.a.Shown.go] and `_private`."
    assert shown["LIMIT"].docstring.value == "the limit, in tokens"
