"""Write ``tests/durations.json``: the seconds each test file took in a measured run of the suite, which
``tests/conftest.py`` uses to hand pytest-xdist's workers the heaviest files first.

Usage (a junit file of a whole run: ``make test`` with ``--junitxml``)::

    .venv/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder tests --junitxml /tmp/suite.xml
    .venv/bin/python benchmarks/test_durations.py /tmp/suite.xml --commit "$(git rev-parse --short HEAD)"

A file's seconds are the sum of its tests' junit times (setup, call and teardown: a module-scoped launch counts in
its first test's setup). It prints the 20 slowest files.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def file_of(classname: str) -> str:
    """The test file (path under ``tests/``) of a junit ``classname`` (``tests.test_x``, ``tests.cuda.test_y``,
    ``tests.test_x.TestClass``). Raises ``ValueError`` when no prefix of it names a file under ``tests/``."""
    parts = classname.split(".")
    for end in range(len(parts), 1, -1):
        path = Path(*parts[1:end]).with_suffix(".py")
        if (TESTS / path).is_file():
            return path.as_posix()
    raise ValueError(f"{classname!r}: no test file under {TESTS} matches it")


def seconds_by_file(junit: Path) -> dict[str, float]:
    """Seconds per test file in ``junit`` (a pytest ``--junitxml`` file), rounded to 0.1 s."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        name = file_of(case.get("classname"))
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0))
    return {k: round(v, 1) for k, v in sorted(seconds.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="a pytest --junitxml file of a whole run of tests/")
    parser.add_argument("--commit", required=True, help="the commit the run tested (recorded in the file)")
    parser.add_argument("--out", type=Path, default=TESTS / "durations.json")
    args = parser.parse_args(argv)
    seconds = seconds_by_file(args.junit)
    note = f"seconds per test file, junit times of a run at {args.commit} (benchmarks/test_durations.py)"
    args.out.write_text(json.dumps({"note": note, "seconds": seconds}, indent=1) + "\n")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{s:8.1f} s  {name}")
    print(f"{sum(seconds.values()):8.1f} s  in all, {len(seconds)} files -> {args.out}")


if __name__ == "__main__":
    main()
