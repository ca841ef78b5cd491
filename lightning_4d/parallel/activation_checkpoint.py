"""Activation checkpointing per transformer layer (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174; "full" recomputation as in Korthikanti et al. 2022, arXiv 2205.05198). Saving and loading
training checkpoints is another thing: :mod:`lightning_4d.checkpoint`.

Both modes wrap every block in PyTorch's non-reentrant ``checkpoint_wrapper`` (parameter names keep their meaning:
DCP state dicts and our deterministic initialization strip the wrapper's ``_checkpoint_wrapped_module.`` prefix):

- ``"full"`` keeps only each layer's input for backward and recomputes the layer's forward during backward;
- ``"selective"`` decides op by op which outputs the forward keeps (op-level selective activation checkpointing:
  torchtitan's ``selective`` ``op`` mode, ``torchtitan/distributed/activation_checkpoint.py``, on PyTorch's
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). :func:`selective_checkpoint_policy` saves the
  outputs of the matmuls, of the attention kernels and of tensor parallelism's reductions, and recomputes the rest
  (RMSNorm, RoPE, SiLU and the SwiGLU product, casts, views, residual additions, sequence parallelism's
  all-gathers). A layer's backward then re-runs its pointwise ops and, under sequence parallelism, its two
  all-gathers, but no matmul and no attention kernel. Korthikanti et al. 2022's "selective activation
  recomputation" chooses the other way round (keep the matmul inputs, recompute the attention core) for an unfused
  attention whose ``s²`` tensors dominate; with fused attention kernels nothing of size ``s²`` is saved, and the
  pointwise ops are the cheap part to recompute.

The recomputation replays the same ops on the same inputs and takes the saved outputs back unchanged, so losses and
gradients equal those of ``"none"`` (``tests/test_activation_checkpointing.py``, float32; tp=2, pp=2 and cp=2 in
``tests/test_parity.py``, ``tests/test_pipeline.py`` and ``tests/test_context_parallel.py``). Bytes
kept per layer under each mode: :mod:`lightning_4d.memory.model`; what each costs: ``docs/memory.md``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_4d.config import ACTIVATION_CHECKPOINTING
from lightning_4d.parallel._compat import SAC_SAVED_PRIVATE_OPS, CheckpointImpl, checkpoint_wrapper

#: ops whose outputs ``"selective"`` saves, by qualified name (overload left out): the matmuls, and the private ops
#: of :data:`~lightning_4d.parallel._compat.SAC_SAVED_PRIVATE_OPS` (attention kernels, tp reductions).
#: ``aten::matmul`` and ``aten::linear`` are composite: the policy sees what they decompose into, ``aten::mm``
#: (``nn.Linear`` without bias, any number of leading dims), ``aten::addmm`` (with a bias) and ``aten::bmm``
#: (batched matmuls, e.g. the ``eager`` attention's, whose ``[b, heads, s, s]`` scores are then saved too).
SELECTIVE_SAVED_OPS = frozenset(("aten::mm", "aten::addmm", "aten::bmm", *SAC_SAVED_PRIVATE_OPS))


@functools.lru_cache(maxsize=None)
def _op_name(func: Any) -> str:
    """``"aten::mm"`` for ``torch.ops.aten.mm.default`` (``OpOverload.name()`` without the overload)."""
    return func.name().split(".", 1)[0]


def selective_checkpoint_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"selective"`` policy, called by PyTorch for every op a checkpointed block runs in forward: ``MUST_SAVE``
    (keep the output for backward, return it instead of recomputing) for the ops of :data:`SELECTIVE_SAVED_OPS`,
    ``PREFER_RECOMPUTE`` for every other op.

    Args:
        ctx: PyTorch's ``SelectiveCheckpointContext`` (unused: the decision depends on the op alone).
        func: the op (an ``OpOverload``, or a higher-order operator under ``torch.compile``).
        args, kwargs: the op's arguments (unused).
    """
    return CheckpointPolicy.MUST_SAVE if _op_name(func) in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block of ``model.layers`` (a ``ModuleDict``) in place.

    Args:
        model: a ``LlamaModel`` or a pipeline stage of one.
        mode: ``"none"`` (no-op), ``"full"`` or ``"selective"`` (module docstring).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode == "none":
        return
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing={mode!r} is not valid: expected one of {list(ACTIVATION_CHECKPOINTING)}."
        )
    kwargs: dict[str, Any] = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy)
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
