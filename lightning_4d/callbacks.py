"""Callbacks of the main job."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_4d.contract import layout_strategy, optional_member
from lightning_4d.features.moe.runtime import ExpertLoadMonitor
from lightning_4d.monitor import StepMonitor

# ExpertLoadMonitor: the MoE component's callback, named here on the command line (docs/moe.md); StepMonitor:
# tokens/s, MFU and peak memory per step (docs/monitoring.md)
__all__ = ["ExpertLoadMonitor", "StepMonitor", "TrainingSummary"]


class TrainingSummary(L.Callback):
    """At the end of ``fit``: print the final validation loss next to the corpus' unigram entropy (both in nats per
    token) and a short greedy sample of generated text.

    The unigram entropy ``H = -sum_t p(t) ln p(t)`` over the training tokens is the loss of the best model that
    ignores context: a validation loss below it shows that the model learned to use context. Generation runs on
    every rank (tensor-parallel and sharded layers need all of them) and rank 0 prints.

    Args:
        prompt: text the sample starts from.
        max_new_tokens: number of generated tokens.
    """

    def __init__(self, prompt: str = "def ", max_new_tokens: int = 80) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.summary: dict = {}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        val_loss = trainer.callback_metrics.get("val_loss")
        unigram_entropy = optional_member(datamodule, "unigram_entropy")
        entropy = unigram_entropy() if unigram_entropy is not None else float("nan")
        sample = ""
        tokenizer = optional_member(datamodule, "tokenizer")
        generate = optional_member(pl_module, "generate")
        if tokenizer is not None and generate is not None:
            layout = layout_strategy(trainer.strategy)
            multiple = layout.parallel_config.sequence_divisor if layout is not None else 1
            ids = generate(tokenizer.encode(self.prompt), self.max_new_tokens, pad_to_multiple_of=multiple)
            sample = tokenizer.decode(ids)
        self.summary = {
            "val_loss": float(val_loss) if val_loss is not None else float("nan"),
            "unigram_entropy": entropy,
            "sample": sample,
        }
        verdict = "below" if self.summary["val_loss"] < entropy else "NOT below"
        rank_zero_info(
            "\n=== lightning_4d training summary ===\n"
            f"final validation loss : {self.summary['val_loss']:.4f} nats/token\n"
            f"corpus unigram entropy: {entropy:.4f} nats/token  (validation loss is {verdict} it)\n"
            f"greedy sample (prompt {self.prompt!r}):\n{sample}\n"
            "====================================="
        )
