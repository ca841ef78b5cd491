"""torch's own CPU AdamW throughput: the host step of ``optimizer_offload=True`` (the step-time model's
``CPU_ADAMW_BYTES_PER_SECOND``, ``lightning_4d/planning/optimizer_offload_costs.py``).

One float32 tensor of ``--params`` elements with a gradient, ``torch.optim.AdamW`` (``fused=True``, then
``foreach=True``) stepped ``--steps`` times after ``--warmup``, with ``--threads`` intra-op threads; printed per
implementation: the median seconds of a step, parameters per second, and bytes per second counting the
:data:`BYTES_PER_PARAM` bytes each step reads and writes per parameter (gradient, weight, m, v read; weight, m, v
written: 7 float32 values, 28 bytes). The CPU time of this process is reported beside the wall time: on a shared
machine the CPU time's rate is the steadier figure (``--cpu-time`` ranks by it).

Usage::

    PYTHONPATH=$PWD python benchmarks/cpu_adamw.py [--params 16777216] [--steps 10] [--threads 1] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

#: float32 bytes one AdamW step reads and writes per parameter: gradient, weight, m, v read; weight, m, v written
BYTES_PER_PARAM = 4 * 7


def measure(params: int, steps: int, warmup: int, kind: str, cpu_time: bool) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds) of one AdamW step over ``params`` float32 parameters (``kind``: ``"fused"``
    or ``"foreach"``)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(params))
    w.grad = torch.randn(params)
    opt = torch.optim.AdamW([w], lr=1e-4, weight_decay=0.1, **{kind: True})
    walls, cpus = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=16 * 2**20)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true", help="rate from this process's CPU seconds")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.params:,} float32 parameters")
    for kind in ("fused", "foreach"):
        wall, cpu = measure(args.params, args.steps, args.warmup, kind, args.cpu_time)
        seconds = cpu / args.threads if args.cpu_time else wall
        rate = args.params / seconds
        print(
            f"AdamW({kind}=True): step {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU; {rate / 1e6:.1f} M params/s, "
            f"{rate * BYTES_PER_PARAM / 1e9:.2f} GB/s ({BYTES_PER_PARAM} B per parameter)"
        )


if __name__ == "__main__":
    main()
