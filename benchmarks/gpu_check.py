"""The prepared checks of a lent GPU, as one program (``benchmarks/gpu_check.sh`` runs it; docs/memory.md shows what
it found).

(0) first, the smoke matrix (``python -m lightning_4d.support --smoke``, issue 32): one rank of every support-matrix
    row that is not refused, 2 steps each, written to ``smoke_<GPU>_<date>.json`` in ``--out`` (docs/support.md reads
    the CUDA ones from ``benchmarks/results/``);
(r) ``benchmarks/ranks_on_one_gpu.py`` (at most 60 s): whether two processes on this one GPU can run our collectives,
    gloo with CUDA tensors and NCCL (issue 32 item 4), folded into the JSON;
(n) the CUDA numerics tests (at most 90 s): ``tests/cuda/test_numerics.py``, ``tests/test_context_parallel_cuda.py``,
    ``tests/test_checkpoint_cuda.py``;
(a) ``lightning-4d measure --device cuda`` for per-rank layouts up to the GPU's size: llama3.1-8b (one with
    activation offload) and llama3-70b ranks, and rank ``worst`` of llama3.1-405b tp8 pp16 s=8192 (Meta's layout)
    with full checkpointing and without;
(b) ``benchmarks/gpu_step_time.py``: our single-GPU step against plain PyTorch (tokens/s, MFU; also with half the
    layers' activations offloaded), SDPA against eager;
(c) ``benchmarks/memory_accuracy.py --write``: estimate against ``max_memory_allocated`` on one GPU, and the
    measured overhead allowance (CUDA context, fragmentation) written to ``lightning_4d/planning/overhead.json``
    (copied to the output folder);
(d) ``tests/test_compat.py`` on the GPU machine's torch (each private name still there).

Each part runs as its own process under a time limit taken from what is left of ``--budget-s`` (default 450 s, so
that the whole check, start-up included, stays under 8 minutes on an H100 and a 15-minute device budget leaves room
to rerun a part; the first H100 run, 2026-11-27, showed the parts' times: smoke 69 s, numerics 109 s, peaks 32 s, a
measured row 22-33 s, the step timing 94 s, compat 46 s; the ranks part is off by default since that run answered
it: NCCL refuses two ranks on one GPU). A part that runs out of time or memory
is recorded as such, and the rest goes on; the smoke matrix gets at most :data:`SMOKE_LIMIT_S` and skips the rows
left when its own budget is spent). Writes ``gpu_check_<GPU>_<date>.json`` and ``.md``
(and the parts' logs) into ``--out``.

Usage::

    python benchmarks/gpu_check.py --out benchmarks/results [--device cpu]   # cpu: a dry run at tiny sizes
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


#: the most seconds the smoke matrix may take (its rows stop at SMOKE_LIMIT_S - 15, so the JSON is complete)
SMOKE_LIMIT_S = 150.0


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=450.0, help="time for all parts together (seconds)")
    p.add_argument("--parts", default="smoke,numerics,measure,step,compat,accuracy")
    p.add_argument(
        "--measure-rows",
        default="0,1,3,5,6",
        help="measure only these rows (comma-separated indices into GPU_ROWS / CPU_ROWS; empty: all)",
    )
    args = p.parse_args()
    start = time.time()
    left = lambda: args.budget_s - (time.time() - start)  # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    import torch

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tag = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_") + "_" + datetime.date.today().isoformat()
    log = out / f"gpu_check_{tag}.log"
    result = {
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": args.device,
        "smoke": None,
        "measure": [],
        "step_time": None,
        "memory_accuracy": None,
        "compat": None,
    }
    parts = args.parts.split(",")
    json_path = out / f"gpu_check_{tag}.json"

    def save() -> None:
        json_path.write_text(json.dumps(result, indent=1))

    if "smoke" in parts:
        limit = min(SMOKE_LIMIT_S, left() - 30 * (len(parts) - 1))
        cmd = [py, "-m", "lightning_4d.support", "--smoke", "--device", args.device, "--out", str(out)]
        cmd += ["--budget-s", str(max(10.0, limit - 15))]
        rc, text, secs = _run(cmd, limit, log)
        found = sorted(out.glob(f"smoke_{tag}.json"))
        smoke = json.loads(found[-1].read_text()) if found else None
        counts: dict = {}
        for row in (smoke or {}).get("rows", {}).values():
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        result["smoke"] = {"rc": rc, "seconds": round(secs, 1), "file": found[-1].name if found else None}
        result["smoke"].update(counts=counts, rows=(smoke or {}).get("rows"), tail=None if smoke else text[-1500:])
        print(f"smoke matrix: rc={rc} {counts} ({secs:.0f} s)", flush=True)
        save()
    if "ranks" in parts and left() > 60:
        # issue 32 item 4: can several ranks share this one GPU (gloo with CUDA tensors, NCCL)?
        scratch = out / "ranks_scratch"
        cmd = [py, "benchmarks/ranks_on_one_gpu.py", "--device", args.device, "--out", str(scratch)]
        rc, text, secs = _run(cmd, 60.0, log)
        found = sorted(scratch.glob("ranks_on_one_gpu_*.json"))
        result["ranks_on_one_gpu"] = json.loads(found[-1].read_text()) if found else {"rc": rc, "tail": text[-1500:]}
        shutil.rmtree(scratch, ignore_errors=True)  # folded into this part's record (the device tool returns 8 files)
        print(f"ranks on one GPU: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    if "numerics" in parts and left() > 60:
        # issue 32: the CUDA fixes shown on the GPU (cp kernels and merge with every gradient, grouped GEMM, 20 steps
        # of the tiny job against the CPU, a save and a resume with the fused AdamW)
        tests = ["tests/cuda/test_numerics.py", "tests/test_context_parallel_cuda.py", "tests/test_checkpoint_cuda.py"]
        cmd = [py, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *tests]
        rc, text, secs = _run(cmd, min(150.0, left() - 45), log)
        result["numerics"] = {"rc": rc, "seconds": round(secs, 1), "tail": text[-3000:]}
        print(f"numerics: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    if "peaks" in parts and args.device == "cuda" and left() > 60:
        # what is alive at the peak of the pp rows, by allocating code (benchmarks/cuda_memory_peak.py)
        rc, text, secs = _run([py, "benchmarks/cuda_memory_peak.py", "--out", str(out)], min(90.0, left() - 45), log)
        result["cuda_memory_peak"] = {"rc": rc, "seconds": round(secs, 1), "tail": text[-3000:]}
        print(f"peaks: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    if "measure" in parts:
        rows = GPU_ROWS if args.device == "cuda" else CPU_ROWS
        if args.measure_rows:
            rows = [rows[int(i)] for i in args.measure_rows.split(",") if int(i) < len(rows)]
        for i, (name, argv) in enumerate(rows):
            after = len(parts) - parts.index("measure") - 1  # parts still to run after this one
            limit = min(150.0, left() - 45 * after) if args.device == "cuda" else left()
            if limit < 20:
                result["measure"].append({"name": name, "status": "skipped: out of time"})
                continue
            cmd = [py, "-m", "lightning_4d", "measure", *argv.split(), "--device", args.device, "--json"]
            rc, text, secs = _run(cmd, limit, log)
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
            save()
    if "step" in parts and left() > 60:
        step_args = ["--device", args.device]
        if args.device == "cpu":
            step_args += [
                "--preset",
                "tiny-test",
                "--sdpa-preset",
                "tiny-test",
                "--shapes",
                "2x64",
                "--steps",
                "4",
                "--warmup",
                "1",
            ]
        rc, text, secs = _run(
            [py, "benchmarks/gpu_step_time.py", "--out", str(out), *step_args], min(240.0, left() - 60), log
        )
        path = out / "gpu_step_time.json"
        result["step_time"] = json.loads(path.read_text()) if path.is_file() else {"rc": rc, "tail": text[-1500:]}
        result["step_time"]["rc"] = rc
        print(f"step time: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    if "compat" in parts and left() > 15:
        rc, text, secs = _run(
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_compat.py"], min(90.0, left() - 5), log
        )
        result["compat"] = {"rc": rc, "tail": text[-1500:]}
        print(f"compat: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    if "accuracy" in parts and args.device == "cuda" and left() > 40:
        rc, text, secs = _run([py, "benchmarks/memory_accuracy.py", "--write"], left() - 30, log)
        result["memory_accuracy"] = {"rc": rc, "output": text[-4000:]}
        overhead = ROOT / "lightning_4d" / "planning" / "overhead.json"
        shutil.copy(overhead, out / "overhead.json")
        print(f"memory accuracy: rc={rc} ({secs:.0f} s)", flush=True)
        save()
    save()
    (out / f"gpu_check_{tag}.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    """The tables of one run, as docs/memory.md quotes them."""
    gib = 2**30
    lines = [f"GPU check on {result['gpu']}, torch {result['torch']}, {result['date']}", ""]
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
    lines += [
        "| layout (rank) | status | params GiB est/meas | opt. states GiB est/meas | rest of peak GiB est/meas | "
        "peak GiB est/meas | est/meas | reserved/allocated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["measure"]:
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
    main()
