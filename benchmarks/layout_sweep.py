"""The layout sweep: `estimate`, `plan` and `--emit-config` output over a seeded sample of layouts, written to one file,
so a restructuring of the package can show that every estimate, plan and CLI output stayed byte-identical.

    python benchmarks/layout_sweep.py --out /tmp/before.txt          # on the commit before the change
    python benchmarks/layout_sweep.py --out /tmp/after.txt --compare /tmp/before.txt

Each case is one `lightning-4d estimate|plan` command line run in this process (`lightning_4d.planning.commands.main`),
its exit code, its stdout and its stderr; the file holds them in order. `--cases N` sets the number of sampled estimate
cases (default 600: about two minutes on one core); plans are a fixed list. Exits 1 when `--compare` finds a
difference, naming the first differing case.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
import tempfile
from pathlib import Path

MODELS = ("tiny", "small", "llama3.2-1b", "llama3-8b", "llama3-70b", "llama3.1-405b", "mixtral-8x7b", "tiny-moe")
MOE = ("mixtral-8x7b", "tiny-moe")


def _estimate_case(rng: random.Random) -> list[str]:
    model = rng.choice(MODELS)
    tp = rng.choice((1, 1, 2, 4, 8))
    pp = rng.choice((1, 1, 2, 4))
    cp = rng.choice((1, 1, 2, 4))
    dp = rng.choice((1, 2, 4, 8))
    seq = rng.choice((256, 2048, 8192, 32768))
    argv = ["--model", model, "--seq-length", str(seq), "--micro-batch-size", str(rng.choice((1, 2, 4)))]
    argv += ["--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--dp", str(dp)]
    argv += ["--zero-stage", str(rng.choice((0, 1, 2, 3)))]
    argv += ["--precision", rng.choice(("bf16-mixed", "bf16-mixed", "32-true", "bf16-true"))]
    ac = rng.choice(("none", "full", "selective"))
    argv += ["--activation-checkpointing", ac]
    if tp > 1 and rng.random() < 0.3:
        argv += ["--sequence-parallel", rng.choice(("true", "false"))]
    if tp > 1 and ac != "selective" and rng.random() < 0.2:
        argv += ["--tensor-parallel-overlap"]
    if ac != "selective" and rng.random() < 0.2:
        argv += ["--compile"]
    if ac == "none" and rng.random() < 0.15:
        argv += ["--activation-offload-layers", str(rng.choice((1, 2)))]
    if pp > 1:
        sched = rng.choice(("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"))
        argv += ["--pipeline-schedule", sched, "--num-microbatches", str(rng.choice((pp, 2 * pp, 4 * pp)))]
    elif rng.random() < 0.2:
        argv += ["--num-microbatches", str(rng.choice((2, 4)))]
    if cp > 1:
        argv += ["--cp-method", rng.choice(("ring", "allgather", "alltoall"))]
    if model in MOE:
        argv += ["--ep", str(rng.choice((1, 2, 4, 8)))]
    elif rng.random() < 0.1:
        argv += ["--float8", rng.choice(("tensorwise", "rowwise"))]
    if rng.random() < 0.3:
        argv += ["--json"]
    if rng.random() < 0.1:
        argv += ["--formula", "fujii2024"]
    argv += ["--gpu-memory", rng.choice(("H100-80GB", "A100-40GB", "H200"))]
    return ["estimate", *argv]


PLANS = (
    "--model llama3-8b --num-gpus 8 --seq-length 8192 --global-batch-size 64",
    "--model llama3-8b --num-gpus 16 --gpus-per-node 8 --seq-length 8192 --global-batch-size 128 --json",
    "--model llama3-70b --num-gpus 64 --gpus-per-node 8 --seq-length 8192 --global-batch-size 512 --top 10",
    "--model llama3-70b --num-gpus 16 --gpus-per-node 8 --gpu-memory H100-80GB --seq-length 8192 "
    "--global-batch-size 512",
    "--model llama3.2-1b --num-gpus 8 --seq-length 4096 --global-batch-size 64 --compile --json",
    "--model llama3.2-3b --num-gpus 4 --seq-length 2048 --global-batch-size 32 --tensor-parallel-overlap",
    "--model mixtral-8x7b --num-gpus 32 --gpus-per-node 8 --seq-length 4096 --global-batch-size 256 --json",
    "--model tiny-moe --num-gpus 8 --seq-length 256 --global-batch-size 16 --ep 2",
    "--model tiny --num-gpus 4 --seq-length 256 --global-batch-size 8 --precision 32-true --json",
    "--model small --num-gpus 8 --seq-length 1024 --global-batch-size 16 --zero-stage 3 --pp 2",
    "--model llama3-8b --num-gpus 8 --seq-length 131072 --global-batch-size 8 --cp 4",
    "--model llama3.1-405b --num-gpus 1024 --gpus-per-node 8 --seq-length 8192 --global-batch-size 1024 --top 5",
)
#: plans whose first pick is also written by --emit-config (the YAML compared too)
EMITTED = (0, 4, 6, 8)


def _run(command: str, argv: list[str]) -> str:
    from lightning_4d.planning.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(command, argv)
        except SystemExit as exc:  # argparse's own refusals
            rc = exc.code
    return f"$ {command} {' '.join(argv)}\nrc={rc}\n{out.getvalue()}--- stderr\n{err.getvalue()}"


def sweep(cases: int) -> list[str]:
    """The outputs of ``cases`` sampled estimates and of the fixed plans (with their emitted configs)."""
    rng = random.Random(2411_06465)
    out = [_run(c[0], c[1:]) for c in (_estimate_case(rng) for _ in range(cases))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, line in enumerate(PLANS):
            argv = line.split()
            if i in EMITTED:
                path = Path(tmp) / "plan.yaml"
                argv += ["--emit-config", str(path)]
            text = _run("plan", argv).replace(tmp, "<tmp>")
            if i in EMITTED and path.exists():
                text += "--- emitted\n" + path.read_text().replace(tmp, "<tmp>")
                path.unlink()
            out.append(text)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", type=int, default=600)
    p.add_argument("--compare", default=None, help="a file written before: exit 1 at the first difference")
    args = p.parse_args()
    outputs = sweep(args.cases)
    sep = "\n=====\n"
    Path(args.out).write_text(sep.join(outputs))
    rcs = [o.split("\n")[1] for o in outputs]
    print(f"{len(outputs)} cases ({rcs.count('rc=0')} rc=0, {rcs.count('rc=1')} rc=1, {rcs.count('rc=2')} rc=2)")
    if args.compare:
        before = Path(args.compare).read_text().split(sep)
        if len(before) != len(outputs):
            print(f"different number of cases: {len(before)} before, {len(outputs)} now")
            return 1
        for i, (a, b) in enumerate(zip(before, outputs)):
            if a != b:
                print(f"case {i} differs:\n--- before\n{a}\n--- now\n{b}")
                return 1
        print("byte-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
