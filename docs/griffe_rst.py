"""A griffe extension for the docs site (mkdocs.yml: the mkdocstrings python handler's ``extensions``).

lightning_4d's docstrings are written for Sphinx: Google-style sections, which mkdocstrings parses, inside
reStructuredText, which it does not. This turns the three pieces of reStructuredText the docstrings use into
Markdown before mkdocstrings renders them:

- roles (``:class:`~lightning_4d.config.ParallelConfig```, ``:meth:`~ModelFamily.is_model```, ``:func:``,
  ``:mod:``, ``:data:``, ``:attr:``, ``:exc:``, ``:obj:``; ``~`` shows the last name only): a cross-reference when the
  object is one the API reference shows (a ``::: path`` line of a page in ``docs/reference/``, or a public member
  of one), which mkdocs-autorefs resolves (an unresolved one fails ``mkdocs build --strict``); otherwise the name as
  code;
- a paragraph ending in ``::`` (a literal block follows): one colon, the indented block is then a Markdown code block;
- simple tables (``=====  =====`` rules): Markdown tables (a first cell ending in ``,`` continues on the next row).

It also reads Sphinx's ``#:`` comments above an attribute as its docstring (``FAMILIES``, class constants), and
takes what the layout registry derives at import time (``lightning_4d/layout.py``: ``ParallelConfig``'s and
``FourDStrategy``'s "Args" and ``FourDStrategy.__init__``'s signature) from the imported objects, where the source
holds the registry's marker line and ``**layout``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import griffe

from lightning_4d.layout import ARGS_MARKER  # the line the registry replaces at import time

#: the pages whose ``::: identifier`` lines make up the API reference
REFERENCE = Path(__file__).resolve().parent / "reference"

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj):`(?P<body>[^`]+)`")
_RULE = re.compile(r"^(?P<indent>\s*)=+(?:\s+=+)+\s*$")


def _reference_identifiers() -> list[str]:
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        found += re.findall(r"^:::\s+(\S+)", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return found


def _lookup(collection: Any, path: str) -> Any:
    try:
        return collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _canonical(obj: Any) -> str | None:
    try:
        return obj.canonical_path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class RestToMarkdown(griffe.Extension):
    """Rewrite every docstring of a loaded package (module docstring above)."""

    def on_package(self, *, pkg: griffe.Module, loader: Any = None, **kwargs: Any) -> None:
        collection = pkg.modules_collection
        for obj in _walk(pkg):
            if obj.is_attribute and obj.docstring is None:
                _comment_docstring(obj, loader)
            if obj.is_class and obj.docstring is not None and ARGS_MARKER in obj.docstring.value:
                _derived(obj)
        shown = {
            c
            for c in (
                _canonical(o) for o in (_lookup(collection, i) for i in _reference_identifiers()) if o is not None
            )
            if c
        }
        for obj in _walk(pkg):
            if obj.docstring is not None:
                text = _tables(_literal_blocks(obj.docstring.value))
                obj.docstring.value = _ROLE.sub(lambda m: _role(m["body"], obj, collection, shown), text)

    on_package_loaded = on_package  # this event's name in older griffe versions (idempotent: runs once or twice)


def _comment_docstring(obj: Any, loader: Any) -> None:
    """The ``#:`` comment lines right above the attribute ``obj`` as its docstring."""
    try:
        lines = obj.lines_collection[obj.filepath]
    except (KeyError, TypeError):
        return
    if not obj.lineno:
        return
    comment, i = [], obj.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        comment.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    if comment:
        obj.docstring = griffe.Docstring(
            "\n".join(comment),
            lineno=i + 2,
            endlineno=obj.lineno - 1,
            parent=obj,
            parser=getattr(loader, "docstring_parser", None),
            parser_options=getattr(loader, "docstring_options", None),
        )


def _derived(cls: Any) -> None:
    """The class ``cls`` as the layout registry made it at import time: its docstring, and its ``__init__``'s
    signature (``FourDStrategy``'s ``__signature__``; ``ParallelConfig``'s dataclass fields)."""
    module = importlib.import_module(cls.module.path)
    runtime = getattr(module, cls.name)
    cls.docstring.value = inspect.cleandoc(runtime.__doc__)
    params = []
    for p in inspect.signature(runtime.__init__).parameters.values():
        annotation = None if p.annotation is inspect.Parameter.empty else inspect.formatannotation(p.annotation)
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        kind = griffe.ParameterKind(p.kind.description)
        params.append(griffe.Parameter(p.name, annotation=annotation, kind=kind, default=default))
    init = cls.members.get("__init__")
    if init is None or init.is_alias:
        init = griffe.Function("__init__", lineno=cls.lineno, endlineno=cls.lineno, parent=cls)
        cls.set_member("__init__", init)
    init.parameters = griffe.Parameters(*params)


def _walk(obj: Any):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _role(body: str, obj: Any, collection: Any, shown: set[str]) -> str:
    """Markdown for one role: ``~a.b.C`` -> ``C``, ``title <a.b.C>`` -> ``title``; a link when ``shown``."""
    m = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    title, target = (m["title"], m["target"]) if m else (None, body)
    short = target.startswith("~")
    target = target.lstrip("~").removesuffix("()")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
    # Sphinx's search order: the enclosing class / module first, then the path as written
    scopes = []
    scope = obj
    while scope is not None:
        scopes.append(f"{scope.path}.{target}")
        scope = scope.parent
    for candidate in [*scopes, target]:
        found = _lookup(collection, candidate)
        if found is not None:
            path = _canonical(found)
            if path and _is_shown(path, found, shown):
                return f"[`{title}`][{path}]"
            break
    return f"`{title}`"


def _is_shown(path: str, obj: Any, shown: set[str]) -> bool:
    """Whether the API reference renders ``path``: an identifier of a ``:::`` line, or a public member with a
    docstring below one (mkdocstrings' default filters and ``show_if_no_docstring: false``)."""
    if path in shown:
        return True
    for root in shown:
        if path.startswith(root + "."):
            rest = path[len(root) + 1 :].split(".")
            return not any(part.startswith("_") for part in rest) and bool(obj.docstring)
    return False


def _literal_blocks(text: str) -> str:
    """``Text::`` + indented block -> ``Text:`` + code block; a line that is only ``::`` goes."""
    text = re.sub(r"^[ \t]*::[ \t]*\n", "", text, flags=re.MULTILINE)
    return re.sub(r"(?<=\S)::[ \t]*(?=\n[ \t]*\n)", ":", text)


def _tables(text: str) -> str:
    """Every reStructuredText simple table in ``text`` as a Markdown table."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        rules = [j for j in range(i, len(lines)) if _RULE.match(lines[j])][:3] if _RULE.match(lines[i]) else []
        if len(rules) < 3 or rules[0] != i:
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        header = _rows(lines[rules[0] + 1 : rules[1]], starts)
        body = _rows(lines[rules[1] + 1 : rules[2]], starts)
        indent = _RULE.match(lines[i])["indent"]
        for row in header[:1] + [["---"] * len(starts)] + body:
            out.append(indent + "| " + " | ".join(cell.replace("|", r"\|") for cell in row) + " |")
        i = rules[2] + 1
    return "\n".join(out)


def _rows(lines: list[str], starts: list[int]) -> list[list[str]]:
    rows: list[list[str]] = []
    for line in lines:
        if not line.strip():
            continue
        cells = [""] * len(starts)
        first = len(line) - len(line.lstrip())
        if first < starts[1] and rows is not None:  # text in the first column: a new row
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=len(starts) - 1)
            cells[: len(parts)] = parts
            if rows and rows[-1][0].endswith(","):  # the first cell continues (a list of names)
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
            else:
                rows.append(cells)
        else:  # a continuation line: the cells it starts in
            column = max(k for k, s in enumerate(starts) if s <= first)
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=len(starts) - 1 - column)
            for k, part in enumerate(parts, start=column):
                rows[-1][k] = f"{rows[-1][k]} {part}".strip()
    return rows
