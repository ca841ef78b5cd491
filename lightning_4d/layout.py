"""The layout registry: every field of a training layout declared once.

A :class:`LayoutField` says everything the package needs to know about one layout option: its name, type, default
and choices, its one-line help and its docstring entry, the ``estimate``/``measure`` (and ``plan``) option that sets
it, which parallel feature owns it, whether a sharded checkpoint saves it, whether the planner enumerates it (and how
a planned value maps back to the option), and when it is written among a layout's ``FourDStrategy`` arguments. Derived
from :data:`LAYOUT_FIELDS`, never written out elsewhere:

- :class:`~lightning_4d.config.ParallelConfig`'s fields, defaults and the "Args" of its docstring
  (:func:`layout_dataclass`), and the generic checks of every field's values (:func:`check_values`);
- :class:`~lightning_4d.FourDStrategy`'s signature (its ``__signature__``, which ``inspect`` and so LightningCLI read)
  and the "Args" of its docstring (:func:`strategy_signature`, :func:`args_doc`);
- the planner's layout (``planning/step_time.Layout``, ``planning/planner.Candidate``: :func:`planned_dataclass`,
  :func:`plan_values`, :func:`config_of_plan`);
- the layout options of ``lightning-4d estimate|plan|measure`` (``planning/commands.py``), the ``ParallelConfig`` they
  build (:func:`config_kwargs_from_args`), the support rows' ``measure`` flags (:func:`measure_flags`);
- the one writer from a layout to ``FourDStrategy`` arguments (:func:`strategy_arguments`): the pasteable line of
  the pre-fit check's refusal and of ``estimate``'s suggestions, and ``plan --emit-config``'s ``init_args``;
- the layout a sharded checkpoint saves (:func:`saved_layout`) and the one ``estimate`` reports
  (:func:`reported_layout`).

Beside the fields, the training precisions a layout trains with and the one refusal of the others
(:func:`check_training_precision`, :func:`precision_refusal`: ``config`` checks with it, the support matrix's refused
row states it).

A new layout option: one :class:`LayoutField` here, then the feature's runtime, its rules against the other
features, its memory term and its time term, in the feature's folder of ``lightning_4d/features/``
(``docs/extending.md``, "Add a layout option").

Pure Python: no torch import (the memory estimator and the CLI read it on a laptop).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

ZERO_STAGES = (0, 1, 2, 3)
#: activation checkpointing modes (see lightning_4d/parallel/activation_checkpoint.py)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
#: context-parallel attention methods (see lightning_4d/features/context_parallel/runtime.py)
CONTEXT_PARALLEL_METHODS = ("ring", "allgather", "alltoall")
#: data-parallel gradient compression (see lightning_4d/parallel/compression.py)
GRADIENT_COMPRESSIONS = ("none", "bf16", "powersgd")
#: the dtype of the activations and gradients sent between pipeline stages (None: the model's; float8: e4m3 with a
#: per-tensor scale, parallel/compression.py)
PIPELINE_COMM_DTYPES = (None, "bfloat16", "float8")
#: the dtype PowerSGD's factors P and Q are all-reduced in (None: float32)
POWERSGD_COMM_DTYPES = (None, "bfloat16")
#: float8 training of the decoder layers' dense linears through torchao (None: off; see
#: lightning_4d/parallel/float8.py): its tensorwise or rowwise scaling recipe
FLOAT8_RECIPES = (None, "tensorwise", "rowwise")
#: pipeline schedules (torch.distributed.pipelining)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")

#: what a sharded checkpoint saves of a field (:func:`saved_layout`): nothing, its value as given (under its name),
#: its resolved value (under its ``short`` name), or the resolved value only when it differs from the default (a
#: field added after checkpoints were saved: older checkpoints' layouts still compare equal)
Saved = Literal["no", "value", "resolved", "resolved_if_set"]


#: a :class:`LayoutField` hook left unset
_UNSET: Any = object()


#: Lightning precision flags FourDStrategy trains with (``Trainer(precision=...)``); the rest are refused by
#: :func:`check_training_precision`
TRAINING_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
#: refused precision flags (and their aliases), each with the reason
_REFUSED_PRECISIONS = {
    ("16-mixed", "16"): (
        "float16 mixed precision needs a gradient scaler whose overflow check and unscaling span every gradient "
        "shard (tp, pp, ZeRO buckets, experts), which neither FourDStrategy nor Lightning's ModelParallelStrategy "
        "provides"
    ),
}


def precision_refusal(precision: object) -> Optional[str]:
    """The one line :func:`check_training_precision` refuses ``precision`` (a Lightning precision flag) with, as the
    support matrix's refused row states it (``lightning_4d/support_rows.py``); ``None`` for a flag FourDStrategy
    trains with."""
    for names, reason in _REFUSED_PRECISIONS.items():
        if str(precision).lower() in names:
            return (
                f"precision={precision!r} is not supported by FourDStrategy: {reason}. Use one of "
                f"{list(TRAINING_PRECISIONS)} ('bf16-mixed' trains at the speed of float16 on Ampere and newer "
                "GPUs, with no scaler)."
            )
    return None


def check_training_precision(precision: object) -> str:
    """``precision`` (a Lightning precision flag) as given, when FourDStrategy can train with it.

    The Trainer's own flags are accepted (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` and Lightning's aliases,
    ``"16-true"``); ``"16-mixed"`` is refused here, in one place, by ``lightning-4d fit`` before the Trainer is
    built, by ``estimate``, ``plan`` and ``measure`` before anything runs, and by the strategy's setup.

    Raises:
        ValueError: ``"16-mixed"`` (or ``"16"``, ``16``), with the reason and the flags that train.
    """
    refusal = precision_refusal(precision)
    if refusal is not None:
        raise ValueError(refusal)
    return str(precision)


def check_positive_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (not a bool): the check of every size and count of a layout, and of the
    memory estimator's and the planner's integer arguments (``name``: the argument, as the message names it).

    Raises:
        ValueError: ``value`` is not such an int (the message names ``name`` and ``value``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: expected a positive integer (1, 2, 4, ...).")
    return value


@dataclass(frozen=True)
class LayoutField:
    """One field of the layout.

    Attributes:
        name: the ``ParallelConfig`` field and the ``FourDStrategy`` argument.
        type: its annotation (the strategy's, which LightningCLI reads; ``Literal`` of the choices).
        default: its default (the same in ``ParallelConfig``, ``FourDStrategy`` and the CLI).
        feature: the parallel feature that owns it (``dp``, ``tp``, ``sp``, ``pp``, ``cp``, ``ep``, ``zero``,
            ``activation_checkpointing``, ``offload``, ``compression``, ``compile``, ``float8``, ``checkpoint``).
        help: one line, the CLI's help (the docstrings say more: ``doc``).
        doc: its entry in ``ParallelConfig``'s and ``FourDStrategy``'s docstrings (one paragraph, wrapped there).
        choices: the valid values when they are a closed set (checked by :func:`check_values`).
        flags: the option strings of ``estimate`` and ``measure`` (the first is the main spelling; users and the
            docs use them as they are); ``()``: not on the CLI.
        dest: the argparse destination; ``None``: the main flag's (``--cp-method`` -> ``cp_method``).
        minimum: for an integer (or a list of them on the CLI), the least value the CLI takes (1: a size, checked
            by :func:`check_values` too).
        short: the ``ParallelConfig`` property of the resolved value (``tp``, ``dp``, ``v``, ``sp``, ...).
        saved: what a sharded checkpoint saves of it (:data:`Saved`).
        planned: a dimension the planner enumerates (a field of ``planning/step_time.Layout`` and
            ``planning/planner.Candidate``: :func:`planned_dataclass`).
        plan_type: the planner's type of its resolved value (``None``: ``type``).
        plan_default: the planner's value when the layout does not set it (``_UNSET``: ``default``).
        pipeline_only: its planned value is written back (:func:`config_of_plan`) and written among the strategy's
            arguments (:func:`strategy_arguments`) only with pp > 1; the planner holds ``plan_default`` without pp.
        written: when it is among a layout's strategy arguments (:func:`strategy_arguments`): ``"always"``,
            ``"tp"`` / ``"cp"`` / ``"pp"`` (when that size is > 1), or ``"set"`` (when it is not its default).
        implied: the value the short line of :func:`strategy_arguments` (``concise=True``) leaves out (``_UNSET``:
            none).
        plan_help: the help of ``plan``'s option that keeps the field fixed (same flags); ``None``: no such option.
        cli_help: the CLI's help where it says more than ``help`` (the CLI's own default, say).
    """

    name: str
    type: Any
    default: Any
    feature: str
    help: str
    doc: str
    choices: Optional[tuple] = None
    flags: tuple[str, ...] = ()
    dest: Optional[str] = None
    minimum: Optional[int] = None
    short: Optional[str] = None
    saved: Saved = "no"
    planned: bool = False
    plan_type: Any = None
    plan_default: Any = _UNSET
    pipeline_only: bool = False
    written: Literal["always", "tp", "cp", "pp", "set"] = "always"
    implied: Any = _UNSET
    plan_help: Optional[str] = None
    cli_help: Optional[str] = None

    @property
    def option_dest(self) -> str:
        """The argparse destination of :attr:`flags`."""
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")

    @property
    def plan_name(self) -> str:
        """Its name in the planner's layout: the mesh sizes by their mesh names (``tp``, ``pp``, ``cp``, ``dp``), the
        rest by their own."""
        return self.short if self.short in MESH_DIM_NAMES else self.name

    def resolved(self, config: Any) -> Any:
        """The field's resolved value in ``config`` (``config.<short>``, else the value as given)."""
        return getattr(config, self.short or self.name)


def _size(name: str, short: str, feature: str, help: str, doc: str) -> LayoutField:
    """A mesh size: a positive integer, default 1, option ``--<short>``, saved resolved, enumerated by the planner."""
    return LayoutField(
        name,
        int,
        1,
        feature,
        help,
        doc,
        flags=(f"--{short}",),
        minimum=1,
        short=short,
        saved="resolved",
        planned=True,
        plan_help=f"only layouts with this {short} size",
    )


#: a count given as an int or left to the strategy (dp ``"auto"``, v and m ``None``): positive, enumerated by the
#: planner as an int, 1 in a planned layout that does not use it
_PLANNED_COUNT: dict[str, Any] = dict(minimum=1, planned=True, plan_type=int, plan_default=1)


LAYOUT_FIELDS: tuple[LayoutField, ...] = (
    LayoutField(
        "data_parallel_size",
        Union[Literal["auto"], int],
        "auto",
        "dp",
        "dp, the model replicas that see different data ('auto': world size / (pp*cp*tp))",
        'dp, the model replicas that see different data; ``"auto"`` (or -1) takes what is left of the world size '
        "after pp, cp and tp.",
        flags=("--dp",),
        short="dp",
        saved="resolved",
        **_PLANNED_COUNT,
        plan_help="only layouts with this dp size",
        cli_help="data parallel size",
    ),
    _size(
        "tensor_parallel_size",
        "tp",
        "tp",
        "tp, the ranks that split every matrix of a layer (default 1)",
        "tp, the ranks that split every matrix of a layer (Megatron-style column/row split; must divide heads, kv "
        "heads, FFN size and the padded vocabulary).",
    ),
    _size(
        "pipeline_parallel_size",
        "pp",
        "pp",
        "pp, the ranks of the pipeline's stages (default 1)",
        "pp, the ranks of the pipeline's stages (the layers are split into ``pp·v`` stages; ``lightning_4d`` Llama "
        "models and the transformers Llama; ``lightning_4d/features/pipeline/runtime.py``). With pp > 1 the strategy "
        "runs the schedule inside ``training_step`` (``docs/pipeline.md``).",
    ),
    _size(
        "context_parallel_size",
        "cp",
        "cp",
        "cp, the ranks that split every sequence (default 1)",
        "cp, the ranks that split the sequence of every sample (load-balanced zigzag chunks: rank i holds chunks i "
        "and 2c-1-i of 2c): the strategy shards ``input_ids`` / ``labels`` of each batch over the sequence and "
        "attention exchanges K/V over the cp group (``lightning_4d/features/context_parallel/runtime.py``); the "
        "sequence length must be a multiple of 2·cp (times tp under sp).",
    ),
    LayoutField(
        "zero_stage",
        int,
        1,
        "zero",
        "ZeRO stage over dp*cp: 0 replicated, 1 optimizer states, 2 + gradients, 3 + parameters sharded (default 1)",
        "ZeRO stage over the ``dp_cp`` group: 0 replicated, 1 optimizer states sharded, 2 + gradients sharded, 3 + "
        'parameters sharded (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054).',
        choices=ZERO_STAGES,
        flags=("--zero-stage",),
        saved="value",
        planned=True,
        plan_help="only layouts with this ZeRO stage",
    ),
    LayoutField(
        "data_parallel_replicate_size",
        int,
        1,
        "zero",
        "HSDP: the replicas of the ZeRO shard group, dp = replicate x shard (default 1: ZeRO over all of dp*cp)",
        "hybrid sharding (HSDP; Lightning's ``HYBRID_SHARD``, torchtitan's ``data_parallel_replicate_degree``): "
        "the dp ranks form this many replicas of a ZeRO shard group of ``dp/replicate · cp`` ranks (consecutive "
        "ranks, one node when it fits). ZeRO 1-3 shard the states within the shard group only; gradients are "
        "reduce-scattered within it, then each shard all-reduced across the replicas, so the parameter all-gathers "
        "of ZeRO 3 never leave the shard group. Must divide dp; needs ZeRO 1-3; not with expert parallelism. "
        "Default 1 (ZeRO over all ``dp·cp`` ranks); ``docs/parallelism.md``.",
        flags=("--dp-replicate",),
        minimum=1,
        short="dp_replicate",
        saved="resolved_if_set",
        planned=True,
        written="set",
        plan_help="only layouts with this HSDP replica count (without it the plan tries 1 and, where dp*cp*tp "
        "spans nodes, the fewest replicas that keep each shard group inside a node)",
    ),
    LayoutField(
        "sequence_parallel",
        Optional[bool],
        None,
        "sp",
        "shard norms and residuals over the sequence inside a tp group (None: on when tp > 1)",
        "shard the norm / residual regions of a tp group over the sequence (Korthikanti et al. 2022, arXiv "
        "2205.05198); ``None`` = on when tp > 1.",
        flags=("--sequence-parallel",),
        short="sp",
        saved="value",
        planned=True,
        plan_type=bool,
        plan_default=False,
        written="tp",
        implied=True,
        cli_help="true or false (default: on when tp > 1)",
    ),
    LayoutField(
        "tensor_parallel_overlap",
        bool,
        False,
        "sp",
        "the tp projections as rings overlapped with their matmuls (needs tp > 1 and sequence parallelism, "
        "not with selective checkpointing; docs/parallelism.md)",
        "under sequence parallelism, run the tp projections as rings of point-to-point steps over the tp group, each "
        "step's send/recv of a sequence shard (or of a partial sum) overlapped with the matmul of the shard at hand, "
        "never gathering the whole sequence (all-gather→matmul for ``wq/wk/wv``, ``w1/w3``, the LM head; "
        "matmul→reduce-scatter for ``wo``, ``w2``; ``lightning_4d/features/tensor_parallel/runtime.py``, "
        "``docs/parallelism.md``). Same bytes on the wire, same results. Needs tp > 1 and sequence parallelism, not "
        "with selective checkpointing; ``lightning_4d`` Llama models only. Default ``False``.",
        flags=("--tensor-parallel-overlap",),
        planned=True,
        written="tp",
        implied=False,
        plan_help="also consider the tp projections as rings overlapped with their matmuls (tp > 1 with sequence "
        "parallelism, checkpointing none or full; off by default, as in FourDStrategy)",
    ),
    LayoutField(
        "activation_checkpointing",
        Literal[ACTIVATION_CHECKPOINTING],
        "none",
        "activation_checkpointing",
        "recompute in backward: none, full (every layer) or selective (its pointwise ops) (default none)",
        '``"none"``, ``"full"`` (keep each transformer layer\'s input, recompute the layer in backward) or '
        '``"selective"`` (keep the outputs of each layer\'s matmuls, attention kernels and tp reductions but '
        "``w2``'s, under tp ``wo``'s reduced shard instead of its partial sum; recompute its pointwise ops in "
        "backward; ``lightning_4d/parallel/activation_checkpoint.py``, ``docs/memory.md``).",
        choices=ACTIVATION_CHECKPOINTING,
        flags=("--activation-checkpointing",),
        planned=True,
    ),
    LayoutField(
        "compile",
        bool,
        False,
        "compile",
        "torch.compile each decoder layer (not with selective checkpointing; docs/parallelism.md)",
        "``torch.compile`` each decoder layer (``lightning_4d/parallel/compile.py``; the step-time model's "
        "``POINTWISE_FACTOR``): dp/ZeRO, tp/sp, pp, cp, ep, full activation checkpointing and offload, float8, our "
        "Llama and the transformers families; not with selective checkpointing (:func:`~lightning_4d.config."
        "check_compile`; ``docs/parallelism.md``).",
        flags=("--compile",),
        planned=True,
        implied=False,
        plan_help="predict every layout with torch.compile'd decoder layers (FourDStrategy(compile=True): "
        "checkpointing none or full; off by default, as in FourDStrategy)",
    ),
    LayoutField(
        "activation_offload_layers",
        int,
        0,
        "offload",
        "decoder layers per pipeline stage whose saved activations go to host memory (default 0; not "
        "with activation checkpointing; docs/offload.md)",
        "the first this many decoder layers of every pipeline stage (all of a shorter stage's) keep their saved "
        "activations in host memory (page-locked) between forward and backward: copied out in forward, back in "
        "backward, on side streams overlapping compute (``lightning_4d/parallel/offload.py``, Megatron-Core's "
        "``cpu_offloading_num_layers``). 0 (default) = none. Not with activation checkpointing; ``docs/offload.md``.",
        flags=("--activation-offload-layers",),
        minimum=0,
    ),
    LayoutField(
        "optimizer_offload",
        bool,
        False,
        "offload",
        "optimizer states on the host: fp32 masters and Adam's m, v in host memory, the step on the CPU (ZeRO 1-3; "
        "docs/offload.md)",
        "keep the optimizer's states in host memory and run its step on the CPU with torch's own AdamW (ZeRO-Offload, "
        "Ren et al. 2021, arXiv 2101.06840): at ZeRO 1 this rank's owned slice of every bucket has a host copy (the "
        "float32 master, or the parameter's float32 copy) and a host gradient, Adam's m and v live beside it, the "
        "averaged gradient slice is copied to the host (non-blocking, into pinned memory on CUDA) and the updated "
        "slice copied back before the all-gather (``lightning_4d/parallel/optimizer_offload.py``); at ZeRO 2/3 "
        "FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters (the masters), their gradients and so the "
        "optimizer states on the host and gathers each unit onto the device for compute. Needs ZeRO 1, 2 or 3. "
        "Default ``False``; ``docs/offload.md``.",
        flags=("--optimizer-offload",),
        planned=True,
        written="set",
        implied=False,
    ),
    LayoutField(
        "pipeline_schedule",
        Literal[PIPELINE_SCHEDULES],
        "1f1b",
        "pp",
        "the pipeline schedule (default 1f1b)",
        '``"1f1b"`` (default; one forward, one backward: at most p micro-batches in flight; Narayanan et al. 2021, '
        'PipeDream-Flush, arXiv 2006.09503), ``"gpipe"`` (all forwards, then all backwards: m in flight), '
        '``"interleaved_1f1b"`` (v non-adjacent model chunks per rank, bubble / v; Narayanan et al. 2021, '
        'Megatron-LM, arXiv 2104.04473), ``"zbv"`` (zero-bubble V schedule, backward split into input and weight '
        'gradients, 2 chunks per rank in a V; Qi et al. 2024, arXiv 2401.10241) or ``"dualpipev"`` (DeepSeek-V3\'s '
        "DualPipe in V shape, arXiv 2412.19437), all from ``torch.distributed.pipelining``.",
        choices=PIPELINE_SCHEDULES,
        flags=("--pipeline-schedule",),
        planned=True,
        plan_type=str,
        pipeline_only=True,
        written="pp",
    ),
    LayoutField(
        "virtual_pipeline_stages",
        Optional[int],
        None,
        "pp",
        "stages per pp rank (default: the schedule's, 1 for gpipe/1f1b, 2 for the others)",
        "v, model chunks (stages) per pp rank; ``None`` = the schedule's default (1 for gpipe/1f1b, 2 for the "
        "others). The model is split into ``pp·v`` stages.",
        flags=("--virtual-pipeline-stages",),
        short="v",
        saved="resolved",
        **_PLANNED_COUNT,
        pipeline_only=True,
        written="pp",
    ),
    LayoutField(
        "num_microbatches",
        Optional[int],
        None,
        "pp",
        "micro-batches per step (pipeline schedules; default pp, 2*pp for dualpipev)",
        "m, micro-batches per optimizer step through the pipeline; ``None`` = derived by the strategy (the "
        "DataModule's ``global_batch_size / (micro_batch_size · dp)``, else pp). The DataLoader batch per dp rank "
        "must be a multiple of m; ``LMDataModule`` delivers ``micro_batch_size · m`` sequences per batch under pp.",
        flags=("--num-microbatches",),
        short="microbatches",
        **_PLANNED_COUNT,
        pipeline_only=True,
        written="pp",
    ),
    LayoutField(
        "pipeline_layer_split",
        Optional[list[int]],
        None,
        "pp",
        "decoder layers per pipeline stage (pp*v counts; default: equal, or the planner's split "
        "when pp*v does not divide the layers)",
        "decoder layers per stage, ``pp·v`` counts in stage order summing to ``num_layers`` (e.g. fewer on the last "
        "stage, which also holds the norm, the LM head and the loss); ``None`` = equal.",
        flags=("--pipeline-layer-split",),
        minimum=1,
        saved="value",
        planned=True,
        plan_type=Optional[tuple[int, ...]],
        pipeline_only=True,
        written="set",
    ),
    LayoutField(
        "context_parallel_method",
        Literal[CONTEXT_PARALLEL_METHODS],
        "ring",
        "cp",
        "context-parallel attention (default ring)",
        '``"ring"`` (default; K/V blocks passed around the cp group point to point, overlapped with compute, '
        'partial results merged by log-sum-exp; Liu et al. 2023, arXiv 2310.01889), ``"allgather"`` (K/V of the '
        "whole sequence all-gathered, Llama 3's method, arXiv 2407.21783 §3.3.2; cheaper for few kv heads) or "
        '``"alltoall"`` (DeepSpeed-Ulysses, arXiv 2309.14509: q, k, v all-to-all\'d from sequence shards to head '
        "shards, attention over the whole sequence with ``a/(tp·cp)`` heads, the output all-to-all'd back; needs "
        "``num_heads/tp`` divisible by cp, :func:`~lightning_4d.features.context_parallel.alltoall_heads`). All "
        "three are exact; ``docs/context_parallel.md``.",
        choices=CONTEXT_PARALLEL_METHODS,
        flags=("--cp-method",),
        planned=True,
        written="cp",
    ),
    LayoutField(
        "gradient_compression",
        Literal[GRADIENT_COMPRESSIONS],
        "none",
        "compression",
        "how dp gradients are reduced: none, bf16 or powersgd (ZeRO 0/1)",
        "how the dp gradients are reduced (``lightning_4d/parallel/compression.py``, ``docs/communication.md``): "
        '``"none"`` (in their dtype, float32 under ``bf16-mixed``), ``"bf16"`` (cast to bfloat16 for the '
        'collective: half the bytes) or ``"powersgd"`` (rank-``powersgd_rank`` approximation of every matrix '
        "gradient with error feedback and warm start, Vogels et al. 2019, arXiv 1905.13727; ZeRO 0 and 1 only).",
        choices=GRADIENT_COMPRESSIONS,
    ),
    LayoutField("powersgd_rank", int, 4, "compression", "r of PowerSGD", "r of PowerSGD (default 4).", saved="value"),
    LayoutField(
        "powersgd_start_step",
        int,
        0,
        "compression",
        "optimizer steps reduced exactly before PowerSGD",
        "the optimizer steps reduced exactly before PowerSGD starts compressing (default 0; PyTorch's "
        "``start_powerSGD_iter``; ``trainer.global_step`` below it: uncompressed).",
    ),
    LayoutField(
        "powersgd_comm_dtype",
        Optional[Literal[POWERSGD_COMM_DTYPES]],
        None,
        "compression",
        "the dtype PowerSGD's factors are all-reduced in (None: float32)",
        '``None`` (PowerSGD\'s factors P and Q all-reduced in float32) or ``"bfloat16"`` (half their bytes).',
        choices=POWERSGD_COMM_DTYPES,
    ),
    LayoutField(
        "pipeline_comm_dtype",
        Optional[Literal[PIPELINE_COMM_DTYPES]],
        None,
        "compression",
        "the dtype of the activations and gradients sent between pipeline stages (None: the model's)",
        '``None`` (send pipeline activations and their gradients in the model\'s dtype), ``"bfloat16"`` (half the '
        'bytes of a float32 model) or ``"float8"`` (e4m3 with a per-tensor scale, a quarter; '
        "``features/pipeline/runtime.py``, ``parallel/compression.py``).",
        choices=PIPELINE_COMM_DTYPES,
    ),
    LayoutField(
        "float8",
        Optional[Literal[FLOAT8_RECIPES]],
        None,
        "float8",
        "float8 matmuls in the decoder layers' dense linears through torchao: tensorwise or rowwise scaling "
        "(default: off; the extra lightning-4d[float8]; docs/parallelism.md)",
        '``None`` (default) or a torchao float8 training recipe, ``"tensorwise"`` or ``"rowwise"`` (the extra '
        "``lightning-4d[float8]``): the linears of every decoder layer of a ``lightning_4d`` Llama (attention "
        "projections, SwiGLU; not the LM head nor the embedding) compute their three matmuls in float8, converted "
        "before compile and FSDP2 (``lightning_4d/parallel/float8.py``; under tp through torchao's float8 "
        'tensor-parallel styles); at ZeRO 2/3 ``"tensorwise"`` all-gathers those weights in float8, and under tp '
        "with sequence parallelism the sequence in float8 too. Not with ``tensor_parallel_overlap``, "
        "Mixture-of-Experts models nor the transformers families yet; ``docs/parallelism.md``.",
        choices=FLOAT8_RECIPES,
        flags=("--float8",),
    ),
    LayoutField(
        "expert_parallel_size",
        int,
        1,
        "ep",
        "expert parallel size of a Mixture-of-Experts model: ranks of dp*cp*tp that split the experts, "
        "folded over tp first (divides dp*cp*tp and num_experts; default 1)",
        "ep, for a Mixture-of-Experts model: the ranks that split the routed experts of every MoE layer "
        "(``num_experts / ep`` each; tokens dispatched and combined by all-to-all, ``features/moe/expert.py``). No "
        "mesh dimension of its own: ep groups are blocks of ep consecutive ranks of the flattened ``dp_cp`` mesh, "
        "under tp of ``dp_cp_tp`` (ep folded over tp first, as in Megatron-Core's MoE parallel folding: the tp ranks "
        "are the innermost ep ranks; under tp an MoE layer is not split, each tp rank runs it whole on its ``s/t`` "
        "tokens), so ep divides dp·cp·tp and ``num_experts``; the expert parameters' gradients are reduced and their "
        "ZeRO 1-3 shards held over the expert data-parallel group (dp·cp·tp/ep ranks), the dense ones over dp·cp "
        "(``docs/moe.md``).",
        flags=("--expert-parallel-size", "--ep"),
        dest="ep",
        minimum=1,
        short="ep",
        saved="resolved_if_set",
        planned=True,
        written="set",
        plan_help="only layouts with this expert parallel size (Mixture-of-Experts models; without it the plan "
        "tries every ep that divides dp*cp*tp and num_experts)",
    ),
    LayoutField(
        "async_checkpoint",
        bool,
        False,
        "checkpoint",
        "write sharded checkpoints in the background: training blocks only while the states are copied to host "
        "memory (docs/checkpoints.md)",
        "write sharded checkpoints (``save_distributed_checkpoint=True``) in the background: ``save_checkpoint`` "
        "blocks only while every rank copies its states to host memory (pinned on CUDA; "
        "``torch.distributed.checkpoint``'s ``DefaultStager``), then ``torch.distributed.checkpoint.async_save`` "
        "writes them into ``<path>.tmp`` on a thread of its own while training goes on, and the folder is renamed "
        "into place only once every rank's write completed: ``last`` never points at a partial write. The next save, "
        "``remove_checkpoint`` of that path and the end of ``fit`` wait for it; a failed write raises there. Costs "
        "one host copy of the rank's states (``lightning_4d/checkpoint.py`` ``AsyncSaves``, ``docs/checkpoints.md``). "
        "Default ``False``.",
        flags=("--async-checkpoint",),
        plan_help="plan's checkpoint interval charges only the blocking part of a save (the states' copy to host "
        "memory; off by default, as in FourDStrategy)",
    ),
)
#: the fields by name
FIELDS: dict[str, LayoutField] = {f.name: f for f in LAYOUT_FIELDS}
#: the fields the planner enumerates, in registry order
PLANNED_FIELDS: tuple[LayoutField, ...] = tuple(f for f in LAYOUT_FIELDS if f.planned)


def args_doc(indent: int = 8, width: int = 120) -> str:
    """The "Args" entries of every field (``name: doc``, wrapped at ``width`` with continuation lines indented 4
    more): the part of ``ParallelConfig``'s and ``FourDStrategy``'s docstrings the registry writes."""
    pad = " " * indent
    return "\n".join(
        textwrap.fill(f"{f.name}: {f.doc}", width, initial_indent=pad, subsequent_indent=pad + "    ")
        for f in LAYOUT_FIELDS
    )


#: the line of a docstring that :func:`layout_dataclass` and :func:`layout_signature` replace by :func:`args_doc`
ARGS_MARKER = "<the layout fields>"


def _with_args(doc: Optional[str]) -> str:
    """``doc`` with the line holding :data:`ARGS_MARKER` replaced by :func:`args_doc` at that line's indent."""
    lines = (doc or "").split("\n")
    out = []
    for line in lines:
        if line.strip() == ARGS_MARKER:
            out.append(args_doc(len(line) - len(line.lstrip())))
        else:
            out.append(line)
    return "\n".join(out)


def layout_dataclass(cls: type) -> type:
    """Make ``cls`` (``ParallelConfig``) a dataclass whose fields are :data:`LAYOUT_FIELDS` (their names, types and
    defaults, in registry order) and whose docstring's :data:`ARGS_MARKER` line is :func:`args_doc`.

    Raises:
        TypeError: ``cls`` declares a field of its own (the registry is the one declaration).
    """
    own = [name for name in cls.__dict__.get("__annotations__", {}) if not name.startswith("_")]
    if own:
        raise TypeError(f"{cls.__name__} declares {own}: declare layout fields in lightning_4d/layout.py")
    cls.__annotations__ = {f.name: f.type for f in LAYOUT_FIELDS}
    for f in LAYOUT_FIELDS:
        setattr(cls, f.name, f.default)  # immutable defaults only (None, ints, strings, bools)
    cls.__doc__ = _with_args(cls.__doc__)
    return dataclass(cls)


def layout_signature(cls: type) -> type:
    """Give ``cls`` (``FourDStrategy``, whose ``__init__`` takes its own arguments as keywords and the layout as
    ``**layout``) the signature it accepts: ``self``, every field as a keyword with its type and default, then its own
    arguments; ``__init__.__signature__`` (what ``inspect.signature``, so LightningCLI's jsonargparse, reads) and
    ``__init__.__annotations__`` (``typing.get_type_hints``) both; and its docstring's :data:`ARGS_MARKER` line
    replaced by :func:`args_doc`."""
    init = cls.__init__
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(init).parameters.values()
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in LAYOUT_FIELDS
    ]
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *fields, *own]
    init.__signature__ = inspect.Signature(params, return_annotation=None)
    init.__annotations__ = {p.name: p.annotation for p in params[1:]} | {"return": None}
    cls.__doc__ = _with_args(cls.__doc__)
    return cls


def layout_of(values: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The layout fields among ``values`` (``FourDStrategy``'s keyword arguments).

    Raises:
        TypeError: a name in ``values`` that is no field (as Python does for an unknown keyword argument).
    """
    unknown = [name for name in values if name not in FIELDS]
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r}; its layout arguments are {list(FIELDS)}"
        )
    return dict(values)


def planned_dataclass(cls: type) -> type:
    """Make ``cls`` (the planner's layout, or a subclass adding fields of its own) a dataclass (slotted: the planner
    builds ~10^5) whose first fields are :data:`PLANNED_FIELDS` by :attr:`LayoutField.plan_name` (types
    ``plan_type``, defaults ``plan_default``), then ``micro_batch_size`` (default 1), then the fields ``cls``
    declares; every field a keyword (no positional layouts)."""
    base = {f.plan_name: f.plan_type or f.type for f in PLANNED_FIELDS} | {"micro_batch_size": int}
    own = {k: v for k, v in cls.__dict__.get("__annotations__", {}).items() if k not in base}
    if not any(dataclasses.is_dataclass(b) for b in cls.__mro__[1:]):
        for f in PLANNED_FIELDS:
            setattr(cls, f.plan_name, f.default if f.plan_default is _UNSET else f.plan_default)
        cls.micro_batch_size = 1
        cls.__annotations__ = base | own
    else:
        cls.__annotations__ = own
    return dataclass(slots=True, kw_only=True)(cls)


def plan_values(config: Any, micro_batch_size: int, num_microbatches: int) -> dict[str, Any]:
    """The planner's layout of a resolved ``ParallelConfig`` with micro-batch size b and m micro-batches: each planned
    field's resolved value by its plan name (fields the layout does not use without pp at their ``plan_default``,
    the layer split as a tuple), and ``micro_batch_size``."""
    out: dict[str, Any] = {}
    for f in PLANNED_FIELDS:
        if f.name == "num_microbatches":  # the batch's, given: with pp = 1 the gradient-accumulation steps
            value = num_microbatches
        elif f.pipeline_only and config.pp == 1 and f.plan_default is not _UNSET:
            value = f.plan_default
        else:
            value = f.resolved(config)
        out[f.plan_name] = tuple(value) if isinstance(value, list) else value
    out["micro_batch_size"] = micro_batch_size
    return out


def config_of_plan(layout: Any) -> dict[str, Any]:
    """The ``ParallelConfig`` keyword arguments of a planner's layout (:func:`plan_values`' inverse): sequence
    parallelism only under tp, the pipeline's fields only with pp > 1 (the schedule ``1f1b`` without)."""
    out: dict[str, Any] = {}
    for f in PLANNED_FIELDS:
        value = getattr(layout, f.plan_name)
        if f.pipeline_only and layout.pp == 1:
            value = f.default
        elif f.name == "sequence_parallel" and layout.tp == 1:
            value = None
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def strategy_arguments(config: Any, concise: bool = False) -> dict[str, Any]:
    """The one writer from a layout to ``FourDStrategy`` arguments: the planned fields of a resolved
    ``ParallelConfig`` (registry order, resolved values) that apply to it (:attr:`LayoutField.written`: sp and the
    overlap under tp, the cp method under cp, the pipeline's fields with pp > 1, the layer split and ep when set),
    as ``plan --emit-config`` writes them; ``concise``: without the values :attr:`LayoutField.implied` (the pasteable
    line of the pre-fit check's refusal and of ``estimate``'s suggestions)."""
    size = {"tp": config.tp, "cp": config.cp, "pp": config.pp}
    out: dict[str, Any] = {}
    for f in PLANNED_FIELDS:
        value = f.resolved(config)
        if f.written in size and size[f.written] == 1:
            continue  # sp and the overlap without tp, the cp method without cp, the pipeline's fields without pp
        if f.written == "set" and (value is None or value == f.default):
            continue
        if concise and value is f.implied:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def config_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ParallelConfig`` keyword arguments among ``values`` (``FourDStrategy.__init__``'s arguments, say)."""
    return {f.name: values[f.name] for f in LAYOUT_FIELDS if f.name in values}


def config_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ParallelConfig`` keyword arguments of the layout options of ``estimate``/``measure`` (``--dp`` left out:
    ``"auto"``)."""
    out = {f.name: getattr(args, f.option_dest) for f in LAYOUT_FIELDS if f.flags}
    out["data_parallel_size"] = out["data_parallel_size"] or "auto"
    return out


def saved_layout(config: Any) -> dict[str, Any]:
    """What a sharded checkpoint saves of a resolved ``ParallelConfig``: the sizes that decide which parameter slices
    and which PowerSGD state a rank holds (``checkpoint.LAYOUT_KEY``; a load compares it with its own)."""
    out: dict[str, Any] = {}
    for f in LAYOUT_FIELDS:
        if f.saved == "no":
            continue
        key, value = (f.name, getattr(config, f.name)) if f.saved == "value" else (f.short, f.resolved(config))
        if f.saved == "resolved_if_set" and value == f.default:
            continue
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def reported_layout(config: Any) -> dict[str, Any]:
    """Every field of a resolved ``ParallelConfig`` with its resolved value, the mesh sizes under their mesh names
    (``tp``, ``pp``, ``cp``, ``dp``), the rest under their own (``estimate --json``'s ``layout`` and its
    suggestions')."""
    out: dict[str, Any] = {}
    for f in LAYOUT_FIELDS:
        value = f.resolved(config)
        out[f.short if f.short in MESH_DIM_NAMES else f.name] = list(value) if isinstance(value, tuple) else value
    return out


#: the fields on the CLI by their argparse destination (``tp``, ``cp_method``, ``ep``, ...)
BY_OPTION: dict[str, LayoutField] = {f.option_dest: f for f in LAYOUT_FIELDS if f.flags}


def measure_flags(options: Mapping[str, Any]) -> list[str]:
    """``lightning-4d measure`` flags for ``options`` (argparse destinations, e.g. a support row's layout): a layout
    field by the flag its destination spells (``ep`` -> ``--ep``, ``cp_method`` -> ``--cp-method``), a switch (a
    bool field) as the bare flag when true; other options (``precision``, ``micro_batch_size``, ...) as
    ``--<name-with-dashes>``; a list as its items."""
    out: list[str] = []
    for key, value in options.items():
        field, flag = BY_OPTION.get(key), "--" + key.replace("_", "-")
        if field is not None and flag not in field.flags:
            flag = field.flags[0]
        if field is not None and field.type is bool:
            out += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out
