"""Checkpoint files: how a pickled ``torch.layout`` is rebuilt, and the byte ranges DCP's ``.metadata`` records."""

from __future__ import annotations

import torch

#: ``torch.serialization._get_layout(name) -> torch.layout``: how a pickled ``torch.layout`` is rebuilt (DCP's
#: ``.metadata`` names it; torch's own weights-only unpickler allows it; :mod:`lightning_4d.safe_load` too)
layout_by_name = torch.serialization._get_layout


#: the fields of DCP's ``_StorageInfo`` (a private class: the values of ``Metadata.storage_data``) we read
DCP_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length")


def dcp_file_extents(storage_data: dict) -> dict[str, int]:
    """``{shard file name: the end of the last byte range .metadata records in it}`` from a DCP ``Metadata``'s
    ``storage_data`` (values: ``torch.distributed.checkpoint.filesystem._StorageInfo``), for the truncation check of
    :func:`lightning_4d.checkpoint._check_complete`."""
    extents: dict[str, int] = {}
    for info in storage_data.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents
