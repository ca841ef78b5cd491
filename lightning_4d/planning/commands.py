"""``lightning-4d estimate`` and ``lightning-4d plan``: the memory estimate of one layout, and the layouts of a job
that fit, ranked by predicted step time. Neither imports torch, so both answer in well under a second.

Exit codes: 0 (``estimate``: fits; ``plan``: at least one layout fits), 1 (does not fit / none fits), 2 (invalid
input: the one-line error names the bad value).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, get_args, get_origin

from lightning_4d.config import (
    TRAINING_PRECISIONS,
    ParallelConfig,
    check_training_precision,
)
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.layout import (
    LAYOUT_FIELDS,
    LayoutField,
    config_kwargs_from_args,
    reported_layout,
)
from lightning_4d.planning.emit import check_emittable, fit_command, write_plan_config
from lightning_4d.planning.hardware import GIB, GPU_PRESETS, gpu_spec, parse_bytes, physical_memory
from lightning_4d.planning.printing import print_estimate, print_plan
from lightning_4d.planning.reliability import DEFAULT_CHECKPOINT_WRITE_GBPS, DEFAULT_MTBF_GPU_HOURS
from lightning_4d.planning.workload import Job, Search, Workload

FORMULAS = ("lightning_4d", "fujii2024")
#: how many layouts (the fastest predicted) ``plan --plot`` estimates and draws
PLOT_LAYOUTS = 400


#: fields a model YAML must give when it does not name a ``preset`` to start from (the sizes; the others have
#: meaningful defaults: RoPE theta, norm epsilon, ...)
REQUIRED_MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def load_model_config(spec: str) -> Any:
    """A :class:`~lightning_4d.models.LlamaConfig` from a preset name, or from a YAML file holding either a training
    config (``model: {model_config: <preset or fields>}``, as ``configs/*.yaml``) or the config's fields. The fields
    must be complete (:data:`REQUIRED_MODEL_FIELDS`) unless ``preset: <name>`` names a preset they override.

    Raises:
        ValueError: an unknown preset, a missing file, a YAML syntax error, a file that is empty or not a mapping,
            no model config in it, an unknown field, a missing field (each message names the file and the value).
    """
    import dataclasses

    from lightning_4d.models.llama_config import LlamaConfig

    path = Path(spec)
    if not (spec.endswith((".yaml", ".yml")) or path.is_file()):
        return LlamaConfig.from_preset(spec)
    if not path.is_file():
        raise ValueError(
            f"--model {spec!r}: no such file (expected a preset: {', '.join(LlamaConfig.preset_names())})."
        )
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"--model {spec!r}: not valid YAML{where} ({getattr(err, 'problem', None) or err}).") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise ValueError(
            f"--model {spec!r}: the file is {what}; expected LlamaConfig fields (or preset: NAME) or a "
            "training config with model.model_config."
        )
    model = data.get("model", data)
    if isinstance(model, dict) and "init_args" in model:
        model = model["init_args"]
    value = model.get("model_config", model) if isinstance(model, dict) else None
    if isinstance(value, str):
        return LlamaConfig.from_preset(value)
    if not isinstance(value, dict):
        raise ValueError(
            f"--model {spec!r}: the YAML file has no model config (model.model_config or LlamaConfig fields)."
        )
    value = dict(value.get("init_args", value))
    preset = value.pop("preset", None)
    fields = [f.name for f in dataclasses.fields(LlamaConfig)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"--model {spec!r}: unknown field(s) {unknown}; valid: preset, {', '.join(fields)}.")
    missing = [name for name in REQUIRED_MODEL_FIELDS if name not in value]
    if missing and preset is None:
        raise ValueError(
            f"--model {spec!r}: missing field(s) {missing}; give every one of "
            f"{list(REQUIRED_MODEL_FIELDS)}, or name a preset to start from (preset: llama3-8b)."
        )
    return LlamaConfig.from_preset(str(preset), **value) if preset is not None else LlamaConfig(**value)


def _gpu(args: argparse.Namespace):
    return gpu_spec(args.gpu_memory, peak_flops=getattr(args, "peak_tflops", None) and args.peak_tflops * 1e12)


def _positive(text: str, convert: Any, noun: str, expected: str) -> Any:
    """``convert(text)`` when it is finite and > 0, else ``argparse.ArgumentTypeError`` naming ``text``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun} (expected {expected})") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: expected {expected}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _positive(text, int, "an integer", "an integer >= 1")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _positive(text, float, "a number", "a finite number > 0")


def host_memory_gib(text: str) -> int:
    """argparse type of ``--host-memory``: GiB of host memory per node (a number > 0), or a size with its unit
    (``512GiB``, ``2TB``); bytes."""
    error = argparse.ArgumentTypeError(
        f"{text!r} is not valid: expected GiB of host memory per node (a number > 0) or a size such as 512GiB"
    )
    try:
        value = float(text)
    except ValueError:
        try:
            return parse_bytes(text)
        except ValueError:
            raise error from None
    if not (math.isfinite(value) and value > 0):
        raise error
    return int(value * GIB)


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: expected a fraction in (0, 1], e.g. 0.8")
    return value


def strict_bool(text: str) -> bool:
    """argparse type: true/false, yes/no, 1/0 (any case)."""
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not valid: expected true or false (also yes/no, 1/0)")


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit code 2 (``prog: error: ...``)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _precision_flag(value: str) -> str:
    """``--precision``: a flag the memory model knows and FourDStrategy trains with (argparse's one-line error,
    exit 2, otherwise)."""
    try:
        check_training_precision(value)
        if value not in TRAINING_PRECISIONS:
            raise ValueError(f"precision={value!r} is not valid: expected one of {list(TRAINING_PRECISIONS)}.")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (e.g. llama3-8b) or a YAML file (configs/*.yaml)")
    p.add_argument("--seq-length", type=positive_int, required=True, help="tokens per sample")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        type=_precision_flag,
        help=f"Lightning's precision flag: one of {list(TRAINING_PRECISIONS)} (16-mixed is refused)",
    )
    p.add_argument(
        "--gpu-memory",
        default="H100-80GB",
        help=f"a preset ({', '.join(GPU_PRESETS)}) or a size such as 80GiB / 94GB (default H100-80GB)",
    )
    p.add_argument("--budget", type=fraction, default=0.8, help="fraction of the GPU memory a layout may use (0.8)")
    p.add_argument(
        "--host-memory",
        type=host_memory_gib,
        default=None,
        help="host memory per node, GiB (or a size such as 2TiB) that optimizer and activation offload may use "
        "within the budget (default: this machine's physical memory)",
    )
    p.add_argument("--formula", default="lightning_4d", choices=FORMULAS)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _document_tokens_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--document-tokens",
        type=positive_int,
        help="document masking (CausalLMModule(document_masking=True)) with documents of N tokens: estimate and "
        "plan count its masks; plan times the attention its masked kernels compute; measure trains on synthetic "
        "windows of such documents (an EOS every N tokens)",
    )


#: what a command adds to a layout option's help, by (command, field)
_COMMAND_NOTES = {
    ("estimate", "num_microbatches"): "; at pp = 1 the gradient-accumulation steps per optimizer step (Lightning's "
    "accumulate_grad_batches, also --accumulate-grad-batches), as plan and the pre-fit check count them (default 1)",
    **{("measure", name): note for name, note in moe_costs.MEASURE_NOTES.items()},
}


#: more flags a command gives a layout option, by (command, field)
_COMMAND_ALIASES = {("estimate", "num_microbatches"): ("--accumulate-grad-batches",)}


def _layout_option(p: Any, field: LayoutField, default: Any, help: str, aliases: tuple[str, ...] = ()) -> None:
    """Add the option of a layout field (:mod:`lightning_4d.layout`) to ``p``: a switch for a bool, ``true``/``false``
    for an optional bool, its choices, a list of positive integers, or an integer (positive for a size);
    ``aliases``: more flags for the same option."""
    kw: dict[str, Any] = {"dest": field.option_dest, "help": help}
    if field.type is bool:
        kw["action"] = "store_true"
    else:
        kw["default"] = None if default == "auto" else default
        if field.type == Optional[bool]:
            kw["type"] = strict_bool
        elif field.choices is not None:
            kw["choices"] = [c for c in field.choices if c is not None]  # None: the option left out
            if all(isinstance(c, int) for c in field.choices):
                kw["type"] = int
        else:
            kw["type"] = positive_int if field.minimum == 1 else int
            if any(get_origin(t) is list for t in (field.type, *get_args(field.type))):
                kw["nargs"] = "+"
    p.add_argument(*field.flags, *aliases, **kw)


def command_parser(command: str) -> argparse.ArgumentParser:
    """The options of `lightning-4d <command>` (``estimate``, ``plan`` or ``measure``)."""
    p = _Parser(prog=f"lightning-4d {command}")
    _common(p)
    if command == "measure":
        p.add_argument(
            "--rank",
            type=_rank,
            default="worst",
            help="the global rank to build and run (0 .. world size - 1), or 'worst' (default): rank 0 of "
            "the pp rank the estimate names as the largest",
        )
        p.add_argument("--steps", type=positive_int, default=2, help="optimizer steps to run (default 2)")
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the rank runs (default cpu)")
    if command in ("estimate", "measure"):
        moe_costs.add_load_option(p)
        _document_tokens_option(p)
        group = p.add_mutually_exclusive_group()
        for f in LAYOUT_FIELDS:
            if f.flags:
                help = (f.cli_help or f.help) + _COMMAND_NOTES.get((command, f.name), "")
                aliases = _COMMAND_ALIASES.get((command, f.name), ())
                _layout_option(group if f.name == "data_parallel_size" else p, f, f.default, help, aliases)
        group.add_argument("--num-gpus", type=positive_int, help="world size (dp = num_gpus / (tp*pp*cp))")
        p.add_argument("--micro-batch-size", type=positive_int, required=True)
        if command == "estimate":
            p.add_argument(
                "--gpus-per-node",
                type=positive_int,
                default=8,
                help="GPUs per node (default 8): the host memory of a node, and where dp*cp*tp spans nodes at "
                f"ZeRO 1-3 (flat ZeRO, a dense model) the HSDP replica count the step-time model predicts "
                f"fastest is proposed when it fits and is at least {100 * HSDP_MIN_GAIN:g}%% faster",  # %%: argparse
            )
    else:
        _plan_options(p)
    return p


def _plan_options(p: argparse.ArgumentParser) -> None:
    """``plan``'s own options (beside :func:`_common`'s)."""
    p.add_argument("--num-gpus", type=positive_int, required=True)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--global-batch-size", type=positive_int, required=True, help="samples per optimizer step")
    p.add_argument("--top", type=positive_int, default=20, help="how many layouts to list (20)")
    p.add_argument("--peak-tflops", type=positive_float, help="custom GPU: dense bf16 peak (TFLOP/s)")
    for f in LAYOUT_FIELDS:  # the sizes a plan can keep fixed, and --tensor-parallel-overlap
        if f.plan_help:
            _layout_option(p, f, False if f.type is bool else None, f.plan_help)
    moe_costs.add_load_option(p)
    _document_tokens_option(p)
    p.add_argument(
        "--checkpoint-write-gbps",
        type=positive_float,
        default=DEFAULT_CHECKPOINT_WRITE_GBPS,
        help=f"GB/s each node writes checkpoints at (default {DEFAULT_CHECKPOINT_WRITE_GBPS:g}, an "
        "assumption: see docs/step_time.md)",
    )
    p.add_argument(
        "--mtbf-gpu-hours",
        type=positive_float,
        default=DEFAULT_MTBF_GPU_HOURS,
        help=f"GPU-hours between failures of one GPU (default {DEFAULT_MTBF_GPU_HOURS:,.0f}: Llama 3 "
        "paper, 419 interruptions in 54 days on 16,384 GPUs)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw step time against memory (needs matplotlib)")
    p.add_argument(
        "--emit-config",
        metavar="FILE.yaml",
        help="write the first pick as a config for `lightning-4d fit --config FILE.yaml`: the layout, the "
        "batch sizes and, for a preset, a pretraining job (steps, schedule, checkpoints, logger; "
        "docs/estimate_and_plan.md)",
    )


def _propose_split(pc: ParallelConfig, num_layers: int) -> Optional[list[int]]:
    """The planner's layer split (:func:`~lightning_4d.planning.planner.propose_layer_split`) when ``pc`` has pp > 1,
    no ``pipeline_layer_split`` and ``pp·v`` stages that do not divide ``num_layers`` evenly (at least one layer
    each); else ``None`` (the even split, or the layout's own, or an error of ``validate_model`` to come)."""
    from lightning_4d.planning.planner import propose_layer_split

    if pc.pp == 1 or pc.pipeline_layer_split is not None or num_layers < pc.num_stages:
        return None
    return propose_layer_split(num_layers, pc.num_stages)


def _rank(text: str) -> Any:
    """argparse type: ``worst`` or an integer >= 0."""
    if text == "worst":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: expected a rank (an integer >= 0) or 'worst'")
    return value


def workload_from_args(args: argparse.Namespace, cfg: Any, num_microbatches: Optional[int] = None) -> Workload:
    """The :class:`Workload` of ``estimate``'s or ``measure``'s options for model ``cfg``: b, s, precision, the
    MoE load (:func:`~lightning_4d.features.moe.costs.load_of_args`) and document masking (``--document-tokens``)."""
    return Workload(
        cfg,
        args.micro_batch_size,
        args.seq_length,
        args.precision,
        num_microbatches=num_microbatches,
        **moe_costs.load_of_args(args),
        document_masking=args.document_tokens is not None,
        document_tokens=args.document_tokens,
    )


def layout_from_args(args: argparse.Namespace, cfg: Any) -> tuple[ParallelConfig, Optional[list[int]]]:
    """The layout ``estimate`` and ``measure`` are asked for (their options of :data:`LAYOUT_FIELDS`), resolved and
    validated against the model, and the planner's layer split when it proposed one (``None`` else)."""
    pc = ParallelConfig(**config_kwargs_from_args(args))
    if args.dp is None:
        if args.num_gpus is None:
            raise ValueError("give --dp or --num-gpus.")
        pc = pc.resolve(args.num_gpus)
    else:
        pc = pc.resolve(pc.world_size)  # checks that ep divides dp*cp*tp
    proposed = _propose_split(pc, cfg.num_layers)
    if proposed is not None:
        pc = replace(pc, pipeline_layer_split=proposed)
    pc.validate_model(cfg)
    return pc, proposed


def _estimate(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_4d.planning.fujii2024 import fujii2024_of_layout
    from lightning_4d.planning.model import estimate_memory

    cfg = load_model_config(args.model)
    gpu = _gpu(args)
    pc, proposed = layout_from_args(args, cfg)
    # m: the pipeline's micro-batches, or at pp = 1 the gradient-accumulation steps (`--num-microbatches` /
    # `--accumulate-grad-batches`), as `plan` and the pre-fit check (trainer.accumulate_grad_batches) count them
    m = pc.microbatches if pc.pp > 1 else (pc.num_microbatches or 1)
    pc.validate_float8_tokens(args.seq_length, args.micro_batch_size)  # as the strategy refuses it
    if args.formula == "fujii2024":
        if pc.zero_stage > 1 or pc.activation_checkpointing != "none":
            raise ValueError(
                "--formula fujii2024 models ZeRO stage 0 or 1 (its distributed optimizer) without "
                f"activation checkpointing; got zero_stage={pc.zero_stage}, activation_checkpointing="
                f"{pc.activation_checkpointing}."
            )
        pc.validate_sequence(args.seq_length)
        est = fujii2024_of_layout(cfg, pc, args.seq_length, args.micro_batch_size, m)
        out = dict(est.to_dict())
    else:
        per_node = min(pc.world_size, args.gpus_per_node)
        est = estimate_memory(workload_from_args(args, cfg, m), pc, gpu_name=gpu.name, ranks_per_node=per_node)
        out = est.to_dict()
    total = out["total"]
    out.update(
        total_gib=total / GIB,
        fraction=total / gpu.memory,
        fits=total <= args.budget * gpu.memory,
        budget=args.budget,
        gpu=gpu.name,
        gpu_memory=gpu.memory,
        formula=args.formula,
        layout=dict(
            reported_layout(pc),
            num_microbatches=m,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            precision=args.precision,
        ),
        pipeline_layer_split_proposed=proposed is not None,
        num_layers=cfg.num_layers,
        **moe_costs.load_of_args(args, checked=True),
    )
    if args.formula == "lightning_4d":
        out.update(_host_fit(out["host_per_node"], args))
        out["hsdp_proposal"] = _hsdp_proposal(cfg, pc, m, args, gpu)
    if not out["fits"] and args.formula == "lightning_4d":
        out["suggestions"] = _suggestions(cfg, pc, m, args, gpu)
    return out


#: the least predicted gain (a fraction of the flat ZeRO step) for which ``estimate`` proposes HSDP: a smaller one
#: (llama3.1-405b tp8 dp128 ZeRO 3 on 1,024 H100s: 0.03%, 30 ms of 109 s) is a difference of the model's inputs
#: (link bandwidths and latencies), not a prediction to act on
HSDP_MIN_GAIN = 0.01


def _hsdp_proposal(cfg: Any, pc: ParallelConfig, m: int, args: argparse.Namespace, gpu: Any) -> Optional[dict]:
    """The hybrid sharding ``estimate`` proposes for layout ``pc`` (``m`` micro-batches per step): of every replica
    count HSDP can take there (:func:`~lightning_4d.planning.planner.hsdp_replicas` with ``every``, when dp·cp·tp spans
    nodes of ``--gpus-per-node`` GPUs), the one with the least predicted step
    (:func:`~lightning_4d.planning.step_time.step_time_of`) that is at least :data:`HSDP_MIN_GAIN` faster than
    ``pc``'s flat ZeRO and fits the budget: ``{"data_parallel_replicate_size", "step_time", "flat_zero_step_time"
    (seconds), "total", "total_gib" (its peak memory, bytes / GiB)}``; ``None`` at ZeRO 0, under HSDP already, for
    an MoE model (no HSDP) or when no replica count is faster and fits."""
    from lightning_4d.planning.model import estimate_memory
    from lightning_4d.planning.planner import hsdp_replicas
    from lightning_4d.planning.step_time import Layout, model_dims, step_time_of

    if pc.zero_stage == 0 or pc.data_parallel_replicate_size > 1 or getattr(cfg, "is_moe", False):
        return None
    layout, dims = Layout.of(pc, args.micro_batch_size, m), model_dims(cfg)
    kw = dict(
        seq_length=args.seq_length, gpu=gpu, gpus_per_node=args.gpus_per_node, document_tokens=args.document_tokens
    )
    flat = step_time_of(dims, layout, **kw).total
    timed = [
        (step_time_of(dims, replace(layout, data_parallel_replicate_size=r), **kw).total, r)
        for r in hsdp_replicas(pc.tp, pc.cp, pc.dp, args.gpus_per_node, every=True)
    ]
    for t, r in sorted(timed):
        if t > (1 - HSDP_MIN_GAIN) * flat:
            break
        hybrid = replace(pc, data_parallel_replicate_size=r)
        total = estimate_memory(workload_from_args(args, cfg, m), hybrid, gpu_name=gpu.name).total
        if total <= args.budget * gpu.memory:
            return dict(
                data_parallel_replicate_size=r,
                step_time=t,
                flat_zero_step_time=flat,
                total=total,
                total_gib=total / GIB,
            )
    return None


def _host_fit(per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    """``host_memory`` (``--host-memory``, default this machine's physical memory) and ``fits_host``: whether
    ``per_node`` bytes of host memory (``MemoryEstimate.host_per_node``) fit ``--budget`` of it."""
    memory = args.host_memory if args.host_memory is not None else physical_memory()
    return {"host_memory": memory, "fits_host": per_node <= args.budget * memory}


def _suggestions(cfg: Any, pc: ParallelConfig, m: int, args: argparse.Namespace, gpu: Any) -> list[dict[str, Any]]:
    """The nearest layouts of the same world size that fit (``suggest_layouts``, as ``MemoryEstimatorCallback``
    names them when it refuses a layout), at the job's global batch (b·dp·``m``, ``m`` as the estimate counts it):
    ``{"line": the FourDStrategy(...) call, "total", "total_gib",
    "layout"}`` each, fastest predicted first."""
    from lightning_4d.planning.planner import accumulated_batches, suggest_layouts, suggestion_line

    try:
        work = workload_from_args(args, cfg)
        found = suggest_layouts(
            work,
            pc.world_size,
            gpu.memory,
            args.budget,
            global_batch_size=args.micro_batch_size * pc.dp * m,  # the job's sequences per optimizer step
            gpu_name=gpu.name,
            gpus_per_node=args.gpus_per_node,
        )
    except ValueError:  # no suggestion is better than hiding the verdict (as the callback does)
        return []
    return [
        {
            "line": suggestion_line(s, args.micro_batch_size),
            "accumulate_grad_batches": accumulated_batches(s),
            "total": e.total,
            "total_gib": e.total / GIB,
            "layout": reported_layout(s),
        }
        for s, e in found
    ]


def _plan(args: argparse.Namespace, untested_pairs: Optional[Callable[[dict, bool], list]] = None) -> dict[str, Any]:
    cfg = load_model_config(args.model)
    gpu = _gpu(args)
    fixed = {  # the sizes asked for (plan's layout options but its switches, --tensor-parallel-overlap, --compile)
        f.option_dest: getattr(args, f.option_dest)
        for f in LAYOUT_FIELDS
        if f.plan_help and f.type is not bool and getattr(args, f.option_dest) is not None
    }
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'lightning-4d[plot]'")
    search = _search_of(args, fixed)
    rows = _search(args, cfg, gpu, search, top=args.top)
    out = {
        "model": args.model,
        "num_gpus": args.num_gpus,
        "gpus_per_node": args.gpus_per_node,
        "gpu": gpu.name,
        "gpu_memory": gpu.memory,
        "budget": args.budget,
        "seq_length": args.seq_length,
        "global_batch_size": args.global_batch_size,
        "precision": args.precision,
        "formula": args.formula,
        **moe_costs.load_of_args(args, checked=True),
        **search.considered(),
        "checkpoint_write_gbps": args.checkpoint_write_gbps,
        "async_checkpoint": args.async_checkpoint,
        "mtbf_gpu_hours": args.mtbf_gpu_hours,
        "host_memory": args.host_memory,
        "document_tokens": args.document_tokens,
        "layouts": [_plan_row(args, cfg, c, untested_pairs, gpu) for c in rows],
    }
    if args.document_tokens is not None:
        _add_attention_work(out, args.document_tokens)
    if args.plot:
        from lightning_4d.planning.plot import plot_plan

        points = _search(args, cfg, gpu, search, top=None, include_unfit=True, max_estimated=PLOT_LAYOUTS)
        title = (
            f"{args.model} on {args.num_gpus} x {gpu.name}, s={args.seq_length}, global batch "
            f"{args.global_batch_size}: the {len(points)} fastest predicted layouts"
        )
        out["plot"] = plot_plan(points, gpu.memory, args.budget, args.plot, title)["path"]
    return out


def _add_attention_work(out: dict[str, Any], document_tokens: int) -> None:
    """Document masking in ``plan``'s result: ``document_tokens`` and, per layout, ``attention_work``, the attention
    FLOPs its masked kernels compute over causal attention's, which its step time charges
    (:func:`~lightning_4d.planning.step_time.attention_work`); its ``mfu`` counts the documents' attention FLOPs
    (:meth:`LlamaConfig.flops_per_token <lightning_4d.models.LlamaConfig.flops_per_token>`'s ``attention_context``),
    not the masked tiles the kernels compute beside them."""
    from lightning_4d.planning.step_time import attention_work

    out["document_tokens"] = document_tokens
    for row in out["layouts"]:
        method = row["context_parallel_method"]
        row["attention_work"] = attention_work(out["seq_length"], document_tokens, row["cp"], method)


def _search_of(args: argparse.Namespace, fixed: dict[str, int]) -> Search:
    """The :class:`~lightning_4d.planning.workload.Search` ``plan``'s options ask for: the sizes kept ``fixed`` and
    plan's switches (its layout options of type bool that the planner enumerates, declared in
    :data:`~lightning_4d.layout.LAYOUT_FIELDS`, each a field of ``Search`` by the same name)."""
    switches = {
        f.name: getattr(args, f.option_dest) for f in LAYOUT_FIELDS if f.plan_help and f.type is bool and f.planned
    }
    return Search(fixed=fixed, **switches)


def _search(args: argparse.Namespace, cfg: Any, gpu: Any, search: Search, **kw: Any) -> list:
    """:func:`lightning_4d.planning.planner.plan` of the job ``args`` asks for (``kw``: ``top`` and the plot's
    options)."""
    from lightning_4d.planning.planner import plan

    job = Job(
        cfg,
        args.num_gpus,
        args.gpus_per_node,
        args.seq_length,
        args.global_batch_size,
        gpu,
        args.precision,
        **moe_costs.load_of_args(args),
        host_memory=args.host_memory,
        document_tokens=args.document_tokens,
    )
    return plan(job, search, budget=args.budget, formula=args.formula, **kw)


def _plan_row(
    args: argparse.Namespace,
    cfg: Any,
    c: Any,
    untested_pairs: Optional[Callable[[dict, bool], list]],
    gpu: Any,
) -> dict[str, Any]:
    """One layout of ``plan``'s result: the candidate ``c``'s fields, its checkpoint interval
    (:func:`lightning_4d.planning.reliability.checkpoint_interval`), the feature pairs no CPU test runs together and,
    for a layout with hybrid sharding, the predicted step of the same layout with flat ZeRO
    (``flat_zero_step_time``, seconds; ``None`` without HSDP)."""
    from lightning_4d.planning.reliability import async_blocking_seconds, checkpoint_interval
    from lightning_4d.planning.step_time import model_dims, step_time_of

    flat = None
    if c.data_parallel_replicate_size > 1:
        same = replace(c, data_parallel_replicate_size=1)
        kw = dict(seq_length=args.seq_length, gpu=gpu, gpus_per_node=args.gpus_per_node)
        flat = step_time_of(model_dims(cfg), same, **kw, document_tokens=args.document_tokens).total

    blocking = async_blocking_seconds(cfg, c, gpu.host_bandwidth, args.precision) if args.async_checkpoint else None
    ckpt = checkpoint_interval(
        cfg,
        args.num_gpus,
        args.gpus_per_node,
        c.step_time,
        precision=args.precision,
        checkpoint_write_gbps=args.checkpoint_write_gbps,
        mtbf_gpu_hours=args.mtbf_gpu_hours,
        blocking_s=blocking,
    )
    return {
        **c.to_dict(),
        "checkpoint_interval_s": ckpt.interval_s,
        "checkpoint_interval_steps": ckpt.interval_steps,
        "checkpoint_write_s": ckpt.write_s,
        "checkpoint_blocking_s": ckpt.blocking_s,
        "checkpoint_lost_fraction": ckpt.lost_fraction,
        "job_mtbf_s": ckpt.mtbf_s,
        "checkpoint_bytes": ckpt.checkpoint_bytes,
        "flat_zero_step_time": flat,
        # the features of this layout no CPU test of the support matrix combines (docs/support.md)
        # (None: not checked, when the caller gives no checker: planning/ cannot import the support matrix)
        "untested_pairs": None
        if untested_pairs is None
        else [list(p) for p in untested_pairs(c.to_dict(), getattr(cfg, "is_moe", False))],
    }


def main(command: str, argv: list[str], untested_pairs: Optional[Callable[[dict, bool], list]] = None) -> int:
    """Run ``estimate`` or ``plan`` with ``argv``; returns the exit code (0 fits, 1 does not fit, 2 bad input).
    (``measure``'s options are defined here too, :func:`command_parser`; it runs in :mod:`lightning_4d.measure`.)

    ``untested_pairs``: for ``plan``, ``(layout options, moe) -> the feature pairs no CPU test runs together``
    (``lightning-4d plan`` passes :func:`lightning_4d.support.untested_pairs`; planning/ does not import the support
    matrix, which sits above it); without it the ``tested`` column shows ``-``."""
    args = command_parser(command).parse_args(argv)
    emit = getattr(args, "emit_config", None)
    try:
        if emit is not None:
            folder = Path(emit).parent
            if not folder.is_dir():
                raise ValueError(f"--emit-config {emit!r}: the folder {str(folder)!r} does not exist.")
            check_emittable(args.model)  # before the search: a plan of a large job takes seconds
        out = _estimate(args) if command == "estimate" else _plan(args, untested_pairs)
        if emit is not None:
            if not out["layouts"]:
                raise ValueError(
                    f"--emit-config {emit!r}: no layout fits, so there is no first pick to write (use "
                    "more GPUs, a shorter sequence, a larger GPU, optimizer offload with enough --host-memory, or "
                    "--precision bf16-true)."
                )
            out["emit_config"] = write_plan_config(out, emit, " ".join(["lightning-4d", command, *argv]))
    except ValueError as err:
        print(f"lightning-4d {command}: error: {err}", file=sys.stderr)
        return 2
    if command == "estimate":
        if args.json:
            print(json.dumps(out))
        else:
            print_estimate(out)
        return 0 if out["fits"] else 1
    if args.json:
        print(json.dumps(out))
    else:
        print_plan(out)
        if emit is not None:
            print(f"config: wrote the first pick to {emit} ({fit_command(out, emit)})")
    return 0 if out["layouts"] else 1
