"""Our memory estimate under ``bf16-mixed`` next to the paper's Megatron-LM formula (``fujii2024``), per layout.

For a grid of llama2-7b / llama3.1-8b / llama3-70b layouts (tp 1-8, pp 1-8, cp 1-2, s 4096-8192, b 1-2; ZeRO 1, i.e.
Megatron's distributed optimizer; 1F1B; no activation checkpointing; SDPA/flash attention on both sides) it prints,
in GiB per GPU (2^30 bytes):

- ``fujii2024``: the paper's estimate of Megatron-LM (arXiv 2411.06465; model states + activations, no allowance:
  the paper leaves the rest to its 80% rule);
- ``ours``: ``estimate_memory(...)`` of FourDStrategy on CUDA, its peak phase (overhead allowance included);
- ``ours - allowance``: the same without the CUDA context / fragmentation allowance (``overhead``), the quantity
  the paper's formula describes;
- ``ratio``: ``(ours - allowance) / fujii2024``;
- with ``--activation-checkpointing selective``: ours with selective activation checkpointing (the paper's formula
  stays Megatron without recomputation), and ``recomp``, the matmul FLOPs it recomputes as a percentage of the
  layers' matmul FLOPs of a step (``lightning_4d.planning.step_time.selective_recomputed_matmul_fraction``: under tp
  the output projection's forward; no full recomputation anywhere);
- with ``--activation-offload``: selective where it reaches ``--target`` (default 0.85) of ``fujii2024``, else no
  checkpointing with the fewest ``activation_offload_layers`` per stage that reach it (host memory instead of device
  memory: ``lightning_4d/parallel/offload.py``), with ``host`` (GiB of host memory per GPU at the peak) and
  ``step x`` (the planner's predicted H100 step time over the same layout's without offload: the copies are
  synchronous);
- with ``--baseline REF``: ``before``, the estimate of the same row by the estimator at git revision ``REF`` (e.g. the
  commit before bf16 master weights), computed in a subprocess from a temporary ``git worktree`` in the same run.

Our estimate follows our code tensor by tensor and is validated against the bytes measured on CPU
(``tests/test_memory_model.py``); ``fujii2024`` is the paper's formula, reproduced as written.

Usage::

    python benchmarks/memory_vs_megatron.py                       # the table
    python benchmarks/memory_vs_megatron.py --baseline aa06e35    # with a "before" column
    python benchmarks/memory_vs_megatron.py --activation-checkpointing selective
    python benchmarks/memory_vs_megatron.py --activation-offload
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_4d.planning.workload import Workload

GIB = 2**30
# (preset, tp, pp, cp, dp, b, s, m)
GRID = [
    ("llama2-7b", 1, 1, 1, 8, 1, 4096, None),
    ("llama2-7b", 2, 1, 1, 4, 2, 4096, None),
    ("llama2-7b", 4, 2, 1, 1, 1, 4096, 4),
    ("llama3.1-8b", 2, 1, 1, 4, 1, 8192, None),
    ("llama3.1-8b", 1, 1, 1, 8, 1, 8192, None),
    ("llama3.1-8b", 2, 1, 2, 2, 1, 8192, None),
    ("llama3.1-8b", 4, 1, 1, 2, 2, 8192, None),
    ("llama3.1-8b", 8, 1, 1, 1, 1, 8192, None),
    ("llama3-70b", 8, 4, 1, 2, 1, 8192, 4),
    ("llama3-70b", 8, 8, 1, 1, 1, 4096, 8),
    ("llama3-70b", 4, 8, 1, 2, 1, 4096, 8),
    ("llama3-70b", 8, 2, 2, 2, 1, 8192, 4),
]

_ROW_SCRIPT = """
import json, sys
from lightning_4d.config import ParallelConfig
from lightning_4d.planning.model import estimate_memory
out = []
for preset, tp, pp, cp, dp, b, s, m in json.loads(sys.argv[1]):
    pc = ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        context_parallel_size=cp, zero_stage=1, num_microbatches=m, **json.loads(sys.argv[2]))
    e = estimate_memory(preset, pc, b, s, "bf16-mixed", device_type="cuda", gpu_name="NVIDIA H100 80GB HBM3")
    out.append([e.total, e.overhead, e.peak_phase])
print(json.dumps(out))
"""


def ours(grid: list[tuple], pythonpath: str | None = None, ac: str = "none") -> list[list]:
    """``[total, overhead, peak_phase]`` per row, by the estimator importable from ``pythonpath`` (default: this
    checkout) with activation checkpointing ``ac``, in a subprocess so that two revisions never share an
    interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath or str(Path(__file__).resolve().parents[1])
    # run from that folder: ``python -c`` puts the working directory first on sys.path
    result = subprocess.run(
        [sys.executable, "-c", _ROW_SCRIPT, json.dumps(grid), json.dumps({"activation_checkpointing": ac})],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=env["PYTHONPATH"],
    )
    return json.loads(result.stdout)


def baseline(ref: str, grid: list[tuple], ac: str = "none") -> list[list]:
    """The rows by the estimator at git revision ``ref`` (a temporary detached worktree, removed afterwards)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(tree), ref], check=True, capture_output=True
        )
        try:
            return ours(grid, str(tree), ac)
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=True, capture_output=True
            )


def offload_rows(target: float) -> None:
    """The ``--activation-offload`` table (module docstring)."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.models.llama_config import LlamaConfig
    from lightning_4d.planning.fujii2024 import fujii2024_from_config
    from lightning_4d.planning.hardware import gpu_spec
    from lightning_4d.planning.model import estimate_memory
    from lightning_4d.planning.step_time import predict_step_time

    gpu = gpu_spec("H100-80GB")
    print(f"ours: bf16-mixed, ZeRO 1, selective, else offload (fewest layers per stage reaching {target}); H100")
    header = f"{'model':<12} {'tp':>2} {'pp':>2} {'cp':>2} {'dp':>2} {'b':>2} {'s':>5} {'m':>2} | {'fujii2024':>9} "
    header += f"{'mode':>10} {'ours-allowance':>14} {'ratio':>6} {'host':>5} {'step x':>6}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for preset, tp, pp, cp, dp, b, s, m in GRID:
        cfg = LlamaConfig.from_preset(preset)
        ref = fujii2024_from_config(
            cfg, tp=tp, pp=pp, dp=dp, cp=cp, seq_length=s, micro_batch_size=b, num_microbatches=m
        ).total

        def run(**kw: object) -> tuple:
            pc = ParallelConfig(
                data_parallel_size=dp,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                context_parallel_size=cp,
                zero_stage=1,
                num_microbatches=m,
                **kw,
            )
            e = estimate_memory(
                Workload(cfg, b, s, "bf16-mixed"), pc, device_type="cuda", gpu_name="NVIDIA H100 80GB HBM3"
            )
            t = predict_step_time(cfg, pc, b, m or 1, s, gpu, 8).total
            return (e.total - e.overhead) / ref, e.details.get("host_offloaded_activations", 0), t

        ratio, host, _ = run(activation_checkpointing="selective")
        mode, cost = "selective", 1.0
        if ratio > target:
            base = run()[2]
            for k in range(1, cfg.num_layers // pp + 1):
                ratio, host, t = run(activation_offload_layers=k)
                if ratio <= target:
                    break
            mode, cost = f"offload {k}", t / base
        worst = max(worst, ratio)
        line = f"{preset:<12} {tp:>2} {pp:>2} {cp:>2} {dp:>2} {b:>2} {s:>5} {m or '-':>2} | {ref / GIB:>9.1f} "
        line += f"{mode:>10} {ratio * ref / GIB:>14.1f} {ratio:>6.3f} {host / GIB:>5.1f} {cost:>6.2f}"
        print(line)
    print(f"\nlargest ratio (ours without the allowance / fujii2024): {worst:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REF", help="also print the estimate at this git revision")
    parser.add_argument(
        "--activation-checkpointing", choices=("none", "selective"), default="none", help="ours with this mode"
    )
    parser.add_argument(
        "--activation-offload",
        action="store_true",
        help="selective, else the fewest offloaded layers reaching --target",
    )
    parser.add_argument("--target", type=float, default=0.85, help="ratio to reach with --activation-offload")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.activation_offload:
        offload_rows(args.target)
        return
    from lightning_4d.models.llama_config import LlamaConfig
    from lightning_4d.planning.fujii2024 import fujii2024_from_config
    from lightning_4d.planning.step_time import selective_recomputed_matmul_fraction

    ac = args.activation_checkpointing
    now = ours(GRID, ac=ac)
    before = baseline(args.baseline, GRID, ac) if args.baseline else None
    print(f"ours: bf16-mixed, ZeRO 1, activation_checkpointing={ac!r}; fujii2024: Megatron-LM without recomputation")
    header = f"{'model':<12} {'tp':>2} {'pp':>2} {'cp':>2} {'dp':>2} {'b':>2} {'s':>5} {'m':>2} | {'fujii2024':>9} "
    header += f"{'before':>7} " if before else ""
    header += f"{'ours':>7} {'ours-allowance':>14} {'ratio':>6} {'recomp':>6}  peak phase"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for i, (preset, tp, pp, cp, dp, b, s, m) in enumerate(GRID):
        cfg = LlamaConfig.from_preset(preset)
        ref = (
            fujii2024_from_config(
                cfg, tp=tp, pp=pp, dp=dp, cp=cp, seq_length=s, micro_batch_size=b, num_microbatches=m
            ).total
            / GIB
        )
        total, overhead, phase = now[i]
        tensors = (total - overhead) / GIB
        worst = max(worst, tensors / ref)
        line = f"{preset:<12} {tp:>2} {pp:>2} {cp:>2} {dp:>2} {b:>2} {s:>5} {m or '-':>2} | {ref:>9.1f} "
        line += f"{before[i][0] / GIB:>7.1f} " if before else ""
        recomputed = selective_recomputed_matmul_fraction(cfg, tp) if ac == "selective" else 0.0
        line += f"{total / GIB:>7.1f} {tensors:>14.1f} {tensors / ref:>6.3f} {100 * recomputed:>5.1f}%  {phase}"
        print(line)
    print(f"\nlargest ratio (ours without the allowance / fujii2024): {worst:.3f}")


if __name__ == "__main__":
    main()
