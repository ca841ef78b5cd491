"""MkDocs hooks of the docs site (mkdocs.yml ``hooks:``), so that no page repeats a text kept elsewhere:

- ``<!-- include: README.md -->`` on a line of its own is replaced by that file (relative to the repository root),
  its relative links rebased onto the page (``docs/glossary.md`` in README.md is ``glossary.md`` from
  ``docs/index.md``), so the home page is README.md and the links work on GitHub and on the site;
- ``<!-- cli-help -->`` is replaced by ``lightning-4d --help`` and ``lightning-4d <command> --help`` of every command
  of :data:`lightning_4d.cli.COMMANDS`, run at build time (in one subprocess, started before the pages are read) from
  this checkout: the CLI reference cannot go stale, and a command whose ``--help`` fails fails the build;
- a code span that names a page of the site (`` `docs/memory.md` ``, `` `pipeline.md` ``) becomes a link to it.
"""

from __future__ import annotations

import ast
import json
import os
import posixpath
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the width the help texts are printed at (a terminal's width would change them)
COLUMNS = "100"
#: help texts longer than this many lines are folded (pymdownx.details)
LONG = 80

_INCLUDE = re.compile(r"^<!-- include: (?P<path>\S+) -->$", flags=re.MULTILINE)
_CLI = "<!-- cli-help -->"
_LINK = re.compile(r"(?P<head>!?\[[^\]]*\]\()(?P<target>[^)\s]+)(?P<tail>[^)]*\))")
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", flags=re.MULTILINE | re.DOTALL)
_PAGE_NAME = re.compile(r"(?<![\[`])`(?P<name>(?:docs/)?[\w./-]+\.md)`(?![`\]])")

_help: Future | None = None
_pool: ThreadPoolExecutor | None = None


def _commands() -> list[str]:
    """The keys of ``COMMANDS`` in lightning_4d/cli.py, read from the file (no import: fresh on every rebuild)."""
    tree = ast.parse((ROOT / "lightning_4d" / "cli.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in targets):
                return list(ast.literal_eval(node.value))
    raise RuntimeError("lightning_4d/cli.py defines no COMMANDS")


#: run in one subprocess: ``lightning-4d [<command>] --help`` for each command of argv, as JSON (one interpreter,
#: so torch and Lightning are imported once for the four LightningCLI commands: the same texts, a quarter the time)
_HELP_SCRIPT = """
import contextlib, io, json, sys, traceback
from lightning_4d.cli import main
texts = {}
for command in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(([command] if command else []) + ["--help"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            code, _ = 1, traceback.print_exc()
    texts[command] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(texts))
"""


def _run_help(commands: list[str]) -> dict[str, str]:
    """``{command: help text}`` (``""``: the program's own ``--help``), printed by this checkout's code.

    Raises:
        RuntimeError: a ``--help`` that exits non-zero (the build fails).
    """
    env = {
        **os.environ,
        "COLUMNS": COLUMNS,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    done = subprocess.run(
        [sys.executable, "-c", _HELP_SCRIPT, *commands], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"the --help run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    texts = {}
    for command, (code, out, err) in json.loads(done.stdout).items():
        if code != 0:
            raise RuntimeError(f"`lightning-4d {command} --help` exited {code}:\n{err[-3000:]}")
        texts[command] = (out or err).rstrip()
    return texts


def on_pre_build(config: Any) -> None:
    global _help, _pool
    _pool = ThreadPoolExecutor(max_workers=1)
    _help = _pool.submit(_run_help, ["", *_commands()])  # runs while mkdocs reads the pages


def on_post_build(config: Any) -> None:
    if _pool is not None:
        _pool.shutdown(wait=True)


def on_build_error(error: Exception) -> None:
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)


def _cli_reference() -> str:
    texts = _help.result()
    parts = ["```text", texts[""], "```"]
    for command, text in texts.items():
        if not command:
            continue
        parts += ["", f"## `lightning-4d {command}`", ""]
        lines = text.count("\n") + 1
        if lines > LONG:  # LightningCLI's: every Trainer, model and data argument, folded
            block = "\n".join("    " + line if line else "" for line in ["```text", *text.split("\n"), "```"])
            parts += [f'??? note "`lightning-4d {command} --help` ({lines} lines)"', "", block]
        else:
            parts += ["```text", text, "```"]
    return "\n".join(parts)


def _rebase(text: str, source: Path, page: Path, docs_dir: Path) -> str:
    """``text`` of the file ``source`` with its relative link targets made relative to ``page``."""

    def fix(m: re.Match) -> str:
        target = m["target"]
        if re.match(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", target):
            return m.group(0)
        path, sep, anchor = target.partition("#")
        absolute = (source.parent / path).resolve()
        new = (
            posixpath.relpath(absolute.as_posix(), page.parent.as_posix())
            if absolute.is_relative_to(docs_dir)
            else target
        )  # outside the site: left for mkdocs to report
        return f"{m['head']}{new}{sep}{anchor}{m['tail']}"

    return _LINK.sub(fix, text)


def _link_page_names(markdown: str, page: Path, docs_dir: Path) -> str:
    """`` `docs/x.md` `` / `` `x.md` `` naming a page of the site -> a link to it (fenced code untouched)."""

    def link(m: re.Match) -> str:
        name = m["name"]
        target = docs_dir / name.removeprefix("docs/")
        if not target.is_file() or target == page:
            return m.group(0)
        return f"[`{name}`]({posixpath.relpath(target.as_posix(), page.parent.as_posix())})"

    pieces, last = [], 0
    for fence in _FENCE.finditer(markdown):
        pieces += [_PAGE_NAME.sub(link, markdown[last : fence.start()]), fence.group(0)]
        last = fence.end()
    pieces.append(_PAGE_NAME.sub(link, markdown[last:]))
    return "".join(pieces)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    path = docs_dir / page.file.src_uri

    def include(m: re.Match) -> str:
        source = ROOT / m["path"]
        return _rebase(source.read_text(encoding="utf-8"), source, path, docs_dir)

    markdown = _INCLUDE.sub(include, markdown)
    if _CLI in markdown:
        markdown = markdown.replace(_CLI, _cli_reference())
    return _link_page_names(markdown, path, docs_dir)
