"""LightningModules for training ``lightning_4d`` models."""

from lightning_4d.parallel.loss import causal_lm_loss
from lightning_4d.tasks.causal_lm import CausalLMModule, WarmupCosine, lr_lambda

__all__ = ["CausalLMModule", "WarmupCosine", "causal_lm_loss", "lr_lambda"]
