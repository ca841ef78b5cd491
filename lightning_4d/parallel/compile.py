"""``torch.compile`` per decoder layer (``FourDStrategy(compile=True)``), as torchtitan compiles each transformer block
(``apply_compile`` in torchtitan's ``parallelize_llama``): after context / expert parallelism and activation
checkpointing, before FSDP2 (ZeRO 2/3) and before the pipeline schedule runs each stage's layers.

What is compiled is each layer's ``forward`` (an instance attribute replacing the class's, so parameter names do not
change), not its ``__call__``: the module's hooks run eagerly around the compiled region (FSDP2's all-gather and
reshard hooks, activation offload's saved-tensor hooks, whose pack hook then receives the tensors the compiled graph
saves; measured on torch 2.13 CPU: every saved tensor of a compiled ``Linear-GELU-Linear`` went through the pack hook).

Mixture-of-Experts layers read their routing counts on the host (``tolist``: the experts' row splits, the all-to-all
sizes of expert parallelism): a graph break, so such a layer compiles as several graphs with the host read between
them (``docs/parallelism.md`` has the measured comparison with Dynamo's dynamic-shape alternative).

Not under tensor parallelism (refused by :func:`lightning_4d.parallel.parallelize.validate_compile`): measured on
torch 2.13 (gloo, CPU), a compiled layer with DTensor tp plans fails in backward through AOTAutograd (the eager
redistribution after the embedding receives a plain tensor as gradient, "'Tensor' object has no attribute
'_local_tensor'"), also with the residual stream crossing the compiled region as its local tensor; Dynamo alone
(``backend="eager"``) trains correctly, so the fault is AOTAutograd's handling of DTensor, not the plans.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_4d.module_tree import CHECKPOINT_WRAPPED_MODULE

#: the Mixture-of-Experts feed-forwards (ours, transformers' Mixtral's), run eagerly inside a compiled layer: their
#: routing reads counts on the host and their token exchange sizes come from them (module docstring)
EAGER_MODULES = ("MoEFeedForward", "MixtralSparseMoeBlock")


def compile_layers(layers: list[nn.Module]) -> None:
    """Replace the ``forward`` of each module of ``layers`` (decoder layers, possibly wrapped by activation
    checkpointing; call before FSDP2) by ``torch.compile`` of it (inductor, default options), in place. Nothing is
    compiled before the first forward."""
    for layer in layers:
        for module in layer.modules():
            if type(module).__name__ in EAGER_MODULES:
                module.forward = torch.compiler.disable(module.forward)
        # full checkpointing: compiled inside the checkpoint, which runs eagerly (selective is refused with compile:
        # validate_compile)
        inner = getattr(layer, CHECKPOINT_WRAPPED_MODULE, layer)
        inner.forward = torch.compile(inner.forward)
