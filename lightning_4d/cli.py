"""The ``lightning-4d`` program (also ``python -m lightning_4d``).

Subcommands (``lightning-4d --help`` lists them, :data:`COMMANDS`):

- ``fit``, ``validate``, ``test``, ``predict``: a ``LightningCLI`` over :class:`~lightning_4d.tasks.CausalLMModule`
  and :class:`~lightning_4d.data.LMDataModule` (``lightning-4d fit --config configs/tiny.yaml``; any argument can be
  overridden on the command line, e.g. ``--trainer.strategy.tensor_parallel_size=1 --trainer.devices=2``);
- ``prepare-data``: tokenize a corpus (JSON Lines, parquet, a saved ``datasets`` folder, text files) into a Megatron
  indexed dataset (``lightning-4d prepare-data --help``);
- ``estimate``: the memory of one layout per GPU (``lightning-4d estimate --help``; no torch import);
- ``plan``: the layouts of a job that fit, ranked by predicted step time (``lightning-4d plan --help``);
- ``measure``: one rank of any layout built and run in this process on a fake process group, its measured memory
  beside the estimate (``lightning-4d measure --help``; :mod:`lightning_4d.measure`);
- ``export-hf``: a checkpoint of any layout as a Hugging Face Llama directory (``lightning-4d export-hf --help``);
- ``support``: the support matrix, which feature combinations are refused, tested on CPU, run on CUDA
  (``lightning-4d support --help``; :mod:`lightning_4d.support`; ``--smoke`` runs the smoke matrix).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

#: every subcommand with its one-line description, in the order ``lightning-4d --help`` lists them (the first four
#: are LightningCLI's; the others are ours, dispatched before LightningCLI is imported)
COMMANDS = {
    "fit": "train (LightningCLI over CausalLMModule and LMDataModule: --config configs/tiny.yaml, any "
    "--trainer./--model./--data. override)",
    "validate": "one evaluation pass over the validation set (--ckpt_path to evaluate a checkpoint)",
    "test": "one evaluation pass over the test set",
    "predict": "inference over the predict set",
    "prepare-data": "tokenize a corpus (jsonl, parquet, datasets, text) into a Megatron .bin/.idx",
    "estimate": "the memory of one layout per GPU, before anything is allocated (no torch import)",
    "plan": "the layouts of a job that fit, fastest predicted first (no torch import)",
    "measure": "run one rank of any layout in this process (fake process group) and measure its memory beside "
    "the estimate",
    "export-hf": "write a checkpoint (any layout) as a Hugging Face Llama directory (safetensors + config.json)",
    "support": "the support matrix: feature combinations refused, tested on CPU, run on CUDA (--smoke runs them)",
}

#: third-party warnings a training run would print once per process and step, none about the user's code: filtered
#: once, where the program starts (``main``), by exact category and message
KNOWN_WARNINGS = (
    # Lightning 2.6's own pytree copy (lightning/pytorch/utilities/_pytree.py) builds torch's LeafSpec, deprecated in
    # torch 2.10+; harmless (Lightning's code, not ours) and printed on every rank
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


def filter_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` in this process (``main`` calls it; launched ranks run ``main`` too)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


#: set (to anything) to see the traceback of a bad input of ``fit``/``validate``/``test``/``predict`` instead of its one
#: line
TRACEBACK_ENV = "LIGHTNING_4D_TRACEBACK"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _raising_file(err: BaseException) -> str:
    """The absolute path of the file whose frame raised ``err`` (its traceback's last frame; ``""`` without one)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""


def _raised_in(err: BaseException, package: str) -> bool:
    """Whether ``err`` was raised by a frame of the installed ``package``."""
    return f"{os.sep}{package}{os.sep}" in _raising_file(err)


def _raised_here(err: BaseException) -> bool:
    """Whether ``err`` was raised by a frame of this package (``lightning_4d/``)."""
    return _raising_file(err).startswith(_PACKAGE + os.sep)


def _parser_line(message: str) -> str:
    """One line of a jsonargparse refusal (its message lists the key, the union's subtypes, each subtype's error and
    the value given): the key, the errors that name a value (not "Expected a <class 'str'>"), the value when short;
    a layout field refused by its choices in the layout's own words
    (:func:`lightning_4d.config.check_values`' message)."""
    import re

    from lightning_4d.layout import FIELDS

    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    nested = re.search(r"NestedArg\(key='(\w+)', val='([^']*)'\)", message)
    if nested and nested[1] in FIELDS and FIELDS[nested[1]].choices is not None:
        field = FIELDS[nested[1]]
        return f"{field.name}={nested[2]!r} is not valid: expected one of {list(field.choices)}."
    if nested:  # a key the class does not take, or a value its type refuses
        return f"{lines[0].rstrip(':')} does not take {nested[1]}={nested[2]!r} (see --help for its keys and types)"
    errors = [line[2:] for line in lines if line.startswith("- ") and not line.startswith("- Expected a <class")]
    if errors:
        return errors[-1]
    given = [line for line in lines if line.startswith("Given value:") and len(line) < 200]
    return " ".join(lines[:2] + given)[:300]


def input_error(err: BaseException) -> Optional[str]:
    """The one line of a LightningCLI run's bad input, or ``None`` for an error that is not one (a bug: its
    traceback is shown). Bad input: a ``ValueError`` or ``TypeError`` this package raised for a value it was given
    (anywhere in ``err``'s chain of causes), or a value jsonargparse refused while parsing or building the classes
    (``ArgumentError``, or its ``ValueError`` listing each union subtype's error: an unknown key, a value a type,
    choice or one of our classes refuses), shortened to one line (:func:`_parser_line`)."""
    from jsonargparse import ArgumentError

    seen: list[BaseException] = []
    cause: Optional[BaseException] = err
    while cause is not None and cause not in seen:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    for e in seen:
        if isinstance(e, (ValueError, TypeError)) and _raised_here(e):
            return str(e).strip().splitlines()[0]
    if isinstance(err, ArgumentError) or (isinstance(err, ValueError) and _raised_in(err, "jsonargparse")):
        return _parser_line(str(err))
    return None


def usage() -> str:
    """The text of ``lightning-4d --help``: every subcommand with one line."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: lightning-4d <command> [options]   (lightning-4d <command> --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


#: the ``--ckpt_path`` values Lightning resolves itself (``CheckedCLI`` resolves and checks them first)
_SPECIAL_CKPT_PATHS = ("last", "hpc", "best", "registry")

#: model arguments a checkpoint's ``hyper_parameters`` never set: a path the file would make the run read
_FILE_HPARAMS_NEVER_MERGED = ("init_from",)


def _check_local_checkpoint(path: Any) -> None:
    """Refuse a checkpoint given as a URL (Lightning would download and unpickle it), a missing one, and one holding
    more than plain data (:func:`lightning_4d.safe_load.check_checkpoint`); ``None`` and the special names pass
    (resolved and checked later).

    Raises:
        ValueError: a URL, a missing path, or an ``UnsafeFileError`` naming the file.
    """
    from lightning_4d.safe_load import check_checkpoint

    if not isinstance(path, (str, os.PathLike)) or str(path) in _SPECIAL_CKPT_PATHS:
        return
    if "://" in str(path):
        raise ValueError(
            f"checkpoint {str(path)!r} is a URL: checkpoints are read from local files only (Lightning would "
            "download and unpickle it); download it and pass the file"
        )
    if not Path(path).exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")
    check_checkpoint(path)


def _merge_checkpoint_hyper_parameters(cli: Any, merge: Callable[[], None]) -> None:
    """Lightning's merge (``merge``: ``LightningCLI._parse_ckpt_path``) of a full checkpoint file's
    ``hyper_parameters`` over the model's arguments in ``cli.config``, but never of
    :data:`_FILE_HPARAMS_NEVER_MERGED` (a resume restores the weights from the checkpoint itself; a file must not make
    the run read another), and each argument the file changes named in one line on stderr, not applied silently."""
    from jsonargparse import Namespace

    command = cli.config.get("subcommand")
    model = cli.config[command].get("model") if command else None
    if not isinstance(model, Namespace):
        merge()
        return
    before = model.clone()
    merge()
    merged = cli.config[command].get("model")
    if not isinstance(merged, (Namespace, dict)):
        return
    for key in _FILE_HPARAMS_NEVER_MERGED:
        merged[key] = before.get(key)
    changed = [
        f"{key}={merged.get(key)!r} (was {before.get(key)!r})"
        for key in sorted(k for k in dict(merged.items()) if merged.get(k) != before.get(k))
    ]
    if changed:
        line = f"lightning-4d {command}: the checkpoint's hyper_parameters set --model." + ", ".join(changed)
        print(line, file=sys.stderr)


def _refuse_unsafe_arguments(command: Optional[str], config: Any) -> None:
    """Exit with status 2 and one line on stderr when the parsed arguments of ``command`` (``config``: its
    jsonargparse ``Namespace``, or the whole config without a subcommand) ask for a ``--ckpt_path`` or
    ``--model.init_from`` checkpoint that is a URL or holds more than plain data (:func:`_check_local_checkpoint`),
    ``--weights_only=false``, or, with ``FourDStrategy``, a precision it cannot train with
    (:func:`lightning_4d.config.check_training_precision`)."""
    from jsonargparse import Namespace

    from lightning_4d.config import check_training_precision

    model = config.get("model") if config is not None else None
    paths = [
        config.get("ckpt_path") if config is not None else None,
        model.get("init_from") if isinstance(model, (Namespace, dict)) else None,
    ]
    trainer = (config.get("trainer") if config is not None else None) or {}
    strategy = trainer.get("strategy")
    class_path = strategy.get("class_path", "") if isinstance(strategy, (Namespace, dict)) else str(strategy)
    try:
        if class_path.rsplit(".", 1)[-1] == "FourDStrategy":  # its refusal of the Trainer's precision, in
            check_training_precision(trainer.get("precision"))  # our words (Lightning's names no reason)
        if config is not None and config.get("weights_only") is False:
            raise ValueError(
                "--weights_only=false is not honoured: checkpoints are loaded weights only (plain data and "
                "tensors, lightning_4d.safe_load), so a file's code never runs; leave the flag out"
            )
        for path in paths:
            _check_local_checkpoint(path)
    except ValueError as e:
        print(f"lightning-4d {command}: error: {e}", file=sys.stderr)
        sys.exit(2)


def _checked_special_ckpt_path(trainer: Any, subcommand: str, given: Any) -> Any:
    """``given`` (the ``--ckpt_path`` of ``subcommand``), with ``last``, ``hpc``, ``best`` and ``registry``
    resolved as Lightning will (its ``ModelCheckpoint`` lookup, ``None`` when nothing would be loaded) and the
    resolved file checked like a path before the Trainer loads anything; exit status 2 with one line on stderr when
    :func:`_check_local_checkpoint` refuses it."""
    from lightning_4d.parallel._compat.lightning import resolve_ckpt_path

    if not (isinstance(given, str) and given in _SPECIAL_CKPT_PATHS):
        return given
    resolved = resolve_ckpt_path(trainer, subcommand, given)
    try:
        _check_local_checkpoint(resolved)
    except ValueError as e:
        print(f"lightning-4d {subcommand}: error: --ckpt_path {given}: {e}", file=sys.stderr)
        sys.exit(2)
    return given if resolved is None else resolved  # (none: Lightning says itself that nothing will be loaded)


def _checked_cli() -> type:
    """``LightningCLI`` that, once the arguments are parsed and before Lightning reads ``--ckpt_path`` or anything
    is built, refuses unsafe or unusable arguments (:func:`_refuse_unsafe_arguments`), merges a checkpoint's
    hyper-parameters loudly (:func:`_merge_checkpoint_hyper_parameters`) and resolves ``--ckpt_path last`` (``hpc``,
    ``best``, ``registry``) as Lightning will, checking that file before the Trainer loads it
    (:func:`_checked_special_ckpt_path`): one line on stderr, exit status 2."""
    from lightning.pytorch.cli import LightningCLI

    class CheckedCLI(LightningCLI):
        def init_parser(self, **kwargs: Any) -> Any:
            # a bad value raises (main prints one line naming the key) instead of printing the whole usage
            return super().init_parser(**kwargs, exit_on_error=False)

        def parse_arguments(self, parser: Any, args: Any) -> None:
            super().parse_arguments(parser, args)
            command = self.config.get("subcommand")
            _refuse_unsafe_arguments(command, self.config.get(command) if command else self.config)

        def _parse_ckpt_path(self) -> None:
            _merge_checkpoint_hyper_parameters(self, super()._parse_ckpt_path)

        def _run_subcommand(self, subcommand: str) -> None:
            config = self.config_init[subcommand]
            given = config.get("ckpt_path")
            checked = _checked_special_ckpt_path(self.trainer, subcommand, given)
            if checked is not given:
                config["ckpt_path"] = checked
            super()._run_subcommand(subcommand)

    return CheckedCLI


def _lightning_cli(args: Optional[list[str]]) -> bool:
    """Run ``LightningCLI`` on ``args``; True when it ran in a process group (destroyed here)."""
    import torch.distributed as dist

    from lightning_4d.data import LMDataModule
    from lightning_4d.tasks import CausalLMModule

    _checked_cli()(
        CausalLMModule,
        LMDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lightning-4d"},
    )
    # a synchronized shutdown of the process group; the process itself must still leave without interpreter
    # finalization (``_compat.process.exit_distributed_process``: gloo's worker threads can abort it)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-4d`` console script. Returns the process exit code."""
    filter_known_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args and args[0] == "prepare-data":
        from lightning_4d.data import prepare_data_main

        return prepare_data_main(args[1:])
    if args and args[0] == "export-hf":
        from lightning_4d.export_hf import export_hf_main

        return export_hf_main(args[1:])
    if args and args[0] == "measure":
        from lightning_4d.measure import main as measure_main

        return measure_main(args[1:])
    if args and args[0] == "support":
        from lightning_4d.support import main as support_main

        return support_main(args[1:])
    if args and args[0] in ("estimate", "plan"):
        from lightning_4d.planning.commands import main as memory_main
        from lightning_4d.support import untested_pairs

        return memory_main(args[0], args[1:], untested_pairs)
    # LightningCLI reads sys.argv itself when run as the console script (given args too, it warns)
    try:
        distributed = _lightning_cli(None if argv is None else args)
    except Exception as err:  # noqa: BLE001 (bad input becomes one line; anything else is re-raised whole)
        line = input_error(err)
        if line is None or os.environ.get(TRACEBACK_ENV):
            raise
        print(f"lightning-4d {args[0]}: error: {line} (set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 2
    if distributed and argv is None:  # the console script of a distributed run: never return into finalization
        from lightning_4d.parallel._compat.process import exit_distributed_process

        exit_distributed_process(0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
