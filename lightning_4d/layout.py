"""The layout registry: every field of a training layout declared once (issue 33, "one layout registry").

A :class:`LayoutField` names a field of :class:`~lightning_4d.config.ParallelConfig` and says everything the rest of
the package needs to know about it: its type, default and choices, a one-line help, the ``estimate``/``measure``
(and ``plan``) option that sets it, which parallel feature owns it, whether a sharded checkpoint saves it, and
whether the planner enumerates it. From :data:`LAYOUT_FIELDS`:

- generated: the layout options of ``lightning-4d estimate|plan|measure`` (``memory/cli.py``), the
  ``ParallelConfig`` those commands, ``measure``'s strategy and :class:`~lightning_4d.FourDStrategy` build
  (:func:`config_kwargs`, :func:`config_kwargs_from_args`), the layout a sharded checkpoint saves
  (:func:`saved_layout`) and the layout ``estimate`` reports (:func:`reported_layout`);
- checked by ``tests/test_layout.py``: ``ParallelConfig``'s fields and defaults, ``FourDStrategy``'s explicit typed
  signature and its docstring (LightningCLI reads the signature, so it stays written out), and the planner's
  ``step_time.Layout`` / ``planner.Candidate``.

A new layout option: one :class:`LayoutField` here, its field and check in ``config.py``, its argument in
``strategy.py`` and a value in ``tests/test_layout.py``'s ``EXAMPLE`` (the test names whichever is missing), then the
feature's own file, memory terms and tests: 7 files (``docs/architecture.md``, "The layout registry").

Pure Python: no torch import (the memory estimator and the CLI read it on a laptop).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

ZERO_STAGES = (0, 1, 2, 3)
#: activation checkpointing modes (see lightning_4d/parallel/activation_checkpoint.py)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
#: context-parallel attention methods (see lightning_4d/parallel/context.py)
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


@dataclass(frozen=True)
class LayoutField:
    """One field of the layout.

    Attributes:
        name: the ``ParallelConfig`` field and the ``FourDStrategy`` argument.
        type: its annotation (the strategy's, which LightningCLI reads; ``Literal`` of the choices).
        default: its default (the same in ``ParallelConfig``, ``FourDStrategy`` and the CLI).
        feature: the parallel feature that owns it (``dp``, ``tp``, ``sp``, ``pp``, ``cp``, ``ep``, ``zero``,
            ``activation_checkpointing``, ``offload``, ``compression``, ``compile``, ``float8``).
        help: one line, the CLI's help (docstrings say more).
        choices: the valid values when they are a closed set.
        flags: the option strings of ``estimate`` and ``measure`` (the first is the main spelling; users and the
            docs use them as they are); ``()``: not on the CLI.
        dest: the argparse destination; ``None``: the main flag's (``--cp-method`` -> ``cp_method``).
        minimum: for an integer (or a list of them on the CLI), the least value the CLI takes (1: a size).
        short: the ``ParallelConfig`` property of the resolved value (``tp``, ``dp``, ``v``, ``sp``, ...).
        saved: what a sharded checkpoint saves of it (:data:`Saved`).
        planned: a dimension the planner enumerates (``memory/step_time.Layout``, ``memory/planner.Candidate``).
        plan_help: the help of ``plan``'s option that keeps the field fixed (same flags); ``None``: no such option.
        cli_help: the CLI's help where it says more than ``help`` (the CLI's own default, say).
    """

    name: str
    type: Any
    default: Any
    feature: str
    help: str
    choices: Optional[tuple] = None
    flags: tuple[str, ...] = ()
    dest: Optional[str] = None
    minimum: Optional[int] = None
    short: Optional[str] = None
    saved: Saved = "no"
    planned: bool = False
    plan_help: Optional[str] = None
    cli_help: Optional[str] = None

    @property
    def option_dest(self) -> str:
        """The argparse destination of :attr:`flags`."""
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")

    def resolved(self, config: Any) -> Any:
        """The field's resolved value in ``config`` (``config.<short>``, else the value as given)."""
        return getattr(config, self.short or self.name)


def _size(name: str, short: str, feature: str, help: str, plan: bool = True) -> LayoutField:
    """A mesh size: a positive integer, default 1, option ``--<short>``, saved resolved, enumerated by the planner."""
    return LayoutField(
        name,
        int,
        1,
        feature,
        help,
        flags=(f"--{short}",),
        minimum=1,
        short=short,
        saved="resolved",
        planned=True,
        plan_help=f"only layouts with this {short} size" if plan else None,
    )


LAYOUT_FIELDS: tuple[LayoutField, ...] = (
    LayoutField(
        "data_parallel_size",
        Union[Literal["auto"], int],
        "auto",
        "dp",
        "dp, the model replicas that see different data ('auto': world size / (pp*cp*tp))",
        flags=("--dp",),
        minimum=1,
        short="dp",
        saved="resolved",
        planned=True,
        plan_help="only layouts with this dp size",
        cli_help="data parallel size",
    ),
    _size("tensor_parallel_size", "tp", "tp", "tp, the ranks that split every matrix of a layer (default 1)"),
    _size("pipeline_parallel_size", "pp", "pp", "pp, the ranks of the pipeline's stages (default 1)"),
    _size("context_parallel_size", "cp", "cp", "cp, the ranks that split every sequence (default 1)"),
    LayoutField(
        "zero_stage",
        int,
        1,
        "zero",
        "ZeRO stage over dp*cp: 0 replicated, 1 optimizer states, 2 + gradients, 3 + parameters sharded (default 1)",
        choices=ZERO_STAGES,
        flags=("--zero-stage",),
        saved="value",
        planned=True,
        plan_help="only layouts with this ZeRO stage",
    ),
    LayoutField(
        "sequence_parallel",
        Optional[bool],
        None,
        "sp",
        "shard norms and residuals over the sequence inside a tp group (None: on when tp > 1)",
        flags=("--sequence-parallel",),
        short="sp",
        saved="value",
        planned=True,
        cli_help="true or false (default: on when tp > 1)",
    ),
    LayoutField(
        "tensor_parallel_overlap",
        bool,
        False,
        "sp",
        "the tp projections as rings overlapped with their matmuls (needs tp > 1 and sequence parallelism, "
        "not with selective checkpointing; docs/parallelism.md)",
        flags=("--tensor-parallel-overlap",),
        planned=True,
        plan_help="also consider the tp projections as rings overlapped with their matmuls (tp > 1 with sequence "
        "parallelism, checkpointing none or full; off by default, as in FourDStrategy)",
    ),
    LayoutField(
        "activation_checkpointing",
        Literal[ACTIVATION_CHECKPOINTING],
        "none",
        "activation_checkpointing",
        "recompute in backward: none, full (every layer) or selective (its pointwise ops) (default none)",
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
        flags=("--compile",),
        planned=True,
        plan_help="predict every layout with torch.compile'd decoder layers (FourDStrategy(compile=True): "
        "checkpointing none or full; off by default, as in FourDStrategy)",
    ),
    LayoutField(
        "activation_offload_layers",
        int,
        0,
        "offload",
        "decoder layers per pipeline stage whose saved activations go to host memory (default 0; not "
        "with activation checkpointing; docs/memory.md)",
        flags=("--activation-offload-layers",),
        minimum=0,
    ),
    LayoutField(
        "pipeline_schedule",
        Literal[PIPELINE_SCHEDULES],
        "1f1b",
        "pp",
        "the pipeline schedule (default 1f1b)",
        choices=PIPELINE_SCHEDULES,
        flags=("--pipeline-schedule",),
        planned=True,
    ),
    LayoutField(
        "virtual_pipeline_stages",
        Optional[int],
        None,
        "pp",
        "stages per pp rank (default: the schedule's, 1 for gpipe/1f1b, 2 for the others)",
        flags=("--virtual-pipeline-stages",),
        minimum=1,
        short="v",
        saved="resolved",
        planned=True,
    ),
    LayoutField(
        "num_microbatches",
        Optional[int],
        None,
        "pp",
        "micro-batches per step (pipeline schedules; default pp, 2*pp for dualpipev)",
        flags=("--num-microbatches",),
        minimum=1,
        short="microbatches",
        planned=True,
    ),
    LayoutField(
        "pipeline_layer_split",
        Optional[list[int]],
        None,
        "pp",
        "decoder layers per pipeline stage (pp*v counts; default: equal, or the planner's split "
        "when pp*v does not divide the layers)",
        flags=("--pipeline-layer-split",),
        minimum=1,
        saved="value",
        planned=True,
    ),
    LayoutField(
        "context_parallel_method",
        Literal[CONTEXT_PARALLEL_METHODS],
        "ring",
        "cp",
        "context-parallel attention (default ring)",
        choices=CONTEXT_PARALLEL_METHODS,
        flags=("--cp-method",),
        planned=True,
    ),
    LayoutField(
        "gradient_compression",
        Literal[GRADIENT_COMPRESSIONS],
        "none",
        "compression",
        "how dp gradients are reduced: none, bf16 or powersgd (ZeRO 0/1)",
        choices=GRADIENT_COMPRESSIONS,
    ),
    LayoutField("powersgd_rank", int, 4, "compression", "r of PowerSGD", saved="value"),
    LayoutField("powersgd_start_step", int, 0, "compression", "optimizer steps reduced exactly before PowerSGD"),
    LayoutField(
        "powersgd_comm_dtype",
        Optional[Literal[POWERSGD_COMM_DTYPES]],
        None,
        "compression",
        "the dtype PowerSGD's factors are all-reduced in (None: float32)",
        choices=POWERSGD_COMM_DTYPES,
    ),
    LayoutField(
        "pipeline_comm_dtype",
        Optional[Literal[PIPELINE_COMM_DTYPES]],
        None,
        "compression",
        "the dtype of the activations and gradients sent between pipeline stages (None: the model's)",
        choices=PIPELINE_COMM_DTYPES,
    ),
    LayoutField(
        "float8",
        Optional[Literal[FLOAT8_RECIPES]],
        None,
        "float8",
        "float8 matmuls in the decoder layers' dense linears through torchao: tensorwise or rowwise scaling "
        "(default: off; the extra lightning-4d[float8]; docs/parallelism.md)",
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
        flags=("--expert-parallel-size", "--ep"),
        dest="ep",
        minimum=1,
        short="ep",
        saved="resolved_if_set",
        planned=True,
        plan_help="only layouts with this expert parallel size (Mixture-of-Experts models; without it the plan "
        "tries every ep that divides dp*cp*tp and num_experts)",
    ),
)
#: the fields by name
FIELDS: dict[str, LayoutField] = {f.name: f for f in LAYOUT_FIELDS}


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
