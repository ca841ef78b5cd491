"""Checkpoints of a :class:`~lightning_4d.strategy.FourDStrategy` job: what ``save_checkpoint`` / ``load_checkpoint``
delegate to. (Activation checkpointing is another thing: :mod:`lightning_4d.parallel.activation_checkpoint`.)

Two formats:

- **Sharded folder** (``save_distributed_checkpoint=True``, the default): written with ``torch.distributed.checkpoint``
  (DCP; every rank writes its shards): the model state dict and the optimizer states of every ZeRO stage (ZeRO 1's
  per-rank chunks and master weights gathered over dp into the same per-parameter form as ZeRO 0/2/3), all keyed by
  the unsplit model's parameter names with their global shapes, so the folder loads into ANY layout (dp, tp, pp with
  any schedule / v / layer split, cp, ZeRO stage); one file per rank ``powersgd_rank<r>.pt`` for PowerSGD's error
  feedback and warm start (restored on the same layout only), and Lightning's metadata (epoch, loops, callbacks,
  LR schedulers, the saving layout) in ``meta.pt``.
- **Full file** (``save_distributed_checkpoint=False``; not with ZeRO 1 or pp): one ``torch.save`` file holding
  full state dicts, written by Lightning's ``ModelParallelStrategy``; every rank reads it and keeps its shards.

A sharded folder is written atomically: completely into ``<path>.tmp``, then renamed into place (the old folder
moved aside first, to ``last.old.ckpt`` for ``last.ckpt``, and removed after), so a crash never leaves a half-written
checkpoint in place of a good one, and at every moment of a save Lightning's ``ckpt_path="last"`` finds a complete
folder (``tests/test_checkpoint_faults.py`` crashes a save after each of its file operations).

With ``async_checkpoint=True`` (:class:`AsyncSaves`) the save blocks only while the states are copied to host memory;
``torch.distributed.checkpoint.async_save`` writes ``<path>.tmp`` on a thread of its own while training goes on, and
the same rename moves it into place once every rank's write completed (``tests/test_async_checkpoint.py``).
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from datetime import timedelta
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

from lightning_4d.layout import saved_layout
from lightning_4d.models.llama import LlamaModel, canonical_name
from lightning_4d.parallel._compat.checkpoint import dcp_file_extents
from lightning_4d.parallel._compat.dtensor import local_tensor as _local
from lightning_4d.parallel._compat.lightning import LIGHTNING_METADATA_FILENAME, rekey_optimizer_state_if_needed
from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, host_zeros_like, unwrap_optimizer as unwrap
from lightning_4d.safe_load import SafeFileSystemReader, SafeLoadPlanner, load as safe_load

# optimizer state dicts in DCP folders: hyper-parameters stored per parameter name, so ranks that hold different
# parameters (pipeline stages) do not overwrite one another's param_groups
_FLAT_OPTIM = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def _legacy_sharded_optimizer_file(index: int, global_rank: int) -> str:
    """The per-rank file in which versions before :meth:`ShardedOptimizer.gathered_state` saved a
    :class:`ShardedOptimizer`'s slices (ZeRO 1 and master weights alike): read, never written any more."""
    return f"zero1_optimizer_{index}_rank{global_rank}.pt"


def validate_format(config: Any, distributed: bool) -> None:
    """Refuse a full-file checkpoint (``save_distributed_checkpoint=False``, ``distributed`` false) for a layout no
    rank can write one for, when the strategy is built.

    Raises:
        ValueError: ZeRO 1 (each rank holds its own chunk of the optimizer states), PowerSGD (per-rank
            error-feedback state), pp > 1 (no rank holds the whole model) or ``async_checkpoint`` (only the sharded
            folder is written in the background), naming the fix.
    """
    if distributed:
        return
    if getattr(config, "async_checkpoint", False):
        raise ValueError(
            "async_checkpoint=True is not supported with save_distributed_checkpoint=False: only the sharded folder "
            "is written in the background. Use save_distributed_checkpoint=True or async_checkpoint=False."
        )
    if config.zero_stage == 1:
        raise ValueError(
            "save_distributed_checkpoint=False is not supported with zero_stage=1: each rank holds its own chunk of "
            "the optimizer states. Use save_distributed_checkpoint=True (a sharded folder) or zero_stage 0, 2 or 3."
        )
    if config.gradient_compression == "powersgd":
        raise ValueError(
            "save_distributed_checkpoint=False is not supported with gradient_compression='powersgd': each rank "
            "holds its own error-feedback state. Use save_distributed_checkpoint=True (a sharded folder)."
        )
    if config.pp > 1:
        raise ValueError(
            "save_distributed_checkpoint=False is not supported with pipeline_parallel_size > 1: no rank holds the "
            "whole model. Use save_distributed_checkpoint=True (a sharded folder)."
        )


#: the key of the saving run's layout (:func:`lightning_4d.layout.saved_layout`) in a sharded folder's metadata
LAYOUT_KEY = "lightning_4d_layout"


def _compression_file(global_rank: int) -> str:
    return f"powersgd_rank{global_rank}.pt"


def param_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its name in model.named_parameters()}`` (the keys of per-rank optimizer and compression
    state files)."""
    return {id(p): name for name, p in model.named_parameters()}


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its fully qualified name as torch.distributed.checkpoint names it}``: the
    ``named_parameters()`` name without wrapper levels (:func:`lightning_4d.models.llama.canonical_name`), the same
    on every layout (pipeline stages keep the unsplit model's names); the LM head's copy of tied embeddings under pp
    named as the embedding (:func:`tied_aliases`: a folder holds the one weight once). The keys of the optimizer
    states in a sharded folder."""
    aliases = tied_aliases(model)
    return {id(p): saved_key(canonical_name(name), aliases) for name, p in model.named_parameters()}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{key of a tied LM head: key of the embedding it shares}`` for every ``lightning_4d`` Llama in ``model``
    with ``tie_word_embeddings`` (``"<prefix>.output.weight": "<prefix>.tok_embeddings.weight"``, canonical names).
    A sharded folder holds such a weight once, under the embedding's key, whatever the layout: at pp = 1 the two
    names are one tensor, under pp > 1 the last stage's copy equals the first stage's
    (:class:`lightning_4d.features.pipeline.runtime.TiedEmbedding`) and is read back from the embedding's key."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LlamaModel) and module.config.tie_word_embeddings:
            prefix = canonical_name(name) + "." if name else ""
            out[prefix + "output.weight"] = prefix + "tok_embeddings.weight"
    return out


def saved_key(key: str, aliases: dict[str, str]) -> str:
    """``key`` (a model state key, or an optimizer state's ``state.<fqn>.<field>`` / ``param_groups.<fqn>.<field>``)
    with a tied head's name replaced by its embedding's (:func:`tied_aliases`)."""
    if not aliases:
        return key
    if key in aliases:
        return aliases[key]
    for kind in ("state.", "param_groups."):
        if key.startswith(kind):
            fqn, _, field = key[len(kind) :].rpartition(".")
            if fqn in aliases:
                return f"{kind}{aliases[fqn]}.{field}"
    return key


def hold_tied_once(state: dict[str, Any], aliases: dict[str, str]) -> None:
    """Rename a tied head's entries of the flat ``state`` (a model state dict or a flattened optimizer state) to the
    embedding's keys, in place; dropped where the embedding's are present (the same weight, or on a V schedule's
    rank 0 an equal copy)."""
    for key in list(state):
        new = saved_key(key, aliases)
        if new != key:
            value = state.pop(key)
            if new not in state:
                state[new] = value


def _aliased(flat: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """What to read for the flat state ``flat``: its entries under their saved keys (:func:`saved_key`), a tied
    head's left out where the embedding's are asked for too."""
    return {a: v for k, v in flat.items() if (a := saved_key(k, aliases)) == k or a not in flat}


def _unaliased(
    flat: dict[str, Any], read: dict[str, Any], aliases: dict[str, str], copy: bool = False
) -> dict[str, Any]:
    """``flat``'s keys with the values :func:`read_folder` left in ``read`` (:func:`_aliased`); with ``copy``, a tied
    head read under the embedding's key gets its own copy (optimizer states: two parameters' states never share a
    tensor; model weights are copied into the parameters anyway)."""
    out = {}
    for k in flat:
        a = saved_key(k, aliases)
        v = read[a]
        out[k] = v.clone() if copy and a != k and a in flat and isinstance(v, torch.Tensor) else v
    return out


def optimizer_state(
    model: nn.Module, optimizer: Optimizer, distributed: bool, offload: bool = True
) -> Optional[dict[str, Any]]:
    """The state of ``optimizer`` to save: a flattened, layout-free DCP optimizer state dict
    (``{"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<hyper-parameter>": value}``) when ``distributed``, else
    ``None`` (Lightning's full state dict applies). ZeRO 1 and master weights (:class:`ShardedOptimizer`) write the
    same form as ZeRO 0/2/3, gathered over dp (:meth:`ShardedOptimizer.gathered_state`; collective), so that any
    layout can load it. ``offload=False`` (an asynchronous save: :class:`AsyncSaves` stages the states itself, into
    pinned memory on CUDA) leaves a plain optimizer's states where they are instead of copying them to the CPU."""
    sharded = ShardedOptimizer.of(unwrap(optimizer))
    if sharded is not None:
        return sharded.gathered_state(param_fqns(model)) if distributed else None
    options = _FLAT_OPTIM if offload else StateDictOptions(flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(model, unwrap(optimizer), options=options) if distributed else None


class AsyncSaves:
    """The background writes of one job's sharded checkpoints (``async_checkpoint=True``), at most one in flight.

    :meth:`start` copies a rank's states into host memory (the part that blocks training: torch's
    ``DefaultStager``, pinned on CUDA, its buffers kept and reused by the next save), then hands them to
    ``torch.distributed.checkpoint.async_save``, which writes ``<path>.tmp`` on a thread of its own, its collectives
    on a gloo process group of its own (:meth:`group`: never interleaved with training's collectives; a CPU group
    also for a CUDA job, as ``async_save`` requires); torchtitan's ``CheckpointManager`` (``async_mode="async"`` /
    ``"async_with_pinned_mem"``, ``torchtitan/components/checkpoint.py``) does the same. When rank 0's write
    completes, DCP's last step has gathered every rank's write results (``_save_state_dict``'s ``all_reduce`` of
    ``"write"``: it completes only when every rank wrote its shards and rank 0 wrote ``.metadata``), so rank 0 then
    renames the folder into place (:func:`_rename_into_place`) from that thread: ``last`` never names a partial
    write. A failed write (on any rank: DCP fails it on every rank) leaves the previous folder in place and is
    raised by :meth:`wait`.

    Memory: one host copy of the rank's states for as long as the job runs (the stager's buffers).

    Args:
        timeout: of the gloo group's collectives (a rank that died mid-write fails the others' writes after it).
        pin_memory: stage into page-locked memory (CUDA jobs).
    """

    def __init__(self, timeout: Optional[timedelta] = None, pin_memory: bool = False) -> None:
        self.timeout = timeout
        self.pin_memory = pin_memory
        self._group: Optional[Any] = None
        self._stager: Optional[Any] = None
        self._pending: Optional[tuple[Path, Future]] = None
        #: seconds the last :meth:`start` blocked (staging and the hand-over), for the benchmark and logs
        self.last_blocking_s = 0.0

    @property
    def pending(self) -> Optional[Path]:
        """The path of the save in flight (not yet waited for), or ``None``."""
        return self._pending[0] if self._pending is not None else None

    def group(self) -> Any:
        """The gloo process group of the background writes, made on first use (collective: every rank of the default
        group calls it, which :func:`save_sharded`'s callers do)."""
        if self._group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
            self._group = torch.distributed.new_group(backend="gloo", **kwargs)
        return self._group

    def _staging(self) -> Any:
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self.pin_memory,
                    use_shared_memory=False,
                    use_async_staging=False,  # staged before start returns: training may change the states next
                    use_non_blocking_copy=False,
                )
            )
        return self._stager

    def start(self, state: dict[str, Any], tmp: Path, path: Path, global_rank: int) -> None:
        """Stage ``state`` (DCP's state dict of :func:`save_sharded`) and write it into ``tmp`` in the background;
        rank 0 renames ``tmp`` to ``path`` once the write completed on every rank. Waits for the previous save
        first. Collective (every rank, same paths)."""
        import time

        from torch.distributed.checkpoint import async_save

        self.wait()
        begin = time.perf_counter()
        upload = async_save(state, checkpoint_id=tmp, process_group=self.group(), async_stager=self._staging())
        done: Future = Future()

        def finish(upload: Future) -> None:  # on the writer's thread (or here, when already done)
            try:
                upload.result()
                if global_rank == 0:
                    _rename_into_place(tmp, path)
            except BaseException as e:  # noqa: BLE001 (handed to wait)
                done.set_exception(e)
            else:
                done.set_result(None)

        upload.add_done_callback(finish)
        self._pending = (path, done)
        self.last_blocking_s = time.perf_counter() - begin

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and renamed into place on this rank.

        Raises:
            RuntimeError: the write failed (its cause chained): the checkpoint it was writing does not exist, the
                previous one at that path is kept (``<path>.tmp`` holds the partial write; the next save removes it).
        """
        if self._pending is None:
            return
        path, done = self._pending
        self._pending = None
        try:
            done.result()
        except BaseException as e:
            raise RuntimeError(
                f"the asynchronous save of checkpoint {str(path)!r} failed ({_failure(e)}): the previous checkpoint "
                "at that path is kept"
            ) from e

    def close(self) -> None:
        """:meth:`wait`, then free the staging buffers (the end of ``fit``)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def save_sharded(
    checkpoint: dict[str, Any],
    path: Path,
    global_rank: int,
    barrier: Callable[[], None],
    config: Any = None,
    model: Optional[nn.Module] = None,
    buckets: Optional[Any] = None,
    saves: Optional[AsyncSaves] = None,
) -> None:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states`` from :func:`optimizer_state`,
    metadata) as a sharded folder at ``path``, atomically (module docstring), with the saving layout ``config``
    (a ``ParallelConfig``, :func:`~lightning_4d.layout.saved_layout`) and PowerSGD's per-rank state when
    ``buckets`` (``GradientBuckets`` of ``model``) compress. Collective: every rank calls it with the same ``path``.
    ``checkpoint`` is emptied of its state dicts on the way. With ``saves`` (``async_checkpoint=True``) it waits
    for the previous save, then returns once the states are staged: the shards are written and the folder renamed
    into place in the background (:class:`AsyncSaves`; ``meta.pt`` and PowerSGD's files are written before it
    returns).

    Raises:
        RuntimeError: with ``saves``, the previous asynchronous save failed (:meth:`AsyncSaves.wait`).
    """
    from torch.distributed.checkpoint import save as dcp_save

    if saves is not None:
        saves.wait()  # before tmp is cleared: the previous save may be writing the same one
    if buckets is not None and buckets.powersgd is not None and model is not None:
        checkpoint["compression_state"] = buckets.compression_state(param_names(model))
    if config is not None:
        checkpoint[LAYOUT_KEY] = saved_layout(config)
    tmp = path.with_name(path.name + ".tmp")
    if global_rank == 0 and tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    aliases = tied_aliases(model) if model is not None else {}
    hold_tied_once(state["state_dict"], aliases)  # a tied weight once, under the embedding's key
    compression = checkpoint.pop("compression_state", None)
    if compression is not None:
        torch.save(compression, tmp / _compression_file(global_rank))
    for idx, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        if isinstance(opt_state, dict):
            hold_tied_once(opt_state, aliases)
        _masters_into_weights(opt_state, state["state_dict"])
        state[f"optimizer_{idx}"] = opt_state
    if saves is not None:
        if global_rank == 0:  # small; the rename waits for the shards anyway
            torch.save(checkpoint, tmp / LIGHTNING_METADATA_FILENAME)
        saves.start(state, tmp, path, global_rank)
        return
    dcp_save(state, checkpoint_id=tmp)
    if global_rank == 0:
        torch.save(checkpoint, tmp / LIGHTNING_METADATA_FILENAME)
    barrier()
    if global_rank == 0:
        _rename_into_place(tmp, path)
    barrier()


def _failure(e: BaseException) -> str:
    """One line for a failed save: ``"<type>: <message>"``, or for DCP's ``CheckpointException`` (its ``failures``:
    ``{rank: exception or (exception, stack)}``) each failed rank's ``"rank <r>: <type>: <message>"``."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(e).__name__}: {e}"
    parts = []
    for rank, failure in sorted(failures.items()):
        failure = failure[0] if isinstance(failure, tuple) and failure else failure
        parts.append(f"rank {rank}: {type(failure).__name__}: {failure}")
    return "; ".join(parts)


def _masters_into_weights(opt_state: Any, model_state: dict[str, Any]) -> None:
    """Move the float32 master weights of a :meth:`ShardedOptimizer.gathered_state` (``state.<fqn>.master``) into the
    model state dict in place of the bfloat16 parameters (a tied weight's every name), so that a folder's weights
    are always the full-precision ones, as FSDP2's (whose float32 shards are the masters) are: any layout and ZeRO
    stage then resumes from the same float32 values."""
    if not isinstance(opt_state, dict):
        return
    for key in [k for k in opt_state if k.startswith("state.") and k.endswith(".master")]:
        fqn, master = key[len("state.") : -len(".master")], opt_state.pop(key)
        if fqn not in model_state:
            continue
        storage = _local(model_state[fqn]).data_ptr()
        for name, value in model_state.items():
            if isinstance(value, torch.Tensor) and _local(value).data_ptr() == storage:
                model_state[name] = master


def _old(path: Path) -> Path:
    """Where :func:`_rename_into_place` moves the folder it replaces: ``<stem>.old<suffix>`` (``last.ckpt`` ->
    ``last.old.ckpt``), a name Lightning's ``ckpt_path="last"`` still finds (``ModelCheckpoint._find_last_checkpoints``
    takes every ``last*`` entry with the ``.ckpt`` suffix, and the newest of them by modification time)."""
    return path.with_name(path.stem + ".old" + path.suffix)


def _legacy_old(path: Path) -> Path:
    """Where earlier versions moved it (``last.ckpt.old``, which the ``last`` lookup does not find)."""
    return path.with_name(path.name + ".old")


def _rename_into_place(tmp: Path, path: Path) -> None:
    """Replace ``path`` by the complete folder ``tmp``: ``path`` -> :func:`_old` ``(path)``, ``tmp`` -> ``path``, remove
    the old one. A crash at any point leaves a complete folder that Lightning's ``"last"`` lookup finds (``path``, or
    between the two renames the old one under its ``last*.ckpt`` name) and that :func:`resolve` loads; the next save
    cleans up what the crash left."""
    old = _old(path)
    if path.exists():
        if old.exists():  # a stale one from an earlier crash: path is the newer complete folder
            shutil.rmtree(old)
        if path.is_dir():
            path.rename(old)
        else:
            path.unlink()
    tmp.rename(path)
    for stale in (old, _legacy_old(path)):
        if stale.exists():
            shutil.rmtree(stale)


def resolve(path: Path) -> Path:
    """The folder to load for ``path``: ``path`` itself, or, when a crash came between the two renames of
    :func:`_rename_into_place` (``path`` missing), the complete previous folder (:func:`_old`, or the name earlier
    versions gave it), with a warning.

    Raises:
        ValueError: none exists.
    """
    if path.exists():
        return path
    for old in (_old(path), _legacy_old(path)):
        if old.is_dir():
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                f"checkpoint {str(path)!r} is missing but {str(old)!r} is complete (a save was "
                "interrupted while replacing it): loading that one"
            )
            return old
    raise ValueError(f"checkpoint {str(path)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")


def check_complete(path: Path) -> dict[str, Any]:
    """Raise a clear error when the sharded folder ``path`` lacks a file every complete save writes, or when a
    shard file is shorter than the byte ranges DCP's ``.metadata`` records in it (a truncated copy). Returns the
    folder's ``state_dict_metadata`` (``{key: TensorStorageMetadata | BytesStorageMetadata}``), read once here.

    Raises:
        ValueError: naming the missing or truncated file (and, for a truncated one, its size and the size needed),
            or a ``.metadata`` that names more than DCP's metadata classes (an ``UnsafeFileError``, read unrun).
    """
    from lightning_4d.safe_load import UnsafeFileError, confined

    for name in (".metadata", LIGHTNING_METADATA_FILENAME):
        if not (path / name).is_file():
            raise ValueError(
                f"checkpoint folder {str(path)!r} is incomplete: {name!r} is missing (a save that did not finish "
                "writes into '<path>.tmp' and never replaces a complete folder; "
                "pass a folder ModelCheckpoint completed)"
            )
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except UnsafeFileError:
        raise
    except Exception as e:
        raise ValueError(
            f"checkpoint folder {str(path)!r}: '.metadata' cannot be read ({type(e).__name__}: {e})"
        ) from e
    for name, size in sorted(dcp_file_extents(metadata.storage_data).items()):
        file = confined(path, name, f"checkpoint folder {str(path)!r}: '.metadata'")
        if not file.is_file():
            raise ValueError(f"checkpoint folder {str(path)!r} is incomplete: shard file {name!r} is missing")
        if file.stat().st_size < size:
            raise ValueError(
                f"checkpoint folder {str(path)!r}: shard file {name!r} is truncated "
                f"({file.stat().st_size} "
                f"bytes; .metadata records data up to byte {size}): restore it or use another checkpoint"
            )
    return metadata.state_dict_metadata


def saved_shapes(saved: dict[str, Any], prefix: str = "state_dict.") -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of the tensors under ``prefix`` in a folder's ``state_dict_metadata`` ``saved``
    (:func:`check_complete`), keys without the prefix (tensors only: no saved bytes object)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k[len(prefix) :]: tuple(m.size)
        for k, m in saved.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def check_same_model(
    path: Path, saved: dict[str, tuple[int, ...]], wanted: dict[str, Any], extra_prefix: Optional[str] = None
) -> None:
    """Raise, naming the first differing tensor, when the checkpoint ``path`` (its tensors' shapes ``saved``) is not
    of the model whose tensors ``wanted`` (``{key: tensor}``, global shapes: a DTensor's whole shape) asks for: a
    wanted key it lacks or holds in another shape, in the model's order; then, with ``extra_prefix`` (a layout whose
    every rank holds the whole model), a saved key under that prefix the model lacks.

    Raises:
        ValueError: ``path`` is from another model (the tensor, both shapes and a hint).
    """
    for key, tensor in wanted.items():
        if key not in saved:
            near = ", ".join(repr(k) for k in sorted(saved)[:3])
            raise ValueError(
                f"checkpoint {str(path)!r} is from another model: it holds no tensor {key!r} (the model's "
                f"{tuple(tensor.shape)}; it holds {len(saved)} tensors, e.g. {near}): pass a checkpoint of this "
                "model config"
            )
        if tuple(saved[key]) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint {str(path)!r} is from another model: tensor {key!r} has shape {tuple(saved[key])} there, "
                f"{tuple(tensor.shape)} in the model: pass a checkpoint of this model config"
            )
    if extra_prefix is not None:
        for key in sorted(k for k in saved if k.startswith(extra_prefix) and k not in wanted):
            raise ValueError(
                f"checkpoint {str(path)!r} is from another model: it holds tensor {key!r} {tuple(saved[key])} "
                "that the model lacks: pass a checkpoint of this model config"
            )


def read_folder(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path``, with a read failure (a truncated or corrupted
    shard file) reported as a ``ValueError`` that names the folder and the files in it. Read through
    :mod:`lightning_4d.safe_load` (``.metadata`` and non-tensor entries unpickled with only plain data allowed: an
    ``UnsafeFileError`` names what else an entry holds)."""
    from torch.distributed.checkpoint import CheckpointException, load as dcp_load

    from lightning_4d.safe_load import UnsafeFileError

    reader, planner = SafeFileSystemReader(str(path)), SafeLoadPlanner(str(path))
    try:
        dcp_load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        # DCP wraps a rank's failure in a CheckpointException (``failures``: rank -> exception)
        # (each a ``(exception, stack)`` pair)
        for failure in [e, *(e.failures.values() if isinstance(e, CheckpointException) else ())]:
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, UnsafeFileError):
                raise UnsafeFileError(str(failure)) from e  # DCP wraps each rank's failure in a CheckpointException
        files = sorted(f.name for f in path.iterdir() if f.suffix == ".distcp")
        sizes = ", ".join(f"{f} ({(path / f).stat().st_size} bytes)" for f in files)
        raise ValueError(
            f"could not read checkpoint folder {str(path)!r}: a shard file is truncated or corrupted ({sizes}): "
            f"{type(e).__name__}: {str(e)[-800:]}"
        ) from e


def _sharded_optimizer_template(
    path: Path, saved: dict[str, Any], key: str, model: nn.Module, fqns: dict[int, str]
) -> dict[str, Any]:
    """What a :class:`ShardedOptimizer` asks the folder ``path`` (its ``state_dict_metadata``: ``saved``) for: each
    of its parameters' saved states as a CPU tensor of the parameter's whole local shape (a DTensor with its
    placements, :func:`~lightning_4d.parallel.sharded_optimizer.host_zeros_like`: DCP reads just this rank's tp shard
    of the saved tensor, whatever layout wrote it, into host memory), scalars as CPU scalars, hyper-parameters as
    placeholders."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    params = {fqn: p for p in model.parameters() if (fqn := fqns.get(id(p))) is not None}
    for name, meta in saved.items():
        if not name.startswith(key + "."):
            continue
        kind, _, rest = name[len(key) + 1 :].partition(".")
        fqn, _, field = rest.rpartition(".")
        p = params.get(fqn)
        if p is None or kind not in ("state", "param_groups"):
            continue
        entry = name[len(key) + 1 :]
        if kind == "param_groups" or not isinstance(meta, TensorStorageMetadata):
            out[entry] = None
        elif tuple(meta.size) == ():
            out[entry] = torch.zeros((), dtype=meta.properties.dtype)
        elif tuple(meta.size) == tuple(p.shape):
            out[entry] = host_zeros_like(p, meta.properties.dtype)
        else:
            raise ValueError(
                f"checkpoint {str(path)!r}: optimizer state {name!r} has shape {tuple(meta.size)}, "
                f"the model's parameter {fqn!r} {tuple(p.shape)}: it was saved from another model"
            )
    return out


def load_sharded(
    path: Path,
    model: nn.Module,
    optimizers: list[Any],
    strict: bool,
    global_rank: int,
    buckets: Optional[Any] = None,
    layout: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Load a sharded folder written by :func:`save_sharded` under ANY layout into ``model``, ``optimizers`` and the
    PowerSGD state of ``buckets`` (``GradientBuckets``); returns Lightning's metadata dict.

    Model weights and optimizer states are keyed by the unsplit model's parameter names and stored whole (DCP keeps
    each tensor's global shape), so each rank reads just the slices its layout needs: dp, tp, pp (any schedule,
    v, layer split), cp and ZeRO stage may all differ from the saving run. PowerSGD's per-rank state is restored
    only under the layout that saved it (``layout``, a dict compared with the one saved in the metadata); on
    another layout it restarts from zero with a warning. A folder saved by an earlier version with per-rank ZeRO-1
    files (``zero1_optimizer_<i>_rank<r>.pt``, the legacy name, for ZeRO 0 master weights too) loads under its own
    layout only. Every file is read through :mod:`lightning_4d.safe_load` (weights only: nothing in it runs).

    Raises:
        ValueError: the folder is incomplete (names the missing file), a shard file cannot be read (names the
            files), it is from another model (:func:`check_same_model`: the first differing tensor named), an
            optimizer state's shape differs from the model's parameter, or a file holds more than plain data (an
            ``UnsafeFileError`` naming the file, what it holds and what to do).
    """

    saved = check_complete(path)
    fqns = param_fqns(model)  # a tied head under its embedding's name (tied_aliases)
    aliases = tied_aliases(model)
    weights = get_model_state_dict(model)
    masters = _master_targets(model, optimizers, fqns, weights)
    model_state = {"state_dict": _aliased(weights, aliases)}  # a tied weight is saved once
    whole = layout is not None and layout.get("pp", 1) == 1  # else other stages' tensors are in the folder too
    on_disk = {k: v for k, v in saved_shapes(saved).items() if k not in aliases}  # older folders: a tied head too
    check_same_model(path, on_disk, model_state["state_dict"], "" if strict and whole else None)
    read_folder(model_state, path)
    weights = _unaliased(weights, model_state["state_dict"], aliases)
    set_model_state_dict(model, weights, options=StateDictOptions(strict=strict))
    metadata = safe_load(path / LIGHTNING_METADATA_FILENAME)
    _load_optimizers(path, saved, model, optimizers, global_rank, (fqns, aliases), masters)
    if buckets is not None and buckets.powersgd is not None:
        _load_compression_state(path, model, buckets, global_rank, layout, metadata.get(LAYOUT_KEY))
    metadata.pop(LAYOUT_KEY, None)
    return metadata


def _master_targets(
    model: nn.Module, optimizers: list[Any], fqns: dict[int, str], weights: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The float32 tensors the saved weights of the parameters stepped through float32 masters (ZeRO 0/1 under
    bf16-mixed) are read into, by saved name; each also replaces its parameter's entry of ``weights`` (the model's
    state dict), so that the weights are read in float32."""
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    masters: dict[str, torch.Tensor] = {}
    for optimizer in optimizers:
        sharded = ShardedOptimizer.of(unwrap(optimizer))
        for p in sharded.parameters() if sharded is not None else []:
            if id(p) in sharded.has_master and names[id(p)] in weights:
                masters[fqns[id(p)]] = host_zeros_like(p, torch.float32)
                weights[names[id(p)]] = masters[fqns[id(p)]]
    return masters


def _load_optimizers(
    path: Path,
    saved: Any,
    model: nn.Module,
    optimizers: list[Any],
    global_rank: int,
    names: tuple[dict[int, str], Any],
    masters: dict[str, torch.Tensor],
) -> None:
    """:func:`load_sharded`'s optimizer states: a :class:`ShardedOptimizer`'s from an earlier version's per-rank
    file or from the folder's gathered states (its float32 masters from ``masters``), a plain optimizer's through
    torch's flat optimizer state dict (``saved``: :func:`check_complete`'s; ``names``: the parameters' saved names
    and the tied aliases)."""
    fqns, aliases = names
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        sharded = ShardedOptimizer.of(unwrap(optimizer))
        legacy = path / _legacy_sharded_optimizer_file(idx, global_rank)
        if sharded is not None and legacy.exists():  # an earlier version's per-rank files
            saved = safe_load(legacy)
            sharded.load_sharded_state(param_names(model), saved["state"])
            for group, values in zip(sharded.optimizer.param_groups, saved["param_groups"]):
                group.update(values)
        elif sharded is not None:
            opt_state = {key: _sharded_optimizer_template(path, saved, key, model, fqns)}
            read_folder(opt_state, path)
            sharded.load_gathered_state(fqns, opt_state[key], weights=masters)
        else:
            flat = get_optimizer_state_dict(model, unwrap(optimizer), options=_FLAT_OPTIM)
            opt_state = {key: _aliased(flat, aliases)}
            read_folder(opt_state, path)
            flat = _unaliased(flat, opt_state[key], aliases, copy=True)
            set_optimizer_state_dict(model, unwrap(optimizer), optim_state_dict=flat, options=_FLAT_OPTIM)


def _load_compression_state(
    path: Path, model: nn.Module, buckets: Any, global_rank: int, layout: Optional[dict[str, Any]], saved_layout: Any
) -> None:
    """Restore PowerSGD's per-rank state of ``buckets`` from the folder ``path`` when it was saved under this
    ``layout`` (``saved_layout``: the one in the folder's metadata); else warn that it restarts from zero."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    saved_compression = path / _compression_file(global_rank)
    if saved_compression.exists() and (layout is None or saved_layout == layout):
        buckets.load_compression_state(param_names(model), safe_load(saved_compression))
    elif saved_compression.exists():
        rank_zero_warn(
            f"{str(path)!r} was saved on another layout ({saved_layout}, now {layout}): PowerSGD's "
            "error feedback restarts from zero and its warm start from a random Q."
        )
    else:
        rank_zero_warn(
            f"{str(path)!r} holds no PowerSGD state (it was saved without gradient_compression="
            "'powersgd'): the error feedback starts from zero and the warm start from a random Q."
        )


def load_full(path: Path, model: nn.Module, optimizers: list[Any], strict: bool) -> dict[str, Any]:
    """Load a single-file checkpoint (``save_distributed_checkpoint=False``): every rank reads the file (memory
    mapped, weights only: :func:`lightning_4d.safe_load.load`) and keeps its shards of the full state dicts; returns
    the rest of the checkpoint dict.

    Raises:
        ValueError: the file holds more than plain data (an ``UnsafeFileError`` naming it), is not a checkpoint, or
            is from another model (:func:`check_same_model`: the first differing tensor named).
    """
    checkpoint = safe_load(path)
    wanted = get_model_state_dict(model)
    full = {k: tuple(v.shape) for k, v in checkpoint.get("state_dict", {}).items() if isinstance(v, torch.Tensor)}
    check_same_model(path, full, wanted, "" if strict else None)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    for idx, optimizer in enumerate(optimizers):
        state = rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][idx], model)
        set_optimizer_state_dict(
            model, unwrap(optimizer), optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )
    checkpoint.pop("optimizer_states", None)
    return checkpoint
