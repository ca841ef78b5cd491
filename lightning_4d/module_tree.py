"""Dotted-path access to a module's submodules and the items of a decoder-layer container: the module-tree helpers
the model families (:mod:`lightning_4d.families.base`) and the parallel rewiring
(:mod:`lightning_4d.features.tensor_parallel.runtime`, :mod:`lightning_4d.features.pipeline.runtime`) share. It imports
nothing of ours, so neither side imports the other for them."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

__all__ = ["MODULE_WRAPPER_PREFIXES", "find_submodel", "layer_items", "set_submodel"]

#: the module level activation checkpointing's ``checkpoint_wrapper`` inserts into parameter names (torch's
#: ``_CHECKPOINT_WRAPPED_MODULE``)
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
#: the module level ``torch.compile`` (``OptimizedModule._orig_mod``) inserts
COMPILED_MODULE = "_orig_mod"
#: the module level FSDP1 (``torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE``) inserts
FSDP1_WRAPPED_MODULE = "_fsdp_wrapped_module"
#: every module level a wrapper inserts into parameter names, stripped from them so that a parameter keeps one name on
#: every layout (``lightning_4d.models.llama.canonical_name``). Torch's private names, written once here, below both
#: the model and the parallel code that strip or insert them; ``tests/test_compat.py`` checks each against the
#: installed torch, as it checks those of ``parallel/_compat/``.
MODULE_WRAPPER_PREFIXES = (CHECKPOINT_WRAPPED_MODULE, COMPILED_MODULE, FSDP1_WRAPPED_MODULE)


def find_submodel(module: nn.Module, path: str) -> Optional[nn.Module]:
    """``module``'s submodule at the dotted attribute ``path`` (``None`` where a module on the way is missing or
    ``None``)."""
    try:
        return module.get_submodule(path)
    except AttributeError:  # torch's get_submodule: no such attribute, or one that is not a module (None)
        return None


def own_weight(module: Optional[nn.Module]) -> Optional[nn.Parameter]:
    """The parameter ``module`` registers as ``weight`` itself (an embedding's table, a linear layer's matrix), or
    ``None`` (no module, or one without such a parameter)."""
    return None if module is None else dict(module.named_parameters(recurse=False)).get("weight")


def set_submodel(module: nn.Module, path: str, value: Optional[nn.Module]) -> None:
    """Set ``module``'s attribute at the dotted ``path`` (its parent must exist) to ``value``."""
    parent, _, leaf = path.rpartition(".")
    setattr(find_submodel(module, parent) if parent else module, leaf, value)


def layer_items(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(key, layer)`` of a decoder-layer container in order: an ``nn.ModuleDict``'s items, or an
    ``nn.ModuleList``'s ``(str(index), layer)``."""
    return (
        list(container.items())
        if isinstance(container, nn.ModuleDict)
        else [(str(i), m) for i, m in enumerate(container)]
    )
