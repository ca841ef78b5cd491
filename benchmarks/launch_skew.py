"""Hunt an intermittent failure of a multi-process launch by skewing its ranks' timing: run the transformers Llama
launch of ``tests/test_hf_llama_4d.py`` (one world size of its ``LAYOUTS``) again and again under ``torchrun`` (fresh
interpreters), while a thread stops random ranks (``SIGSTOP``, one to three at a time, for a random span up to
``--max-stop`` seconds) and lets them go on (``SIGCONT``), many times a second.

``python benchmarks/launch_skew.py [--world 8] [--runs 8] [--max-stop 4.0] [--out DIR]``

Why: a collective or point-to-point exchange issued in a different order on some ranks, or a rank that reads
a buffer before its message arrived, fails only when one rank runs far ahead of another. Machine load makes that rare;
stopping a rank for seconds in the middle of its work makes it routine (every rank falls behind or runs ahead of
its peers at random points, far beyond what load does), so a timing-dependent bug shows within a few runs. A
process-group timeout (120 s in these launches, ``tests/_collectives.TIMEOUT_S``) is not reached: no rank stops
longer than ``--max-stop``.

Prints one line per run (exit status, seconds) and keeps each failed run's whole output in a folder of its own
under ``--out`` (``<time>-<pid>/fail<i>.txt``: an earlier hunt's files are never overwritten). Not a test: each
8-process run takes 1.5-2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank_pids(script: str) -> list[int]:
    """The process ids of the ranks running ``script`` (their command line names it, their environment holds
    ``LOCAL_RANK``: torchrun's agent is left alone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if script.encode() not in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            if b"LOCAL_RANK=" in Path(f"/proc/{entry}/environ").read_bytes():
                pids.append(int(entry))
        except OSError:  # ended meanwhile, or not ours
            continue
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def skew(done: threading.Event, script: str, max_stop: float, seed: int) -> None:
    """Until ``done``: every 0.05-0.6 s stop one to three random ranks for up to ``max_stop`` seconds."""
    rng = random.Random(seed)
    while not done.is_set():
        time.sleep(rng.uniform(0.05, 0.6))
        pids = rank_pids(script)
        if not pids:
            continue
        stopped = rng.sample(pids, k=min(len(pids), rng.choice([1, 1, 1, 2, 3])))
        _signal_all(stopped, signal.SIGSTOP)
        time.sleep(rng.uniform(0.01, max_stop))
        _signal_all(stopped, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="the launch's number of processes (tests' LAYOUTS key)")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--max-stop", type=float, default=4.0, help="longest stop of a rank, seconds")
    parser.add_argument("--out", type=Path, default=Path("launch_skew"), help="where failed runs' output goes")
    args = parser.parse_args(argv)
    os.environ["L4D_TEST_LAUNCHER"] = "torchrun"  # fresh interpreters, each rank a process of its own
    sys.path.insert(0, str(ROOT))
    from tests._launch import SCRIPTS, torchrun
    from tests.test_hf_llama_4d import LAYOUTS, STEPS

    if args.world not in LAYOUTS:
        parser.error(f"--world {args.world}: tests/test_hf_llama_4d.py launches {sorted(LAYOUTS)} processes")
    script = str(SCRIPTS / "hf_llama_4d.py")
    kept = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    failed = 0
    for i in range(args.runs):
        folder = Path(tempfile.mkdtemp(prefix="launch_skew"))
        done = threading.Event()
        stopper = threading.Thread(target=skew, args=(done, script, args.max_stop, i), daemon=True)
        stopper.start()
        start = time.monotonic()
        layouts = json.dumps(LAYOUTS[args.world])
        cmd = ("--out", str(folder), "--layouts", layouts, "--steps", str(STEPS))
        proc = torchrun(args.world, script, *cmd, timeout=900, check=False)
        done.set()
        stopper.join()
        _signal_all(rank_pids(script), signal.SIGCONT)
        print(f"run {i}: exit {proc.returncode}, {time.monotonic() - start:.0f} s", flush=True)
        if proc.returncode != 0:
            failed += 1
            kept.mkdir(parents=True, exist_ok=True)
            (kept / f"fail{i}.txt").write_text(f"{proc.stdout}\n===== stderr =====\n{proc.stderr}")
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{failed} of {args.runs} runs failed (max stop {args.max_stop} s, world {args.world})")
    if failed:
        print(f"their output: {kept}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
