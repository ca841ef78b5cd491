"""``CausalLMModule``: the LightningModule that pretrains (or fine-tunes) a ``lightning_4d`` Llama model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.contract import LayoutStrategy, layout_strategy, optional_member
from lightning_4d.families.registry import load_initial_weights
from lightning_4d.features.moe.runtime import MoETraining
from lightning_4d.models.document_mask import DOCUMENT_IDS
from lightning_4d.models.llama import LlamaModel
from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.parallel._compat.kernels import grouped_mm
from lightning_4d.parallel._compat.lightning import attached_trainer, set_scheduler_lrs
from lightning_4d.parallel.loss import causal_lm_loss
from lightning_4d.precision import loss_scaler
from lightning_4d.safe_load import check_checkpoint
from lightning_4d.tasks.documents import DocumentMasking, token_weight
from lightning_4d.tasks.metrics import TokenMeanLoss

#: :meth:`CausalLMModule.generate` right-pads each forward's sequence to a multiple of this many tokens (one shape for
#: this many consecutive new tokens)
GENERATE_LENGTH_STEP = 32


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warm-up then cosine decay.

    ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; then
    ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))`` with
    ``progress = (step - warmup_steps) / (max_steps - warmup_steps)`` clipped to [0, 1] (Loshchilov & Hutter 2017,
    "SGDR", arXiv 1608.03983; the schedule of the Llama papers).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """The learning-rate multiplier of :class:`CausalLMModule` (:func:`lr_lambda` with its three settings), as an
    object rather than a closure: ``LambdaLR`` saves a callable object's ``__dict__`` with the scheduler's state, so
    a checkpoint records the schedule (``warmup_steps``, ``total_steps``, ``min_lr_ratio``) and a resume continues the
    schedule the run was started with, whatever the resuming Trainer's ``max_steps`` (a function would be saved as
    ``None`` and the schedule rebuilt from the new ``max_steps``: the LR would jump at the resume)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_lambda(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)

    def __repr__(self) -> str:
        return (
            f"WarmupCosine(warmup_steps={self.warmup_steps}, total_steps={self.total_steps}, "
            f"min_lr_ratio={self.min_lr_ratio})"
        )


class CausalLMModule(MoETraining, L.LightningModule):
    """Next-token prediction with AdamW and warm-up + cosine learning rate.

    Args:
        model_config: a preset name (``"tiny"``, ``"llama3-8b"``, ... see ``LlamaConfig.preset_names()``), the
            directory of a Hugging Face Llama (its ``config.json``: :meth:`LlamaConfig.from_hf`) or a ``LlamaConfig``.
        learning_rate: peak learning rate.
        min_lr_ratio: final learning rate as a fraction of the peak.
        warmup_steps: optimizer steps of linear warm-up.
        max_steps: length of the cosine schedule in optimizer steps (default: the Trainer's ``max_steps``, else its
            estimated stepping batches). The schedule is saved in checkpoints (:class:`WarmupCosine`): resuming with
            ``ckpt_path`` continues the schedule the run was started with (warm-up, length, final ratio), also
            when the resuming Trainer's ``max_steps`` is larger (the steps past the schedule's end run at
            ``min_lr_ratio``), unless ``max_steps`` is given here: then the resumed run follows the new schedule
            (``warmup_steps``, ``max_steps``, ``min_lr_ratio`` of this module) from the resumed step on
            (``--model.max_steps=600``; ``docs/checkpoints.md``).
        weight_decay: AdamW decoupled weight decay, applied to matrices only (embeddings and linear weights; not to
            norm weights).
        betas: AdamW's ``(beta1, beta2)``.
        eps: AdamW's epsilon.
        init_seed: seed of the layout-independent weight initialization (same seed ⇒ same weights on every layout).
        init_from: start from these weights instead of the random initialization (fit, validate, test and predict
            alike): a Hugging Face Llama directory (``config.json`` + ``model.safetensors`` or sharded with
            ``model.safetensors.index.json``; pair it with ``model_config=LlamaConfig.from_hf(dir)``, or in YAML
            ``model_config: <dir>``) or one of our checkpoints (a sharded folder or a full file; weights only).
            Under ``FourDStrategy`` each rank reads only its own slices after parallelization
            (:func:`lightning_4d.families.registry.load_initial_weights`). Ignored when Lightning resumes from
            ``ckpt_path``. A checkpoint that holds more than plain data (a pickle that could run code) is refused
            here, unread (:func:`lightning_4d.safe_load.check_checkpoint`: a ``ValueError`` naming the file).
        document_masking: attention stays within each document of a packed window (Llama 3's pretraining mask; off
            by default): the documents come from the batch's ``"document_ids"`` ``[b, s]`` when the data gives them,
            else from the end-of-document tokens of ``input_ids`` (``eos_token_id``; the EOS ends its document).
            Every layout (pp: each stage masks its micro-batch from the batch it holds) and every cp method
            (:mod:`lightning_4d.models.document_mask`, ``docs/data.md``).
        eos_token_id: the end-of-document token (default: the DataModule's ``tokenizer.eos_id``, what
            ``prepare-data`` appends after every document).
        reset_position_ids: with document masking, the rotary positions restart at 0 at each document (default
            on, as Megatron's ``reset_position_ids`` and torchtitan's packed documents).
        eod_mask_loss: with document masking, the loss at each EOS (which would predict the next document's first
            token) is not trained (default on, Megatron's ``eod_mask_loss``). The loss is then the mean over the
            trained tokens of the whole global batch (their count summed over dp x cp), not a mean of per-rank means.

    Logs ``train_loss`` (mean over the global batch, identical on every rank), ``val_loss`` and ``val_ppl``
    (torchmetrics, :class:`~lightning_4d.tasks.metrics.TokenMeanLoss`: the token-weighted mean loss over the whole
    validation set and its ``exp``, summed over the data-parallel ranks at the end of the epoch, identical on every
    rank) and ``lr`` (tokens per second, MFU and peak memory per step: :class:`~lightning_4d.monitor.StepMonitor`,
    a callback the shipped configs add). An MoE model also trains and logs its load-balancing loss and routing
    statistics (:class:`~lightning_4d.features.moe.runtime.MoETraining`).

    Batches are ``{"input_ids": LongTensor [b, s], "labels": LongTensor [b, s]}``, with document masking optionally
    ``"document_ids": LongTensor [b, s]`` (non-decreasing along each sequence).

    Raises:
        ValueError: a bad argument (one line naming it): an unknown preset, ``learning_rate <= 0``, ``warmup_steps
            < 0``, a missing ``init_from``, ``reset_position_ids`` / ``eod_mask_loss`` without ``document_masking``,
            document masking with ``attention_backend='flash'``; at fit, document masking without an EOS token.
    """

    def __init__(
        self,
        model_config: Union[str, LlamaConfig] = "tiny",
        learning_rate: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        init_seed: int = 0,
        init_from: Optional[str] = None,
        document_masking: bool = False,
        eos_token_id: Optional[int] = None,
        reset_position_ids: Optional[bool] = None,
        eod_mask_loss: Optional[bool] = None,
    ) -> None:
        super().__init__()
        if isinstance(model_config, str):
            model_config = LlamaConfig.from_name(model_config)
        if not isinstance(model_config, LlamaConfig):
            raise ValueError(f"model_config={model_config!r} is not valid: expected a preset name or a LlamaConfig")
        model_config.check_trainable("CausalLMModule")  # e.g. the Llama 4 presets: estimate / plan only
        if learning_rate <= 0:
            raise ValueError(f"learning_rate={learning_rate} is not valid: expected > 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} is not valid: expected >= 0")
        self.save_hyperparameters()
        self.model_config = model_config
        self.init_from = str(init_from) if init_from is not None else None
        if self.init_from is not None and not Path(self.init_from).exists():
            raise ValueError(
                f"init_from={self.init_from!r} does not exist: pass a Hugging Face model directory or "
                "a checkpoint of ours"
            )
        if self.init_from is not None:  # a file that would run code when read: refused here, before any process group
            check_checkpoint(self.init_from)
        self.documents = DocumentMasking.of(
            document_masking, eos_token_id, reset_position_ids, eod_mask_loss, model_config.attention_backend
        )
        self.model: Optional[LlamaModel] = None
        #: eod_mask_loss under pp: the training step's loss scale per trained token (:meth:`pipeline_loss`)
        self._pipeline_scale: Optional[Tensor] = None
        # validation metrics (torchmetrics, synchronized over the dp x cp group: _validation_metrics)
        self.val_loss_metric = TokenMeanLoss()
        self.val_ppl_metric = TokenMeanLoss(perplexity=True)

    # ------------------------------------------------------------------ checks
    def validate_datamodule(self, datamodule: Any) -> None:
        """Raise ``ValueError`` when the data's tokenizer has more tokens than the model's vocabulary."""
        vocab = optional_member(datamodule, "vocab_size")
        if isinstance(vocab, int) and vocab > self.model_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is {self.model_config.vocab_size}; set "
                f"model_config.vocab_size >= {vocab} (e.g. --model.model_config.vocab_size={vocab}) or use a "
                "tokenizer that matches the model."
            )

    def setup(self, stage: str) -> None:
        self.validate_datamodule(self.trainer.datamodule)
        if self.documents is not None:
            self.documents = self.documents.with_eos(optional_member(self.trainer.datamodule, "tokenizer"))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With document masking: add the batch's ``document_ids`` (from its EOS tokens unless the data gave them),
        its per-document ``positions`` and the masked EOS labels (:class:`~lightning_4d.tasks.documents.
        DocumentMasking`), before the strategy shards the sequence over cp."""
        if self.documents is None or not isinstance(batch, dict):
            return batch
        return self.documents.prepare(batch)

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the model. A :class:`~lightning_4d.contract.LayoutStrategy` that materializes and initializes
        ``lightning_4d`` Llama models itself (its ``initializes_llama_models`` is true: ``FourDStrategy``) gets it on
        the meta device, through its
        ``tensor_init_context(empty_init=True)``; under any other strategy the model is built on the device and
        initialized here (:meth:`LlamaModel.init_weights`, the same weights for the same ``init_seed``)."""
        if self.model is not None:
            return
        trainer = attached_trainer(self)
        layout = layout_strategy(trainer.strategy) if trainer is not None else None
        if layout is not None and layout.initializes_llama_models:
            with layout.tensor_init_context(empty_init=True):
                self.model = LlamaModel(self.model_config, init_seed=self.hparams.init_seed)
            self.model.set_grouped_mm(grouped_mm)
            return
        self.model = LlamaModel(self.model_config, init_seed=self.hparams.init_seed)
        self.model.set_grouped_mm(grouped_mm)  # MoE layers: grouped GEMMs on CUDA in bfloat16
        if any(p.is_meta for p in self.model.parameters()):  # built under an outer meta-device context
            self.model.to_empty(device=self.device)
        else:
            self.model.to(self.device)
        with torch.no_grad():
            self.model.init_weights()
        if self.init_from is not None and not (trainer is not None and trainer.ckpt_path):
            load_initial_weights(self, self.init_from)

    def forward(
        self, input_ids: Tensor, positions: Optional[Tensor] = None, document_ids: Optional[Tensor] = None
    ) -> Tensor:
        """Logits ``[b, s, V]`` for ``input_ids`` ``[b, s]`` (``positions``, ``document_ids``:
        :meth:`LlamaModel.forward`)."""
        assert self.model is not None, "configure_model() has not run"
        return self.model(input_ids, positions, document_ids)

    @staticmethod
    def _documents_of(batch: dict[str, Tensor]) -> Optional[tuple[Tensor, Tensor]]:
        """Document masking's ``(positions, document ids)`` of a batch (:meth:`on_before_batch_transfer` put them
        there), or ``None``."""
        if DOCUMENT_IDS not in batch:
            return None
        return batch["positions"], batch[DOCUMENT_IDS]

    def _token_scale(self, batch: dict[str, Tensor], parts: int = 1) -> Optional[Tensor]:
        """With ``eod_mask_loss`` the weight of one trained token (:func:`~lightning_4d.tasks.documents.token_weight`
        over the whole batch of ``parts`` micro-batches, times ``parts``: the pipeline divides each micro-batch's loss
        by it) by which a mean loss times its trained tokens makes the dp x cp average of the step's losses the mean
        over the trained tokens of the global batch; ``None`` otherwise."""
        if self.documents is None or not self.documents.eod_mask_loss:
            return None
        layout = self._layout()
        return token_weight(batch["labels"], layout.dp_cp_group if layout is not None else None) * parts

    def pipeline_loss(self, logits: Any, labels: Tensor) -> Tensor:
        """The loss of one micro-batch under pp: :func:`~lightning_4d.parallel.loss.causal_lm_loss`, with
        ``eod_mask_loss`` scaled by the micro-batch's trained tokens (:meth:`_token_scale`)."""
        loss = causal_lm_loss(logits, labels)
        scale = self._pipeline_scale
        return loss if scale is None else loss * (scale * (labels != -100).sum())

    def _batch_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """The loss of one batch without pp: the mean cross-entropy over its trained tokens; with ``eod_mask_loss``
        scaled so that the dp x cp mean of it is the mean over the trained tokens of the whole batch."""
        logits = self(batch["input_ids"], batch.get("positions"), batch.get(DOCUMENT_IDS))
        loss = causal_lm_loss(logits, batch["labels"])
        scale = self._token_scale(batch)
        return loss if scale is None else loss * (scale * (batch["labels"] != -100).sum())

    # ------------------------------------------------------------------ reductions
    def _global_mean(self, value: Tensor) -> Tensor:
        """Average a per-rank scalar over the data-parallel (dp x cp) group; the same value on every rank."""
        value = value.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        value = value.float().clone()
        layout = layout_strategy(self.trainer.strategy)
        group = layout.dp_cp_group if layout is not None else None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            size = torch.distributed.get_world_size(group)
            if size > 1:  # one rank: no collective (benchmarks/step_overhead.py, the fixed cost per step)
                torch.distributed.all_reduce(value, group=group)
                value /= size
        return value

    # ------------------------------------------------------------------ steps
    def _layout(self) -> Optional[LayoutStrategy]:
        """The Trainer's strategy when it is a :class:`LayoutStrategy` (``FourDStrategy``), else ``None`` (also
        without a Trainer)."""
        trainer = attached_trainer(self)
        return layout_strategy(trainer.strategy) if trainer is not None else None

    def _pipeline(self) -> Any:
        """The strategy's :class:`~lightning_4d.features.pipeline.runtime.PipelineRunner` (pp > 1), else ``None``."""
        layout = self._layout()
        pipeline = layout.pipeline if layout is not None else None
        self._moe_pipeline(pipeline)
        return pipeline

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        pipeline = self._pipeline()
        self._start_moe_step(pipeline)
        if pipeline is not None:
            # forward + backward of all m micro-batches; the mean loss over the batch, on every pipeline stage
            self._pipeline_scale = self._token_scale(batch, pipeline.num_microbatches)
            loss = pipeline.train_step(batch["input_ids"], batch["labels"], self._documents_of(batch))
        else:
            loss = self._batch_loss(batch)
        self.log("train_loss", self._global_mean(loss), prog_bar=True, on_step=True, on_epoch=False)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        self._log_moe_step(pipeline)
        return loss

    def _context_parallel_size(self) -> int:
        """cp (1 without a :class:`LayoutStrategy`)."""
        layout = self._layout()
        return layout.context_parallel_size if layout is not None else 1

    def _gather_sequence(self, x: Tensor) -> Tensor:
        """The full sequence of a per-cp-rank tensor ``[b, s/cp, ...]`` (itself without cp)."""
        layout = self._layout()
        return layout.gather_sequence(x) if layout is not None and layout.context_parallel_size > 1 else x

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        pipeline = self._pipeline()
        if pipeline is not None:
            self._pipeline_scale = None  # validation: micro-batch means, weighted by tokens in the metrics
            loss = pipeline.eval_step(batch["input_ids"], batch["labels"], self._documents_of(batch))  # forward only
        else:
            logits = self(batch["input_ids"], batch.get("positions"), batch.get(DOCUMENT_IDS))
            loss = causal_lm_loss(logits, batch["labels"])
        # this rank's tokens (its shard of the sequence under cp): the loss is the mean over them (micro-batches of
        # equal token counts under pp); the metrics sum loss x tokens and tokens over dp x cp at the end of the epoch
        tokens = (batch["labels"] != -100).sum()
        value = loss.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        for name, metric in (("val_loss", self.val_loss_metric), ("val_ppl", self.val_ppl_metric)):
            metric.process_group = self._metric_group()
            metric.update(value, tokens)
            self.log(name, metric, prog_bar=name == "val_loss", on_step=False, on_epoch=True)
        return loss

    def _metric_group(self) -> Optional[Any]:
        """The group the validation metrics are summed over: ``dp_cp`` under a :class:`LayoutStrategy` (tp ranks
        hold the same loss, and so does every pp rank), else ``None`` (the whole world: DDP, one device)."""
        layout = self._layout()
        return layout.dp_cp_group if layout is not None else None

    def predict_step(self, batch: Union[dict[str, Tensor], Tensor], batch_idx: int) -> Optional[Tensor]:
        """Logits ``[b, s, padded_vocab_size]`` (full vocabulary, also under tp; the full sequence, also under cp) of
        ``batch["input_ids"]`` (or of a ``[b, s]`` tensor). With pp > 1 the batch runs forward-only through the
        pipeline and the logits are returned on the ranks that hold the last stage (``None`` on the others)."""
        input_ids = batch["input_ids"] if isinstance(batch, dict) else batch
        pipeline = self._pipeline()
        logits = pipeline.forward(input_ids) if pipeline is not None else self(input_ids)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return self._gather_sequence(logits) if logits is not None else None

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def uses_fused_adamw(trainer: Any) -> bool:
        """Whether :meth:`configure_optimizers` makes a fused AdamW (``torch.optim.AdamW(fused=True)``: one in-place
        kernel per step, no temporaries at the optimizer step, the memory model's assumption; torchtitan's default)
        under ``trainer``: yes, unless its precision plugin would refuse to clip a fused optimizer's gradients
        (Lightning's AMP plugin refuses, because a fused optimizer unscales float16 gradients itself): with a
        float16 gradient scaler (``16-mixed``), or Lightning's AMP plugin under another strategy than FourDStrategy
        (whose precision plugin clips fused optimizers' gradients when nothing is scaled, ``bf16-mixed``). Then
        torch's default (``foreach`` on CUDA)."""
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugin = trainer.precision_plugin
        if loss_scaler(plugin) is not None:
            return False
        four_d = layout_strategy(trainer.strategy) is not None
        return four_d or not isinstance(plugin, MixedPrecision)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            fused=self.uses_fused_adamw(self.trainer),
        )
        max_steps = hp.max_steps
        if max_steps is None:
            max_steps = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        if max_steps is None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, hp.warmup_steps) if hp.warmup_steps else 0
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, max_steps, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resuming: with ``max_steps`` given to this module, drop the saved schedule settings so that the scheduler
        keeps this module's (a new schedule, asked for); without, the scheduler restores the saved ones (the
        schedule the run was started with). Lightning restores the schedulers after this hook, from this dict."""
        if self.hparams.get("max_steps") is None:
            return
        for state in checkpoint.get("lr_schedulers") or []:
            if isinstance(state, dict) and "lr_lambdas" in state:
                state["lr_lambdas"] = [None] * len(state["lr_lambdas"])

    def on_train_start(self) -> None:
        """Set each optimizer's LR to its scheduler's value at the current step: a no-op on a fresh run or when the
        saved schedule continues; on a resume with a new schedule (``max_steps`` given) the resumed step's LR is
        the new schedule's, not the one the saving run's scheduler had set."""
        trainer = attached_trainer(self)
        for config in trainer.lr_scheduler_configs if trainer is not None else []:
            sched = config.scheduler
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and all(
                isinstance(fn, WarmupCosine) for fn in sched.lr_lambdas
            ):
                set_scheduler_lrs(
                    sched, [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
                )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64, pad_to_multiple_of: int = 1) -> list[int]:
        """Greedy decoding (no KV cache: one full forward per new token). Must run on every rank of the job.

        Each forward's sequence is right-padded to a multiple of :data:`GENERATE_LENGTH_STEP` tokens (and of
        ``pad_to_multiple_of``), so consecutive tokens reuse one shape: DTensor caches its sharding decisions by
        input shape, and a new length per token paid them again each forward (measured on ``make run``'s dp2 x tp2
        job, 4 processes on 2 CPU cores, 80 tokens: 7.3-9.0 s with a new length per token, 4.3 s now; steps of
        16 and 128 tokens took 5.1 s and 6.1 s). Causal attention keeps the padding from changing earlier
        positions, so the tokens are those of the unpadded forward; the padding stops at ``max_seq_length``.

        Args:
            prompt_ids: the prompt's token ids.
            max_new_tokens: number of tokens to append.
            pad_to_multiple_of: right-pad the sequence to this multiple (sequence parallelism needs s % tp == 0,
                context parallelism s % 2cp == 0).

        Returns:
            ``prompt_ids`` followed by the generated ids.
        """
        if self._pipeline() is not None:
            raise NotImplementedError(
                "generate() is not supported with pipeline_parallel_size > 1 (each new token would need the whole "
                "pipeline for one sequence); load the checkpoint with pipeline_parallel_size=1 to generate."
            )
        was_training = self.training
        self.eval()
        ids = list(prompt_ids)
        step = math.lcm(GENERATE_LENGTH_STEP, pad_to_multiple_of)
        longest = self.model_config.max_seq_length // pad_to_multiple_of * pad_to_multiple_of
        for _ in range(max_new_tokens):
            window = ids[-self.model_config.max_seq_length :]
            n = len(window)
            length = min(n + (-n) % step, longest)  # never past the model's longest sequence
            if length < n:  # max_seq_length itself not a multiple of pad_to_multiple_of
                length = n + (-n) % pad_to_multiple_of
            padded = window + [0] * (length - n)
            x = torch.tensor([padded], dtype=torch.long, device=self.device)
            cp = self._context_parallel_size()
            if cp > 1:  # this cp rank's shard of the sequence in, the full sequence's logits gathered back
                from lightning_4d.features.context_parallel.runtime import shard_sequence

                x = shard_sequence(x, self._layout().context_parallel_rank, cp)
            logits = self(x)
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            logits = self._gather_sequence(logits)[:, n - 1]
            ids.append(int(logits[0, : self.model_config.vocab_size].argmax()))
        self.train(was_training)
        return ids
