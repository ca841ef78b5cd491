"""Pipeline bubble per schedule: measured step time against the ideal (no-bubble) time and the theoretical bubble.

For each schedule the same model (a Llama of ``--layers`` layers, split into p·v stages) runs ``--steps`` training
steps of m micro-batches through ``lightning_4d.features.pipeline.runtime.PipelineRunner`` (the code FourDStrategy runs
inside ``training_step``), timed after ``--warmup`` steps. The ideal time of a step is what the busiest rank computes
with no waiting: m times the forward + backward of one micro-batch through each of its stages, timed on that rank
alone (no communication). Printed per schedule:

- ``step``: measured seconds per step (the slowest rank),
- ``ideal``: m x (forward + backward of one micro-batch through the rank's stages), the busiest rank,
- ``bubble``: ``1 - ideal / step`` measured,
- ``theory``: the schedule's bubble fraction: ``(p-1)/(m+p-1)`` for GPipe and 1F1B (Huang et al. 2019, GPipe;
  Narayanan et al. 2021, PipeDream-Flush), ``(p-1)/(v·m+p-1)`` for interleaved 1F1B (Narayanan et al. 2021,
  Megatron-LM, arXiv 2104.04473, §2.2: the bubble shrinks by v), about 0 for ZBV / DualPipeV when m >= 2p (Qi et
  al. 2024, arXiv 2401.10241; DeepSeek-AI 2024, arXiv 2412.19437), which fill it with weight-gradient passes.

On CPU with gloo the figure is rough: p processes share the machine's cores and the point-to-point sends go through
TCP, so use p <= the number of cores and read ratios, not absolute times. Not a timed test.

Usage::

    torchrun --nproc-per-node 2 benchmarks/pipeline_bubble.py --layers 8 --hidden 256 --micro-batches 8
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning_4d.config import ParallelConfig  # noqa: E402
from lightning_4d.families.native_llama import LLAMA  # noqa: E402
from lightning_4d.features.pipeline.runtime import PipelineRunner  # noqa: E402
from lightning_4d.mesh import build_mesh  # noqa: E402
from lightning_4d.models.llama import LlamaModel  # noqa: E402
from lightning_4d.models.llama_config import LlamaConfig  # noqa: E402
from lightning_4d.parallel.loss import causal_lm_loss  # noqa: E402
from lightning_4d.parallel.parallelize import parallelize_model  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def theory(schedule: str, p: int, m: int, v: int) -> str:
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.3f}"
    if schedule == "interleaved_1f1b":
        return f"{(p - 1) / (v * m + p - 1):.3f}"
    return "~0" if m >= 2 * p else "> 0 (m < 2p)"


def build(schedule: str, args: argparse.Namespace, p: int, device: torch.device):
    v = SCHEDULES[schedule]
    config = ParallelConfig(
        data_parallel_size=1,
        pipeline_parallel_size=p,
        zero_stage=0,
        pipeline_schedule=schedule,
        virtual_pipeline_stages=v,
        num_microbatches=args.micro_batches,
    ).resolve(p)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 32,
        num_kv_heads=max(1, args.hidden // 128),
        max_seq_length=args.seq_length,
    )
    config.validate_model(cfg)
    mesh = build_mesh(config, device.type)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    chunks = parallelize_model(LLAMA, model, mesh, config)
    LLAMA.materialize(model, device)
    runner = PipelineRunner(chunks, config, args.micro_batches, mesh.pp.get_group(), device, causal_lm_loss)
    return cfg, chunks, runner, v


def ideal_time(cfg, chunks, args, device) -> float:
    """m x (forward + backward of one micro-batch through this rank's stages), no communication."""
    b, s = args.micro_batch_size, args.seq_length
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)

    def once() -> None:
        for _, chunk in chunks:
            x = (
                ids
                if chunk.embedding is not None
                else torch.randn(b, s, cfg.hidden_size, device=device, requires_grad=True)
            )
            out = chunk(x)
            loss = causal_lm_loss(out, ids) if chunk.head is not None else out.float().pow(2).mean()
            loss.backward()

    for _ in range(args.warmup):
        once()
    start = time.perf_counter()
    for _ in range(args.steps):
        for _ in range(args.micro_batches):
            once()
    for _, chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")
    rows = []
    for schedule in args.schedules:
        torch.manual_seed(0)
        cfg, chunks, runner, v = build(schedule, args, p, device)
        b, s, m = args.micro_batch_size, args.seq_length, args.micro_batches
        ids = torch.randint(0, cfg.vocab_size, (b * m, s), generator=torch.Generator().manual_seed(1))
        for _ in range(args.warmup):
            runner.train_step(ids, ids)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            runner.train_step(ids, ids)
        dist.barrier()
        step = (time.perf_counter() - start) / args.steps
        ideal = ideal_time(cfg, chunks, args, device)
        times = torch.tensor([step, ideal], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank / the busiest rank
        rows.append((schedule, v, float(times[0]), float(times[1]), theory(schedule, p, m, v)))
    if rank == 0:
        print(
            f"\npipeline bubble: p={p}, m={args.micro_batches}, {args.layers} layers, hidden {args.hidden}, "
            f"micro-batch {args.micro_batch_size} x {args.seq_length} tokens, gloo on {device.type}"
        )
        print(f"{'schedule':<18}{'v':>3}{'step s':>10}{'ideal s':>10}{'bubble':>9}{'theory':>9}")
        for schedule, v, step, ideal, th in rows:
            print(f"{schedule:<18}{v:>3}{step:>10.4f}{ideal:>10.4f}{1 - ideal / step:>9.3f}{th:>9}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
