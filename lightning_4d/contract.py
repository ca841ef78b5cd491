"""What ``FourDStrategy`` asks of the task, the data and the Trainer: ONE documented protocol, read once.

The parallel code (:mod:`lightning_4d.parallel`) never reads a LightningModule, a DataModule or a Trainer itself. The
strategy reads them once, in ``setup_environment`` (before the process group exists, before the DataModule's
``setup`` and before ``configure_model``), into a frozen :class:`TrainingInputs`, and passes that to the code that
needs it; nothing changes it later. The micro-batch count m derived from it is written into the strategy's resolved
``ParallelConfig`` at the same moment (:func:`lightning_4d.parallel.pipeline.resolve_num_microbatches`), and the
DataModule reads it back through :class:`MicroBatchingStrategy`.

Every member is optional: a LightningModule or DataModule that has none of them trains with the defaults (m from the
schedule, no sequence check before the first batch, the causal-LM loss under pp, random initial weights).

**The LightningModule** (:class:`TaskContract`; :class:`~lightning_4d.tasks.CausalLMModule` implements all of it):

- ``model_config``: a :class:`~lightning_4d.models.LlamaConfig`: the layout is checked against it before the process
  group exists (heads, layers, vocabulary, MoE rules), and a module holding no model yet may still be split by tp, pp
  and cp (it builds a ``lightning_4d`` Llama in ``configure_model``);
- ``init_from``: a Hugging Face directory or one of our checkpoints whose weights replace the initial ones (each rank
  reads its slices, after the model is parallelized; not when resuming from ``ckpt_path``);
- ``pipeline_loss(logits, labels)``: the loss of one micro-batch under pp (default
  :func:`~lightning_4d.parallel.loss.causal_lm_loss`);
- ``validate_datamodule(datamodule)``: raise ``ValueError`` for data the module cannot train on (called here, before
  the process group, so that the error comes before the queue wait).

**The DataModule** (:class:`DataContract`; :class:`~lightning_4d.data.LMDataModule` implements all of it):
``seq_length`` (checked against sp and cp), ``micro_batch_size`` and ``global_batch_size`` (under pp, m =
``global_batch_size / (micro_batch_size · dp)`` unless ``num_microbatches`` is given). In return it reads
``num_microbatches`` of a :class:`MicroBatchingStrategy` (a DataLoader batch then holds ``micro_batch_size · m``
sequences, which the schedule splits).

**The Trainer**: ``accumulate_grad_batches`` (must be 1 under pp: the schedule accumulates over its m micro-batches).

It imports no torch and no Lightning when loaded (Lightning's ``is_overridden`` when :meth:`TrainingInputs.of` reads),
and of ours only the model config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from lightning_4d.models.config import LlamaConfig

__all__ = ["DataContract", "MicroBatchingStrategy", "TaskContract", "TrainingInputs"]


class TaskContract(Protocol):
    """The members a LightningModule may define for ``FourDStrategy`` (module docstring); each is optional, so this
    protocol documents them rather than being required."""

    model_config: LlamaConfig
    init_from: Optional[str]

    def pipeline_loss(self, logits: Any, labels: Any) -> Any:
        """The loss of one micro-batch under pp (a scalar tensor)."""

    def validate_datamodule(self, datamodule: Any) -> None:
        """Raise ``ValueError`` for data the module cannot train on."""


class DataContract(Protocol):
    """The members a DataModule may define for ``FourDStrategy`` (module docstring), each optional."""

    seq_length: int
    micro_batch_size: int
    global_batch_size: Optional[int]


@runtime_checkable
class MicroBatchingStrategy(Protocol):
    """What a DataModule asks of the strategy: m, the micro-batches per DataLoader batch (``FourDStrategy``: the
    pipeline schedule's m under pp, else 1)."""

    @property
    def num_microbatches(self) -> int:
        """m (1 without pp)."""


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) else None


@dataclass(frozen=True)
class TrainingInputs:
    """What the task, the data and the Trainer give the strategy (module docstring), read once by :meth:`of`.

    Attributes:
        model_config: the module's ``model_config`` when it is a ``LlamaConfig``, else ``None``.
        applies_own_plans: the module overrides ``configure_model`` (where it may apply plans of its own with
            ``self.device_mesh``), so tp, pp and cp are not refused for it.
        init_from: the module's ``init_from`` (a path), or ``None``.
        pipeline_loss: the module's ``pipeline_loss``, or ``None`` (the causal-LM loss).
        seq_length, micro_batch_size, global_batch_size: the DataModule's, where it has them as ints.
        accumulate_grad_batches: the Trainer's (1 without a Trainer).
    """

    model_config: Optional[LlamaConfig] = None
    applies_own_plans: bool = False
    init_from: Optional[str] = None
    pipeline_loss: Optional[Callable[..., Any]] = None
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    accumulate_grad_batches: int = 1

    @classmethod
    def of(cls, module: Any, trainer: Any = None) -> "TrainingInputs":
        """Read ``module`` (a LightningModule, or ``None``), ``trainer`` (the Trainer it is attached to, or ``None``)
        and the Trainer's DataModule; let the module check the DataModule (``validate_datamodule``).

        Raises:
            ValueError: the module's ``validate_datamodule`` refuses the DataModule.
        """
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if datamodule is not None and hasattr(module, "validate_datamodule"):
            module.validate_datamodule(datamodule)
        model_config = getattr(module, "model_config", None)
        init_from = getattr(module, "init_from", None)
        return cls(
            model_config=model_config if isinstance(model_config, LlamaConfig) else None,
            applies_own_plans=_overrides_configure_model(module),
            init_from=str(init_from) if init_from is not None else None,
            pipeline_loss=getattr(module, "pipeline_loss", None),
            seq_length=_int(getattr(datamodule, "seq_length", None)),
            micro_batch_size=_int(getattr(datamodule, "micro_batch_size", None)),
            global_batch_size=_int(getattr(datamodule, "global_batch_size", None)),
            accumulate_grad_batches=_accumulation(trainer),
        )


def _accumulation(trainer: Any) -> int:
    return int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1


def _overrides_configure_model(module: Any) -> bool:
    """Whether ``module`` is a LightningModule that overrides ``configure_model``."""
    if module is None:
        return False
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(module, L.LightningModule) and is_overridden("configure_model", module)
