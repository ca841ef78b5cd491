"""Bytes on the wire per rank and training step, measured with CommMeter next to the minimum of each layout.

    python benchmarks/communication.py            # launches itself: 2 processes, then 4 (CPU, gloo)

Layouts (the ``small`` preset, fp32, s=128, global batch 8, the second step of two): dp2 at ZeRO 0-3; dp2×tp2,
pp2×dp2 (1F1B, m=2), cp2×dp2 (ring). For each mesh dimension it prints the bytes rank 0 sent (lightning_4d/parallel/
comm.py: ring volumes, all-reduce 2(D−1)/D·n, all-gather / reduce-scatter (D−1)/D·n, send n), the minimum of the
layout and the ratio:

- dp_cp, P fp32 parameters on the rank (its tp/pp shard), D = dp·cp: ZeRO 0 and 1 ``2(D−1)/D·4P`` (an all-reduce
  is a reduce-scatter + all-gather: ZeRO 1's own pair costs the same; Rajbhandari et al. 2020, ZeRO, §7), ZeRO 2
  the same (the parameters gathered once), ZeRO 3 ``3(D−1)/D·4P`` (gathered again in backward);
- tp with sequence parallelism: Megatron-LM's 4 all-gathers / reduce-scatters of ``b·s/cp·h`` values forward and 4
  backward per layer, + 4 at the embedding and the head (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2); ours
  re-gathers the two saved sequence shards per layer in backward and the head's input once more (10 per layer +
  5: the memory issue's trade), and all-reduces the replicated norm weights' gradients and the loss's per-token
  max and sums (small);
- pp: each micro-batch's hidden states (or their gradient) sent once per stage boundary: ``m·b/m·s/cp·h·4/tp``;
- cp (ring), per layer: K and V of the local tokens gathered forward and again backward, their gradients
  reduce-scattered: ``3·(cp−1)·KV`` with KV the local K and V bytes; the ring sends each block's gradients
  ``cp − 1`` hops back to their owner, so it moves the minimum.

Not a timed test: bytes are exact, measured in one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, PRESET = 128, 8, "small"
LAYOUTS = {
    2: [dict(dp=2, zero=z) for z in range(4)],
    4: [dict(dp=2, tp=2, zero=1), dict(pp=2, dp=2, zero=1, m=2), dict(cp=2, dp=2, zero=1)],
}


def _run_layout(layout: dict, out: Path) -> None:
    import lightning as L
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_4d import FourDStrategy
    from lightning_4d.data import LMDataModule
    from lightning_4d.models import LlamaConfig
    from lightning_4d.parallel.comm import CommMeterCallback
    from lightning_4d.tasks import CausalLMModule

    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    dp, pp = layout.get("dp", 1), layout.get("pp", 1)
    m = layout.get("m", 1)
    micro = GLOBAL_BATCH // (dp * m)
    cfg = LlamaConfig.from_preset(PRESET)
    module = CausalLMModule(cfg, learning_rate=1e-3, warmup_steps=1, max_steps=2)
    dm = LMDataModule(
        seq_length=SEQ,
        micro_batch_size=micro,
        global_batch_size=GLOBAL_BATCH,
        train_samples=GLOBAL_BATCH * 2,
        val_samples=micro * dp,
        seed=1,
    )
    strategy = FourDStrategy(
        data_parallel_size=dp,
        tensor_parallel_size=layout.get("tp", 1),
        pipeline_parallel_size=pp,
        context_parallel_size=layout.get("cp", 1),
        zero_stage=layout["zero"],
        num_microbatches=m if pp > 1 else None,
        process_group_backend="gloo",
    )
    events = []

    class Meter(CommMeterCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            current = self.meter
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            events.append(current.events)

    meter = Meter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[meter],
    )
    trainer.fit(module, dm)
    tp_mesh = strategy.mesh.tp
    local = 0
    for p in module.model.parameters():  # the rank's tp/pp shard, before ZeRO sharding
        n = p.numel()
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for name, placement in zip(names, p.placements):
                if name == "tp" and placement.is_shard():
                    n //= tp_mesh.size()
        local += n
    if trainer.global_rank == 0:
        (out / f"{json.dumps(layout, sort_keys=True)}.json").write_text(
            json.dumps({"events": events[-1], "params": local})
        )
    torch.distributed.barrier()


def _minimum(layout: dict, params: int) -> dict[str, float]:
    from lightning_4d.models import LlamaConfig

    cfg = LlamaConfig.from_preset(PRESET)
    tp, pp, cp, dp = (layout.get(k, 1) for k in ("tp", "pp", "cp", "dp"))
    d = dp * cp
    passes = {0: 2, 1: 2, 2: 2, 3: 3}[layout["zero"]]
    out = {"dp_cp": passes * (d - 1) / d * 4 * params}
    tokens = GLOBAL_BATCH // dp * SEQ // cp  # per rank and step
    layers = cfg.num_layers // pp
    if tp > 1:
        out["tp"] = (8 * layers + 4) * (tp - 1) / tp * tokens * cfg.hidden_size * 4
    if pp > 1:
        out["pp"] = tokens * cfg.hidden_size * 4 / (tp if tp > 1 else 1)
    if cp > 1:
        kv = 2 * tokens * cfg.num_kv_heads // tp * cfg.head_dim * 4
        out["cp"] = 3 * (cp - 1) * kv * layers
    return out


def _report(out: Path) -> None:
    from lightning_4d.parallel.comm import bytes_sent

    print("| layout | dim | measured bytes/rank/step | minimum | ratio | measured by kind |")
    print("|---|---|---:|---:|---:|---|")
    for world, layouts in LAYOUTS.items():
        for layout in layouts:
            record = json.loads((out / f"{json.dumps(layout, sort_keys=True)}.json").read_text())
            measured: dict[str, dict[str, int]] = {}
            for dim, kind, n, size in record["events"]:
                if kind == "all_reduce" and n == 4:
                    continue  # the logged loss' mean over ranks
                measured.setdefault(dim, {}).setdefault(kind, 0)
                measured[dim][kind] += bytes_sent(kind, n, size)
            minimum = _minimum(layout, record["params"])
            name = (
                " ".join(f"{k}{v}" for k, v in layout.items() if k in ("dp", "tp", "pp", "cp"))
                + f" ZeRO {layout['zero']}"
            )
            for dim in sorted(set(minimum) | {d for d in measured if sum(measured[d].values())}):
                got = sum(measured.get(dim, {}).values())
                least = minimum.get(dim, 0)
                ratio = f"{got / least:.2f}" if least else "-"
                kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(measured.get(dim, {}).items()) if v)
                print(f"| {name} | {dim} | {got:,} | {least:,.0f} | {ratio} | {kinds} |")


def main() -> None:
    if "LOCAL_RANK" in os.environ:
        out = Path(sys.argv[1])
        for layout in LAYOUTS[int(os.environ["WORLD_SIZE"])]:
            _run_layout(layout, out)
        import torch

        torch.distributed.destroy_process_group()
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for world in LAYOUTS:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={world}",
                    __file__,
                    tmp,
                ],
                check=True,
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        _report(Path(tmp))


if __name__ == "__main__":
    main()
