"""``torch.compile`` per decoder layer (``FourDStrategy(compile=True)``), as torchtitan compiles each transformer block
(``apply_compile`` in torchtitan's ``parallelize_llama``): after context parallelism, the MoE step and activation
checkpointing, before FSDP2 (ZeRO 2/3) and before the pipeline schedule runs each stage's layers.

What is compiled is each layer's ``forward`` (an instance attribute replacing the class's, so parameter names do not
change), not its ``__call__``: the module's hooks run eagerly around the compiled region (FSDP2's all-gather and
reshard hooks, activation offload's saved-tensor hooks, whose pack hook then receives the tensors the compiled graph
saves; measured on torch 2.13 CPU: every saved tensor of a compiled ``Linear-GELU-Linear`` went through the pack hook).

Mixture-of-Experts layers read their routing counts on the host (``tolist``: the routed rows' splits, the all-to-all
sizes of ep): a graph break, so such a layer compiles as several graphs with the host read between
them (``docs/validation_cpu.md`` has the measured comparison with Dynamo's dynamic-shape alternative).

Under tensor parallelism the DTensors live inside the compiled region (the sharded weights, the norms'
sequence-sharded ``Shard(1)`` inputs, the redistributions of the plans), and the layer's input and output are plain
local tensors: the residual stream ``[b, s/t, h]`` under sequence parallelism, ``[b, s, h]`` without, as the plans of
:mod:`lightning_4d.features.tensor_parallel.runtime` hand them over (torchtitan compiles its tp blocks the same way).
One more step: the first layer's input is the embedding's output, the local tensor of a redistribution, which DTensor
returns as an ``AsyncCollectiveTensor`` (the collective's result not waited for yet); AOTAutograd resolves such an input
to its inner tensor before tracing, and that tensor does not require grad, so the compiled backward returned no gradient
for it and the eager redistribution after the embedding failed ("'Tensor' object has no attribute '_local_tensor'",
measured on torch 2.13, gloo, CPU). Each compiled layer's ``forward`` therefore waits for such inputs eagerly first
(:class:`_WaitAsyncCollective`: a view, no copy; gradient passed through), and the compiled graph takes plain tensors.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import Tensor

from lightning_4d.parallel._compat.compile import AsyncCollectiveTensor
from lightning_4d.parallel._compat.fsdp import checkpointed_module

#: the Mixture-of-Experts feed-forwards (ours, transformers' Mixtral's), run eagerly inside a compiled layer: their
#: routing reads counts on the host and their token exchange sizes come from them (module docstring)
EAGER_MODULES = ("MoEFeedForward", "MixtralSparseMoeBlock")


class _WaitAsyncCollective(torch.autograd.Function):
    """``x`` (an ``AsyncCollectiveTensor``, any shape) -> the same values as a plain tensor (a view of its waited
    inner tensor, no copy); backward passes the gradient through unchanged (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: D102
        inner = x.trigger_wait()
        return inner.view_as(inner)  # a new tensor object: autograd's metadata is not written into the ACT's inner one

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        return grad


def _compiled_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(forward)`` called with every ``AsyncCollectiveTensor`` argument (positional or keyword) waited
    for eagerly first (:class:`_WaitAsyncCollective`), so the compiled graph takes plain tensors (module docstring)."""
    compiled = torch.compile(forward)

    def plain(a: Any) -> Any:
        return _WaitAsyncCollective.apply(a) if isinstance(a, AsyncCollectiveTensor) else a

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return compiled(*map(plain, args), **{k: plain(v) for k, v in kwargs.items()})

    return run


def compile_layers(layers: list[nn.Module]) -> None:
    """Replace the ``forward`` of each module of ``layers`` (decoder layers, possibly wrapped by activation
    checkpointing; call before FSDP2) by ``torch.compile`` of it (inductor, default options), in place, behind an
    eager wait for inputs still in flight (:func:`_compiled_forward`). Nothing is compiled before the first forward."""
    for layer in layers:
        for module in layer.modules():
            if type(module).__name__ in EAGER_MODULES:
                module.forward = torch.compiler.disable(module.forward)
        # full checkpointing: compiled inside the checkpoint, which runs eagerly (selective is refused with compile:
        # validate_compile)
        inner = checkpointed_module(layer)
        inner.forward = _compiled_forward(inner.forward)
