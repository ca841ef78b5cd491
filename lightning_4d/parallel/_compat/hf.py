"""transformers' private names: a model's attention implementation on transformers 4.x."""

from __future__ import annotations

from typing import Any


def set_attention_implementation(model: Any, name: str) -> None:
    """Make a transformers model use the attention function registered as ``name`` in its ``AttentionInterface``:
    the public ``set_attn_implementation`` (transformers 5), else the config's private ``_attn_implementation``
    (transformers 4.x, where it is the only way)."""
    try:
        set_implementation = model.set_attn_implementation
    except AttributeError:  # transformers 4.x
        model.config._attn_implementation = name
    else:
        set_implementation(name)
