"""Predicted vs published: the planner's step-time model (lightning_4d/memory/step_time.py) on every run of
``CALIBRATION_RUNS``, and where the published layout ranks in ``lightning-4d plan`` for its job.

    python benchmarks/step_time_calibration.py

For each run: the published settings where the publication gives them all (torchtitan), else the published layout's
fastest variant that fits (schedule, v, layer split, ZeRO stage, checkpointing chosen by the planner among those of
the publication's tp, pp, cp, dp and micro-batch size), its predicted MFU (model FLOPs 6N + 12·L·h·s
per token, as the task logs it) and tokens/s per GPU next to the published figure, the ratio, and the rank of the
layout's best row in the planner's full list for the job. Pure Python (no torch), a few seconds.
"""

from __future__ import annotations

from types import SimpleNamespace

from lightning_4d.config import ParallelConfig
from lightning_4d.memory.hardware import GPU_PRESETS
from lightning_4d.memory.planner import plan
from lightning_4d.memory.step_time import CALIBRATION_RUNS, predict_step_time
from lightning_4d.models.config import LlamaConfig


def main() -> None:
    print(
        "| run | layout (planner's variant) | predicted MFU | published MFU | ratio | predicted tokens/s/GPU | "
        "published tokens/s/GPU | rank in plan |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run in CALIBRATION_RUNS:
        cfg, gpu, lay = LlamaConfig.from_preset(run["model"]), GPU_PRESETS[run["gpu"]], run["layout"]
        s, gb, n = run["seq_length"], run["global_batch_size"], run["num_gpus"]
        fixed = {k: lay[k] for k in ("tp", "pp", "cp", "dp")}
        if "activation_checkpointing" in lay:  # the publication gives every setting: predict exactly that
            pc = ParallelConfig(
                data_parallel_size=lay["dp"],
                tensor_parallel_size=lay["tp"],
                pipeline_parallel_size=lay["pp"],
                context_parallel_size=lay["cp"],
                zero_stage=lay["zero_stage"],
                activation_checkpointing=lay["activation_checkpointing"],
            )
            b = lay["micro_batch_size"]
            t = predict_step_time(cfg, pc, b, gb // (lay["dp"] * b), s, gpu, run["gpus_per_node"]).total
            best = SimpleNamespace(
                tokens_per_sec=gb * s / t,
                mfu=cfg.flops_per_token(s) * gb * s / t / (n * gpu.peak_flops),
                tp=pc.tp,
                pp=pc.pp,
                cp=pc.cp,
                dp=pc.dp,
                micro_batch_size=b,
                zero_stage=pc.zero_stage,
                activation_checkpointing=pc.activation_checkpointing,
            )
        else:  # the planner's fastest variant of the published sizes that fits the default budget
            best = plan(
                cfg, n, run["gpus_per_node"], gpu, s, gb, top=1, fixed=fixed, micro_batch_size=lay["micro_batch_size"]
            )[0]
        ranked = plan(cfg, n, run["gpus_per_node"], gpu, s, gb, top=300)
        rank = next((i for i, c in enumerate(ranked, 1) if (c.tp, c.pp, c.cp, c.dp) == tuple(fixed.values())), None)
        per_gpu = best.tokens_per_sec / n
        published_mfu = run["mfu"] or run["tokens_per_sec_per_gpu"] * cfg.flops_per_token(s) / gpu.peak_flops
        published_tps = run["tokens_per_sec_per_gpu"] or published_mfu * gpu.peak_flops / cfg.flops_per_token(s)
        variant = (
            f"tp{best.tp} pp{best.pp} cp{best.cp} dp{best.dp} b{best.micro_batch_size} ZeRO {best.zero_stage} "
            f"{best.activation_checkpointing}"
            + (f" {best.pipeline_schedule} v{best.virtual_pipeline_stages}" if best.pp > 1 else "")
        )
        print(
            f"| {run['name']} | {variant} | {100 * best.mfu:.1f}% | {100 * published_mfu:.1f}% | "
            f"{best.mfu / published_mfu:.2f} | {per_gpu:,.0f} | {published_tps:,.0f} | "
            f"{rank if rank else '> 300'} |"
        )


if __name__ == "__main__":
    main()
