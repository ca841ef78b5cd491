"""Llama 2 / Llama 3 models: config and presets, rotary embeddings, attention backends, the transformer.

Depends on nothing else in ``lightning_4d`` but the Mixture-of-Experts layer an MoE decoder layer holds
(:mod:`lightning_4d.features.moe.layer`). The config (``LlamaConfig``, ``PRESETS``) is pure Python; the torch
modules are imported on first use, so the memory estimator and the CLI's ``estimate`` / ``plan`` load without torch.
"""

from importlib import import_module
from typing import Any

from lightning_4d.models.llama_config import PRESETS, LlamaConfig, RopeScaling

_LAZY = {
    "attention": "attention_backends",
    "available_backends": "attention_backends",
    "Attention": "llama",
    "FeedForward": "llama",
    "LlamaModel": "llama",
    "RMSNorm": "llama",
    "TransformerBlock": "llama",
    "apply_rotary": "rope",
    "rope_cos_sin": "rope",
    "rope_inv_freq": "rope",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"lightning_4d.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lightning_4d.models' has no attribute {name!r}")


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
