"""Activation checkpointing per transformer layer (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174; "full" recomputation as in Korthikanti et al. 2022, arXiv 2205.05198). Saving and loading
training checkpoints is another thing: :mod:`lightning_4d.checkpoint`.

``"full"`` keeps only each layer's input for backward and recomputes the layer's forward during backward, using
PyTorch's non-reentrant ``checkpoint_wrapper`` (parameter names keep their meaning: DCP state dicts and our
deterministic initialization strip the wrapper's ``_checkpoint_wrapped_module.`` prefix).
"""

from __future__ import annotations

import torch.nn as nn

from lightning_4d.parallel._compat import CheckpointImpl, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block of ``model.layers`` (a ``ModuleDict``) in place.

    Args:
        model: a ``LlamaModel`` or a pipeline stage of one.
        mode: ``"none"`` (no-op) or ``"full"``.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation_checkpointing={mode!r} is not valid: expected 'none' or 'full'")
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
