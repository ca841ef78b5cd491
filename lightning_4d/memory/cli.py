"""``lightning-4d estimate`` and ``lightning-4d plan``: the memory estimate of one layout, and the layouts of a job
that fit, ranked by predicted step time. Neither imports torch, so both answer in well under a second.

Exit codes: 0 (``estimate``: fits; ``plan``: at least one layout fits), 1 (does not fit / none fits), 2 (invalid
input: the one-line error names the bad value).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_4d.config import (ACTIVATION_CHECKPOINTING, CONTEXT_PARALLEL_METHODS, PIPELINE_SCHEDULES, ZERO_STAGES,
                                  ParallelConfig)
from lightning_4d.memory.hardware import GIB, GPU_PRESETS, gpu_spec
from lightning_4d.memory.model import PRECISIONS

FORMULAS = ("lightning_4d", "fujii2024")


def load_model_config(spec: str) -> Any:
    """A :class:`~lightning_4d.models.LlamaConfig` from a preset name, or from a YAML file holding either a training
    config (``model: {model_config: <preset or fields>}``, as ``configs/*.yaml``) or the config's fields.

    Raises:
        ValueError: an unknown preset, a missing file, a YAML without a model config.
    """
    from lightning_4d.models.config import LlamaConfig

    path = Path(spec)
    if not (spec.endswith((".yaml", ".yml")) or path.is_file()):
        return LlamaConfig.from_preset(spec)
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: no such file (expected a preset: {', '.join(LlamaConfig.preset_names())}).")
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    model = data.get("model", data)
    if isinstance(model, dict) and "init_args" in model:
        model = model["init_args"]
    value = model.get("model_config", model) if isinstance(model, dict) else None
    if isinstance(value, str):
        return LlamaConfig.from_preset(value)
    if isinstance(value, dict):
        if "init_args" in value:
            value = value["init_args"]
        preset = value.pop("preset", None)
        return LlamaConfig.from_preset(preset, **value) if preset else LlamaConfig(**value)
    raise ValueError(f"--model {spec!r}: the YAML file has no model config (model.model_config or LlamaConfig fields).")


def _gpu(args: argparse.Namespace):
    return gpu_spec(args.gpu_memory, peak_flops=getattr(args, "peak_tflops", None) and args.peak_tflops * 1e12)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (e.g. llama3-8b) or a YAML file (configs/*.yaml)")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    p.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS))
    p.add_argument("--gpu-memory", default="H100-80GB",
                   help=f"a preset ({', '.join(GPU_PRESETS)}) or a size such as 80GiB / 94GB (default H100-80GB)")
    p.add_argument("--budget", type=float, default=0.8, help="fraction of the GPU memory a layout may use (0.8)")
    p.add_argument("--formula", default="lightning_4d", choices=FORMULAS)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lightning-4d {command}")
    _common(p)
    if command == "estimate":
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--cp", type=int, default=1)
        p.add_argument("--cp-method", default="ring", choices=list(CONTEXT_PARALLEL_METHODS),
                       help="context-parallel attention (default ring)")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--dp", type=int, help="data parallel size")
        group.add_argument("--num-gpus", type=int, help="world size (dp = num_gpus / (tp*pp*cp))")
        p.add_argument("--micro-batch-size", type=int, required=True)
        p.add_argument("--zero-stage", type=int, default=1, choices=list(ZERO_STAGES))
        p.add_argument("--activation-checkpointing", default="none", choices=list(ACTIVATION_CHECKPOINTING))
        p.add_argument("--sequence-parallel", default=None, type=lambda v: v.lower() in ("1", "true", "yes"),
                       help="default: on when tp > 1")
        p.add_argument("--num-microbatches", type=int,
                       help="micro-batches per step (pipeline schedules; default pp, 2*pp for dualpipev)")
        p.add_argument("--pipeline-schedule", default="1f1b", choices=list(PIPELINE_SCHEDULES))
        p.add_argument("--virtual-pipeline-stages", type=int, default=None,
                       help="stages per pp rank (default: the schedule's, 1 for gpipe/1f1b, 2 for the others)")
        p.add_argument("--pipeline-layer-split", type=int, nargs="+", default=None,
                       help="decoder layers per pipeline stage (pp*v counts)")
    else:
        p.add_argument("--num-gpus", type=int, required=True)
        p.add_argument("--gpus-per-node", type=int, default=8)
        p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step")
        p.add_argument("--top", type=int, default=20)
        p.add_argument("--peak-tflops", type=float, help="custom GPU: dense bf16 peak (TFLOP/s)")
    return p


def _estimate(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_4d.memory.fujii2024 import fujii2024_from_config
    from lightning_4d.memory.model import estimate_memory

    cfg = load_model_config(args.model)
    gpu = _gpu(args)
    pc = ParallelConfig(data_parallel_size=args.dp or "auto", tensor_parallel_size=args.tp,
                        pipeline_parallel_size=args.pp, context_parallel_size=args.cp, zero_stage=args.zero_stage,
                        sequence_parallel=args.sequence_parallel, activation_checkpointing=args.activation_checkpointing,
                        pipeline_schedule=args.pipeline_schedule, virtual_pipeline_stages=args.virtual_pipeline_stages,
                        num_microbatches=args.num_microbatches, pipeline_layer_split=args.pipeline_layer_split,
                        context_parallel_method=args.cp_method)
    if args.dp is None:
        if args.num_gpus is None:
            raise ValueError("give --dp or --num-gpus.")
        pc = pc.resolve(args.num_gpus)
    pc.validate_model(cfg)
    m = pc.microbatches
    if args.formula == "fujii2024":
        if pc.zero_stage > 1 or pc.activation_checkpointing != "none":
            raise ValueError("--formula fujii2024 models ZeRO stage 0 or 1 (its distributed optimizer) without "
                             f"activation checkpointing; got zero_stage={pc.zero_stage}, activation_checkpointing="
                             f"{pc.activation_checkpointing}.")
        pc.validate_sequence(args.seq_length)
        est = fujii2024_from_config(cfg, tp=pc.tp, pp=pc.pp, dp=pc.dp, cp=pc.cp, seq_length=args.seq_length,
                                    micro_batch_size=args.micro_batch_size, num_microbatches=m,
                                    virtual_stages=pc.v,
                                    distributed_optimizer=pc.zero_stage == 1)
        out = dict(est.to_dict())
    else:
        est = estimate_memory(cfg, pc, args.micro_batch_size, args.seq_length, args.precision,
                              num_microbatches=m, gpu_name=gpu.name)
        out = est.to_dict()
    total = out["total"]
    out.update(total_gib=total / GIB, fraction=total / gpu.memory, fits=total <= args.budget * gpu.memory,
               budget=args.budget, gpu=gpu.name, gpu_memory=gpu.memory, formula=args.formula,
               layout=dict(tp=pc.tp, pp=pc.pp, cp=pc.cp, dp=pc.dp, zero_stage=pc.zero_stage,
                           sequence_parallel=pc.sp, activation_checkpointing=pc.activation_checkpointing,
                           pipeline_schedule=pc.pipeline_schedule, num_microbatches=m,
                           micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                           precision=args.precision))
    return out


def _print_estimate(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    lay = out["layout"]
    title = (f"{out['formula']} estimate per GPU: tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} dp={lay['dp']} "
             f"ZeRO {lay['zero_stage']} b={lay['micro_batch_size']} s={lay['seq_length']} {lay['precision']} "
             f"checkpointing={lay['activation_checkpointing']}")
    table = Table(title=title)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("bytes", justify="right")
    keys = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead") \
        if out["formula"] == "lightning_4d" else ("model_states", "activations")
    for k in keys:
        table.add_row(k, f"{out[k] / GIB:.2f}", f"{int(out[k]):,}")
    table.add_row("total (peak)", f"{out['total_gib']:.2f}", f"{int(out['total']):,}", style="bold")
    console = Console(width=max(Console().width, 150))
    console.print(table)
    if out["formula"] == "lightning_4d":
        console.print(f"peak phase: {out['peak_phase']} (total = parameters + optimizer_states + overhead + the "
                      "largest phase; see docs/memory.md)")
    verdict = "fits" if out["fits"] else "does NOT fit"
    console.print(f"{out['total_gib']:.2f} GiB = {100 * out['fraction']:.1f}% of {out['gpu']} "
                  f"({out['gpu_memory'] / GIB:.1f} GiB): {verdict} within the {100 * out['budget']:.0f}% budget.")


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_4d.memory.planner import plan

    cfg = load_model_config(args.model)
    gpu = _gpu(args)
    rows = plan(cfg, args.num_gpus, args.gpus_per_node, gpu, args.seq_length, args.global_batch_size,
                precision=args.precision, budget=args.budget, formula=args.formula,
                top=args.top)
    return {"model": args.model, "num_gpus": args.num_gpus, "gpus_per_node": args.gpus_per_node, "gpu": gpu.name,
            "gpu_memory": gpu.memory, "budget": args.budget, "seq_length": args.seq_length,
            "global_batch_size": args.global_batch_size, "precision": args.precision, "formula": args.formula,
            "layouts": [c.to_dict() for c in rows]}


def _print_plan(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{out['model']} on {out['num_gpus']} x {out['gpu']}, s={out['seq_length']}, global batch "
                        f"{out['global_batch_size']}: layouts within {100 * out['budget']:.0f}% of memory, fastest "
                        "predicted first")
    for col in ("#", "tp", "pp", "cp", "dp", "b", "m", "ZeRO", "ckpt", "sp", "schedule", "GiB", "mem %", "step s",
                "tokens/s", "MFU", "bubble", "comm", "recomp"):
        table.add_column(col, justify="right")
    for i, c in enumerate(out["layouts"], 1):
        schedule = "-" if c["pp"] == 1 else (c["pipeline_schedule"] + (f" v{c['virtual_pipeline_stages']}"
                                             if c["pipeline_schedule"] == "interleaved_1f1b" else ""))
        cp = str(c["cp"]) + ("" if c["cp"] == 1 else f" {c['context_parallel_method']}")
        table.add_row(str(i), str(c["tp"]), str(c["pp"]), cp, str(c["dp"]), str(c["micro_batch_size"]),
                      str(c["num_microbatches"]), str(c["zero_stage"]), c["activation_checkpointing"],
                      "-" if c["tp"] == 1 else ("on" if c["sequence_parallel"] else "off"), schedule,
                      f"{c['memory_gib']:.1f}", f"{100 * c['fraction']:.0f}", f"{c['step_time']:.3f}",
                      f"{c['tokens_per_sec']:,.0f}", f"{100 * c['mfu']:.1f}%", f"{100 * c['bubble_fraction']:.0f}%",
                      f"{100 * c['communication_fraction']:.0f}%", f"{100 * c['recompute_fraction']:.0f}%")
    console = Console(width=max(Console().width, 180))
    console.print(table)
    if not out["layouts"]:
        console.print("No layout fits: use more GPUs, a shorter sequence, or a larger GPU.")
    for i, c in enumerate(out["layouts"], 1):
        if c["pipeline_layer_split"]:
            console.print(f"#{i}: pipeline_layer_split={c['pipeline_layer_split']}")
            break
    console.print("bubble, comm (exposed communication) and recomp (recomputation): fractions of the predicted step. "
                  "Step time, tokens/s and MFU are predicted by the step-time model of docs/memory.md (calibrated on "
                  "published runs), not measured.")


def main(command: str, argv: list[str]) -> int:
    """Run ``estimate`` or ``plan`` with ``argv``; returns the exit code (0 fits, 1 does not fit, 2 bad input)."""
    args = _parser(command).parse_args(argv)
    try:
        out = _estimate(args) if command == "estimate" else _plan(args)
    except ValueError as err:
        print(f"lightning-4d {command}: error: {err}", file=sys.stderr)
        return 2
    if command == "estimate":
        if args.json:
            print(json.dumps(out))
        else:
            _print_estimate(out)
        return 0 if out["fits"] else 1
    if args.json:
        print(json.dumps(out))
    else:
        _print_plan(out)
    return 0 if out["layouts"] else 1
