"""LightningModules for training ``lightning_4d`` models."""

from lightning_4d.parallel.loss import causal_lm_loss
from lightning_4d.tasks.causal_lm import CausalLMModule, lr_lambda

__all__ = ["CausalLMModule", "causal_lm_loss", "lr_lambda"]
