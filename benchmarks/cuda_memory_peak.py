"""What is alive on the GPU at a smoke row's peak, by the code that allocated it (issue 32: the ZBV and DualPipeV rows
peaked 6-9% above estimate + CUDA library workspaces on an H100, while the other pp schedules were within 3%).

For each support-matrix row named, the row's smoke run (:func:`lightning_4d.support.run_row`, rank ``worst`` on the
fake process group, 2 steps) runs with the CUDA caching allocator's event recording on
(:func:`lightning_4d.parallel._compat.process.record_cuda_memory_history`); the trace is replayed (``alloc`` adds the
block's bytes, ``free_requested`` removes them) to find the peak, and the blocks alive there are summed by the innermost
frame in ``lightning_4d`` (and by the innermost Python frame of all; C++ frames and the smoke run's own dispatch
mode are passed over). Writes ``cuda_memory_peak_<GPU>_<date>.json``.

Usage::

    python benchmarks/cuda_memory_peak.py --rows pp2-1f1b,pp2-zbv,pp2-dualpipev --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from lightning_4d.parallel._compat.process import cuda_memory_snapshot, record_cuda_memory_history
from lightning_4d.support import ROWS, run_row

#: frames that are not where a tensor was asked for: the smoke run's dispatch mode (lightning_4d/support.py), which
#: sees every op, and C++ frames (the first GPU run grouped everything under them)
SKIP = ("lightning_4d/support.py",)


def _site(frames: list[dict], inside: str) -> str:
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and inside in name and not any(s in name for s in SKIP):
            name = f["filename"].split(inside)[-1] if inside else f["filename"]
            return f"{name}:{f['line']} {f['name']}"
    return "(none)"


def live_at_peak(trace: list[dict], base: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """Replay ``trace`` (one device's events) from ``base`` allocated bytes: the peak (bytes) and the bytes alive
    there, by the innermost ``lightning_4d`` frame and by the innermost frame."""
    live: dict[int, dict] = {}
    now, peak, at_peak = base, base, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
    ours: dict[str, int] = defaultdict(int)
    inner: dict[str, int] = defaultdict(int)
    for ev in at_peak.values():
        frames = ev.get("frames") or []
        ours[_site(frames, "lightning_4d/")] += ev["size"]
        inner[_site(frames, "")] += ev["size"]
    top = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1])[:40])  # noqa: E731
    return peak, top(ours), top(inner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="pp2-1f1b,pp2-zbv,pp2-dualpipev,offload-pp-zbv")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    by_id = {r.id: r for r in ROWS}
    from lightning_4d.provenance import code_record

    code = code_record("cuda")  # which code ran the rows
    gpu = code["card"]
    result: dict = {"gpu": gpu, "code": code, "rows": {}}
    run_row(by_id["z0-bf16-mixed"], device="cuda")  # CUDA's libraries initialized outside the recorded runs
    for row_id in args.rows.split(","):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        record_cuda_memory_history(True, max_entries=2_000_000)
        got = run_row(by_id[row_id], device="cuda")
        snap = cuda_memory_snapshot()
        record_cuda_memory_history(False)
        trace = snap["device_traces"][torch.cuda.current_device()]
        peak, ours, inner = live_at_peak(trace, base)
        result["rows"][row_id] = {
            "smoke": got,
            "base_allocated": base,
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "replayed_peak": peak,
            "events": len(trace),
            "alive_at_peak_by_lightning_4d_frame": ours,
            "alive_at_peak_by_innermost_frame": inner,
        }
        print(f"{row_id}: peak {peak:,} B (replayed) / {torch.cuda.max_memory_allocated():,} B, {len(trace)} events")
        for site, n in list(ours.items())[:12]:
            print(f"   {n:>14,} B  {site}")
    tag = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_") + "_" + datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cuda_memory_peak_{tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
