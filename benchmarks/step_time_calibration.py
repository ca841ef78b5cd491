"""Predicted vs published: the planner's step-time model (lightning_4d/planning/step_time.py) on every run of
``CALIBRATION_RUNS``, and where the published layout ranks in ``lightning-4d plan`` for its job.

    python benchmarks/step_time_calibration.py

For each run: the published settings where the publication gives them all (torchtitan), else the published layout's
fastest variant that fits (schedule, v, layer split, ZeRO stage, checkpointing, cp method chosen by the planner among
those of the publication's tp, pp, cp, dp and micro-batch size), its predicted MFU (model FLOPs 6N + 12·L·h·s per
token, as the task logs it) and tokens/s per GPU next to the published figure, the ratio, and the rank of the
layout's best row in the planner's full list for the job. ``compile``: as the run's source says (compiled or eager);
where it does not say (Meta's runs), the ratio is that of the fused-pointwise (compiled) prediction and the eager
prediction's MFU is printed beside it (``step_time.CALIBRATION_RUNS``, ``step_time.POINTWISE_FACTOR``). Pure Python
(no torch), a few seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_4d.config import ParallelConfig
from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.planning.hardware import GPU_PRESETS
from lightning_4d.planning.planner import plan
from lightning_4d.planning.step_time import CALIBRATION_RUNS, Layout, model_dims, step_time_of
from lightning_4d.planning.workload import Job, Search


def predict(run: dict[str, Any]) -> dict[str, Any]:
    """The model's prediction of ``run`` (a ``CALIBRATION_RUNS`` row): ``layout`` (the step-time
    :class:`~lightning_4d.planning.step_time.Layout`, eager), ``mfu`` and ``tokens_per_sec_per_gpu`` in the run's
    compile mode (compiled where it is ``None``), ``eager_mfu``, ``published_mfu``,
    ``published_tokens_per_sec_per_gpu``, ``ratio`` (predicted / published MFU) and ``rank`` (of the published sizes
    in the planner's list; None: beyond 300)."""
    cfg, gpu, lay = LlamaConfig.from_preset(run["model"]), GPU_PRESETS[run["gpu"]], run["layout"]
    s, gb, n, per_node = run["seq_length"], run["global_batch_size"], run["num_gpus"], run["gpus_per_node"]
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
        layout = Layout.of(pc, lay["micro_batch_size"], gb // (lay["dp"] * lay["micro_batch_size"]))
    else:  # the planner's fastest variant of the published sizes that fits the default budget
        best = plan(
            Job(cfg, n, per_node, s, gb, gpu), Search(micro_batch_size=lay["micro_batch_size"], fixed=fixed), top=1
        )[0]
        layout = Layout(**{f.name: getattr(best, f.name) for f in dataclasses.fields(Layout)})

    def mfu(compile: bool) -> float:
        # the model predicts a compiled step for any layout (FourDStrategy refuses compile with selective checkpointing)
        t = step_time_of(
            model_dims(cfg), dataclasses.replace(layout, compile=compile), seq_length=s, gpu=gpu, gpus_per_node=per_node
        ).total
        return cfg.flops_per_token(s) * gb * s / t / (n * gpu.peak_flops)

    ranked = plan(Job(cfg, n, per_node, s, gb, gpu), top=300)
    rank = next((i for i, c in enumerate(ranked, 1) if (c.tp, c.pp, c.cp, c.dp) == tuple(fixed.values())), None)
    predicted = mfu(run["compile"] is not False)
    published_mfu = run["mfu"] or run["tokens_per_sec_per_gpu"] * cfg.flops_per_token(s) / gpu.peak_flops
    return dict(
        layout=layout,
        mfu=predicted,
        eager_mfu=mfu(False),
        tokens_per_sec_per_gpu=predicted * gpu.peak_flops / cfg.flops_per_token(s),
        published_mfu=published_mfu,
        published_tokens_per_sec_per_gpu=published_mfu * gpu.peak_flops / cfg.flops_per_token(s),
        ratio=predicted / published_mfu,
        rank=rank,
    )


def main() -> None:
    print(
        "| run | compile | layout (planner's variant) | predicted MFU | published MFU | ratio | "
        "predicted tokens/s/GPU | published tokens/s/GPU | rank in plan |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for run in CALIBRATION_RUNS:
        p = predict(run)
        lay = p["layout"]
        variant = (
            f"tp{lay.tp} pp{lay.pp} cp{lay.cp} dp{lay.dp} b{lay.micro_batch_size} ZeRO {lay.zero_stage} "
            f"{lay.activation_checkpointing}"
            + (f" {lay.context_parallel_method}" if lay.cp > 1 else "")
            + (f" {lay.pipeline_schedule} v{lay.virtual_pipeline_stages}" if lay.pp > 1 else "")
        )
        mode = {True: "yes", False: "no"}.get(run["compile"], f"not stated (eager: {100 * p['eager_mfu']:.1f}%)")
        print(
            f"| {run['name']} | {mode} | {variant} | {100 * p['mfu']:.1f}% | {100 * p['published_mfu']:.1f}% | "
            f"{p['ratio']:.2f} | {p['tokens_per_sec_per_gpu']:,.0f} | {p['published_tokens_per_sec_per_gpu']:,.0f} | "
            f"{p['rank'] or '> 300'} |"
        )


if __name__ == "__main__":
    main()
