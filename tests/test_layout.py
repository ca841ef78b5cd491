"""The layout registry: ``ParallelConfig``, ``FourDStrategy``'s signature and docstring, the planner's layout, the CLI
options and the one writer of strategy arguments are derived from ``lightning_4d.layout.LAYOUT_FIELDS``; these tests
check what each derivation gives (and that LightningCLI's jsonargparse reads the derived signature)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from lightning_4d.config import ParallelConfig
from lightning_4d.layout import (
    FIELDS,
    LAYOUT_FIELDS,
    config_kwargs_from_args,
    reported_layout,
    saved_layout,
)
from lightning_4d.models import LlamaConfig
from lightning_4d.planning.commands import command_parser, layout_from_args
from lightning_4d.planning.planner import Candidate
from lightning_4d.planning.step_time import Layout

#: a value of every field, valid together (pp=2, tp=2, cp=2, dp=2 on 16 ranks): not the default but for ep
#: (refused with PowerSGD), activation offload (refused with checkpointing), float8 (refused with
#: tensor_parallel_overlap), HSDP (refused with ZeRO 0 and PowerSGD) and optimizer offload (refused with ZeRO 0)
EXAMPLE = dict(
    data_parallel_size=2,
    tensor_parallel_size=2,
    pipeline_parallel_size=2,
    context_parallel_size=2,
    zero_stage=0,
    data_parallel_replicate_size=1,
    sequence_parallel=True,
    tensor_parallel_overlap=True,
    activation_checkpointing="full",
    compile=True,
    activation_offload_layers=0,
    optimizer_offload=False,
    pipeline_schedule="interleaved_1f1b",
    virtual_pipeline_stages=2,
    num_microbatches=4,
    pipeline_layer_split=[1, 1, 1, 1],
    context_parallel_method="allgather",
    gradient_compression="powersgd",
    powersgd_rank=2,
    powersgd_start_step=3,
    powersgd_comm_dtype="bfloat16",
    pipeline_comm_dtype="bfloat16",
    expert_parallel_size=1,
    float8=None,
    async_checkpoint=True,
)


_AT_DEFAULT = (
    "expert_parallel_size",
    "activation_offload_layers",
    "float8",
    "data_parallel_replicate_size",
    "optimizer_offload",
)


def test_example_names_every_field():
    assert set(EXAMPLE) == set(FIELDS)
    assert all(EXAMPLE[f.name] != f.default for f in LAYOUT_FIELDS if f.name not in _AT_DEFAULT)


def test_parallel_config_fields_and_defaults_are_the_registry():
    fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    assert set(fields) == set(FIELDS), "ParallelConfig and lightning_4d/layout.py name different fields"
    for name, field in FIELDS.items():
        assert fields[name].default == field.default, name
    doc = inspect.getdoc(ParallelConfig)
    assert [name for name in FIELDS if f"{name}:" not in doc] == [], "ParallelConfig's docstring misses these"


def test_strategy_signature_is_the_registry():
    """FourDStrategy keeps an explicit typed signature (LightningCLI reads it): same names, defaults and types as the
    registry, and its docstring describes each."""
    from lightning_4d import FourDStrategy

    params = inspect.signature(FourDStrategy.__init__).parameters
    hints = typing.get_type_hints(FourDStrategy.__init__)
    missing = [name for name in FIELDS if name not in params]
    assert missing == [], f"FourDStrategy.__init__ lacks the layout arguments {missing}"
    for name, field in FIELDS.items():
        assert params[name].default == field.default, name
        assert hints[name] == field.type, f"{name}: {hints[name]} in FourDStrategy, {field.type} in the registry"
    doc = inspect.getdoc(FourDStrategy)
    assert [name for name in FIELDS if f"{name}:" not in doc] == [], "FourDStrategy's docstring misses these"


def test_strategy_refuses_an_unknown_layout_argument():
    from lightning_4d import FourDStrategy

    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_paralel_size'"):
        FourDStrategy(tensor_paralel_size=2)
    with pytest.raises(TypeError):
        FourDStrategy(2)  # every argument a keyword, as the signature says


def test_lightning_cli_reads_every_argument_with_its_type_and_doc():
    """jsonargparse (LightningCLI's parser) honours the derived ``__signature__``: every field and the strategy's own
    arguments are options, each with the registry's doc as help, and a bad choice is refused by the field's type."""
    from jsonargparse import ArgumentParser

    from lightning_4d import FourDStrategy

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(FourDStrategy, "strategy")
    actions = {a.dest: a for a in parser._actions}
    for name in inspect.signature(FourDStrategy.__init__).parameters:
        if name != "self":
            assert f"strategy.{name}" in actions, name
    for f in LAYOUT_FIELDS:
        assert actions[f"strategy.{f.name}"].help.startswith(f.doc[:30]), f.name
    args = parser.parse_args(["--strategy.zero_stage=3", "--strategy.context_parallel_method=alltoall"])
    assert args.strategy.zero_stage == 3 and args.strategy.context_parallel_method == "alltoall"
    with pytest.raises(Exception, match="context_parallel_method"):
        parser.parse_args(["--strategy.context_parallel_method=rings"])


def test_strategy_arguments_is_the_one_writer():
    """Every planned field that applies to the layout, resolved; ``concise`` leaves out what the defaults give."""
    from lightning_4d.layout import strategy_arguments

    pc = ParallelConfig(**EXAMPLE)
    full = strategy_arguments(pc)
    assert full == {
        "data_parallel_size": 2,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "context_parallel_size": 2,
        "zero_stage": 0,
        "sequence_parallel": True,
        "tensor_parallel_overlap": True,
        "activation_checkpointing": "full",
        "compile": True,
        "pipeline_schedule": "interleaved_1f1b",
        "virtual_pipeline_stages": 2,
        "num_microbatches": 4,
        "pipeline_layer_split": [1, 1, 1, 1],
        "context_parallel_method": "allgather",
    }
    assert strategy_arguments(pc, concise=True) == {k: v for k, v in full.items() if k != "sequence_parallel"}
    flat = ParallelConfig(data_parallel_size=8, expert_parallel_size=2).resolve(8)
    assert strategy_arguments(flat) == {
        "data_parallel_size": 8,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "context_parallel_size": 1,
        "zero_stage": 1,
        "activation_checkpointing": "none",
        "compile": False,
        "expert_parallel_size": 2,
    }
    assert "compile" not in strategy_arguments(flat, concise=True)


def test_strategy_passes_every_field_to_its_config():
    from lightning_4d import FourDStrategy

    config = FourDStrategy(**EXAMPLE).parallel_config
    assert config == ParallelConfig(**EXAMPLE)
    assert {name: getattr(config, name) for name in FIELDS} == EXAMPLE


def test_cli_options_are_generated_from_the_registry():
    """estimate and measure take every field with flags, under its flags (the spellings users and docs know), with
    the registry's default and choices; plan takes those with ``plan_help``, default unset."""
    for command in ("estimate", "measure", "plan"):
        actions = {a.dest: a for a in command_parser(command)._actions}
        for f in LAYOUT_FIELDS:
            wanted = f.plan_help if command == "plan" else f.flags
            if not wanted:
                continue
            action = actions[f.option_dest]
            alias = ("--accumulate-grad-batches",) if (command, f.name) == ("estimate", "num_microbatches") else ()
            assert tuple(action.option_strings) == f.flags + alias, (command, f.name)
            if f.choices is not None:
                assert list(action.choices) == [c for c in f.choices if c is not None], (command, f.name)
            if command != "plan" and f.default != "auto":
                assert action.default == f.default, (command, f.name)
    assert "--cp-method" in command_parser("estimate")._option_string_actions  # spellings kept
    assert "--ep" in command_parser("measure")._option_string_actions


def test_cli_layout_round_trips_every_flagged_field():
    argv = ["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "1"]
    for f in LAYOUT_FIELDS:
        if not f.flags:
            continue
        value = EXAMPLE[f.name]
        if value is None:  # the option left out (float8: refused with the example's tensor_parallel_overlap)
            continue
        if f.type is bool:
            argv += [f.flags[0]] if value else []  # a switch: given when True
        elif isinstance(value, list):
            argv += [f.flags[0], *map(str, value)]
        else:
            argv += [f.flags[0], str(value).lower()]
    args = command_parser("estimate").parse_args(argv)
    kwargs = config_kwargs_from_args(args)
    assert kwargs == {f.name: EXAMPLE[f.name] for f in LAYOUT_FIELDS if f.flags}
    cfg = LlamaConfig(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=128)
    pc, proposed = layout_from_args(args, cfg)
    assert proposed is None and pc.world_size == 16


def test_saved_layout_keys_are_those_of_older_checkpoints():
    """A sharded checkpoint's saved layout is compared with the loading run's (PowerSGD's state is restored only on
    the same layout): its keys and values stay those saved before the registry; ep only when > 1."""
    pc = ParallelConfig(**EXAMPLE)
    assert saved_layout(pc) == {
        "pp": 2,
        "dp": 2,
        "cp": 2,
        "tp": 2,
        "zero_stage": 0,
        "v": 2,
        "pipeline_layer_split": [1, 1, 1, 1],
        "sequence_parallel": True,
        "powersgd_rank": 2,
    }
    assert saved_layout(ParallelConfig(data_parallel_size=4, expert_parallel_size=2))["ep"] == 2
    assert saved_layout(ParallelConfig(data_parallel_size=4))["sequence_parallel"] is None


def test_reported_layout_names_every_field():
    pc = ParallelConfig(**EXAMPLE)
    out = reported_layout(pc)
    assert len(out) == len(FIELDS)
    assert out["tp"] == 2 and out["dp"] == 2 and out["virtual_pipeline_stages"] == 2
    assert out["num_microbatches"] == 4 and out["expert_parallel_size"] == 1 and out["sequence_parallel"] is True


@pytest.mark.parametrize("cls", [Layout, Candidate])
def test_planner_layout_has_every_planned_field(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in LAYOUT_FIELDS if f.planned and f.name not in names and f.short not in names]
    assert missing == [], f"{cls.__name__} lacks the planned layout fields {missing}"


def test_planner_layout_round_trips_every_planned_field():
    example = dict(EXAMPLE, gradient_compression="none", powersgd_comm_dtype=None, powersgd_rank=4)
    example.update(powersgd_start_step=0, pipeline_comm_dtype=None)
    pc = ParallelConfig(**example)
    back = Layout.of(pc, micro_batch_size=1, num_microbatches=pc.microbatches).parallel_config()
    for f in LAYOUT_FIELDS:
        if f.planned:
            assert f.resolved(back) == f.resolved(pc), f.name
        else:
            assert getattr(back, f.name) == f.default, f"{f.name} is not planned: the planner keeps its default"


def test_every_field_has_a_feature_and_help():
    features = {
        "dp",
        "tp",
        "sp",
        "pp",
        "cp",
        "ep",
        "zero",
        "activation_checkpointing",
        "offload",
        "compression",
        "float8",
        "compile",
        "checkpoint",
    }
    for f in LAYOUT_FIELDS:
        assert f.feature in features and f.help and f.doc.endswith("."), f.name
        assert f.choices is None or f.default in f.choices, f.name


def test_layout_module_is_the_bottom_layer():
    """lightning_4d.layout imports nothing of the package and no torch: config, planning/ and the CLI read it."""
    from tests.test_imports import PACKAGE, imports_of

    bad = [i for i in imports_of(f"{PACKAGE}.layout") if i.startswith((PACKAGE, "torch", "lightning"))]
    assert bad == []


def _planned_layouts() -> list[ParallelConfig]:
    """Layouts whose planned fields together leave no default unvisited (pp, cp, ep, sp off, ...)."""
    pipelined = {name: value for name, value in EXAMPLE.items() if FIELDS[name].planned}
    return [
        ParallelConfig(**pipelined),
        ParallelConfig(
            data_parallel_size=4,
            tensor_parallel_size=2,
            sequence_parallel=False,
            expert_parallel_size=2,
            zero_stage=3,
            activation_checkpointing="selective",
        ),
        ParallelConfig(data_parallel_size=2, compile=True),
    ]


def test_suggestions_and_emitted_configs_name_every_planned_field():
    """The two places that write a planned layout back as FourDStrategy arguments (the refusal's pasteable
    ``FourDStrategy(...)`` line and ``plan --emit-config``'s ``init_args``) give back the same layout."""
    import ast

    from lightning_4d.planning.emit import plan_config
    from lightning_4d.planning.planner import suggestion_line

    for pc in _planned_layouts():
        call = ast.parse(suggestion_line(pc, 1).split("  #")[0]).body[0].value
        from_line = ParallelConfig(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords})
        layout = Layout.of(pc, 1, pc.microbatches)
        row = Candidate(
            **dataclasses.asdict(layout), memory=0, fraction=0.0, fits=True, step_time=1.0, tokens_per_sec=1.0, mfu=0.0
        ).to_dict()
        out = {"layouts": [row], "num_gpus": pc.world_size, "gpus_per_node": 8, "precision": "bf16-mixed"}
        init_args = plan_config(dict(out, model="tiny", seq_length=64))["trainer"]["strategy"]["init_args"]
        from_config = ParallelConfig(**init_args)
        for f in LAYOUT_FIELDS:
            if f.planned:
                assert f.resolved(from_line) == f.resolved(pc), ("suggestion_line", f.name)
                assert f.resolved(from_config) == f.resolved(pc), ("plan_config", f.name)
