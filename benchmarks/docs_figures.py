"""Keep the docs true: the `lightning-4d` commands they show run, and the figures they quote are produced.

Two conventions, for README.md, docs/*.md and configs/*.yaml (checked by ``tests/test_docs.py``, in ``make test``):

1. **Commands.** Every complete ``lightning-4d estimate|plan ...`` and ``lightning-4d [<command>] --help`` the pages
   show (in code blocks, inline backticks and YAML comments; ``\\`` continues a line; ``[...]`` optional parts are
   left out; ``python -m lightning_4d`` and ``.venv/bin/lightning-4d`` are the same program) runs in process and must
   exit 0, unless the text right after it on the same line says ``exits 1`` / ``exit 2`` (the code it must exit
   with); ``--plot FILE`` is left out, and ``--emit-config FILE`` writes into the test's folder. A command with a
   placeholder (``<n>``, ``...``, ``a|b``, an upper-case or one-letter value such as ``C`` or ``FILE.png``) is a
   template, not run.

2. **Figures.** A figure quoted from a fast command sits between markers and is regenerated, never typed:

   - inline, one value from the command's ``--json`` output (``{key}`` / ``{layout[dp]}`` Python format fields;
     every number ``k`` also as ``k_gib``, and ``verdict``: ``yes``/``no`` for ``fits``; in a paragraph write
     ``{layout_dp}`` / ``{layouts0_tp}`` for ``{layout[dp]}`` / ``{layouts[0][tp]}``, which the docs site would read
     as link references)::

         <!-- figure: lightning-4d estimate --model tiny ... | {total_gib:.1f} -->0.3<!-- /figure -->

   - a block: the command's own output in a ``text`` code block (as it is when the command has ``--markdown``), on
     the lines between::

         <!-- figure: lightning-4d estimate --model tiny ... -->
         ...
         <!-- /figure -->

   - a table: header lines as given, then one row per command (``row:`` a format as above, over each command's
     ``--json``), written between the comment and ``<!-- /figure -->``::

         <!-- figure-rows:
         | cp | total GiB |
         |---|---|
         row: | {layout[cp]} | {total_gib:.1f} |
         lightning-4d estimate --model llama3.1-8b --cp 1 ...
         lightning-4d estimate --model llama3.1-8b --cp 2 ...
         -->
         ...
         <!-- /figure -->

   ``python benchmarks/docs_figures.py`` (``make docs-figures``) rewrites every figure; ``--check`` only reports the
   stale ones (exit 1). Figures of benchmarks that take minutes are not marked: the page names the command and date.

3. **Pasteable blocks.** A shell code block (``bash``, ``sh``, ``console``, or untagged with a command in it) runs
   as printed: no optional part in brackets, no ``<placeholder>``, ellipsis, ``path/to/`` or placeholder value
   (:func:`paste_problems`; optional parts go in a second block or a comment). Only inline synopses in prose may
   use brackets, which rule 1 leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
#: the commands of the program that run in well under a second each, without torch
RUN_COMMANDS = ("estimate", "plan")
#: the width rich tables are printed at (a terminal's width would change the figures)
COLUMNS = "150"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, docs/*.md and configs/*.yaml."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "configs").glob("*.yaml"))]


# ------------------------------------------------------------------------------------------------------ commands
@dataclass
class Command:
    page: str
    line: int
    text: str  # as shown, continuations joined
    argv: Optional[list[str]]  # after `lightning-4d`; None: a template (placeholder) or not one we run
    expected_exit: int
    why_not_run: str = ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: lightning-4d {self.text}"


_PROGRAM = re.compile(r"(?:\.venv/bin/)?lightning-4d\b|python -m lightning_4d\b")
_EXIT = re.compile(r"\bexits? (\d)\b")
#: options of `estimate` / `plan` that write a file the check does not need: it runs the command without them
#: (`--emit-config FILE` stays: tests/test_docs.py writes it into its own folder and trains from it)
_WRITES = ("--plot",)
_PLACEHOLDER_VALUE = re.compile(r"^(?:[A-Za-z]|[A-Z][A-Z_]*(?:\.\w+)?)$")


def _argv(rest: str, kinds: tuple[str, ...] = RUN_COMMANDS) -> tuple[Optional[list[str]], str]:
    """The arguments of a command shown as ``rest`` (after the program), or ``(None, why)`` when it is not run
    (``kinds``: the commands taken; prose after the command, from a word in parentheses on, is left out)."""
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # optional parts
    if any(mark in rest for mark in ("<", "...", "…", "|")):
        return None, "placeholder"
    try:
        argv = shlex.split(rest)
    except ValueError:
        return None, "not a command line"
    argv = argv[: next((i for i, a in enumerate(argv) if a.startswith("(")), len(argv))]
    # run without `--plot FILE` (the figure is not checked)
    argv = [a for i, a in enumerate(argv) if a not in _WRITES and (i == 0 or argv[i - 1] not in _WRITES)]
    if not argv:
        return None, "the program named, no command"
    if argv[0] not in kinds and argv[-1] not in ("--help", "-h"):
        return None, f"`{argv[0]}` is not run by this check"
    if argv[0] in kinds and len(argv) == 1:
        return None, "the command named, no arguments"
    for prev, arg in zip(argv, argv[1:]):
        if prev.startswith("--") and not arg.startswith("--") and _PLACEHOLDER_VALUE.match(arg):
            return None, f"placeholder value {arg}"
    return argv, ""


def _logical_lines(lines: list[str]) -> list[tuple[int, str]]:
    """``(index of the first line, text)`` of each shell line of ``lines``, a trailing ``\\`` joining the next."""
    out = []
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        out.append((start, line))
    return out


def _commands_in(
    text: str, page: str, first_line: int, code: bool, kinds: tuple[str, ...] = RUN_COMMANDS
) -> list[Command]:
    """Commands in ``text`` (a code block's lines when ``code``, else prose whose inline spans are commands)."""
    found = []
    if code:
        for start, line in _logical_lines(text.split("\n")):
            code_part, _, comment = ("", "", line) if line.lstrip().startswith("#") else line.partition(" #")
            m = _PROGRAM.search(code_part)
            if m:
                found.append((first_line + start, code_part[m.end() :], comment))
    else:
        for span in re.finditer(r"`([^`]+)`", text):
            inner = re.sub(r"\\\s*\n", " ", span.group(1))
            m = _PROGRAM.match(inner.strip())
            if not m:
                continue
            after = text[span.end() :].split("\n", 1)[0]
            found.append((first_line + text.count("\n", 0, span.start()), inner.strip()[m.end() :], after))
    out = []
    for line, body, after in found:
        body = " ".join(body.split())
        argv, why = _argv(body, kinds)
        m = _EXIT.search(after)
        out.append(Command(page, line, body, argv, int(m.group(1)) if m else 0, why))
    return out


def commands(root: Path = ROOT, kinds: tuple[str, ...] = RUN_COMMANDS) -> list[Command]:
    """Every ``lightning-4d`` command the pages show (``Command.argv`` is None for those not run; ``kinds``: the
    commands whose arguments are taken, with ``--help`` of any)."""
    out = []
    for path in pages(root):
        page = str(path.relative_to(root))
        text = path.read_text()
        if path.suffix == ".yaml":  # comments: their text as prose; a bare command runs to the end of its line
            lines = text.split("\n")
            prose = "\n".join(re.sub(r"^\s*# ?", "", ln) if ln.lstrip().startswith("#") else "" for ln in lines)
            out += _commands_in(prose, page, 1, code=False, kinds=kinds)
            bare = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)  # blank the inline spans
            out += _commands_in(bare, page, 1, code=True, kinds=kinds)
            continue
        pos = 0
        for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
            prose = text[pos : block.start()]
            out += _commands_in(prose, page, 1 + text.count("\n", 0, pos), code=False, kinds=kinds)
            out += _commands_in(block.group(1), page, 1 + text.count("\n", 0, block.start(1)), code=True, kinds=kinds)
            pos = block.end()
        out += _commands_in(text[pos:], page, 1 + text.count("\n", 0, pos), code=False, kinds=kinds)
    return out


def run(argv: list[str]) -> tuple[int, str, str]:
    """``lightning-4d <argv>`` in this process: (exit code, stdout, stderr)."""
    from lightning_4d.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: --help (0), bad input (2)
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return code, out.getvalue(), err.getvalue()


# -------------------------------------------------------------------------------------------- pasteable blocks
#: the fences whose lines a reader pastes into a shell; an untagged block counts when a line of it starts a command
SHELL_FENCES = ("bash", "sh", "shell", "console", "zsh")
_SHELL_START = re.compile(r"^\s*(?:\$ )?(?:lightning-4d|python3?|torchrun|srun|sbatch|pip|make|export|mkdir|cd)\b")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\n]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)


def shell_lines(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(page, line, text)`` of every command line in the shell code blocks of README.md and docs/ (continuations
    joined, ``#`` comments dropped): what a reader pastes."""
    out = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for block in _FENCE.finditer(text):
            lines = block["body"].split("\n")
            lang = block["lang"].strip().lower()
            if lang not in SHELL_FENCES and not (lang == "" and any(_SHELL_START.match(ln) for ln in lines)):
                continue
            first = 1 + text.count("\n", 0, block.start("body"))
            for start, line in _logical_lines(lines):
                code = _strip_comment(line)
                if code.strip():
                    out.append((str(path.relative_to(root)), first + start, code.strip()))
    return out


def _strip_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` at the start of a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


_QUOTED = re.compile(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"")
_EXPANSION = re.compile(r"\$\{[^}]*\}")  # ${arr[0]}, ${VAR:-default}
_TEST_BRACKETS = re.compile(r"(?<!\S)(?:\[\[|\]\]|\[|\])(?!\S)")  # [[ ... ]] and [ ... ]: words of their own
_ARRAY_INDEX = re.compile(r"\b\w+\[[^\]\s]*\]=")  # arr[0]=x
_OPTIONAL = re.compile(r"\[\s*-{1,2}\w|\[[^\]\s]*\s[^\]]*\]|\[[A-Z][A-Z_]*\]")
_ANGLE = re.compile(r"<[A-Za-z][^<>\s]*>")
_ELLIPSIS = re.compile(r"\.\.\.|…")


def paste_problems(line: str) -> list[str]:
    """What in the shell command ``line`` a reader would paste and the shell or the program would refuse: an
    optional part in brackets (``[--flag VALUE]``, ``[FILE]``), a ``<placeholder>``, an ellipsis, a ``path/to/``
    path or a placeholder option value (one letter or upper case, such as ``--tp T`` or ``--plot FILE.png``).
    Quoted strings, ``${...}`` expansions, the ``[ ... ]`` / ``[[ ... ]]`` tests, array indices and unquoted brackets
    without spaces (globs, ``pip install 'pkg[extra]'``, a YAML list ``--x=[1,2]``) are legitimate shell."""
    bare = _QUOTED.sub("''", line)
    bare = _EXPANSION.sub("", bare)
    bare = _TEST_BRACKETS.sub(" ", bare)
    bare = _ARRAY_INDEX.sub("", bare)
    found = [f"optional part {bare[m.start() : bare.find(']', m.start()) + 1]}" for m in _OPTIONAL.finditer(bare)]
    found += [f"placeholder {m.group(0)}" for m in _ANGLE.finditer(bare)]
    found += ["an ellipsis"] if _ELLIPSIS.search(bare) else []
    found += ["a path/to/ placeholder"] if "path/to/" in bare else []
    words = bare.split()
    for prev, word in zip(words, words[1:]):
        if prev.startswith("--") and "=" not in prev and _PLACEHOLDER_VALUE.match(word):
            found.append(f"placeholder value {prev} {word}")
    return found


# ------------------------------------------------------------------------------------------------------- figures
_INLINE = re.compile(r"<!-- figure: (?P<cmd>[^|>]+?) \| (?P<fmt>.+?) -->(?P<body>.*?)<!-- /figure -->")
_BLOCK = re.compile(r"^<!-- figure: (?P<cmd>[^|>]+?) -->\n(?P<body>.*?)^<!-- /figure -->", re.S | re.M)
_ROWS = re.compile(r"^<!-- figure-rows:\n(?P<spec>.*?)^-->\n(?P<body>.*?)^<!-- /figure -->", re.S | re.M)


def _figure_argv(cmd: str) -> list[str]:
    m = _PROGRAM.match(cmd.strip())
    if not m:
        raise ValueError(f"figure command {cmd!r}: expected `lightning-4d ...`")
    return shlex.split(cmd.strip()[m.end() :])


def _json_fields(data: dict) -> dict:
    fields = dict(data)
    for key, value in data.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            fields[f"{key}_gib"] = value / 2**30
        # also without brackets (a `[a][b]` in a page's text reads as a Markdown link reference to the docs site):
        # `{layout_dp}` for `{layout[dp]}`, `{layouts0_tp}` for `{layouts[0][tp]}`
        if isinstance(value, dict):
            fields.update({f"{key}_{sub}": v for sub, v in value.items()})
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    fields.update({f"{key}{i}_{sub}": v for sub, v in item.items()})
    if "fits" in data:
        fields["verdict"] = "yes" if data["fits"] else "no"
    return fields


#: (exit code, ``--json`` output) by command line: a page quotes several fields of one command, which runs once per
#: process
_JSON: dict[tuple[str, ...], tuple[int, dict]] = {}


def run_json(argv: list[str]) -> tuple[int, dict]:
    """``lightning-4d <argv> --json`` in this process, once per ``argv`` and process: (exit code, its JSON object).

    Raises:
        ValueError: the command exited with neither 0 (fits) nor 1 (does not fit).
    """
    key = tuple(argv)
    if key not in _JSON:
        code, out, err = run([*argv, "--json"])
        if code not in (0, 1):
            raise ValueError(f"figure command `lightning-4d {shlex.join(argv)}` exited {code}: {err.strip()}")
        _JSON[key] = (code, json.loads(out))
    return _JSON[key]


def figure_argvs(root: Path = ROOT) -> set[tuple[str, ...]]:
    """The command lines (``argv`` after the program) of every inline and table figure of the pages: each runs
    with ``--json`` (:func:`run_json`)."""
    found = set()
    for page in pages(root):
        text = page.read_text()
        cmds = [m["cmd"] for m in _INLINE.finditer(text)]
        cmds += [line for m in _ROWS.finditer(text) for line in m["spec"].split("\n") if _PROGRAM.match(line.strip())]
        found.update(tuple(_figure_argv(c)) for c in cmds)
    return found


def render_inline(cmd: str, fmt: str) -> str:
    return fmt.format_map(_json_fields(run_json(_figure_argv(cmd))[1]))


def render_block(cmd: str) -> str:
    argv = _figure_argv(cmd)
    code, out, err = run(argv)
    if code not in (0, 1):
        raise ValueError(f"figure command {cmd!r} exited {code}: {err.strip()}")
    body = "\n".join(line.rstrip() for line in out.rstrip("\n").split("\n"))
    if "--markdown" in argv:  # the command prints Markdown: the page shows it as Markdown, not in a code block
        return f"{body}\n"
    return f"```text\n{body}\n```\n"


def render_rows(spec: str) -> str:
    lines = [line for line in spec.split("\n") if line.strip()]
    rows = [line[len("row:") :].strip() for line in lines if line.startswith("row:")]
    if len(rows) != 1:
        raise ValueError(f"figure-rows needs one `row:` format line, got {len(rows)}")
    cmds = [line for line in lines if _PROGRAM.match(line.strip())]
    header = [line for line in lines if not line.startswith("row:") and line not in cmds]
    return "\n".join(header + [render_inline(cmd, rows[0]) for cmd in cmds]) + "\n"


def regenerate(text: str) -> str:
    """``text`` with every figure between markers produced anew."""
    text = _ROWS.sub(lambda m: f"<!-- figure-rows:\n{m['spec']}-->\n{render_rows(m['spec'])}<!-- /figure -->", text)
    text = _BLOCK.sub(lambda m: f"<!-- figure: {m['cmd']} -->\n{render_block(m['cmd'])}<!-- /figure -->", text)
    return _INLINE.sub(
        lambda m: f"<!-- figure: {m['cmd']} | {m['fmt']} -->{render_inline(m['cmd'], m['fmt'])}<!-- /figure -->", text
    )


def figure_count(text: str) -> int:
    return len(_BLOCK.findall(text)) + len(_INLINE.findall(text)) + len(_ROWS.findall(text))


def stale_figures(path: Path) -> list[str]:
    """The figures of ``path`` whose page text differs from what their command prints now (one line each)."""
    text = path.read_text()
    stale = []
    for m in _BLOCK.finditer(text):
        if m["body"] != render_block(m["cmd"]):
            stale.append(f"{path.name}:{1 + text.count(chr(10), 0, m.start())}: block of `{m['cmd']}`")
    for m in _ROWS.finditer(text):
        if m["body"] != render_rows(m["spec"]):
            stale.append(
                f"{path.name}:{1 + text.count(chr(10), 0, m.start())}: "
                f"table of {m['spec'].count('lightning-4d')}"
                " commands"
            )
    for m in _INLINE.finditer(text):
        new = render_inline(m["cmd"], m["fmt"])
        if m["body"] != new:
            stale.append(
                f"{path.name}:{1 + text.count(chr(10), 0, m.start())}: {m['body']!r} should be {new!r} "
                f"(`{m['cmd']} | {m['fmt']}`)"
            )
    return stale


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale figures (exit 1 when any)")
    parser.add_argument("paths", nargs="*", type=Path, help="pages (default README.md, docs/*.md, configs/*.yaml)")
    args = parser.parse_args(argv)
    stale = []
    for path in args.paths or pages():
        text = path.read_text()
        if not figure_count(text):
            continue
        if args.check:
            stale += stale_figures(path)
            continue
        new = regenerate(text)
        if new != text:
            path.write_text(new)
            print(f"{path}: figures regenerated")
    for line in stale:
        print(f"stale: {line}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
