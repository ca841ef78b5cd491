"""Checkpoints of a :class:`~lightning_4d.strategy.FourDStrategy` job: what ``save_checkpoint`` / ``load_checkpoint``
delegate to. (Activation checkpointing is another thing: :mod:`lightning_4d.parallel.checkpointing`.)

Two formats:

- **Sharded folder** (``save_distributed_checkpoint=True``, the default): the model state dict and the optimizer
  states of ZeRO 0/2/3 written with ``torch.distributed.checkpoint`` (DCP; every rank writes its shards, parameter
  names are the unsplit model's), one file per rank ``zero1_optimizer_<i>_rank<r>.pt`` for the ZeRO-1 optimizer
  chunks, one per rank ``powersgd_rank<r>.pt`` for PowerSGD's error feedback and warm start (each rank's own), and
  Lightning's metadata (epoch, loops, callbacks, ...) in ``meta.pt``. Loads into the same layout (dp,
  tp, pp, cp and ZeRO stage as when saved).
- **Full file** (``save_distributed_checkpoint=False``; not with ZeRO 1 or pp): one ``torch.save`` file holding
  full state dicts, written by Lightning's ``ModelParallelStrategy``; every rank reads it and keeps its shards.

A sharded folder is written atomically: completely into ``<path>.tmp``, then renamed into place (the old folder
moved aside first and removed after), so a crash never leaves a half-written checkpoint in place of a good one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_4d.parallel._compat import LIGHTNING_METADATA_FILENAME, rekey_optimizer_state_if_needed
from lightning_4d.parallel.zero import ShardedOptimizer, unwrap_optimizer as unwrap

# optimizer state dicts in DCP folders: hyper-parameters stored per parameter name, so ranks that hold different
# parameters (pipeline stages) do not overwrite one another's param_groups
_FLAT_OPTIM = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def _zero1_file(index: int, global_rank: int) -> str:
    return f"zero1_optimizer_{index}_rank{global_rank}.pt"


def _compression_file(global_rank: int) -> str:
    return f"powersgd_rank{global_rank}.pt"


def param_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its name in model.named_parameters()}`` (the keys of per-rank optimizer and compression
    state files)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer: Optimizer, distributed: bool) -> Optional[dict[str, Any]]:
    """The state of ``optimizer`` to save: this rank's ZeRO-1 chunk (``{"zero1": True, "state", "param_groups"}``),
    a flattened DCP optimizer state dict (``distributed``), or ``None`` when Lightning's full state dict applies."""
    zero1 = ShardedOptimizer.of(unwrap(optimizer))
    if zero1 is None:
        return get_optimizer_state_dict(model, unwrap(optimizer), options=_FLAT_OPTIM) if distributed else None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in zero1.optimizer.param_groups]
    return {"zero1": True, "state": zero1.sharded_state(param_names(model)), "param_groups": groups}


def save_sharded(checkpoint: dict[str, Any], path: Path, global_rank: int, barrier: Callable[[], None]) -> None:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states`` from :func:`optimizer_state`,
    metadata) as a sharded folder at ``path``, atomically (module docstring). Collective: every rank calls it with
    the same ``path``. ``checkpoint`` is emptied of its state dicts on the way."""
    from torch.distributed.checkpoint import save as dcp_save

    tmp = path.with_name(path.name + ".tmp")
    if global_rank == 0 and tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    compression = checkpoint.pop("compression_state", None)
    if compression is not None:
        torch.save(compression, tmp / _compression_file(global_rank))
    for idx, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        if isinstance(opt_state, dict) and opt_state.get("zero1"):
            torch.save(opt_state, tmp / _zero1_file(idx, global_rank))
        else:
            state[f"optimizer_{idx}"] = opt_state
    dcp_save(state, checkpoint_id=tmp)
    if global_rank == 0:
        torch.save(checkpoint, tmp / LIGHTNING_METADATA_FILENAME)
    barrier()
    if global_rank == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            if path.is_dir():
                path.rename(old)
            else:
                path.unlink()
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    barrier()


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[Any], strict: bool, global_rank: int, weights_only: Optional[bool],
    buckets: Optional[Any] = None,
) -> dict[str, Any]:
    """Load a sharded folder written by :func:`save_sharded` under the same layout into ``model``, ``optimizers``
    and the PowerSGD state of ``buckets`` (``GradientBuckets``; this rank's shards only); returns Lightning's
    metadata dict."""
    from torch.distributed.checkpoint import load as dcp_load

    model_state = {"state_dict": get_model_state_dict(model)}
    dcp_load(model_state, checkpoint_id=path)
    set_model_state_dict(model, model_state["state_dict"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        zero1 = ShardedOptimizer.of(unwrap(optimizer))
        if zero1 is not None:
            saved = torch.load(path / _zero1_file(idx, global_rank), weights_only=False)
            zero1.load_sharded_state(param_names(model), saved["state"])
            for group, values in zip(zero1.optimizer.param_groups, saved["param_groups"]):
                group.update(values)
            continue
        key = f"optimizer_{idx}"
        opt_state = {key: get_optimizer_state_dict(model, unwrap(optimizer), options=_FLAT_OPTIM)}
        dcp_load(opt_state, checkpoint_id=path)
        set_optimizer_state_dict(model, unwrap(optimizer), optim_state_dict=opt_state[key], options=_FLAT_OPTIM)
    if buckets is not None and buckets.powersgd is not None:
        saved_compression = path / _compression_file(global_rank)
        if saved_compression.exists():
            buckets.load_compression_state(param_names(model), torch.load(saved_compression, weights_only=True))
        else:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(f"{str(path)!r} holds no PowerSGD state (it was saved without gradient_compression="
                           "'powersgd'): the error feedback starts from zero and the warm start from a random Q.")
    return torch.load(path / LIGHTNING_METADATA_FILENAME, weights_only=weights_only if weights_only is not None else False)


def load_full(
    path: Path, model: nn.Module, optimizers: list[Any], strict: bool, weights_only: Optional[bool]
) -> dict[str, Any]:
    """Load a single-file checkpoint (``save_distributed_checkpoint=False``): every rank reads the file (memory
    mapped) and keeps its shards of the full state dicts; returns the rest of the checkpoint dict."""
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    for idx, optimizer in enumerate(optimizers):
        state = rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][idx], model)
        set_optimizer_state_dict(
            model, unwrap(optimizer), optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )
    checkpoint.pop("optimizer_states", None)
    return checkpoint
