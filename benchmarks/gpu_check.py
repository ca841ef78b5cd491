"""The prepared checks of a lent GPU, planned as two calls of a 15-minute device budget (``benchmarks/gpu_check.sh``
runs one part; docs/validation.md shows what they found). Every result they write carries the record of the code that
ran it (:func:`lightning_4d.provenance.code_record`: commit, clean tree, torch, CUDA, driver, card).

Part 1 (call 1, at most 6 minutes with the machine's start): the smoke matrix (``python -m lightning_4d.support
--smoke``): one rank of every support-matrix row that is not refused, 2 steps each, in the order of
:func:`lightning_4d.support.smoke_plan`: first the rows never run on CUDA, then those that failed, then those whose
exercised files changed since their CUDA run (or whose run recorded no commit), then the rest as time allows. The
rows are written to ``smoke_<GPU>_<date>.json`` one by one, so a timeout loses none that ran (docs/support.md reads
the CUDA ones from ``benchmarks/results/``); then ``tests/test_compat.py`` on the GPU machine's torch.

Part 2 (call 2, ``--part 2``): the CUDA numerics tests (``tests/cuda/test_numerics.py``,
``tests/test_context_parallel_cuda.py``, ``tests/test_checkpoint_cuda.py``, each file its own process); ``lightning-4d
measure --device cuda`` for per-rank layouts at size (:data:`GPU_ROWS`: llama3.1-8b, llama3-70b and llama3.1-405b
ranks); ``benchmarks/gpu_step_time.py`` (our single-GPU step against plain PyTorch, tokens/s, MFU); and, when time
is left, ``benchmarks/memory_accuracy.py --write`` (the measured overhead allowance, copied to the output folder).

Each part has :data:`PART_BUDGET_S` seconds; each check in it (:data:`PARTS`) gets its cap, at most what is left less
the floors of the checks after it (:class:`Budget`). A check, smoke row or measure row that does not fit is skipped,
printed and recorded (``skipped`` in the JSON). Optional checks (``--parts``): ``ranks`` (two processes on one GPU,
``benchmarks/ranks_on_one_gpu.py``; answered on an H100: NCCL refuses two ranks on one GPU) and ``peaks``
(``benchmarks/cuda_memory_peak.py``).

A lent GPU gets the working tree without ``.git``: ``--prepare`` (run where git is, before the first call) writes
``.gpu-check/`` (ignored by git, named in the device tool's ``carry``): the stamp of the commit
(:data:`lightning_4d.provenance.STAMP`), the smoke plan made with git's history (``plan.json``), and the wheels the
GPU machine lacks (``--wheels DIR``: torchao, jsonargparse), which ``gpu_check.sh`` installs. Writes
``gpu_check_<GPU>_<date>_part<N>.json`` and ``.md`` (and the log) into ``--out``.

Usage::

    python benchmarks/gpu_check.py --prepare --wheels /path/to/wheels   # here, with git
    benchmarks/gpu_check.sh --part 1        # call 1 on the GPU
    benchmarks/gpu_check.sh --part 2        # call 2
    python benchmarks/gpu_check.py --part 1 --device cpu --out /tmp/gc   # a dry run at tiny sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent

#: (name, measure arguments) on a GPU: llama3.1-8b's README layout (tp2 dp4 ZeRO 1 s=8192: 60 GiB claimed), the same
#: with selective checkpointing, a 1F1B pipeline rank, a llama3-70b rank, and Meta's llama3.1-405b layout
GPU_ROWS = [
    ("8b tp2 dp4 z1 s8192", "--model llama3.1-8b --tp 2 --dp 4 --zero-stage 1 --seq-length 8192 --micro-batch-size 1"),
    (  # issue 32: 42.50 GiB measured on an H100 vs 40.14 estimated (torch 2.11)
        "8b dp8 z3 s8192 selective",
        "--model llama3.1-8b --dp 8 --zero-stage 3 --seq-length 8192 --micro-batch-size 1 "
        "--activation-checkpointing selective",
    ),
    (
        "8b tp2 dp4 z1 s8192 selective",
        "--model llama3.1-8b --tp 2 --dp 4 --zero-stage 1 --seq-length 8192 "
        "--micro-batch-size 1 --activation-checkpointing selective",
    ),
    (
        "8b tp2 pp2 dp2 z1 1f1b m4",
        "--model llama3.1-8b --tp 2 --pp 2 --dp 2 --zero-stage 1 --seq-length 4096 "
        "--micro-batch-size 1 --num-microbatches 4",
    ),
    (
        "8b tp2 pp2 dp2 z1 1f1b m4 offload 8",
        "--model llama3.1-8b --tp 2 --pp 2 --dp 2 --zero-stage 1 --seq-length 4096 "
        "--micro-batch-size 1 --num-microbatches 4 --activation-offload-layers 8",
    ),
    (
        "70b tp8 pp4 dp8 z1 s4096 m8",
        "--model llama3-70b --tp 8 --pp 4 --dp 8 --zero-stage 1 --seq-length 4096 "
        "--micro-batch-size 1 --num-microbatches 8",
    ),
    (
        "405b tp8 pp16 dp128 z1 s8192 full",
        "--model llama3.1-405b --tp 8 --pp 16 --dp 128 --zero-stage 1 "
        "--seq-length 8192 --micro-batch-size 1 --num-microbatches 16 "
        "--activation-checkpointing full",
    ),
    (
        "405b tp8 pp16 dp128 z1 s8192 none",
        "--model llama3.1-405b --tp 8 --pp 16 --dp 128 --zero-stage 1 "
        "--seq-length 8192 --micro-batch-size 1 --num-microbatches 16",
    ),
]
#: the same code paths at tiny sizes, for a dry run on CPU
CPU_ROWS = [
    ("tiny tp2 dp4 z1", "--model tiny-test --tp 2 --dp 4 --zero-stage 1 --seq-length 64 --micro-batch-size 1"),
    (
        "tiny tp2 pp2 dp2 z1 1f1b m4",
        "--model tiny-test --tp 2 --pp 2 --dp 2 --zero-stage 1 --seq-length 64 "
        "--micro-batch-size 1 --num-microbatches 4",
    ),
]


#: the checks of each part, in order: (name, cap in seconds, floor: the seconds kept for it while the checks before
#: it run). Part 1's smoke matrix took 69 s for 35 rows on an H100 (2 s a row); part 2's numerics 109 s, a measured
#: row 22-33 s, the step timing 94 s there
PARTS: dict[int, tuple[tuple[str, float, float], ...]] = {
    1: (("ranks", 60.0, 0.0), ("smoke", 230.0, 120.0), ("compat", 50.0, 30.0)),
    2: (
        ("numerics", 90.0, 40.0),
        ("peaks", 60.0, 0.0),
        ("measure", 80.0, 30.0),
        ("step", 90.0, 50.0),
        ("accuracy", 60.0, 0.0),
    ),
}
#: the checks a part runs unless ``--parts`` names others (ranks and peaks answered their questions on an H100)
DEFAULT_CHECKS = ("smoke", "compat", "numerics", "measure", "step", "accuracy")
#: the seconds one part's checks may take together: a call of at most 6 minutes holds the machine's start (a minute or
#: more), the copy of the tree, the wheels' install and this, with a margin
PART_BUDGET_S = 250.0
#: the fewest seconds a check or a measure row is started with
MIN_CHECK_S = 20.0
#: the most seconds one measure row may take
MEASURE_ROW_S = 45.0
#: the numerics test files, each run as its own process (a timeout loses one file's answer)
NUMERICS = ("tests/cuda/test_numerics.py", "tests/test_context_parallel_cuda.py", "tests/test_checkpoint_cuda.py")
#: what ``--prepare`` writes, for a machine without git (ignored by git; named in the device tool's carry)
PREPARED = ROOT / ".gpu-check"


class Budget:
    """The time bookkeeping of one part: how long each check may take, and what was skipped.

    Args:
        total: the part's seconds.
        checks: the part's checks (``(name, cap, floor)``, :data:`PARTS`), those that run.
        clock: the time source (seconds; a fake in tests).
    """

    def __init__(self, total: float, checks: list[tuple[str, float, float]], clock=time.monotonic) -> None:
        self.total, self.checks, self.clock = total, list(checks), clock
        self.start = clock()
        self.skipped: list[str] = []

    def left(self) -> float:
        """Seconds left of the part."""
        return self.total - (self.clock() - self.start)

    def limit(self, name: str) -> float:
        """The seconds check ``name`` may take now: its cap, at most what is left less the floors of the checks
        after it; 0 (and recorded as skipped) when that is under :data:`MIN_CHECK_S`."""
        names = [c[0] for c in self.checks]
        i = names.index(name)
        cap = self.checks[i][1]
        after = sum(c[2] for c in self.checks[i + 1 :])
        limit = min(cap, self.left() - after)
        if limit < MIN_CHECK_S:
            self.skip(name, f"out of time ({max(0.0, self.left()):.0f} s left of {self.total:.0f} s)")
            return 0.0
        return limit

    def skip(self, what: str, why: str) -> None:
        """Record and print that ``what`` was skipped, and why."""
        self.skipped.append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)


def planned_smoke_rows(prepared: Path = PREPARED) -> list[tuple[str, str]]:
    """The smoke rows in the order part 1 runs them, each with its reason: ``plan.json`` of ``--prepare`` when there
    is one (made where git could tell which rows changed), else :func:`lightning_4d.support.smoke_plan` now."""
    plan = prepared / "plan.json"
    if plan.is_file():
        return [tuple(x) for x in json.loads(plan.read_text())["rows"]]
    from lightning_4d.support import smoke_plan

    return [(row.id, reason) for row, reason in smoke_plan()]


def prepare(wheels: Optional[Path], prepared: Path = PREPARED) -> None:
    """Write ``prepared`` (:data:`PREPARED`) for a machine that gets the tree without git: the stamp of the commit,
    the smoke plan, and the wheels of ``wheels`` (``*.whl``)."""
    from lightning_4d.provenance import write_stamp

    prepared.mkdir(parents=True, exist_ok=True)
    stamp = write_stamp(prepared / "code.json")
    from lightning_4d.support import smoke_plan

    rows = [(row.id, reason) for row, reason in smoke_plan()]  # made here, with git's history
    (prepared / "plan.json").write_text(json.dumps({"commit": stamp["commit"], "rows": rows}, indent=0) + "\n")
    if wheels is not None:
        (prepared / "wheels").mkdir(exist_ok=True)
        for whl in sorted(Path(wheels).glob("*.whl")):
            (prepared / "wheels" / whl.name).unlink(missing_ok=True)
            shutil.copyfile(whl, prepared / "wheels" / whl.name)
    counts: dict[str, int] = {}
    for _, reason in rows:
        counts[reason] = counts.get(reason, 0) + 1
    print(f"prepared {prepared}: commit {stamp['commit'][:10]}, smoke plan {counts}")
    print(f"wheels: {sorted(p.name for p in (prepared / 'wheels').glob('*.whl'))}")


def _run(cmd: list[str], limit: float, log: Path) -> tuple[int, str, float]:
    """Run ``cmd`` (cwd: the repository) for at most ``limit`` seconds; its output goes to ``log``."""
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, limit))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        out += f"\n[timed out after {limit:.0f} s]"
        rc = 124
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n[rc={rc}, {time.time() - t0:.1f} s]\n\n")
    return rc, out, time.time() - t0


def _smoke(args, budget: Budget, result: dict, out: Path, tag: str, log: Path) -> None:
    """Part 1's smoke matrix: the planned rows in order, until its share of the budget is spent."""
    limit = budget.limit("smoke")
    planned = planned_smoke_rows()
    result["smoke_plan"] = planned
    if not limit:
        return
    py = sys.executable
    cmd = [py, "-m", "lightning_4d.support", "--smoke", "--device", args.device, "--out", str(out)]
    cmd += ["--rows", ",".join(row_id for row_id, _ in planned), "--budget-s", str(max(10.0, limit - 15))]
    before = set(out.glob(f"smoke_{tag}*.json"))
    rc, text, secs = _run(cmd, limit, log)
    found = sorted(set(out.glob(f"smoke_{tag}*.json")) - before, key=lambda p: p.stat().st_mtime)
    smoke = json.loads(found[-1].read_text()) if found else None
    rows = (smoke or {}).get("rows", {})
    counts: dict = {}
    for row in rows.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    not_run = [
        (row_id, reason) for row_id, reason in planned if rows.get(row_id, {}).get("status", "skipped") == "skipped"
    ]
    if not_run:
        by_reason: dict[str, list[str]] = {}
        for row_id, reason in not_run:
            by_reason.setdefault(reason, []).append(row_id)
        groups = "; ".join(f"{reason} ({len(ids)}): {', '.join(ids)}" for reason, ids in by_reason.items())
        budget.skip(f"{len(not_run)} of {len(planned)} smoke rows", f"out of time; {groups}")
    result["smoke"] = {"rc": rc, "seconds": round(secs, 1), "file": found[-1].name if found else None}
    result["smoke"].update(counts=counts, rows=rows or None, tail=None if smoke else text[-1500:])
    print(f"smoke matrix: rc={rc} {counts} ({secs:.0f} s)", flush=True)


def _numerics(args, budget: Budget, result: dict, log: Path) -> None:
    """Part 2's CUDA numerics tests, one process per file."""
    limit = budget.limit("numerics")
    if not limit:
        return
    start, files = time.monotonic(), {}
    for i, test in enumerate(NUMERICS):
        left = limit - (time.monotonic() - start)
        if left < MIN_CHECK_S:
            budget.skip(test, "out of numerics' time")
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test]
        rc, text, secs = _run(cmd, left, log)
        summary = next(
            (
                ln
                for ln in reversed(text.splitlines())
                if " in " in ln and ("passed" in ln or "skipped" in ln or "failed" in ln)
            ),
            "",
        )
        files[test] = {"rc": rc, "seconds": round(secs, 1), "summary": summary.strip("= "), "tail": text[-1500:]}
        print(f"numerics {test}: rc={rc} {summary.strip('= ')} ({secs:.0f} s)", flush=True)
    result["numerics"] = files


def _measure(args, budget: Budget, result: dict, log: Path) -> None:
    """Part 2's measure rows at size, each with at most :data:`MEASURE_ROW_S` of the check's share."""
    rows = GPU_ROWS if args.device == "cuda" else CPU_ROWS
    if args.measure_rows:
        rows = [rows[int(i)] for i in args.measure_rows.split(",") if int(i) < len(rows)]
    limit = budget.limit("measure")
    start = time.monotonic()
    for name, argv in rows:
        left = min(MEASURE_ROW_S, limit - (time.monotonic() - start))
        if left < MIN_CHECK_S:
            budget.skip(f"measure {name}", "out of time")
            result["measure"].append({"name": name, "status": "skipped: out of time"})
            continue
        cmd = [sys.executable, "-m", "lightning_4d", "measure", *argv.split(), "--device", args.device, "--json"]
        rc, text, secs = _run(cmd, left, log)
        row = {"name": name, "args": argv, "rc": rc, "seconds": round(secs, 1)}
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        if rc == 0 and lines:
            got = json.loads(lines[-1])
            row.update(
                status="ok",
                rank=got["rank"],
                coordinates=got["coordinates"],
                rows=got["rows"],
                measured=got["measured"],
                fragmentation=got.get("fragmentation"),
            )
        else:
            oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
            row["status"] = "out of memory" if oom else ("timed out" if rc == 124 else "failed")
            row["tail"] = text[-1500:]
        result["measure"].append(row)
        print(f"measure {name}: {row['status']} ({secs:.0f} s)", flush=True)


def _step(args, budget: Budget, result: dict, out: Path, log: Path) -> None:
    """Part 2's step timing (``benchmarks/gpu_step_time.py``; it writes each run as it is timed)."""
    limit = budget.limit("step")
    if not limit:
        return
    step_args = ["--device", args.device]
    if args.device == "cpu":
        step_args += "--preset tiny-test --sdpa-preset tiny-test --shapes 2x64 --steps 4 --warmup 1 --float8".split()
    rc, text, secs = _run([sys.executable, "benchmarks/gpu_step_time.py", "--out", str(out), *step_args], limit, log)
    path = out / "gpu_step_time.json"
    result["step_time"] = json.loads(path.read_text()) if path.is_file() else {"tail": text[-1500:]}
    result["step_time"]["rc"] = rc
    print(f"step time: rc={rc} ({secs:.0f} s)", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one part of the GPU check (or ``--prepare``). Returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--part", type=int, default=1, choices=sorted(PARTS), help="which call: 1 smoke, 2 the rest")
    p.add_argument("--budget-s", type=float, default=PART_BUDGET_S, help="seconds for the part's checks together")
    p.add_argument("--parts", default=",".join(DEFAULT_CHECKS), help="the checks to run (of the part's, PARTS)")
    p.add_argument(
        "--measure-rows",
        default="0,1,3,5,6",
        help="measure only these rows (comma-separated indices into GPU_ROWS / CPU_ROWS; empty: all)",
    )
    p.add_argument("--prepare", action="store_true", help="write .gpu-check/ (stamp, smoke plan, wheels); no run")
    p.add_argument("--wheels", default=None, help="--prepare: a folder of wheels to carry (torchao, jsonargparse)")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(Path(args.wheels) if args.wheels else None)
        return 0
    wanted = args.parts.split(",")
    checks = [
        c for c in PARTS[args.part] if c[0] in wanted and (args.device == "cuda" or c[0] not in ("peaks", "accuracy"))
    ]
    budget = Budget(args.budget_s, checks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lightning_4d.provenance import code_record

    code = code_record(args.device)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", code["card"]).strip("_") + "_" + datetime.date.today().isoformat()
    log = out / f"gpu_check_{tag}_part{args.part}.log"
    result: dict = {
        "gpu": code["card"],
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "part": args.part,
        "code": code,
        "budget_s": args.budget_s,
        "checks": [c[0] for c in checks],
        "smoke": None,
        "measure": [],
        "step_time": None,
        "memory_accuracy": None,
        "compat": None,
        "skipped": budget.skipped,
    }
    json_path = out / f"gpu_check_{tag}_part{args.part}.json"
    py = sys.executable
    print(
        f"part {args.part}: {[c[0] for c in checks]} in {args.budget_s:.0f} s; commit {code['commit']} "
        f"(clean: {code['clean']}), torch {code['torch']}, CUDA {code['cuda']}, driver {code['driver']}",
        flush=True,
    )

    def save() -> None:
        json_path.write_text(json.dumps(result, indent=1))

    for name, _, _ in checks:
        if name == "ranks" and (limit := budget.limit(name)):
            scratch = out / "ranks_scratch"
            cmd = [py, "benchmarks/ranks_on_one_gpu.py", "--device", args.device, "--out", str(scratch)]
            rc, text, secs = _run(cmd, limit, log)
            found = sorted(scratch.glob("ranks_on_one_gpu_*.json"))
            result["ranks_on_one_gpu"] = (
                json.loads(found[-1].read_text()) if found else {"rc": rc, "tail": text[-1500:]}
            )
            shutil.rmtree(scratch, ignore_errors=True)  # folded into this part's record
            print(f"ranks on one GPU: rc={rc} ({secs:.0f} s)", flush=True)
        elif name == "smoke":
            _smoke(args, budget, result, out, tag, log)
        elif name == "numerics":
            _numerics(args, budget, result, log)
        elif name == "peaks" and (limit := budget.limit(name)):
            rc, text, secs = _run([py, "benchmarks/cuda_memory_peak.py", "--out", str(out)], limit, log)
            result["cuda_memory_peak"] = {"rc": rc, "seconds": round(secs, 1), "tail": text[-3000:]}
            print(f"peaks: rc={rc} ({secs:.0f} s)", flush=True)
        elif name == "measure":
            _measure(args, budget, result, log)
        elif name == "step":
            _step(args, budget, result, out, log)
        elif name == "compat" and (limit := budget.limit(name)):
            cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_compat.py"]
            rc, text, secs = _run(cmd, limit, log)
            result["compat"] = {"rc": rc, "tail": text[-1500:]}
            print(f"compat: rc={rc} ({secs:.0f} s)", flush=True)
        elif name == "accuracy" and (limit := budget.limit(name)):
            rc, text, secs = _run([py, "benchmarks/memory_accuracy.py", "--write"], limit, log)
            result["memory_accuracy"] = {"rc": rc, "output": text[-4000:]}
            overhead = ROOT / "lightning_4d" / "planning" / "overhead.json"
            shutil.copy(overhead, out / "overhead.json")
            print(f"memory accuracy: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    save()
    (out / f"gpu_check_{tag}_part{args.part}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"part {args.part} done in {args.budget_s - budget.left():.0f} s; skipped {len(budget.skipped)} (above)")
    return 0


def markdown(result: dict) -> str:
    """The tables of one run, as docs/validation.md quotes them."""
    gib = 2**30
    code = result.get("code") or {}
    commit = code.get("commit") or "not recorded"
    if code.get("clean") is False:
        commit += " with uncommitted changes: " + ", ".join(code.get("changed") or [])
    lines = [
        f"GPU check part {result.get('part', '-')} on {result['gpu']}, {result['date']}: commit {commit}; torch "
        f"{code.get('torch', result.get('torch'))}, CUDA {code.get('cuda')}, driver {code.get('driver')}",
        "",
    ]
    if result.get("skipped"):
        lines += ["Skipped (out of the part's time):", "", *(f"- {x}" for x in result["skipped"]), ""]
    numerics = result.get("numerics")
    if isinstance(numerics, dict) and numerics and "rc" not in numerics:
        lines += ["| numerics | rc | result |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['rc']} | {v['summary']} |" for k, v in numerics.items()]
        lines.append("")
    ranks = (result.get("ranks_on_one_gpu") or {}).get("results")
    if ranks:
        lines += ["Two ranks on one device (benchmarks/ranks_on_one_gpu.py):", ""]
        for backend, steps in ranks.items():
            lines.append(f"- {backend}: " + ", ".join(f"{k} {v}" for k, v in steps.items()))
        lines.append("")
    smoke = result.get("smoke")
    if smoke:
        lines += [f"Smoke matrix (lightning_4d.support, {smoke['seconds']} s): {smoke['counts']}", ""]
        lines += ["| row | status | (estimate + library) / peak | error |", "| --- | --- | --- | --- |"]
        for row_id, row in (smoke.get("rows") or {}).items():
            ratio = f"{row['ratio']:.3f}" if row.get("ratio") else "-"
            error = (row.get("error") or "").replace("|", "/")[:200] if row["status"] != "skipped" else "skipped"
            lines.append(f"| {row_id} | {row['status']} | {ratio} | {error} |")
        lines.append("")
    if result.get("measure"):
        lines += [
            "| layout (rank) | status | params GiB est/meas | opt. states GiB est/meas | rest of peak GiB est/meas | "
            "peak GiB est/meas | est/meas | reserved/allocated |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for row in result.get("measure") or []:
        if row.get("status") != "ok":
            lines.append(f"| {row['name']} | {row.get('status')} | | | | | | |")
            continue
        r = {x["component"]: x for x in row["rows"]}

        def pair(k: str) -> str:
            return f"{r[k]['estimated'] / gib:.2f} / {r[k]['measured'] / gib:.2f}"

        frag = row.get("fragmentation")
        lines.append(
            f"| {row['name']} (rank {row['rank']}) | ok | {pair('parameters')} | {pair('optimizer_states')} | "
            f"{pair('peak - parameters - optimizer states')} | {pair('total (peak)')} | "
            f"{r['total (peak)']['ratio']:.3f} | {'-' if frag is None else f'{1 + frag:.3f}'} |"
        )
    st = result.get("step_time")
    if st and st.get("rows"):
        lines += [
            "",
            f"Single-GPU step, {st['preset']} bf16-mixed ZeRO 0, SDPA flash (median of timed steps):",
            "",
            "| b x s | run | step ms | tokens/s | MFU | peak GiB | / plain |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        from gpu_step_time import ROWS  # benchmarks/ is the script's folder: on sys.path

        for row in st["rows"]:
            for key in [k for k in ROWS if k in row]:  # a shape cut short by the time limit has fewer rows
                x = row[key]
                mfu = f"{100 * x['mfu']:.1f}%" if x.get("mfu") else "-"
                lines.append(
                    f"| {row['b']} x {row['s']} | {key} | {1e3 * x['step_s']:.1f} | "
                    f"{x['tokens_per_s']:,.0f} | {mfu} | {x['peak_gib']:.2f} | "
                    f"{x.get('ratio_to_plain', 1.0):.3f} |"
                )
        lines += ["", f"SDPA vs eager, max |diff| / max |logit|: {st.get('sdpa_vs_eager')}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
