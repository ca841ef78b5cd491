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

  Two kinds of projection are the exception (the tp plan's ``rowwise`` modules, ``wo`` and ``w2``; the family
  names them: :func:`apply_activation_checkpointing`'s ``row_parallel``):

  - the layer's last projection (``w2``, whose output only feeds the residual sum that is the layer's output, which
    the next layer keeps as its input) keeps nothing: PyTorch's recomputation stops once it has packed ``w2``'s
    inputs (early stop, before ``w2``'s kernel runs), so its output, and under tp its reduction, were kept for
    nothing; recomputing them costs nothing either;
  - under tensor parallelism ``wo``'s matmul output is the partial sum over the rank's heads, ``[b, s, h]`` in full
    on every tp rank, and its reduction (all-reduce, or reduce-scatter to the ``[b, s/t, h]`` sequence shard under
    sp) is what the rest of the layer reads: selective keeps the reduction and recomputes the matmul (``2·b·s·h·h/t``
    FLOPs per layer in backward, about 2.6% of a Llama 3 8B layer's step FLOPs).

  So a layer under tp keeps about ``1/t`` of what it keeps at tp = 1 (Korthikanti et al. 2022 §4.2: what a
  sequence-parallel layer must keep is its sequence shard). Forward hooks on those modules tell the policy where an
  op runs (:func:`mark_projections`).

The recomputation replays the same ops on the same inputs and takes the saved outputs back unchanged, so losses and
gradients equal those of ``"none"`` (``tests/test_activation_checkpointing.py``, float32; tp=2, pp=2 and cp=2 in
``tests/test_parity.py``, ``tests/test_pipeline.py`` and ``tests/test_context_parallel.py``). Bytes
kept per layer under each mode: :mod:`lightning_4d.planning.model`; what each costs: ``docs/memory.md``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_4d.config import ACTIVATION_CHECKPOINTING
from lightning_4d.parallel._compat.fsdp import SAC_SAVED_PRIVATE_OPS, CheckpointImpl, checkpoint_wrapper

#: the matmul ops a projection runs
_MATMULS = frozenset(("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm"))
#: how many marked projections are running now, by kind (:func:`mark_projections`): ``"partial"`` (under tp: the
#: matmul recomputed, the reduction kept) and ``"output"`` (the layer's last projection: nothing kept)
_running = {"partial": 0, "output": 0}

#: ops whose outputs ``"selective"`` saves, by qualified name (overload left out): the matmuls, and the private ops
#: of :data:`~lightning_4d.parallel._compat.fsdp.SAC_SAVED_PRIVATE_OPS` (attention kernels, tp reductions).
#: ``aten::matmul`` and ``aten::linear`` are composite: the policy sees what they decompose into, ``aten::mm``
#: (``nn.Linear`` without bias, any number of leading dims), ``aten::addmm`` (with a bias) and ``aten::bmm``
#: (batched matmuls, e.g. the ``eager`` attention's, whose ``[b, heads, s, s]`` scores are then saved too).
SELECTIVE_SAVED_OPS = frozenset((*_MATMULS, *SAC_SAVED_PRIVATE_OPS))


@functools.lru_cache(maxsize=None)
def _op_name(func: Any) -> str:
    """``"aten::mm"`` for ``torch.ops.aten.mm.default`` (``OpOverload.name()`` without the overload)."""
    return func.name().split(".", 1)[0]


def selective_checkpoint_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"selective"`` policy, called by PyTorch for every op a checkpointed block runs in forward: ``MUST_SAVE``
    (keep the output for backward, return it instead of recomputing) for the ops of :data:`SELECTIVE_SAVED_OPS`,
    ``PREFER_RECOMPUTE`` for every other op, and for those that run inside a projection :func:`mark_projections`
    marked: every op of an ``"output"`` one, the matmuls of a ``"partial"`` one.

    Args:
        ctx: PyTorch's ``SelectiveCheckpointContext`` (unused: the decision depends on the op alone).
        func: the op (an ``OpOverload``, or a higher-order operator under ``torch.compile``).
        args, kwargs: the op's arguments (unused).
    """
    name = _op_name(func)
    if name not in SELECTIVE_SAVED_OPS or _running["output"] or (_running["partial"] and name in _MATMULS):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _count(kind: str, step: int) -> Any:
    def hook(module: nn.Module, *args: Any) -> None:
        _running[kind] += step

    return hook


def mark_projections(modules: list[nn.Module], kind: str) -> None:
    """Mark ``modules`` for the ``"selective"`` policy (module docstring): ``kind`` ``"partial"`` (a row-parallel
    projection under tp: the matmuls inside recomputed, the reduction after them kept) or ``"output"`` (the layer's
    last projection: nothing inside kept). Forward pre- and post-hooks count the marked modules running, in forward
    and in the recomputation alike; the post-hook runs even when the forward raises (``always_call``): PyTorch stops
    a recomputation early by raising inside the module whose inputs were the last tensors it needed (``w2``)."""
    for m in modules:
        m.register_forward_pre_hook(_count(kind, 1))
        m.register_forward_hook(_count(kind, -1), always_call=True)


def _submodule(layer: nn.Module, name: str) -> Any:
    """``layer``'s submodule ``name`` (dotted), ``None`` where the layer has none (a Mixture-of-Experts layer has no
    ``feed_forward.w2``)."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def apply_activation_checkpointing(
    layers: nn.Module, mode: str, row_parallel: tuple[str, ...] = (), tp: int = 1
) -> None:
    """Wrap every decoder layer of ``layers`` (an ``nn.ModuleDict`` or ``nn.ModuleList``; layers without parameters,
    a pipeline's placeholders, stay as they are) in place.

    Args:
        layers: the model's decoder-layer container (``LlamaModel.layers``, or a pruned one of a pipeline rank).
        mode: ``"none"`` (no-op), ``"full"`` or ``"selective"`` (module docstring).
        row_parallel: the row-parallel projections of one layer (dotted names relative to it, the tp plan's
            ``rowwise``, the layer's last projection last); ``tp``: the tensor-parallel size. ``"selective"`` keeps
            nothing of the last one and, under tp, the reductions but not the partial sums of the others (module
            docstring). A name a layer lacks (an MoE layer's ``feed_forward.w2``) is left out for that layer.

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
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    for key in keys:
        if any(True for _ in layers[key].parameters()):
            if mode == "selective" and row_parallel:
                *partial, output = [_submodule(layers[key], name) for name in row_parallel]
                mark_projections([m for m in [output] if m is not None], "output")
                if tp > 1:
                    mark_projections([m for m in partial if m is not None], "partial")
            layers[key] = checkpoint_wrapper(layers[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
