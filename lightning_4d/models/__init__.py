"""Llama 2 / Llama 3 models: config and presets, rotary embeddings, attention backends, the transformer.

Depends on nothing else in ``lightning_4d``.
"""

from lightning_4d.models.attention import attention, available_backends
from lightning_4d.models.config import PRESETS, LlamaConfig, RopeScaling
from lightning_4d.models.llama import Attention, FeedForward, LlamaModel, RMSNorm, TransformerBlock
from lightning_4d.models.rope import apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "LlamaConfig",
    "LlamaModel",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "apply_rotary",
    "attention",
    "available_backends",
    "rope_cos_sin",
    "rope_inv_freq",
]
