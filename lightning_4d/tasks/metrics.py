"""torchmetrics metrics of :class:`~lightning_4d.tasks.CausalLMModule`: the token-weighted mean loss and its
perplexity, synchronized over the data-parallel ranks the way Lightning's metrics are."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torchmetrics import Metric


class TokenMeanLoss(Metric):
    """The token-weighted mean of per-batch mean losses (``perplexity=True``: its ``exp``, the perplexity).

    ``update(loss, tokens)`` adds ``loss x tokens`` and ``tokens``; ``compute()`` sums both over the ranks of
    ``process_group`` (torchmetrics' ``dist_reduce_fx="sum"``; ``None``: the whole world, nothing outside
    ``torch.distributed``) and returns ``sum / tokens``. Under ``FourDStrategy`` the group is ``dp_cp``: tp ranks
    hold the same loss and the same tokens, and so do all pp ranks (the pipeline shares the last stage's loss with
    every stage), so every rank computes the same value. The group may be set after construction
    (``metric.process_group = group``), as it only exists once the strategy is set up.

    The states are float32 sums (non-persistent: not in checkpoints), reset by Lightning at the end of each epoch.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    loss_sum: Tensor
    tokens: Tensor

    def __init__(self, perplexity: bool = False, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self.perplexity = perplexity
        self.add_state("loss_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, loss: Tensor, tokens: Tensor | int) -> None:
        """Add one batch: ``loss`` its mean loss (a scalar), ``tokens`` the tokens it is the mean over."""
        tokens = torch.as_tensor(tokens, device=self.tokens.device, dtype=self.tokens.dtype)
        self.loss_sum += loss.detach().to(self.loss_sum) * tokens
        self.tokens += tokens

    def compute(self) -> Tensor:
        mean = self.loss_sum / self.tokens
        return torch.exp(mean) if self.perplexity else mean
