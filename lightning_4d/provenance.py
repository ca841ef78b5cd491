"""Which code ran a result: the one record every CUDA result of the project carries (:func:`code_record`), and which
files changed since a recorded commit (:func:`changed_files`).

The commit comes from git when the package runs from a git checkout. A machine that receives a copy of the
working tree without its ``.git`` (a lent GPU) reads it from :data:`STAMP`, written where git is by
``python -m lightning_4d.provenance --stamp`` (``benchmarks/gpu_check.py --prepare`` writes it): the commit and the git
blob hash of every tracked file at that commit, so the copy is checked file by file (``clean`` is False and
``changed`` lists the files that differ). Without either (a wheel install) the commit is ``None`` and the record says
why. This module imports no torch at import time (the support matrix reads it without torch).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
#: the record of the checkout carried to a machine without git (written by ``--stamp``; ignored by git)
STAMP = ROOT / ".gpu-check" / "code.json"
#: the most changed files a record lists
MAX_LISTED = 20


def _git(*args: str, root: Path = ROOT) -> Optional[str]:
    """``git args`` run in ``root`` (its stdout), or ``None`` when git is missing, fails, or ``root`` is not the top
    of a git checkout (an installed package inside another repository's virtual environment is not)."""
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_available(root: Path = ROOT) -> bool:
    """Whether ``root`` is a git checkout that git can read (its history answers :func:`changed_files`)."""
    return _git("rev-parse", "HEAD", root=root) is not None


def blob_hash(path: Path) -> str:
    """The git blob hash of the file at ``path`` (what ``git hash-object`` prints), computed without git."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git_state(root: Path) -> Optional[dict[str, Any]]:
    """The commit and the tracked files that differ from it, from git (``None`` without it)."""
    head = _git("rev-parse", "HEAD", root=root)
    if head is None:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no", root=root) or ""
    changed = sorted(line[3:].strip() for line in status.splitlines() if line.strip())
    return {"commit": head.strip(), "clean": not changed, "changed": changed[:MAX_LISTED], "source": "git"}


def _stamp_state(root: Path, stamp: Path) -> Optional[dict[str, Any]]:
    """The commit of :data:`STAMP` and the tracked files whose content differs from it (``None`` without a stamp)."""
    try:
        data = json.loads(stamp.read_text())
        commit, files = data["commit"], data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    changed = sorted(p for p, sha in files.items() if not (root / p).is_file() or blob_hash(root / p) != sha)
    return {"commit": commit, "clean": not changed, "changed": changed[:MAX_LISTED], "source": "stamp"}


def code_state(root: Path = ROOT, stamp: Path = STAMP) -> dict[str, Any]:
    """The commit this checkout is at and whether its tracked files are that commit's: ``{"commit", "clean",
    "changed", "source"}`` (``source``: ``git``, ``stamp`` or ``None``; without either, ``commit`` and ``clean`` are
    ``None`` and ``why`` says so)."""
    state = _git_state(root) or _stamp_state(root, stamp)
    if state is None:
        return {
            "commit": None,
            "clean": None,
            "changed": [],
            "source": None,
            "why": "not a git checkout and no stamp of one (an installed package)",
        }
    return state


def _driver_version() -> Optional[str]:
    """The NVIDIA driver's version (``nvidia-smi``), or ``None``."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    return lines[0].strip() if lines else None


def code_record(device: str = "cuda") -> dict[str, Any]:
    """Which code ran a result, and where: the one record every result the project's scripts write carries (under
    the key ``code``): :func:`code_state`'s ``commit``, ``clean``, ``changed`` and ``source``, and ``torch``,
    ``cuda`` (the CUDA runtime torch was built with), ``driver`` (the NVIDIA driver), ``card`` (the device's name;
    ``cpu`` on the CPU), ``python`` and ``time`` (UTC, ISO 8601)."""
    import torch

    on_cuda = device == "cuda" and torch.cuda.is_available()
    return {
        **code_state(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver_version() if on_cuda else None,
        "card": torch.cuda.get_device_name() if on_cuda else "cpu",
        "python": sys.version.split()[0],
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def changed_files(commit: str, root: Path = ROOT) -> Optional[list[str]]:
    """The files whose content differs between ``commit`` and this checkout's working tree (committed since, or
    changed and not committed yet: ``git diff --name-only commit``), or ``None`` when git cannot say (no git, not a
    checkout, or ``commit`` not in its history)."""
    out = _git("diff", "--name-only", commit, "--", root=root)
    return None if out is None else sorted(line for line in out.splitlines() if line)


def changed_since_date(date: str, root: Path = ROOT) -> Optional[list[str]]:
    """The files that differ between the last commit before ``date`` (``YYYY-MM-DD``, its start) and this checkout's
    working tree (:func:`changed_files`; a file changed on that date counts), or ``None`` when git cannot say."""
    commit = _git("rev-list", "-1", f"--before={date} 00:00:00", "HEAD", root=root)
    return changed_files(commit.strip(), root) if commit and commit.strip() else None


def touched(changed: list[str], paths: tuple[str, ...]) -> list[str]:
    """The ``changed`` files under ``paths`` (files, or folders ending in ``/``)."""
    return [f for f in changed if any(f == p or (p.endswith("/") and f.startswith(p)) for p in paths)]


def write_stamp(path: Path = STAMP, root: Path = ROOT) -> dict[str, Any]:
    """Write :data:`STAMP` (or ``path``): the commit of this checkout and the blob hash of every file tracked at it,
    for a machine that gets the working tree without ``.git``. Returns the stamp.

    Raises:
        RuntimeError: ``root`` is not a git checkout.
    """
    head = _git("rev-parse", "HEAD", root=root)
    tree = _git("ls-tree", "-r", "HEAD", root=root)
    if head is None or tree is None:
        raise RuntimeError(f"{root} is not a git checkout git can read: no stamp of its commit can be written.")
    files = {}
    for line in tree.splitlines():
        meta, _, name = line.partition("\t")
        mode, kind, sha = meta.split()
        if kind == "blob" and mode != "120000":
            files[name] = sha
    stamp = {"commit": head.strip(), "files": files}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=0) + "\n")
    return stamp


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m lightning_4d.provenance``: print :func:`code_state` as JSON, or with ``--stamp`` write
    :data:`STAMP`. Returns the exit code (2: ``--stamp`` outside a git checkout)."""
    p = argparse.ArgumentParser(prog="python -m lightning_4d.provenance", description=__doc__.split("\n")[0])
    p.add_argument("--stamp", action="store_true", help=f"write {STAMP.relative_to(ROOT)} (the commit, file hashes)")
    args = p.parse_args(argv)
    if args.stamp:
        try:
            stamp = write_stamp()
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"wrote {STAMP} (commit {stamp['commit'][:12]}, {len(stamp['files'])} files)")
        return 0
    print(json.dumps(code_state(), indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
