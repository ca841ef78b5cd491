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
moved aside first and removed after), so a crash never leaves a half-written checkpoint in place of a good one.
"""

from __future__ import annotations

import math
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_4d.parallel._compat import LIGHTNING_METADATA_FILENAME, rekey_optimizer_state_if_needed
from lightning_4d.parallel._compat import dcp_file_extents
from lightning_4d.parallel._compat import local_tensor as _local
from lightning_4d.parallel.zero import ShardedOptimizer, unwrap_optimizer as unwrap

# optimizer state dicts in DCP folders: hyper-parameters stored per parameter name, so ranks that hold different
# parameters (pipeline stages) do not overwrite one another's param_groups
_FLAT_OPTIM = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def _legacy_sharded_optimizer_file(index: int, global_rank: int) -> str:
    """The per-rank file in which versions before :meth:`ShardedOptimizer.gathered_state` saved a
    :class:`ShardedOptimizer`'s slices (ZeRO 1 and master weights alike): read, never written any more."""
    return f"zero1_optimizer_{index}_rank{global_rank}.pt"


#: the key of the saving run's layout (``ParallelConfig`` sizes) in a sharded folder's Lightning metadata
LAYOUT_KEY = "lightning_4d_layout"


def layout_of(config: Any) -> dict[str, Any]:
    """The sizes of a ``ParallelConfig`` that decide which parameter slices a rank holds (saved with a sharded
    folder under :data:`LAYOUT_KEY`)."""
    split = config.pipeline_layer_split
    return {"pp": config.pp, "dp": config.dp, "cp": config.cp, "tp": config.tp, "zero_stage": config.zero_stage,
            "v": config.v, "pipeline_layer_split": list(split) if split is not None else None,
            "sequence_parallel": config.sequence_parallel, "powersgd_rank": config.powersgd_rank}


def _compression_file(global_rank: int) -> str:
    return f"powersgd_rank{global_rank}.pt"


def param_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its name in model.named_parameters()}`` (the keys of per-rank optimizer and compression
    state files)."""
    return {id(p): name for name, p in model.named_parameters()}


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its fully qualified name as torch.distributed.checkpoint names it}``: the
    ``named_parameters()`` name without wrapper levels (:func:`lightning_4d.models.llama._canonical_name`), the same
    on every layout (pipeline stages keep the unsplit model's names). The keys of the optimizer states in a sharded
    folder."""
    from lightning_4d.models.llama import _canonical_name

    return {id(p): _canonical_name(name) for name, p in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer: Optimizer, distributed: bool) -> Optional[dict[str, Any]]:
    """The state of ``optimizer`` to save: a flattened, layout-free DCP optimizer state dict
    (``{"state.<fqn>.<key>": tensor, "param_groups.<fqn>.<hyper-parameter>": value}``) when ``distributed``, else
    ``None`` (Lightning's full state dict applies). ZeRO 1 and master weights (:class:`ShardedOptimizer`) write the
    same form as ZeRO 0/2/3, gathered over dp (:meth:`ShardedOptimizer.gathered_state`; collective), so that any
    layout can load it."""
    sharded = ShardedOptimizer.of(unwrap(optimizer))
    if sharded is not None:
        return sharded.gathered_state(param_fqns(model)) if distributed else None
    return get_optimizer_state_dict(model, unwrap(optimizer), options=_FLAT_OPTIM) if distributed else None


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
        _masters_into_weights(opt_state, state["state_dict"])
        state[f"optimizer_{idx}"] = opt_state
    dcp_save(state, checkpoint_id=tmp)
    if global_rank == 0:
        torch.save(checkpoint, tmp / LIGHTNING_METADATA_FILENAME)
    barrier()
    if global_rank == 0:
        _rename_into_place(tmp, path)
    barrier()


def _masters_into_weights(opt_state: Any, model_state: dict[str, Any]) -> None:
    """Move the float32 master weights of a :meth:`ShardedOptimizer.gathered_state` (``state.<fqn>.master``) into the
    model state dict in place of the bfloat16 parameters (a tied weight's every name), so that a folder's weights
    are always the full-precision ones, as FSDP2's (whose float32 shards are the masters) are: any layout and ZeRO
    stage then resumes from the same float32 values."""
    if not isinstance(opt_state, dict):
        return
    for key in [k for k in opt_state if k.startswith("state.") and k.endswith(".master")]:
        fqn, master = key[len("state."):-len(".master")], opt_state.pop(key)
        if fqn not in model_state:
            continue
        storage = _local(model_state[fqn]).data_ptr()
        for name, value in model_state.items():
            if isinstance(value, torch.Tensor) and _local(value).data_ptr() == storage:
                model_state[name] = master


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _rename_into_place(tmp: Path, path: Path) -> None:
    """Replace ``path`` by the complete folder ``tmp``: ``path`` -> ``path.old``, ``tmp`` -> ``path``, remove
    ``path.old``. A crash between the two renames leaves ``path.old`` complete, and :func:`resolve` loads it."""
    old = _old(path)
    if path.exists():
        if old.exists():  # a stale one from an earlier crash: path is the newer complete folder
            shutil.rmtree(old)
        if path.is_dir():
            path.rename(old)
        else:
            path.unlink()
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)


def resolve(path: Path) -> Path:
    """The folder to load for ``path``: ``path`` itself, or, when a crash came between the two renames of
    :func:`_rename_into_place` (``path`` missing), the complete previous folder ``path.old`` (with a warning).

    Raises:
        ValueError: neither exists.
    """
    if path.exists():
        return path
    if _old(path).is_dir():
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"checkpoint {str(path)!r} is missing but {str(_old(path))!r} is complete (a save was "
                       "interrupted while replacing it): loading that one")
        return _old(path)
    raise ValueError(f"checkpoint {str(path)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")


def _check_complete(path: Path) -> dict[str, Any]:
    """Raise a clear error when the sharded folder ``path`` lacks a file every complete save writes, or when a
    shard file is shorter than the byte ranges DCP's ``.metadata`` records in it (a truncated copy). Returns the
    folder's ``state_dict_metadata`` (``{key: TensorStorageMetadata | BytesStorageMetadata}``), read once here.

    Raises:
        ValueError: naming the missing or truncated file (and, for a truncated one, its size and the size needed).
    """
    from torch.distributed.checkpoint import FileSystemReader

    for name in (".metadata", LIGHTNING_METADATA_FILENAME):
        if not (path / name).is_file():
            raise ValueError(
                f"checkpoint folder {str(path)!r} is incomplete: {name!r} is missing (a save that did not finish "
                "writes into '<path>.tmp' and never replaces a complete folder; pass a folder ModelCheckpoint completed)"
            )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise ValueError(f"checkpoint folder {str(path)!r}: '.metadata' cannot be read ({type(e).__name__}: {e})") from e
    for name, size in sorted(dcp_file_extents(metadata.storage_data).items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint folder {str(path)!r} is incomplete: shard file {name!r} is missing")
        if file.stat().st_size < size:
            raise ValueError(f"checkpoint folder {str(path)!r}: shard file {name!r} is truncated ({file.stat().st_size} "
                             f"bytes; .metadata records data up to byte {size}): restore it or use another checkpoint")
    return metadata.state_dict_metadata


def _dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path``, with a read failure (a truncated or corrupted
    shard file) reported as a ``ValueError`` that names the folder and the files in it."""
    from torch.distributed.checkpoint import load as dcp_load

    try:
        dcp_load(state, checkpoint_id=path, no_dist=no_dist)
    except Exception as e:  # DCP wraps each rank's failure in a CheckpointException
        files = sorted(f.name for f in path.iterdir() if f.suffix == ".distcp")
        sizes = ", ".join(f"{f} ({(path / f).stat().st_size} bytes)" for f in files)
        raise ValueError(
            f"could not read checkpoint folder {str(path)!r}: a shard file is truncated or corrupted ({sizes}): "
            f"{type(e).__name__}: {str(e)[-800:]}"
        ) from e


def _sharded_optimizer_template(path: Path, saved: dict[str, Any], key: str, model: nn.Module,
                    fqns: dict[int, str]) -> dict[str, Any]:
    """What a :class:`ShardedOptimizer` asks the folder ``path`` (its ``state_dict_metadata``: ``saved``) for: each
    of its parameters' saved states as a tensor of the parameter's whole local shape (a DTensor with its placements:
    DCP reads just this rank's tp shard of the saved tensor, whatever layout wrote it), scalars as scalars,
    hyper-parameters as placeholders."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    params = {fqn: p for p in model.parameters() if (fqn := fqns.get(id(p))) is not None}
    for name, meta in saved.items():
        if not name.startswith(key + "."):
            continue
        kind, _, rest = name[len(key) + 1:].partition(".")
        fqn, _, field = rest.rpartition(".")
        p = params.get(fqn)
        if p is None or kind not in ("state", "param_groups"):
            continue
        entry = name[len(key) + 1:]
        if kind == "param_groups" or not isinstance(meta, TensorStorageMetadata):
            out[entry] = None
        elif tuple(meta.size) == ():
            out[entry] = torch.zeros((), dtype=meta.properties.dtype)
        elif tuple(meta.size) == tuple(p.shape):
            out[entry] = _empty_like_param(p, meta.properties.dtype)
        else:
            raise ValueError(f"checkpoint {str(path)!r}: optimizer state {name!r} has shape {tuple(meta.size)}, "
                             f"the model's parameter {fqn!r} {tuple(p.shape)}: it was saved from another model")
    return out


def _empty_like_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of ``p``'s global shape in ``dtype`` on the CPU, a DTensor with ``p``'s placements for a DTensor
    ``p`` (DCP then reads just this rank's slice into it)."""
    local = torch.zeros(_local(p).shape, dtype=dtype)
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[Any], strict: bool, global_rank: int, weights_only: Optional[bool],
    buckets: Optional[Any] = None, layout: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Load a sharded folder written by :func:`save_sharded` under ANY layout into ``model``, ``optimizers`` and the
    PowerSGD state of ``buckets`` (``GradientBuckets``); returns Lightning's metadata dict.

    Model weights and optimizer states are keyed by the unsplit model's parameter names and stored whole (DCP keeps
    each tensor's global shape), so each rank reads just the slices its layout needs: dp, tp, pp (any schedule,
    v, layer split), cp and ZeRO stage may all differ from the saving run. PowerSGD's per-rank state is restored
    only under the layout that saved it (``layout``, a dict compared with the one saved in the metadata); on
    another layout it restarts from zero with a warning. A folder saved by an earlier version with per-rank ZeRO-1
    files (``zero1_optimizer_<i>_rank<r>.pt``, the legacy name, for ZeRO 0 master weights too) loads under its own
    layout only.

    Raises:
        ValueError: the folder is incomplete (names the missing file), a shard file cannot be read (names the
            files), or an optimizer state's shape differs from the model's parameter.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    saved = _check_complete(path)
    fqns = param_fqns(model)
    model_state = {"state_dict": get_model_state_dict(model)}
    # parameters stepped through float32 masters (ZeRO 0/1 under bf16-mixed) read the saved weights in float32
    masters: dict[str, torch.Tensor] = {}
    for optimizer in optimizers:
        sharded = ShardedOptimizer.of(unwrap(optimizer))
        for p in sharded.parameters() if sharded is not None else []:
            if id(p) in sharded.has_master and fqns[id(p)] in model_state["state_dict"]:
                masters[fqns[id(p)]] = _empty_like_param(p, torch.float32)
                model_state["state_dict"][fqns[id(p)]] = masters[fqns[id(p)]]
    _dcp_load(model_state, path)
    set_model_state_dict(model, model_state["state_dict"], options=StateDictOptions(strict=strict))
    metadata = torch.load(path / LIGHTNING_METADATA_FILENAME,
                          weights_only=weights_only if weights_only is not None else False)
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        sharded = ShardedOptimizer.of(unwrap(optimizer))
        legacy = path / _legacy_sharded_optimizer_file(idx, global_rank)
        if sharded is not None and legacy.exists():  # an earlier version's per-rank files
            saved = torch.load(legacy, weights_only=False)
            sharded.load_sharded_state(param_names(model), saved["state"])
            for group, values in zip(sharded.optimizer.param_groups, saved["param_groups"]):
                group.update(values)
        elif sharded is not None:
            opt_state = {key: _sharded_optimizer_template(path, saved, key, model, fqns)}
            _dcp_load(opt_state, path)
            sharded.load_gathered_state(fqns, opt_state[key], weights=masters)
        else:
            opt_state = {key: get_optimizer_state_dict(model, unwrap(optimizer), options=_FLAT_OPTIM)}
            _dcp_load(opt_state, path)
            set_optimizer_state_dict(model, unwrap(optimizer), optim_state_dict=opt_state[key], options=_FLAT_OPTIM)
    if buckets is not None and buckets.powersgd is not None:
        saved_compression = path / _compression_file(global_rank)
        saved_layout = metadata.get(LAYOUT_KEY)
        if saved_compression.exists() and (layout is None or saved_layout == layout):
            buckets.load_compression_state(param_names(model), torch.load(saved_compression, weights_only=True))
        elif saved_compression.exists():
            rank_zero_warn(f"{str(path)!r} was saved on another layout ({saved_layout}, now {layout}): PowerSGD's "
                           "error feedback restarts from zero and its warm start from a random Q.")
        else:
            rank_zero_warn(f"{str(path)!r} holds no PowerSGD state (it was saved without gradient_compression="
                           "'powersgd'): the error feedback starts from zero and the warm start from a random Q.")
    metadata.pop(LAYOUT_KEY, None)
    return metadata


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


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face safetensors in (init_from) and out (export-hf)

#: our Llama's per-layer parameter paths -> those of transformers' ``LlamaForCausalLM`` (``model.layers.<i>.``)
_HF_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
#: the parameters whose rows Hugging Face stores in rotate-half order (rotary embedding of q and k)
_ROTARY = ("attention.wq.weight", "attention.wk.weight")


def hf_name(name: str) -> str:
    """The transformers ``LlamaForCausalLM`` state-dict key of our ``LlamaModel`` parameter ``name`` (canonical,
    :func:`lightning_4d.models.llama._canonical_name`): ``"layers.3.attention.wq.weight"`` ->
    ``"model.layers.3.self_attn.q_proj.weight"``.

    Raises:
        ValueError: ``name`` is not a parameter of our Llama.
    """
    if name in _HF_TOP:
        return _HF_TOP[name]
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers":
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in _HF_LAYER:
            return f"model.layers.{parts[1]}.{_HF_LAYER[module]}.{leaf}"
    raise ValueError(f"{name!r} is not a parameter of lightning_4d's Llama (expected tok_embeddings, layers.<i>...., "
                     "norm or output)")


def rotary_from_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a Hugging Face ``q_proj`` / ``k_proj`` weight ``[heads·d, h]`` (any whole number of heads) in our
    order: transformers rotates halves (row ``j`` pairs with ``j + d/2`` in a head), Meta's Llama and ours rotate
    interleaved pairs (``2j`` with ``2j+1``). The inverse of the permutation in transformers'
    ``convert_llama_weights_to_hf.py``: ``w.view(heads, 2, d/2, h).transpose(1, 2)``."""
    heads, h = w.shape[0] // head_dim, w.shape[1]
    return w.reshape(heads, 2, head_dim // 2, h).transpose(1, 2).reshape(heads * head_dim, h)


def rotary_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`rotary_from_hf` (ours -> Hugging Face row order), as transformers' conversion script
    permutes Meta's weights."""
    heads, h = w.shape[0] // head_dim, w.shape[1]
    return w.reshape(heads, head_dim // 2, 2, h).transpose(1, 2).reshape(heads * head_dim, h)


def is_hf_model_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory: ``config.json`` and ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``."""
    return path.is_dir() and (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())


def _llamas(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from lightning_4d.models.llama import LlamaModel

    return [(name, m) for name, m in module.named_modules() if isinstance(m, LlamaModel)]


def _tp_only(p: DTensor) -> list:
    """``p``'s placements with every mesh dimension but ``tp`` replicated: a local tensor of whole heads."""
    from torch.distributed.tensor import Replicate

    names = p.device_mesh.mesh_dim_names or ()
    return [pl if (names[i] if i < len(names) else None) == "tp" else Replicate() for i, pl in enumerate(p.placements)]


def _hf_reader(path: Path) -> tuple[Any, set[str]]:
    """DCP's ``HuggingFaceStorageReader`` of the directory ``path`` and the tensor names its files hold."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    return reader, set(reader.read_metadata().state_dict_metadata)


def _hf_load(state: dict[str, torch.Tensor], reader: Any, path: Path) -> None:
    """Fill ``state`` (HF names -> this rank's tensors) in place, a read failure reported as a ``ValueError``."""
    from torch.distributed.checkpoint import load as dcp_load

    try:
        dcp_load(state, storage_reader=reader)
    except Exception as e:
        raise ValueError(f"could not read the Hugging Face weights in {str(path)!r}: {type(e).__name__}: "
                         f"{str(e)[-800:]}") from e


@torch.no_grad()
def _load_hf(llama: nn.Module, path: Path) -> None:
    """Read this rank's slices of every parameter of ``llama`` (a ``LlamaModel``, possibly split, sharded and on
    the meta device no more) from the Hugging Face directory ``path`` with DCP's ``HuggingFaceStorageReader``: each
    DTensor parameter receives just its shard of the file's tensor; q/k rows are permuted after reading their whole
    heads (the tp shard, a tp-only DTensor), then redistributed into the parameter's placements."""
    from torch.distributed.tensor import empty as dtensor_empty

    from lightning_4d.models.llama import _canonical_name

    config = llama.config
    if config.padded_vocab_size != config.vocab_size:
        raise ValueError(f"init_from={str(path)!r}: Hugging Face weights have vocab_size={config.vocab_size} rows; "
                         f"the model pads to {config.padded_vocab_size} (pad_vocab_to_multiple_of="
                         f"{config.pad_vocab_to_multiple_of}): use pad_vocab_to_multiple_of=1 to load them")
    reader, available = _hf_reader(path)
    state: dict[str, torch.Tensor] = {}
    rotary: list[tuple[nn.Parameter, torch.Tensor]] = []
    for name, p in llama.named_parameters():
        key = hf_name(_canonical_name(name))
        if key not in available:
            raise ValueError(f"init_from={str(path)!r} holds no tensor {key!r} (for our {name!r}); it holds "
                             f"{len(available)} tensors, e.g. {sorted(available)[:3]}: is it a Llama of this config?")
        if _canonical_name(name).endswith(_ROTARY):
            tmp = dtensor_empty(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=_tp_only(p)) \
                if isinstance(p, DTensor) else torch.empty_like(p)
            rotary.append((p, tmp))
            state[key] = tmp
        else:
            state[key] = p.data
    _hf_load(state, reader, path)
    for p, tmp in rotary:
        if isinstance(p, DTensor):
            local = rotary_from_hf(tmp.to_local(), config.head_dim)
            whole = DTensor.from_local(local, p.device_mesh, tmp.placements, shape=p.shape, stride=p.stride())
            p.data.to_local().copy_(whole.redistribute(p.device_mesh, p.placements).to_local())
        else:
            p.data.copy_(rotary_from_hf(tmp, config.head_dim))


@torch.no_grad()
def _load_hf_native(model: nn.Module, path: Path) -> None:
    """Read this rank's slices of a transformers ``LlamaForCausalLM`` (split by :mod:`lightning_4d.adapters.hf_llama`)
    from the Hugging Face directory ``path``: the file's keys are the model's own state-dict keys, so DCP's
    ``HuggingFaceStorageReader`` fills each (DTensor) shard in place. A tied ``lm_head.weight`` absent from the file
    is the embedding."""
    reader, available = _hf_reader(path)
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in state if k not in available and not (tied and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"init_from={str(path)!r} holds no tensor {missing[0]!r} ({len(missing)} missing): is it a "
                         "checkpoint of this model?")
    _hf_load({k: v for k, v in state.items() if k in available}, reader, path)


@torch.no_grad()
def _load_ours(prefix: str, llama: nn.Module, path: Path) -> None:
    """Load only the weights of ``llama`` (under ``prefix`` in the LightningModule) from one of our checkpoints: a
    sharded folder (DCP reads this rank's slices) or a full file (memory-mapped; each rank keeps its shards)."""
    from torch.distributed.tensor import distribute_tensor

    from lightning_4d.models.llama import _canonical_name

    params = {f"{prefix}.{_canonical_name(n)}" if prefix else _canonical_name(n): p
              for n, p in llama.named_parameters()}
    if path.is_dir():
        _check_complete(path)
        state = {"state_dict": {k: p.data for k, p in params.items()}}
        _dcp_load(state, path)
        return
    saved = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
    saved = saved.get("state_dict", saved)
    for key, p in params.items():
        if key not in saved:
            raise ValueError(f"init_from={str(path)!r} holds no weight {key!r}")
        full = saved[key]
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.data.to_local().copy_(local)
        else:
            p.data.copy_(full)


def load_initial_weights(module: nn.Module, init_from: Union[str, Path]) -> None:
    """Replace the initial weights of the ``lightning_4d`` Llama inside ``module`` (after parallelization and
    initialization, before the optimizer copies master weights) with those at ``init_from``: a Hugging Face model
    directory (:func:`is_hf_model_dir`; ``config.json`` + ``model.safetensors`` or sharded with an index) or one of
    our checkpoints (sharded folder or full file). Every rank reads only the slices it holds (DCP), so no rank
    materializes a full fp32 copy of the model. Works on every layout and on one process.

    Raises:
        ValueError: ``init_from`` does not exist or is neither kind, ``module`` holds no (or several) Llama models
            for a Hugging Face directory, or a tensor is missing or unreadable (the message names it).
    """
    from lightning_4d.adapters.hf_llama import find_hf_llamas

    path = Path(init_from)
    llamas = _llamas(module)
    if not path.exists():
        raise ValueError(f"init_from={str(init_from)!r} does not exist: pass a Hugging Face model directory "
                         "(config.json + model.safetensors[.index.json]) or a checkpoint of ours")
    hf_llamas = find_hf_llamas(module) if not llamas else []
    if len(hf_llamas) == 1 and is_hf_model_dir(path):
        _load_hf_native(hf_llamas[0], path)
        return
    if not llamas:
        raise ValueError(f"init_from={str(init_from)!r}: {type(module).__name__} holds no lightning_4d Llama model")
    if is_hf_model_dir(path):
        if len(llamas) > 1:
            raise ValueError(f"init_from={str(init_from)!r}: {type(module).__name__} holds {len(llamas)} Llama models "
                             f"({[n for n, _ in llamas]}); a Hugging Face directory holds one")
        _load_hf(llamas[0][1], path)
    elif path.is_dir() and not (path / ".metadata").is_file():
        raise ValueError(f"init_from={str(init_from)!r} is neither a Hugging Face model directory (config.json + "
                         "model.safetensors or model.safetensors.index.json) nor a sharded checkpoint (.metadata)")
    else:
        for prefix, llama in llamas:
            _load_ours(prefix, llama, path)


#: the largest safetensors file :func:`export_hf` writes (bytes; transformers' ``save_pretrained`` default is 5 GB)
HF_SHARD_BYTES = 5 * 10**9
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _saved_hparams(ckpt: Path) -> dict[str, Any]:
    """Lightning's ``hyper_parameters`` and ``datamodule_hyper_parameters`` of a checkpoint (folder or file)."""
    meta = torch.load(ckpt / LIGHTNING_METADATA_FILENAME if ckpt.is_dir() else ckpt, map_location="cpu", mmap=True,
                      weights_only=False)
    return {"model": dict(meta.get("hyper_parameters") or {}), "data": dict(meta.get("datamodule_hyper_parameters") or {})}


def _weight_entries(ckpt: Path, meta: Optional[dict[str, Any]]
                    ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Optional[dict[str, Any]]]:
    """``{saved key: (global shape, dtype)}`` of the model weights in ``ckpt`` (keys ``<prefix>.<name>``): from a
    folder's ``state_dict_metadata`` ``meta`` (:func:`_check_complete`), else from the full file, whose state dict is
    returned too."""
    if meta is not None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {k[len("state_dict."):]: (tuple(m.size), m.properties.dtype) for k, m in meta.items()
                if k.startswith("state_dict.") and isinstance(m, TensorStorageMetadata)}, None
    full = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)["state_dict"]
    return {k: (tuple(v.shape), v.dtype) for k, v in full.items()}, full


#: the start of the UserWarning ``torch.distributed.checkpoint.load(..., no_dist=True)`` gives for the single-process
#: load it was asked for (a regular expression for ``warnings.filterwarnings``)
_DCP_SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
                               r"to load in a single process")


def export_hf(ckpt: Union[str, Path], out_dir: Union[str, Path], dtype: str = "float32",
              tokenizer: Optional[Union[str, Path]] = None, shard_bytes: int = HF_SHARD_BYTES) -> Path:
    """Write one of our checkpoints as a Hugging Face Llama directory that
    ``transformers.LlamaForCausalLM.from_pretrained(out_dir)`` loads: ``config.json`` (:meth:`LlamaConfig.to_hf`),
    the weights in safetensors files of at most ``shard_bytes`` (``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``) in ``dtype``, and the tokenizer's
    ``tokenizer.json`` (``tokenizer``, else the one the checkpoint's data module used, if it was a file).

    ``ckpt`` is a sharded folder of any layout or a full file. One process, no process group: a folder is read one
    output file's tensors at a time (DCP, ``no_dist``), so peak host memory is about one shard file, not the model.
    The q/k rows are permuted to Hugging Face's rotate-half order (:func:`rotary_to_hf`) and the padded vocabulary
    rows dropped. The directory is written to ``<out_dir>.tmp`` and renamed into place when complete.

    Raises:
        ValueError: ``ckpt`` missing or incomplete, not a checkpoint of a ``lightning_4d`` Llama
            (``hyper_parameters.model_config``), an unknown ``dtype``, or ``out_dir`` exists and is not empty.
    """
    import json
    import shutil as _shutil

    from safetensors.torch import save_file

    from lightning_4d.data.tokenizers import HFTokenizer, load_tokenizer
    from lightning_4d.models.config import LlamaConfig

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid: expected one of {list(_EXPORT_DTYPES)}")
    if not ckpt.exists():
        raise ValueError(f"checkpoint {str(ckpt)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")
    saved = _check_complete(ckpt) if ckpt.is_dir() else None
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {str(out_dir)!r} exists and is not empty: pass a new directory")
    hparams = _saved_hparams(ckpt)
    spec = hparams["model"].get("model_config")
    if spec is None:
        raise ValueError(f"{str(ckpt)!r} is not a checkpoint of lightning_4d's CausalLMModule (its hyper_parameters "
                         "hold no model_config)")
    config = spec if isinstance(spec, LlamaConfig) else LlamaConfig.from_name(spec)
    source = tokenizer if tokenizer is not None else hparams["data"].get("tokenizer")
    tok = load_tokenizer(str(source)) if source is not None else None  # ValueError for a bad path, as LMDataModule
    entries, full = _weight_entries(ckpt, saved)
    keys: dict[str, str] = {}  # HF key -> saved key
    rotary, vocab = set(), set()  # HF keys whose rows are permuted / cut to the vocabulary
    for ours in _our_param_names(config):
        found = [k for k in entries if k == ours or k.endswith("." + ours)]
        if not found:
            raise ValueError(f"checkpoint {str(ckpt)!r} holds no weight for {ours!r}")
        hf = hf_name(ours)
        keys[hf] = found[0]
        if ours.endswith(_ROTARY):
            rotary.add(hf)
        if ours in ("tok_embeddings.weight", "output.weight"):
            vocab.add(hf)
    torch_dtype = _EXPORT_DTYPES[dtype]
    groups: list[list[str]] = [[]]
    size = 0
    for hf in keys:
        n = math.prod(entries[keys[hf]][0]) * torch_dtype.itemsize
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(hf)
        size += n
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        _shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for file, group in zip(names, groups):
        if full is None:
            state = {"state_dict": {keys[hf]: torch.empty(entries[keys[hf]][0], dtype=entries[keys[hf]][1])
                                    for hf in group}}
            with warnings.catch_warnings():  # torch warns that it assumes one process: that is what we asked for
                warnings.filterwarnings("ignore", message=_DCP_SINGLE_PROCESS_WARNING)
                _dcp_load(state, ckpt, no_dist=True)
            tensors = state["state_dict"]
        else:
            tensors = {keys[hf]: full[keys[hf]] for hf in group}
        out: dict[str, torch.Tensor] = {}
        for hf in group:
            t = tensors[keys[hf]].to(torch.float32)
            if hf in rotary:
                t = rotary_to_hf(t, config.head_dim)
            if hf in vocab:
                t = t[: config.vocab_size]
            out[hf] = t.to(torch_dtype).contiguous()
            weight_map[hf] = file
            total += out[hf].numel() * out[hf].element_size()
        save_file(out, str(tmp / file), metadata={"format": "pt"})
        del out, tensors
    if len(groups) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if isinstance(tok, HFTokenizer):
        file = Path(tok.name)
        _shutil.copy(file, tmp / "tokenizer.json")
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            if (file.parent / extra).is_file():
                _shutil.copy(file.parent / extra, tmp / extra)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir


def _our_param_names(config: Any) -> list[str]:
    """The canonical parameter names of an unsplit ``LlamaModel`` of ``config`` (the tied head excluded)."""
    names = ["tok_embeddings.weight"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{m}.weight" for m in _HF_LAYER]
    names.append("norm.weight")
    if not config.tie_word_embeddings:
        names.append("output.weight")
    return names


def export_hf_main(argv: list[str]) -> int:
    """``lightning-4d export-hf CKPT OUT_DIR [--dtype float32|bfloat16|float16] [--tokenizer PATH]``: see
    :func:`export_hf`. Returns the exit code (2 with a one-line error on bad input)."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-4d export-hf", description=(
        "Write a lightning_4d checkpoint (sharded folder of any layout, or full file) as a Hugging Face Llama "
        "directory (config.json, safetensors shards + index, tokenizer.json) for transformers, vLLM, llama.cpp."))
    parser.add_argument("ckpt", help="a checkpoint ModelCheckpoint wrote (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the directory to create (must not exist or be empty)")
    parser.add_argument("--dtype", default="float32", choices=list(_EXPORT_DTYPES), help="weights dtype (default float32)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (or its directory) to copy; default: the "
                        "one the checkpoint's LMDataModule used, if any")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.ckpt, args.out_dir, dtype=args.dtype, tokenizer=args.tokenizer)
    except ValueError as e:
        print(f"lightning-4d export-hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0
