"""What ``FourDStrategy`` asks of the task, the data and the Trainer: ONE documented protocol, read once.

The parallel code (:mod:`lightning_4d.parallel`) never reads a LightningModule, a DataModule or a Trainer itself. The
strategy reads them once, in ``setup_environment`` (before the process group exists, before the DataModule's
``setup`` and before ``configure_model``), into a frozen :class:`TrainingInputs`, and passes that to the code that
needs it; nothing changes it later. The micro-batch count m derived from it is written into the strategy's resolved
``ParallelConfig`` at the same moment (:func:`lightning_4d.features.pipeline.runtime.resolve_num_microbatches`), and the
DataModule reads it back through :class:`MicroBatchingStrategy`.

Every member is optional: a LightningModule or DataModule that has none of them trains with the defaults (m from the
schedule, no sequence check before the first batch, the causal-LM loss under pp, random initial weights). The package
reads an optional member through :func:`optional_member` only, which refuses a name no protocol here declares.

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

**The strategy** (:class:`LayoutStrategy`): the rest of the package (the task, the callbacks, the meters) asks "is
this ``FourDStrategy``?" in one place, :func:`layout_strategy`, an ``isinstance`` against this abstract base class,
which ``FourDStrategy`` subclasses; what it may then read of the strategy is the members declared there. Under any
other Lightning strategy (DDP, one device, ...) ``layout_strategy`` answers ``None``: the task builds and initializes
its model itself, runs no pipeline and no context parallelism, and averages the logged loss over the whole world.

It imports no torch and no Lightning when loaded (Lightning's ``is_overridden`` when :meth:`TrainingInputs.of` reads),
and of ours only the model config, so that ``tasks/`` can import it without importing the strategy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

from lightning_4d.models.llama_config import LlamaConfig

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_4d.config import ParallelConfig

__all__ = [
    "DataContract",
    "LayoutStrategy",
    "MicroBatchingStrategy",
    "OPTIONAL_MEMBERS",
    "TaskContract",
    "TrainerContract",
    "TrainingInputs",
    "grad_accumulation",
    "layout_strategy",
    "optional_member",
]


class TaskContract(Protocol):
    """The members a LightningModule may define for ``FourDStrategy`` (module docstring); each is optional, so this
    protocol documents them rather than being required."""

    model_config: LlamaConfig
    init_from: Optional[str]

    def pipeline_loss(self, logits: Any, labels: Any) -> Any:
        """The loss of one micro-batch under pp (a scalar tensor)."""

    def validate_datamodule(self, datamodule: Any) -> None:
        """Raise ``ValueError`` for data the module cannot train on."""

    #: the callbacks' and the memory check's (the latter may also take the batch shape from Lightning's own
    #: ``example_input_array``)
    example_input_array: Any

    def generate(self, prompt_ids: list[int], max_new_tokens: int, pad_to_multiple_of: int = 1) -> list[int]:
        """Greedy decoding (``TrainingSummary``'s sample)."""


class DataContract(Protocol):
    """The members a DataModule may define for ``FourDStrategy`` (module docstring), each optional."""

    seq_length: int
    micro_batch_size: int
    global_batch_size: Optional[int]
    #: the tokenizer's vocabulary size (``CausalLMModule.validate_datamodule`` checks it against the model's)
    vocab_size: int
    #: ``encode(text) -> ids`` and ``decode(ids) -> text`` (``TrainingSummary``'s sample)
    tokenizer: Any

    def unigram_entropy(self) -> float:
        """The training tokens' unigram entropy in nats per token (``TrainingSummary``)."""


class TrainerContract(Protocol):
    """What is read of a Trainer, which may be a stand-in holding fewer members (module docstring)."""

    datamodule: Any
    accumulate_grad_batches: int
    #: the Trainer's callback list (``LMDataModule`` appends the callback that re-expresses restored batch counters)
    callbacks: list
    #: the run's length (``LMDataModule`` builds its dataset that long): ``max_steps`` (-1: unset), ``max_epochs``
    max_steps: int
    max_epochs: Optional[int]
    #: Lightning's fit loop, whose ``epoch_loop.batch_progress`` counters ``LMDataModule`` converts on a resume
    fit_loop: Any


def _declared(*protocols: type) -> frozenset[str]:
    return frozenset(
        name
        for p in protocols
        for name in (*p.__annotations__, *(k for k, v in vars(p).items() if callable(v)))
        if not name.startswith("_")
    )


#: every optional member of :class:`TaskContract`, :class:`DataContract` and :class:`TrainerContract`
OPTIONAL_MEMBERS = _declared(TaskContract, DataContract, TrainerContract)


def optional_member(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.<name>``, or ``default`` where ``obj`` (a LightningModule, a DataModule or a Trainer, or ``None``) has
    no such member: the one place the package reads a member the contract declares optional.

    Raises:
        KeyError: ``name`` is not one of :data:`OPTIONAL_MEMBERS` (declare it in its protocol first).
    """
    if name not in OPTIONAL_MEMBERS:
        raise KeyError(f"{name!r} is not an optional member of lightning_4d.contract: {sorted(OPTIONAL_MEMBERS)}")
    return getattr(obj, name, default)


def grad_accumulation(trainer: Any) -> int:
    """The Trainer's ``accumulate_grad_batches`` (1 without a Trainer, or where it is unset or 0)."""
    return int(optional_member(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1


@runtime_checkable
class MicroBatchingStrategy(Protocol):
    """What a DataModule asks of the strategy: m, the micro-batches per DataLoader batch (``FourDStrategy``: the
    pipeline schedule's m under pp, else 1)."""

    @property
    def num_microbatches(self) -> int:
        """m (1 without pp)."""


class LayoutStrategy(ABC):
    """A Lightning strategy that lays the model out itself over a 4D mesh: ``FourDStrategy`` subclasses it, and
    :func:`layout_strategy` is the one test of "is this ``FourDStrategy``?" (module docstring). The members below are
    all the rest of the package reads of such a strategy (the Lightning ``Strategy`` API aside).

    A stand-in in a test may be registered instead of subclassed (``LayoutStrategy.register(cls)``), with only the
    members the code under test reads.
    """

    #: the resolved layout (sizes, schedule, m; :class:`lightning_4d.config.ParallelConfig`)
    parallel_config: "ParallelConfig"
    #: build ``lightning_4d`` Llama models on the meta device (:meth:`tensor_init_context` with ``empty_init=True``):
    #: the strategy materializes and initializes them (``CausalLMModule.configure_model``)
    initializes_llama_models: bool = True
    #: the pipeline schedule's runner (:class:`~lightning_4d.features.pipeline.runtime.PipelineRunner`; pp > 1, after
    #: setup) whose ``train_step`` / ``eval_step`` / ``forward`` the task's steps call, or ``None``
    pipeline: Optional[Any] = None
    #: host bytes held by activation offloading (:class:`~lightning_4d.parallel.offload.OffloadStats`)
    offload_stats: Any

    @property
    @abstractmethod
    def mesh(self) -> Any:
        """The :class:`~lightning_4d.mesh.ParallelMesh` (every process group by name).

        Raises:
            RuntimeError: before the strategy's ``setup_environment``.
        """

    @property
    @abstractmethod
    def dp_cp_group(self) -> Optional[Any]:
        """The process group the loss is averaged over (``dp_cp``), ``None`` before setup."""

    @property
    @abstractmethod
    def context_parallel_size(self) -> int:
        """cp, the ranks that split every sequence (1 without cp)."""

    @property
    @abstractmethod
    def context_parallel_rank(self) -> int:
        """This rank's index in its cp group (which shard of every sequence it holds)."""

    @property
    @abstractmethod
    def gradient_buckets(self) -> Optional[Any]:
        """The ZeRO 0-2 gradient buckets (:class:`~lightning_4d.parallel.grad_buffers.GradientBuckets`, after
        ``setup_optimizers``), or ``None`` (ZeRO 3, one rank, before setup)."""

    @abstractmethod
    def gather_sequence(self, x: "Tensor", dim: int = 1) -> "Tensor":
        """The full sequence of a per-cp-rank tensor ``[b, s/cp, ...]`` (collective over the cp group)."""

    @abstractmethod
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> ContextManager:
        """Lightning's ``Strategy.tensor_init_context``."""


def layout_strategy(strategy: Any) -> Optional[LayoutStrategy]:
    """``strategy`` when it is a :class:`LayoutStrategy` (``FourDStrategy``), else ``None`` (also for ``None``)."""
    return strategy if isinstance(strategy, LayoutStrategy) else None


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
        datamodule = optional_member(trainer, "datamodule")
        validate = optional_member(module, "validate_datamodule")
        if datamodule is not None and validate is not None:
            validate(datamodule)
        model_config = optional_member(module, "model_config")
        init_from = optional_member(module, "init_from")
        return cls(
            model_config=model_config if isinstance(model_config, LlamaConfig) else None,
            applies_own_plans=_overrides_configure_model(module),
            init_from=str(init_from) if init_from is not None else None,
            pipeline_loss=optional_member(module, "pipeline_loss"),
            seq_length=_int(optional_member(datamodule, "seq_length")),
            micro_batch_size=_int(optional_member(datamodule, "micro_batch_size")),
            global_batch_size=_int(optional_member(datamodule, "global_batch_size")),
            accumulate_grad_batches=grad_accumulation(trainer),
        )


def _overrides_configure_model(module: Any) -> bool:
    """Whether ``module`` is a LightningModule that overrides ``configure_model``."""
    if module is None:
        return False
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(module, L.LightningModule) and is_overridden("configure_model", module)
