"""The one loader of the files this package did not just write: checkpoints (full files, a sharded folder's metadata
and per-rank files), ``init_from`` files and the checkpoints ``export-hf`` reads. Loading a file never runs code
that the file carries.

- ``torch.save`` files are read with ``torch.load(..., weights_only=True)``: tensors, plain containers and numbers,
  the types torch allows by default, and this package's own plain-data types (:func:`trusted_types`:
  ``LlamaConfig`` and ``RopeScaling``). The file's pickle is inspected first without unpickling it
  (``torch.serialization.get_unsafe_globals_in_checkpoint``), so a file that names anything else (a function such
  as ``os.system``, a class of someone else's code) is refused before any of it runs, with one line that names
  the file, what it holds and what to do.
- DCP's ``.metadata`` (a plain pickle, which torch's ``FileSystemReader`` reads with ``pickle.load``) is read by an
  unpickler that admits only DCP's own metadata classes and torch's dtypes (:class:`SafeFileSystemReader`), and the
  non-tensor entries of a DCP folder (which torch's ``DefaultLoadPlanner`` unpickles unrestricted) are
  read with this loader too (:class:`SafeLoadPlanner`).
- Hugging Face directories are safetensors (a JSON header and raw bytes: no code), read by DCP's
  ``HuggingFaceStorageReader``.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

#: what a refusal tells the user to do
REMEDY = (
    "if you trust it, load it with your own trusted code and re-save what it holds as "
    "tensors, numbers, strings and plain containers (or convert it with trusted code)"
)


class UnsafeFileError(ValueError):
    """A file that holds more than a weights-only load allows (it could run code when read): refused unread."""


def trusted_types() -> list[type]:
    """This package's types a checkpoint may hold beside torch's default weights-only set: the model config
    dataclasses (plain data, no code runs when they are built). They are allowed process-wide
    (``torch.serialization.add_safe_globals``, as importing ``lightning_4d.models.llama_config`` does for Lightning's
    own loads), never through torch's ``safe_globals`` context manager, whose exit removes the types it was given even
    when they were allowed before it (torch 2.13): every later weights-only load of a checkpoint holding a
    ``LlamaConfig`` (Lightning's ``Trainer.fit(ckpt_path=...)`` with our module) would then fail."""
    from lightning_4d.models.llama_config import LlamaConfig, RopeScaling

    types = [LlamaConfig, RopeScaling]
    torch.serialization.add_safe_globals(types)
    return types


def _refusal(label: str, names: list[str]) -> UnsafeFileError:
    """The refusal of the file ``label`` (as shown: quoted) that references ``names``."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return UnsafeFileError(
        f"refusing to load {label}: it holds {shown}, which a weights-only load does not allow (unpickling "
        f"it could run code); {REMEDY}"
    )


def unsafe_globals(path: Union[str, Path]) -> list[str]:
    """The names (``module.qualname``) of the functions and classes the ``torch.save`` file ``path`` references
    that a weights-only load with :func:`trusted_types` does not allow, found without unpickling the file; ``[]``
    for a file that is not a zip-format ``torch.save`` file (:func:`load` then decides)."""
    trusted_types()
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # not a zip-format torch.save file (legacy format, corrupt, torchscript)
        return []


def load(source: Union[str, Path, io.BytesIO], mmap: bool = True, name: str = "") -> Any:
    """``torch.load`` of ``source`` (a path or an in-memory ``torch.save`` buffer) to the CPU with
    ``weights_only=True`` and :func:`trusted_types` allowed; memory mapped (``mmap``: tensors are read when used)
    when ``source`` is a zip-format file.

    Raises:
        UnsafeFileError: (a ``ValueError``) the file references a function or class outside the allowed set
            (named, with what to do), found before anything in it runs.
        ValueError: the file is missing or is not a ``torch.save`` file (naming it and torch's reason).
    """
    label = name or repr(str(source))
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise ValueError(f"cannot load {label}: no such file")
        names = unsafe_globals(source)
        if names:
            raise _refusal(label, names)
        mmap = mmap and _is_zip(source)
    else:
        mmap = False
    trusted_types()
    try:
        return torch.load(source, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:  # a legacy-format file the static check cannot read, or not a pickle
        reason = _unpickling_reason(e)
        if "global" in reason.lower():
            raise UnsafeFileError(f"refusing to load {label}: {reason[:300]}; {REMEDY}") from e
        raise ValueError(f"cannot load {label}: not a readable torch.save file ({reason[:300] or e})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"cannot load {label}: not a readable torch.save file ({type(e).__name__}: {e})") from e


def _unpickling_reason(e: Exception) -> str:
    """torch's weights-only refusal ``e`` in one line: its reason, without the advice to load with weights_only off."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.partition("WeightsUnpickler error:")[2]
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(boilerplate)]
    return " ".join(lines)


def _is_zip(path: Union[str, Path]) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


# ------------------------------------------------------------------------------------------------ DCP folders
#: the classes of ``torch.distributed.checkpoint`` a DCP ``.metadata`` pickle may name (what torch writes for a folder
#: of tensors and plain entries: plain data whose construction runs no code); any other class, a dataclass or an Enum
#: of DCP included, is refused
DCP_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
)


@functools.lru_cache(maxsize=1)
def _plain_types() -> dict[tuple[str, str], Any]:
    """``{(module, qualname): object}`` of everything but DCP's own classes a DCP ``.metadata`` pickle may name: torch's
    dtypes, layouts and memory formats, ``torch.Size``, ``pathlib``'s paths (the ``checkpoint_id`` DCP records:
    building a path runs nothing), ``collections.OrderedDict``, plain builtin containers, and the function that
    rebuilds a ``torch.layout`` by its name."""
    import collections
    import pathlib

    from lightning_4d.parallel._compat.checkpoint import layout_by_name

    torch_values = (torch.dtype, torch.layout, torch.memory_format)
    paths = (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
    builtins = (set, frozenset, list, dict, tuple, bytes, bytearray)
    return {
        **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch_values)},
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): layout_by_name,
        **{("pathlib", cls.__name__): cls for cls in paths},
        ("collections", "OrderedDict"): collections.OrderedDict,
        **{("builtins", cls.__name__): cls for cls in builtins},
    }


def _dcp_type(module: str, qualname: str) -> Any:
    """The object the pickle of a DCP ``.metadata`` may name: one of :data:`DCP_METADATA_CLASSES` or of
    :func:`_plain_types` (what torch 2.13 writes); anything else is refused (``None``)."""
    import importlib

    if (module, qualname) in DCP_METADATA_CLASSES:
        return vars(importlib.import_module(module)).get(qualname)
    return _plain_types().get((module, qualname))


class _DcpMetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (whose opcodes can be overridden) admitting :func:`_dcp_type`'s objects only, whose
    ``BUILD`` sets state on instances only: a ``BUILD`` onto a class or a function (``setattr`` of its attributes,
    e.g. ``pathlib.PosixPath.glob = frozenset`` for the whole process) is refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, label: str) -> None:
        super().__init__(file)
        self.label = repr(label)

    def find_class(self, module: str, name: str) -> Any:
        obj = _dcp_type(module, name)
        if obj is None:
            raise _refusal(self.label, [f"{module}.{name}"])
        return obj

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if isinstance(target, type) or callable(target):
            name = (
                target.__qualname__
                if isinstance(target, (type, FunctionType, BuiltinFunctionType, MethodType))
                else type(target).__name__
            )
            raise UnsafeFileError(
                f"refusing to load {self.label}: its pickle sets attributes of {name} itself (BUILD on a class), "
                f"which would change it for the whole process; {REMEDY}"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def loads_plain(data: bytes, label: str) -> Any:
    """Unpickle ``data`` (``label`` names it in errors) admitting only plain data: builtin containers, torch's
    dtypes, layouts and sizes, paths, and DCP's metadata classes (the unpickler of :func:`read_dcp_metadata`), e.g.
    torch's flight-recorder trace (:func:`lightning_4d.parallel._compat.process.collective_trace`).

    Raises:
        UnsafeFileError: the pickle names anything else, or sets attributes of a class.
    """
    return _DcpMetadataUnpickler(io.BytesIO(data), label).load()


def read_dcp_metadata(path: Union[str, Path]) -> Any:
    """DCP's ``Metadata`` of the folder ``path`` (its ``.metadata`` file), unpickled with only DCP's metadata
    classes and torch's dtypes allowed.

    Raises:
        UnsafeFileError: the file names anything else (named).
    """
    file = Path(path) / ".metadata"
    with open(file, "rb") as f:
        return _DcpMetadataUnpickler(f, str(file)).load()


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is read by :func:`read_dcp_metadata`, not ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The folder's DCP ``Metadata`` (:func:`read_dcp_metadata`; raises :class:`UnsafeFileError`)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:  # a per-rank metadata file: we never write one
            raise ValueError(f"{str(self.path)!r}: per-rank DCP metadata is not supported")
        metadata = read_dcp_metadata(self.path)
        if metadata.storage_meta is None:  # a dataclass field, None by default
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` reading a DCP folder's non-tensor entries with :func:`load` (weights only);
    ``folder`` names the folder in a refusal."""

    def __init__(self, folder: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Set the non-tensor entry ``read_item`` from ``value`` (raises :class:`UnsafeFileError`)."""
        fqn = read_item.dest_index.fqn
        obj = load(value, name=f"{self.folder!r} (its entry {fqn!r})")
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *parents, last = self.mappings[fqn]
        node = self.original_state_dict
        for key in parents:  # the state dict being loaded into holds the entry's containers already
            node = node[key]
        node[last] = obj


# ---------------------------------------------------------------------------------------------------- pre-checks
def confined(folder: Path, name: object, what: str) -> Path:
    """``folder / name`` for a file name a checkpoint's own index gives (a DCP shard's ``relative_path``, a
    safetensors index entry), when it stays inside ``folder``: a relative path without ``..`` whose resolved path
    (symlinks followed) is under the resolved folder. Checked before the file is looked at, so a crafted index can
    neither read a file elsewhere nor probe whether one exists.

    Raises:
        ValueError: naming ``what`` (the index), the entry and the folder.
    """
    text = str(name)
    candidate = Path(text)
    root = folder.resolve()
    inside = not candidate.is_absolute() and ".." not in candidate.parts and text not in ("", ".")
    if inside:
        resolved = (folder / candidate).resolve()
        inside = resolved != root and root in resolved.parents
    if not inside:
        raise ValueError(
            f"{what} names the file {text!r}, which is not inside {str(folder)!r}: a checkpoint's files are read "
            "from its own folder only (refused unread)"
        )
    return folder / candidate


def check_checkpoint(path: Union[str, Path]) -> None:
    """Refuse, before anything is built (no process group, no model), a checkpoint that holds more than plain data:
    for a file (``torch.save``), the functions and classes its pickle names (read without unpickling; a legacy-format
    file is loaded weights-only); for a sharded folder (DCP ``.metadata``), that file and every ``*.pt`` in the
    folder (Lightning's ``meta.pt``, per-rank optimizer and PowerSGD files). Anything else (a missing path, a
    Hugging Face directory: safetensors hold no code) passes: its reader reports its own errors. A DCP folder's
    non-tensor entries are checked when they are read (:class:`SafeLoadPlanner`).

    Raises:
        UnsafeFileError: (a ``ValueError``) naming the file, what it holds and what to do.
    """
    path = Path(path)
    if path.is_file():
        if unsafe_globals(path):
            raise _refusal(repr(str(path)), unsafe_globals(path))
        if not _is_zip(path):
            load(path, mmap=False)
    elif path.is_dir() and (path / ".metadata").is_file():
        read_dcp_metadata(path)
        for file in sorted(path.glob("*.pt")):
            names = unsafe_globals(file)
            if names:
                raise _refusal(repr(str(file)), names)
