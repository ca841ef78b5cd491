"""Hugging Face safetensors directories read by every model family: recognizing one and reading each rank's slices
of it (DCP's ``HuggingFaceStorageReader``; ``init_from``). The name mapping and q/k permutation are the family's
(:mod:`lightning_4d.models.hf_mapping` for our Llama). Writing one of our checkpoints as such a directory is
``export-hf`` (:mod:`lightning_4d.export_hf`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def is_hf_model_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory: ``config.json`` and ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``."""
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())
    )


def _check_shards(path: Path) -> None:
    """Raise when a file that ``model.safetensors.index.json`` of the directory ``path`` maps tensors to is outside
    ``path`` (:func:`lightning_4d.safe_load.confined`, checked before any is looked at) or missing (naming it and how
    many tensors it holds), or the index is not valid JSON."""
    from lightning_4d.safe_load import confined

    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{str(index)!r} is not a safetensors index (JSON with a weight_map): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index)!r} is not a safetensors index: its weight_map is not an object")
    for name in sorted(set(map(str, weight_map.values()))):
        confined(path, name, f"{str(index)!r}")
    for name in sorted(set(weight_map.values())):
        if not (path / name).is_file():
            count = sum(1 for v in weight_map.values() if v == name)
            raise ValueError(
                f"Hugging Face directory {str(path)!r} is incomplete: shard {name!r} (holding {count} tensors, "
                f"listed in model.safetensors.index.json) is missing"
            )


def hf_reader(path: Path) -> tuple[Any, set[str]]:
    """DCP's ``HuggingFaceStorageReader`` of the directory ``path`` and the tensor names its files hold.

    Raises:
        ValueError: a shard file its index lists is missing (named).
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    _check_shards(path)
    reader = HuggingFaceStorageReader(str(path))
    return reader, set(reader.read_metadata().state_dict_metadata)


def hf_load(state: dict[str, torch.Tensor], reader: Any, path: Path) -> None:
    """Fill ``state`` (Hugging Face names -> this rank's tensors, DTensors receive their shard) in place from
    ``reader`` (:func:`hf_reader`). A floating-point tensor saved in another floating dtype is cast (a bfloat16
    directory into float32 parameters); one of another shape or a non-floating dtype is refused, unread.

    Raises:
        ValueError: a tensor's saved shape differs from the model's, or its dtype is not floating point (each naming
            the tensor, both shapes or dtypes and the directory), or a read failure, naming the directory.
    """
    from torch.distributed.checkpoint import CheckpointException, load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = reader.read_metadata().state_dict_metadata
    for key, target in state.items():
        meta = saved.get(key)
        tensor = meta if isinstance(meta, TensorStorageMetadata) else None  # None: absent, or saved bytes
        size = tuple(tensor.size) if tensor is not None else ()
        if meta is not None and size != tuple(target.shape):
            raise ValueError(
                f"Hugging Face directory {str(path)!r}: tensor {key!r} has shape {size}, the model's is "
                f"{tuple(target.shape)}: it is not a checkpoint of this model config"
            )
        dtype = tensor.properties.dtype if tensor is not None else None
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(
                f"Hugging Face directory {str(path)!r}: tensor {key!r} is {dtype} (the model's {target.dtype}): "
                "quantized or not model weights; pass a directory of floating-point weights"
            )
    try:
        dcp_load(state, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise ValueError(
            f"could not read the Hugging Face weights in {str(path)!r}: {type(e).__name__}: {str(e)[-800:]}"
        ) from e
