"""FourDStrategy's fixed cost per step against Lightning's default strategy, on one CPU process (issue 35 item 4).

Four fits in one run, each ``--steps`` AdamW steps of batch ``b x s`` (default 2 x 64) on random tokens, float32,
one thread:

- ``ours_default`` / ``ours_4d``: :class:`~lightning_4d.tasks.CausalLMModule` (tiny-test preset) under
  ``Trainer(strategy="auto")`` and under ``FourDStrategy(data_parallel_size=1, zero_stage=0)``;
- ``hf_default`` / ``hf_4d``: a LightningModule holding a transformers ``LlamaForCausalLM`` of the same dimensions
  (hidden 64, 2 layers, 4 heads, 2 kv heads, vocabulary 256; random init, no download), same two strategies.

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step and the
strategy's hooks around them; wall seconds, or with ``--cpu-time`` this process's CPU seconds, steadier when other
jobs share the cores); printed: the median of the steps after ``--warmup``, and the ratio FourDStrategy /
default strategy per module (above 1: our fixed cost). The fits alternate (``--repeats`` rounds of the four) so that
a load change on the machine hits both strategies alike; the ratio uses the median over all rounds' steps.

Usage::

    PYTHONPATH=$PWD python benchmarks/step_overhead.py [--steps 40] [--warmup 5] [--repeats 1] [--cpu-time]
        [--profile ours_4d]

``--profile NAME``: a cProfile of that fit's steps after warm-up (cumulative time, top 30 lines) after the table.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

NAMES = ("ours_default", "ours_4d", "hf_default", "hf_4d")


def _hf_module(cfg):
    """A LightningModule holding a transformers LlamaForCausalLM of ``cfg``'s dimensions (what a user writes)."""
    import lightning as L
    import torch.nn.functional as F
    import transformers

    class HFLlamaLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                max_position_embeddings=cfg.max_seq_length,
            )
            self.model = transformers.LlamaForCausalLM(config).float()

        def training_step(self, batch, batch_idx):
            logits = self.model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return HFLlamaLM()


def fit(name: str, cfg, b: int, s: int, steps: int, warmup: int, profile: bool, cpu_time: bool) -> list[float]:
    """One fit; returns the step times (seconds: wall, or this process's CPU time) after ``warmup``."""
    from gpu_step_time import batches, timed_fit  # benchmarks/ is the script's folder: on sys.path

    from lightning_4d import FourDStrategy
    from lightning_4d.tasks import CausalLMModule

    profiler = cProfile.Profile() if profile else None

    def start_profile(batch_idx: int) -> None:
        if profiler is not None and batch_idx == warmup:
            profiler.enable()

    torch.manual_seed(0)
    if name.startswith("ours"):
        module = CausalLMModule(cfg, learning_rate=1e-4, warmup_steps=1, max_steps=steps)
    else:
        module = _hf_module(cfg)
    strategy = FourDStrategy(data_parallel_size=1, zero_stage=0, memory_check=False) if name.endswith("4d") else "auto"
    clock = time.process_time if cpu_time else time.perf_counter
    data = batches(cfg.vocab_size, b, s, steps)
    times, _ = timed_fit(module, strategy, data, "cpu", "32-true", clock=clock, on_batch_start=start_profile)
    if profiler is not None:
        profiler.disable()
        print(f"\n--- cProfile of {name}, steps {warmup}..{steps - 1} (cumulative, then own time) ---")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return times[warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the four fits, alternating")
    p.add_argument("--profile", choices=NAMES, help="cProfile this fit's steps after warm-up")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time each step by this process's CPU seconds (time.process_time) instead of wall seconds: steadier "
        "on a machine other jobs load",
    )
    args = p.parse_args()
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup={args.warmup} must be below --steps={args.steps}")
    warnings.filterwarnings("ignore")
    from lightning_4d.models import LlamaConfig

    cfg = LlamaConfig.from_preset("tiny-test")
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for _ in range(args.repeats):
        for name in NAMES:
            profile = args.profile == name
            times[name] += fit(name, cfg, args.batch, args.seq_length, args.steps, args.warmup, profile, args.cpu_time)
    median = {n: statistics.median(t) for n, t in times.items()}
    clock = "CPU" if args.cpu_time else "wall"
    head = f"tiny-test b{args.batch} s{args.seq_length}, {args.steps} steps ({args.warmup} warm-up)"
    print(f"\n{head}, median {clock} step:")
    for n in NAMES:
        print(f"  {n:>13}: {median[n] * 1e3:7.2f} ms")
    for module in ("ours", "hf"):
        ratio = median[f"{module}_4d"] / median[f"{module}_default"]
        print(f"  ratio FourDStrategy / default strategy, {module}: {ratio:.3f}")


if __name__ == "__main__":
    main()
