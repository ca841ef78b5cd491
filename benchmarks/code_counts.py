"""Function sizes in the package: parameter counts and lengths, from the source's syntax tree.

For every function and method under ``lightning_4d/`` (nested functions and lambdas' enclosing
functions included, lambdas themselves not), counts

- its parameters: positional-only, positional, keyword-only, each one; ``*args`` and ``**kwargs`` one
  each; ``self`` and ``cls`` as the first parameter of a method not counted;
- its length in lines: from the ``def`` line (decorators excluded) to the last line of its body,
  docstring and blank lines included.

Prints every function over ``--max-params`` parameters and over ``--max-lines`` lines, largest first, and
the totals. Needs no third-party package (``ast`` only)::

    python benchmarks/code_counts.py                 # limits 8 parameters, 60 lines
    python benchmarks/code_counts.py --max-params 9  # another limit
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_4d"


class Function(NamedTuple):
    """One function definition: where it is, its parameter count and its length in lines."""

    path: str
    line: int
    name: str
    params: int
    lines: int


def _param_count(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    count = len(names) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    if in_class and names and names[0] in ("self", "cls"):
        count -= 1
    return count


def _walk(tree: ast.AST, path: str, prefix: str, in_class: bool, out: list[Function]) -> None:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.ClassDef):
            _walk(child, path, f"{prefix}{child.name}.", True, out)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            length = child.end_lineno - child.lineno + 1
            out.append(Function(path, child.lineno, name, _param_count(child, in_class), length))
            _walk(child, path, f"{name}.", False, out)
        else:
            _walk(child, path, prefix, in_class, out)


def functions(package: Path = PACKAGE) -> list[Function]:
    """Every function and method defined in the ``.py`` files under ``package``."""
    out: list[Function] = []
    for file in sorted(package.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        _walk(tree, str(file.relative_to(package.parent)), "", False, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-params", type=int, default=8, help="parameter limit (default 8)")
    parser.add_argument("--max-lines", type=int, default=60, help="length limit in lines (default 60)")
    args = parser.parse_args(argv)
    found = functions()
    many = sorted((f for f in found if f.params > args.max_params), key=lambda f: -f.params)
    long = sorted((f for f in found if f.lines > args.max_lines), key=lambda f: -f.lines)
    print(f"functions over {args.max_params} parameters: {len(many)}")
    for f in many:
        print(f"  {f.params:3d}  {f.path}:{f.line}  {f.name}")
    print(f"functions over {args.max_lines} lines: {len(long)}")
    for f in long:
        print(f"  {f.lines:3d}  {f.path}:{f.line}  {f.name}")
    ten = sum(f.params >= 10 for f in found)
    print(
        f"totals: {len(found)} functions; {len(many)} over {args.max_params} parameters "
        f"({ten} with 10 or more); {len(long)} over {args.max_lines} lines; "
        f"most parameters {max(f.params for f in found)}, longest {max(f.lines for f in found)} lines"
    )


if __name__ == "__main__":
    main()
