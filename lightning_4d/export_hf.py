"""``lightning-4d export-hf``: one of our checkpoints (a ``CausalLMModule``'s, any layout, sharded folder or full file)
written as a Hugging Face Llama (or Mixtral) directory that ``transformers`` loads (:func:`export_hf`), and its command
line (:func:`export_hf_main`). Reading Hugging Face directories, which every model family does, is
:mod:`lightning_4d.families.hf_io`; the name mapping and q/k permutation are :mod:`lightning_4d.models.hf_mapping`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_4d.checkpoint import check_complete, read_folder
from lightning_4d.models import hf_mapping
from lightning_4d.parallel._compat.lightning import LIGHTNING_METADATA_FILENAME
from lightning_4d.safe_load import load as safe_load

__all__ = ["EXPORT_DTYPES", "HF_SHARD_BYTES", "export_hf", "export_hf_main"]

#: the largest safetensors file :func:`export_hf` writes (bytes; transformers' ``save_pretrained`` default is 5 GB)
HF_SHARD_BYTES = 5 * 10**9
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _saved_hparams(ckpt: Path) -> dict[str, Any]:
    """Lightning's ``hyper_parameters`` and ``datamodule_hyper_parameters`` of a checkpoint (folder or file)."""
    meta = safe_load(ckpt / LIGHTNING_METADATA_FILENAME if ckpt.is_dir() else ckpt)
    return {
        "model": dict(meta.get("hyper_parameters") or {}),
        "data": dict(meta.get("datamodule_hyper_parameters") or {}),
    }


def _weight_entries(
    ckpt: Path, meta: Optional[dict[str, Any]]
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Optional[dict[str, Any]]]:
    """``{saved key: (global shape, dtype)}`` of the model weights in ``ckpt`` (keys ``<prefix>.<name>``): from a
    folder's ``state_dict_metadata`` ``meta`` (:func:`~lightning_4d.checkpoint.check_complete`), else from the full
    file, whose state dict is returned too."""
    if meta is not None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {
            k[len("state_dict.") :]: (tuple(m.size), m.properties.dtype)
            for k, m in meta.items()
            if k.startswith("state_dict.") and isinstance(m, TensorStorageMetadata)
        }, None
    full = safe_load(ckpt)["state_dict"]
    return {k: (tuple(v.shape), v.dtype) for k, v in full.items()}, full


def _export_groups(
    config: Any, entries: dict[str, tuple[tuple[int, ...], torch.dtype]], ckpt: Path, itemsize: int, shard_bytes: int
) -> tuple[dict[str, str], list[list[str]]]:
    """``({our canonical name: saved key}, [[our names of output file 1], ...])``: every parameter of our Llama of
    ``config`` found in ``entries``, grouped into files of at most ``shard_bytes`` (a bigger tensor alone)."""
    keys: dict[str, str] = {}
    for ours in hf_mapping.param_names(config):
        found = [k for k in entries if k == ours or k.endswith("." + ours)]
        if not found:
            raise ValueError(f"checkpoint {str(ckpt)!r} holds no weight for {ours!r}")
        keys[ours] = found[0]
    groups: list[list[str]] = [[]]
    size = 0
    for ours, key in keys.items():
        n = math.prod(entries[key][0]) * itemsize
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(ours)
        size += n
    return keys, groups


def _read_group(
    ckpt: Path, keys: list[str], entries: dict[str, Any], full: Optional[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    """The full tensors of the saved ``keys``: from the full file's state dict ``full``, else read from the folder
    (DCP in this process, no process group: torch's single-process notice is not the user's concern)."""
    if full is not None:
        return {k: full[k] for k in keys}
    state = {"state_dict": {k: torch.empty(entries[k][0], dtype=entries[k][1]) for k in keys}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        read_folder(state, ckpt, no_dist=True)
    return state["state_dict"]


def _saved_model_config(ckpt: Path, hparams: dict[str, Any]) -> Any:
    """The ``LlamaConfig`` a ``CausalLMModule`` checkpoint saved (its ``hyper_parameters.model_config``: the config or
    a preset name).

    Raises:
        ValueError: the checkpoint holds none (not a ``CausalLMModule``'s).
    """
    from lightning_4d.models.llama_config import LlamaConfig

    spec = hparams["model"].get("model_config")
    if spec is None:
        raise ValueError(
            f"{str(ckpt)!r} is not a checkpoint of lightning_4d's CausalLMModule (its hyper_parameters "
            "hold no model_config)"
        )
    return spec if isinstance(spec, LlamaConfig) else LlamaConfig.from_name(spec)


def _write_weights(
    out: Path,
    ckpt: Path,
    config: Any,
    keys: dict[str, str],
    groups: list[list[str]],
    entries: dict[str, Any],
    full: Optional[dict[str, Any]],
    dtype: torch.dtype,
) -> None:
    """Write the weights of ``groups`` (:func:`_export_groups`) into ``out`` in ``dtype``, one safetensors file per
    group, read one group at a time: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``; Hugging Face's names and tensors
    (:func:`lightning_4d.models.hf_mapping.hf_tensors`).

    Written with ``safetensors.torch.save_file`` per output file, not DCP's ``HuggingFaceStorageWriter``: that
    writer saves one state dict per ``dcp.save`` and its ``finish`` writes the index of that call's tensors only,
    so a sharded directory would need the whole model in host memory at once (one call) or end with the index of
    the last file only (one call per file).
    """
    from safetensors.torch import save_file

    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map, total = {}, 0
    for file, group in zip(names, groups):
        tensors = _read_group(ckpt, [keys[ours] for ours in group], entries, full)
        tensors_out: dict[str, torch.Tensor] = {}
        for ours in group:
            for hf, t in hf_mapping.hf_tensors(ours, tensors[keys[ours]].to(torch.float32), config):
                tensors_out[hf] = t.to(dtype).contiguous()
                weight_map[hf] = file
                total += tensors_out[hf].numel() * tensors_out[hf].element_size()
        save_file(tensors_out, str(out / file), metadata={"format": "pt"})
        del tensors_out, tensors
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )


def _copy_tokenizer(tok: Any, out: Path) -> None:
    from lightning_4d.data.tokenizers import HFTokenizer

    if isinstance(tok, HFTokenizer):
        file = Path(tok.name)
        shutil.copy(file, out / "tokenizer.json")
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            if (file.parent / extra).is_file():
                shutil.copy(file.parent / extra, out / extra)


def export_hf(
    ckpt: Union[str, Path],
    out_dir: Union[str, Path],
    dtype: str = "float32",
    tokenizer: Optional[Union[str, Path]] = None,
    shard_bytes: int = HF_SHARD_BYTES,
) -> Path:
    """Write one of our checkpoints as a Hugging Face Llama directory that
    ``transformers.LlamaForCausalLM.from_pretrained(out_dir)`` loads (an MoE config: a Mixtral directory for
    ``MixtralForCausalLM``, :meth:`LlamaConfig.to_hf` and :func:`lightning_4d.models.hf_mapping.hf_tensors`):
    ``config.json`` (:meth:`LlamaConfig.to_hf`),
    the weights in safetensors files of at most ``shard_bytes`` (``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``) in ``dtype``, and the tokenizer's
    ``tokenizer.json`` (``tokenizer``, else the one the checkpoint's data module used, if it was a file).

    ``ckpt`` is a sharded folder of any layout or a full file. One process, no process group: a folder is read one
    output file's tensors at a time (DCP, ``no_dist``), so peak host memory is about one shard file, not the model.
    The q/k rows are permuted to Hugging Face's rotate-half order and the padded vocabulary rows dropped
    (:func:`lightning_4d.models.hf_mapping.to_hf_tensor`). The directory is written to a fresh hidden folder of its
    own beside it (``.<name>.tmp-XXXX``, removed if the export fails) and renamed into place when complete: nothing
    of the user's is overwritten or deleted.

    Raises:
        ValueError: ``ckpt`` missing or incomplete, not a checkpoint of a ``lightning_4d`` Llama
            (``hyper_parameters.model_config``), an unknown ``dtype``, ``out_dir`` exists and is not empty, or an
            MoE config transformers' Mixtral cannot express (:meth:`LlamaConfig.to_hf`).
    """
    from lightning_4d.data.tokenizers import load_tokenizer

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid: expected one of {list(EXPORT_DTYPES)}")
    if not ckpt.exists():
        raise ValueError(f"checkpoint {str(ckpt)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")
    saved = check_complete(ckpt) if ckpt.is_dir() else None
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {str(out_dir)!r} exists and is not empty: pass a new directory")
    hparams = _saved_hparams(ckpt)
    config = _saved_model_config(ckpt, hparams)
    hf_config = config.to_hf()  # ValueError for an MoE config transformers' Mixtral cannot express, before any write
    source = tokenizer if tokenizer is not None else hparams["data"].get("tokenizer")
    tok = load_tokenizer(str(source)) if source is not None else None  # ValueError for a bad path, as LMDataModule
    entries, full = _weight_entries(ckpt, saved)
    torch_dtype = EXPORT_DTYPES[dtype]
    keys, groups = _export_groups(config, entries, ckpt, torch_dtype.itemsize, shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name of our own beside out_dir (never a folder of the user's), removed if the export fails
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_weights(tmp, ckpt, config, keys, groups, entries, full, torch_dtype)
        hf_config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        _copy_tokenizer(tok, tmp)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_hf_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-4d export-hf`` (tests/test_docs.py parses the commands the docs show)."""
    parser = argparse.ArgumentParser(
        prog="lightning-4d export-hf",
        description=(
            "Write a lightning_4d checkpoint (sharded folder of any layout, or full file) as a Hugging Face Llama "
            "directory (config.json, safetensors shards + index, tokenizer.json) for transformers, vLLM, llama.cpp."
        ),
    )
    parser.add_argument("ckpt", help="a checkpoint ModelCheckpoint wrote (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the directory to create (must not exist or be empty)")
    parser.add_argument(
        "--dtype", default="float32", choices=list(EXPORT_DTYPES), help="weights dtype (default float32)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json (or its directory) to copy; default: the one the checkpoint's LMDataModule used, if any",
    )
    return parser


def export_hf_main(argv: list[str]) -> int:
    """``lightning-4d export-hf CKPT OUT_DIR [--dtype float32|bfloat16|float16] [--tokenizer PATH]``: see
    :func:`export_hf`. Returns the exit code (2 with a one-line error on bad input)."""
    args = export_hf_parser().parse_args(argv)
    try:
        out = export_hf(args.ckpt, args.out_dir, dtype=args.dtype, tokenizer=args.tokenizer)
    except ValueError as e:
        print(f"lightning-4d export-hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0
