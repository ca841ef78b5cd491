"""Checkpoints whose pickle runs a shell command when unpickled (the command creates a marker file): what a
downloaded checkpoint may hold. Every loader must refuse them without running the command (``tests/test_safe_load.py``,
``tests/scripts/crafted_checkpoints.py``)."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_4d import safe_load


class RunsCode:
    """Unpickling this runs ``touch <marker>`` (``os.system``, as in the issue's report)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def crafted_file(path: Path, marker: Path, base: Optional[dict[str, Any]] = None) -> Path:
    """A full checkpoint file shaped like Lightning's (``base``, else a minimal one) with the payload among its
    callbacks' states."""
    ckpt = dict(base or {"state_dict": {}, "hyper_parameters": {}, "epoch": 0, "global_step": 0})
    ckpt["callbacks"] = {"Evil": RunsCode(marker)}
    torch.save(ckpt, path)
    return path


def crafted_folder(good: Path, dest: Path, marker: Path, where: str) -> Path:
    """A copy of the sharded folder ``good`` with the payload in its Lightning metadata (``where="meta"``), in an
    earlier version's per-rank optimizer file (``"legacy"``: ``zero1_optimizer_0_rank0.pt``) or in DCP's
    ``.metadata`` (``"dcp"``)."""
    shutil.copytree(good, dest)
    if where == "meta":
        crafted_file(dest / "meta.pt", marker, safe_load.load(dest / "meta.pt", mmap=False))
    elif where == "legacy":
        torch.save({"state": RunsCode(marker), "param_groups": [{}]}, dest / "zero1_optimizer_0_rank0.pt")
    elif where == "dcp":
        with open(dest / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # noqa: S301 - our own folder, written by the test's run
        metadata.planner_data = RunsCode(marker)
        with open(dest / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    else:
        raise ValueError(where)
    return dest
