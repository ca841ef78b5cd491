"""Callbacks of the main job."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


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
        entropy = datamodule.unigram_entropy() if hasattr(datamodule, "unigram_entropy") else float("nan")
        sample = ""
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None and hasattr(pl_module, "generate"):
            parallel_config = getattr(trainer.strategy, "parallel_config", None)
            multiple = parallel_config.sequence_divisor if parallel_config is not None else 1
            ids = pl_module.generate(tokenizer.encode(self.prompt), self.max_new_tokens, pad_to_multiple_of=multiple)
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


class ExpertLoadMonitor(L.Callback):
    """Under expert parallelism, log after every training step the load imbalance of the experts' ranks: for each
    MoE layer and ep group, the rows the most loaded ep rank's experts received over the group's mean (1.0 is
    balanced, ``ep`` all rows on one rank), the max over layers and groups. It is the figure the memory model's
    ``expert_load_imbalance`` (:func:`lightning_4d.memory.model.estimate_memory`, ``lightning-4d estimate
    --expert-load-imbalance``) multiplies the balanced received rows by; docs/moe.md says how its default was
    measured with this callback.

    Logged: ``moe_expert_load_imbalance`` (this step's) and ``moe_expert_load_imbalance_max`` (the largest since the
    fit started); ``history`` keeps every step's. The rows are those of the step's last forward of each layer (under
    pp the last micro-batch's), read off :class:`~lightning_4d.parallel.expert.ExpertDispatch`'s split sizes; one
    all-reduce of the layers' received rows over each ep group and one of a scalar over all ranks per step. Without
    expert parallelism it does nothing.
    """

    def __init__(self) -> None:
        self.history: list[float] = []
        self.peak = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        import torch
        import torch.distributed as dist

        from lightning_4d.parallel.expert import ExpertDispatch

        parallel_config = getattr(trainer.strategy, "parallel_config", None)
        if parallel_config is None or parallel_config.ep == 1 or not dist.is_initialized():
            return
        dispatches = [getattr(m, "dispatch", None) for m in pl_module.modules()]
        dispatches = [d for d in dispatches if isinstance(d, ExpertDispatch)]
        ratio = torch.zeros((), dtype=torch.float64, device=pl_module.device)
        if dispatches:  # the ranks of an ep group run the same pipeline stage: the same layers, in the same order
            received = torch.tensor([d.received_rows for d in dispatches], dtype=torch.float64, device=ratio.device)
            total = received.clone()
            dist.all_reduce(total, group=dispatches[0].group)
            ratio = (received * dispatches[0].size / total.clamp(min=1)).max()
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        value = float(ratio)
        self.history.append(value)
        self.peak = max(self.peak, value)
        pl_module.log("moe_expert_load_imbalance", value)
        pl_module.log("moe_expert_load_imbalance_max", self.peak)
