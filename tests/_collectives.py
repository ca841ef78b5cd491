"""Every rank's collectives in a launch, from torch's flight recorder, and where the ranks of a process group part:
the property a distributed run needs (each rank of a group issues the same collectives in the same order, from one
thread), checked on what the ranks really issued, and named when a launch fails.

A launch script calls :func:`record` before its process groups exist and :func:`write` at its end (in a ``finally``:
a rank that raises still writes what it issued); the test reads the folder with :func:`first_divergence`.
gloo's flight recorder keeps collectives only: the pipeline's send/recv are not in it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

#: the newest collectives kept per process (torch's flight recorder ring buffer)
KEPT = 200_000
#: the process-group timeout (s) of the launches that record their collectives (tests/scripts/hf_llama_4d.py): a
#: rank that waits longer at a collective fails the launch with gloo's timeout error
TIMEOUT_S = 120


def record() -> None:
    """Make torch's flight recorder keep this process's collectives (call before ``init_process_group``)."""
    from lightning_4d.parallel._compat.process import FLIGHT_RECORDER_ENV

    os.environ.setdefault(FLIGHT_RECORDER_ENV, str(KEPT))


def write(out: Path) -> None:
    """Write this rank's collectives to ``out/collectives_rank<r>.json``: ``{"groups": {name: global ranks},
    "entries": [[group name, sequence number, op, sizes, dtypes, thread id, frames, issued], ...]}`` (sizes and dtypes
    of the tensors every rank passes: :func:`_passed_by_every_rank`; frames: ``"function file:line"``, innermost
    first, the first 8; issued: when the rank issued it, ns of the system clock). Nothing without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from lightning_4d.parallel._compat.process import collective_trace
    from lightning_4d.safe_load import loads_plain

    trace, groups = collective_trace()
    entries = loads_plain(trace, "the flight recorder's trace").get("entries", [])
    rows = [
        [
            e["process_group"][0],
            e["collective_seq_id"],
            e["profiling_name"],
            *_passed_by_every_rank(e),
            e["thread_id"],
            [f"{f['name']} {Path(f['filename']).name}:{f['line']}" for f in e["frames"][:8]],
            e["time_created_ns"],
        ]
        for e in entries
    ]
    path = out / f"collectives_rank{dist.get_rank()}.json"
    path.write_text(json.dumps({"groups": groups, "entries": rows, "kept": KEPT}))


def _passed_by_every_rank(entry: dict) -> tuple[list, list]:
    """The sizes and dtypes of the tensors every rank of the group passes to a collective: its inputs, but a scatter's
    output (its input, the list to scatter, is the root's alone: the others record none)."""
    if entry["profiling_name"].endswith(":scatter"):
        return entry["output_sizes"], entry["output_dtypes"]
    return entry["input_sizes"], entry["input_dtypes"]


def first_divergence(out: Path) -> Optional[str]:
    """The first place where the ranks' collectives of :func:`write` in ``out`` part, described with each rank's
    Python frames, else ``None``: per process group, in sequence order, a collective whose op, input sizes or dtypes
    differ between two of its ranks, or a rank whose sequence stops short of another's (it failed or hung there); a
    rank whose collectives came from two threads; a rank whose recorder dropped entries (more than :data:`KEPT`)."""
    ranks = {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text()) for p in out.glob("collectives_rank*.json")}
    by_group: dict[str, dict[int, list]] = {}
    members_of: dict[str, list[int]] = {}  # a rank knows the groups it is in
    for rank, trace in sorted(ranks.items()):
        members_of.update(trace["groups"])
        if len(trace["entries"]) >= trace["kept"]:
            return f"rank {rank}: {len(trace['entries'])} collectives, the flight recorder keeps {trace['kept']}"
        threads = {row[5] for row in trace["entries"]}
        if len(threads) > 1:
            row = next(r for r in trace["entries"] if r[5] != trace["entries"][0][5])
            return f"rank {rank} issued collectives from {len(threads)} threads, e.g. {_describe(row)}"
        for row in trace["entries"]:
            by_group.setdefault(row[0], {}).setdefault(rank, []).append(row)
    for name, rows in by_group.items():
        members = members_of.get(name, sorted(rows))
        sequences = {r: rows.get(r, []) for r in members if r in ranks}
        longest = max(len(s) for s in sequences.values())
        for i in range(longest):
            here = {r: (s[i] if i < len(s) else None) for r, s in sequences.items()}
            keys = {None if row is None else (row[2], json.dumps(row[3]), json.dumps(row[4])) for row in here.values()}
            if len(keys) > 1:
                lines = "\n".join(f"  rank {r}: {_describe(row)}" for r, row in here.items())
                return f"process group {name} (ranks {members}), collective {i + 1}:\n{lines}"
    return None


def longest_wait(out: Path) -> tuple[float, str]:
    """The longest a rank waited at a collective of :func:`write` in ``out`` for the last rank of its group to issue
    it: seconds between the first and the last rank's issue time (the ranks share one machine's clock), and that
    collective described (the last rank's frames: where the others waited for it). ``(0.0, "")`` without
    collectives. A process group's timeout shorter than this fails the launch with gloo's timeout error (the
    pipeline's send/recv are not in gloo's flight recorder: their waits are not counted)."""
    by_key: dict[tuple, dict[int, list]] = {}
    for p in out.glob("collectives_rank*.json"):
        rank = int(p.stem.rsplit("rank", 1)[1])
        for row in json.loads(p.read_text())["entries"]:
            by_key.setdefault((row[0], row[1]), {})[rank] = row
    worst, where = 0.0, ""
    for (group, _), rows in by_key.items():
        issued = {r: row[7] for r, row in rows.items()}
        wait = (max(issued.values()) - min(issued.values())) / 1e9
        if wait > worst:
            last = max(issued, key=issued.get)
            worst, where = wait, f"group {group}, rank {last} last: {_describe(rows[last])}"
    return worst, where


def _describe(row: Optional[list]) -> str:
    if row is None:
        return "none (its sequence ends before)"
    return f"{row[2]} sizes {row[3]} {row[4]} (seq {row[1]}) from {' < '.join(row[6])}"
