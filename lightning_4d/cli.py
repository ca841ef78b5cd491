"""The ``lightning-4d`` program (also ``python -m lightning_4d``).

Subcommands:

- ``fit``, ``validate``, ``test``, ``predict``: a ``LightningCLI`` over :class:`~lightning_4d.tasks.CausalLMModule`
  and :class:`~lightning_4d.data.LMDataModule` (``lightning-4d fit --config configs/tiny.yaml``; any argument can be
  overridden on the command line, e.g. ``--trainer.strategy.tensor_parallel_size=1 --trainer.devices=2``);
- ``prepare-data``: tokenize text files into a memory-mapped token file (``lightning-4d prepare-data --help``);
- ``estimate``: the memory of one layout per GPU (``lightning-4d estimate --help``; no torch import);
- ``plan``: the layouts of a job that fit, ranked by predicted step time (``lightning-4d plan --help``).
"""

from __future__ import annotations

import sys
from typing import Optional

EXTRA_COMMANDS = ("prepare-data", "estimate", "plan")


def _lightning_cli(args: list[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_4d.data import LMDataModule
    from lightning_4d.tasks import CausalLMModule

    import torch.distributed as dist

    LightningCLI(
        CausalLMModule,
        LMDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lightning-4d"},
    )
    # a clean, synchronized shutdown of the process group: gloo workers that exit while a peer still tears its
    # connections down can abort ("terminate called without an active exception")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``lightning-4d`` console script. Returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "prepare-data":
        from lightning_4d.data import prepare_data_main

        return prepare_data_main(args[1:])
    if args and args[0] in ("estimate", "plan"):
        from lightning_4d.memory.cli import main as memory_main

        return memory_main(args[0], args[1:])
    _lightning_cli(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
