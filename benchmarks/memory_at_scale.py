"""Real-size ranks measured on this CPU machine against the estimate: ``lightning-4d measure`` for each row of
:data:`ROWS` (one rank of a >= 8-way layout of llama3.2-1b / 3b / llama3.1-8b, ZeRO 1 and 3, none / selective /
full checkpointing, 1F1B and interleaved, cp, tied embeddings under pp; tiny-moe and Mixtral 8x7B under expert
parallelism at the estimate's default load), each in its own process, two optimizer steps on synthetic tokens,
the peak of live CPU tensor bytes (``lightning_4d.measure.LiveTensorBytes``) beside ``estimate`` per
component. Goal: model states exact and the total within 5% on every row.

Usage::

    python benchmarks/memory_at_scale.py [--out benchmarks/results] [--rows 0 1 2]

Prints a markdown table (docs/validation_models.md quotes it) and writes ``memory_at_scale_cpu.json`` / ``.md`` into
``--out`` (the rows of an earlier run in that file are kept; a row run again replaces its entry).
Each row takes 1-4 minutes on 2 cores (the ranks really compute; only the collectives are fake).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (name, ``lightning-4d measure`` arguments); all bf16-mixed, b=1
ROWS = [
    ("1b tp8 z1 s2048 none", "--model llama3.2-1b --tp 8 --dp 1 --zero-stage 1 --seq-length 2048"),
    (
        "1b tp8 dp8 z3 s2048 selective",
        "--model llama3.2-1b --tp 8 --dp 8 --zero-stage 3 --seq-length 2048 --activation-checkpointing selective",
    ),
    (
        "1b tp4 cp2 dp2 z1 s4096 full",
        "--model llama3.2-1b --tp 4 --cp 2 --dp 2 --zero-stage 1 --seq-length 4096 --activation-checkpointing full",
    ),
    ("3b tp8 dp4 z3 s4096 none", "--model llama3.2-3b --tp 8 --dp 4 --zero-stage 3 --seq-length 4096"),
    # llama3.1-8b's pipeline rows (untied); llama3.2-3b's tied pipeline row is the last
    (
        "8b tp8 pp4 z1 s2048 interleaved v2 m4 selective",
        "--model llama3.1-8b --tp 8 --pp 4 --dp 1 --zero-stage 1 "
        "--seq-length 2048 --pipeline-schedule interleaved_1f1b "
        "--num-microbatches 4 --activation-checkpointing selective",
    ),
    (
        "8b tp8 pp4 dp2 z1 s2048 1f1b m4 full",
        "--model llama3.1-8b --tp 8 --pp 4 --dp 2 --zero-stage 1 "
        "--seq-length 2048 --num-microbatches 4 --activation-checkpointing full",
    ),
    # Mixture of Experts under expert parallelism: the fake group's count exchange answers the estimate's default
    # load (--expert-load-imbalance, DEFAULT_EXPERT_LOAD_IMBALANCE): the measured rank's experts receive that many
    # times the balanced rows
    ("tiny-moe dp2 ep2 z1 s512 none", "--model tiny-moe --dp 2 --ep 2 --zero-stage 1 --seq-length 512"),
    ("tiny-moe dp4 ep2 z1 s512 none", "--model tiny-moe --dp 4 --ep 2 --zero-stage 1 --seq-length 512"),
    (
        "tiny-moe pp2 dp2 ep2 z1 s512 1f1b m2",
        "--model tiny-moe --pp 2 --dp 2 --ep 2 --zero-stage 1 --seq-length 512 --num-microbatches 2",
    ),
    (
        "tiny-moe tp2 dp2 ep2 z1 s512 sp",
        "--model tiny-moe --tp 2 --dp 2 --ep 2 --zero-stage 1 --seq-length 512 --sequence-parallel true",
    ),
    # Mixtral 8x7B: 2 of its 32 layers per stage, one expert of 8 per rank (ep8 within dp8); GPipe with 2
    # micro-batches at s=128 keeps the run to minutes on 2 cores (every micro-batch really computes)
    (
        "mixtral-8x7b pp16 dp8 ep8 z1 s128 gpipe m2",
        "--model mixtral-8x7b --pp 16 --dp 8 --ep 8 --zero-stage 1 --seq-length 128 --pipeline-schedule gpipe "
        "--num-microbatches 2",
    ),
    # tied embeddings under pp x cp x selective (issue 49): the first stage's peak is the embedding's backward in
    # micro-batch 0's backward, beside micro-batch 1's saved tensors
    (
        "3b tied tp4 pp2 cp2 dp2 z1 s4096 1f1b m2 selective",
        "--model llama3.2-3b --tp 4 --pp 2 --cp 2 --dp 2 --zero-stage 1 --seq-length 4096 "
        "--activation-checkpointing selective",
    ),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--rows", type=int, nargs="+", help="indices into ROWS (default: all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)), PYTHONWARNINGS="ignore"
    )
    # rows run before (the same file) are kept; a row run again replaces its entry
    results_file = out / "memory_at_scale_cpu.json"
    kept = {r["name"]: r for r in json.loads(results_file.read_text())} if results_file.exists() else {}
    results = []
    for i in args.rows if args.rows is not None else range(len(ROWS)):
        name, argv = ROWS[i]
        t0 = time.time()
        cmd = [
            sys.executable,
            "-m",
            "lightning_4d",
            "measure",
            *argv.split(),
            "--micro-batch-size",
            "1",
            "--precision",
            "bf16-mixed",
            "--device",
            "cpu",
            "--json",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            results.append({"name": name, "args": argv, "status": "failed", "tail": proc.stderr[-3000:]})
            kept[name] = results[-1]
            continue
        got = json.loads(lines[-1])
        results.append(
            {
                "name": name,
                "args": argv,
                "status": "ok",
                "seconds": round(time.time() - t0),
                "rank": got["rank"],
                "rows": got["rows"],
            }
        )
        print(
            f"{name}: total estimated / measured {got['rows'][-1]['ratio']:.3f} ({time.time() - t0:.0f} s)", flush=True
        )
        kept[name] = results[-1]
        results_file.write_text(json.dumps([kept[n] for n, _ in ROWS if n in kept], indent=1))
    text = table([kept[n] for n, _ in ROWS if n in kept])
    (out / "memory_at_scale_cpu.md").write_text(text)
    print(text)
    return 0 if all(r["status"] == "ok" for r in results) else 1


def table(results: list[dict]) -> str:
    """The markdown table of ``results``: per row, estimated / measured GiB of each component and the ratio."""
    gib = 2**30
    lines = [
        "| rank of layout (bf16-mixed, b=1) | params | grads | opt. states | rest of peak | peak | est / meas |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | failed | | | | | |")
            continue
        c = {x["component"]: x for x in r["rows"]}

        def pair(key: str) -> str:
            return f"{c[key]['estimated'] / gib:.3f} / {c[key]['measured'] / gib:.3f}"

        lines.append(
            f"| {r['name']} (rank {r['rank']}) | {pair('parameters')} | {pair('gradients')} | "
            f"{pair('optimizer_states')} | {pair('peak - parameters - optimizer states')} | "
            f"{pair('total (peak)')} | {c['total (peak)']['ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
