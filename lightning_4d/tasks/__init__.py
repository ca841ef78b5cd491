"""LightningModules for training ``lightning_4d`` models."""

from lightning_4d.parallel.loss import causal_lm_loss
from lightning_4d.tasks.causal_lm import CausalLMModule, WarmupCosine, lr_lambda
from lightning_4d.tasks.metrics import TokenMeanLoss

__all__ = ["CausalLMModule", "TokenMeanLoss", "WarmupCosine", "causal_lm_loss", "lr_lambda"]
