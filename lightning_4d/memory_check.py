"""``MemoryEstimatorCallback``: refuse, in a second and before any model memory is allocated, a layout that would run
out of memory, saying why and which layouts would fit.

It runs in ``Callback.setup`` (Lightning calls it after the strategy has built the process group and the mesh, and
before ``configure_model`` and the strategy's ``setup`` allocate the model), on every rank. The estimate is a pure
function of the model config, the layout, the batch shape, the precision and the device memory, so every rank
computes the same figure and every rank raises (or none does): no rank is left waiting in a collective.

It never skips itself silently: what it cannot check it says, as a warning (or, on CUDA, for a lightning_4d Llama
under ``FourDStrategy`` whose batch shape is unknown, as an error), see :class:`MemoryEstimatorCallback`.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_4d.contract import layout_strategy, optional_member
from lightning_4d.planning.hardware import parse_bytes, physical_memory
from lightning_4d.planning.model import MemoryEstimate
from lightning_4d.planning.planner import fitting_layout_lines, format_size as _size, suggestion_line
from lightning_4d.planning.workload import Workload

log = logging.getLogger(__name__)

__all__ = ["MemoryBudgetExceeded", "MemoryEstimatorCallback", "suggestion_line"]

_DISABLE = "MemoryEstimatorCallback(enabled=False) or FourDStrategy(memory_check=False)"
_BATCH_CONVENTIONS = (
    "a dict with 'input_ids' [batch, seq], a tuple/list whose first tensor is [batch, seq], or a [batch, seq] tensor"
)


class MemoryBudgetExceeded(RuntimeError):
    """The estimated peak memory of a rank exceeds the budget. ``estimate`` is the worst rank's
    :class:`~lightning_4d.planning.model.MemoryEstimate` (or the paper's estimate), ``suggestions`` a list of
    ``(ParallelConfig, estimate)`` that fit."""

    def __init__(self, message: str, estimate: Any = None, suggestions: Optional[list] = None) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.suggestions = suggestions or []


# ---------------------------------------------------------------------------------------------------- batch shape
class _NoShape(Exception):
    """A place the batch shape could come from did not give it; the message says why (it goes into the warning or
    error that names every place looked at)."""


def _batch_dims(batch: Any) -> tuple[int, int]:
    """``(rows, seq_length)`` of a batch by the conventions of :data:`_BATCH_CONVENTIONS`.

    Raises:
        _NoShape: the batch follows none of them (the message says what it is).
    """
    kind = type(batch).__name__
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise _NoShape(f"a {kind} with keys {sorted(map(str, batch))} and no 'input_ids'")
        tensor = batch["input_ids"]
        if not isinstance(tensor, torch.Tensor):
            raise _NoShape(f"a {kind} whose 'input_ids' is a {type(tensor).__name__}, not a tensor")
        described = f"a {kind} whose 'input_ids' has shape"
    elif isinstance(batch, (tuple, list)):
        tensor = next((x for x in batch if isinstance(x, torch.Tensor)), None)
        if tensor is None:
            raise _NoShape(f"a {kind} of {len(batch)} items, none of them a tensor")
        described = f"a {kind} whose first tensor has shape"
    elif isinstance(batch, torch.Tensor):
        tensor, described = batch, "a tensor of shape"
    else:
        raise _NoShape(f"an object of type {kind}")
    if tensor.dim() != 2:
        raise _NoShape(f"{described} {list(tensor.shape)}, not [batch, seq]")
    return int(tensor.shape[0]), int(tensor.shape[1])


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of ``loader`` (a ``DataLoader``: none for another iterable): the loader's own
    (its iterator draws the workers' base seed from it) and those of torch's shuffling samplers (``RandomSampler``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``: the permutation) as its sampler or its batch sampler's, each
    once."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    if not isinstance(loader, DataLoader):
        return []
    samplers = [loader.sampler]
    if isinstance(loader.batch_sampler, BatchSampler):
        samplers.append(loader.batch_sampler.sampler)
    shuffling = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
    candidates = [loader.generator, *(s.generator for s in samplers if isinstance(s, shuffling))]
    return list({id(g): g for g in candidates if isinstance(g, torch.Generator)}.values())


@contextmanager
def _rng_preserved(loader: Any) -> Iterator[None]:
    """Restore, on exit, every random state that reading a batch from ``loader`` can advance: torch's CPU (and, once
    initialized, CUDA) generators, Python's and NumPy's global ones, and the ``torch.Generator`` of a ``DataLoader``
    and of its (batch) sampler (:func:`_loader_generators`)."""
    saved = [(g, g.get_state()) for g in _loader_generators(loader)]
    cpu, py = torch.get_rng_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np_random = sys.modules["numpy"].random if "numpy" in sys.modules else None
    np_state = np_random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        for g, state in saved:
            g.set_state(state)
        torch.set_rng_state(cpu)
        random.setstate(py)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if np_random is not None:
            np_random.set_state(np_state)


def _first_train_batch(trainer: L.Trainer) -> Any:
    """The first batch of the train dataloader, read before the fit loop reads any, from a fresh iterator, without
    taking it from the run: the DataLoader comes from the data source ``trainer.fit`` was given (the
    ``train_dataloader()`` hook of the DataModule or LightningModule, called once more, or the ``train_dataloaders``
    object itself), the iterator is dropped after one batch (the fit loop makes its own later) and every random state
    the read advances is restored (:func:`_rng_preserved`). A one-pass stream (an iterable that cannot be iterated
    twice) would lose its first batch: give such a run ``micro_batch_size`` and ``seq_length``.

    Raises:
        _NoShape: there is no train dataloader, several, it is empty, or getting it or its batch raised (the
            message names the exception).
    """
    from lightning.pytorch.utilities import CombinedLoader

    from lightning_4d.parallel._compat.lightning import train_data_source

    source = train_data_source(trainer)
    if source is None or source.instance is None or not source.is_defined():
        raise _NoShape(
            "there is none: no train_dataloaders, and neither the DataModule nor the module defines train_dataloader()"
        )
    try:
        loaders = source.dataloader()
    except Exception as err:  # noqa: BLE001 - said in the warning or error; the fit loop calls it again later
        raise _NoShape(f"train_dataloader() raised {type(err).__name__}: {err}") from err
    flat = (loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")).flattened
    if len(flat) != 1:
        raise _NoShape(f"there are {len(flat)} train dataloaders, so no single batch shape")
    with _rng_preserved(flat[0]):
        try:
            iterator = iter(flat[0])
            try:
                return next(iterator)
            finally:
                del iterator  # a multi-process DataLoader iterator shuts its workers down
        except StopIteration:
            raise _NoShape("the train dataloader is empty") from None
        except Exception as err:  # noqa: BLE001 - said in the warning or error
            raise _NoShape(f"reading it raised {type(err).__name__}: {err}") from err


class _ShapeSearch:
    """The batch shape (``micro_batch_size``, ``seq_length``) as :meth:`MemoryEstimatorCallback._batch_shape` finds
    it, one source after another: each dimension is taken from the first source that gives it.

    Attributes:
        shape: ``{"micro_batch_size": b, "seq_length": s}``, ``None`` where not found yet.
        origin: which source gave each dimension found.
        looked: what each source looked at gave, in order (for the message when a dimension stays missing).
    """

    def __init__(self) -> None:
        self.shape: dict[str, Optional[int]] = {"micro_batch_size": None, "seq_length": None}
        self.origin: dict[str, str] = {}
        self.looked: list[str] = []

    @property
    def missing(self) -> bool:
        """Whether a dimension is still unknown."""
        return None in self.shape.values()

    def take(self, where: str, b: Optional[int], s: Optional[int]) -> None:
        """Take ``b`` sequences of ``s`` tokens from ``where`` for each dimension still unknown (``None``: not
        given)."""
        for key, value in (("micro_batch_size", b), ("seq_length", s)):
            if self.shape[key] is None and value is not None:
                self.shape[key], self.origin[key] = int(value), where

    def from_datamodule(self, dm: Any) -> None:
        """The DataModule's ``micro_batch_size`` and ``seq_length`` attributes (``dm``: ``None`` without one)."""
        if dm is None:
            self.looked.append("the DataModule's micro_batch_size and seq_length (no DataModule)")
            return
        b, s = optional_member(dm, "micro_batch_size"), optional_member(dm, "seq_length")
        self.take(f"the DataModule ({type(dm).__name__})", b, s)
        self.looked.append(
            f"the DataModule {type(dm).__name__}'s micro_batch_size and seq_length ("
            f"{'neither' if b is None and s is None else 'only one'} defined)"
        )

    def from_first_batch(self, trainer: L.Trainer, pp: int, num_microbatches: int) -> None:
        """The first batch of the train dataloader (:func:`_first_train_batch`), whose rows hold
        ``num_microbatches`` micro-batches under pp > 1.

        Raises:
            ValueError: pp > 1 and the batch's rows are not a multiple of ``num_microbatches``.
        """
        where = "the first batch of the train dataloader"
        try:
            rows, s = _batch_dims(_first_train_batch(trainer))
        except _NoShape as err:
            self.looked.append(f"{where} ({err}; expected {_BATCH_CONVENTIONS})")
            return
        if pp > 1 and rows % num_microbatches:
            raise ValueError(
                f"{where} has {rows} sequences, which cannot be split into num_microbatches="
                f"{num_microbatches} equal micro-batches (pipeline_parallel_size={pp}); the DataLoader's batch "
                f"size per data-parallel rank must be a multiple of {num_microbatches} (micro_batch_size x "
                "num_microbatches)."
            )
        self.take(where, rows // num_microbatches if pp > 1 else rows, s)

    def from_example_input(self, example: Any) -> None:
        """The module's ``example_input_array`` (one micro-batch; ``None``: not set)."""
        where = "the module's example_input_array"
        if example is None:
            self.looked.append(f"{where} (not set)")
            return
        try:
            self.take(where, *_batch_dims(example))
        except _NoShape as err:
            self.looked.append(f"{where} ({err}; expected {_BATCH_CONVENTIONS})")


class MemoryEstimatorCallback(L.Callback):
    """Check the memory estimate of the job before the model is built.

    It checks a ``lightning_4d`` Llama (a module with a ``model_config`` :class:`~lightning_4d.models.LlamaConfig`,
    such as :class:`~lightning_4d.tasks.CausalLMModule`, or one holding a Llama model before ``configure_model``)
    or a Hugging Face transformers Llama (a module whose ``config`` / ``model_config`` has ``model_type == "llama"``,
    converted with :meth:`LlamaConfig.from_hf_dict` and estimated as our Llama of that shape) under
    :class:`~lightning_4d.FourDStrategy`. The batch shape (``micro_batch_size`` sequences of ``seq_length``
    tokens per rank and micro-batch) comes from the first of these that gives it (each dimension separately):

    1. this callback's ``micro_batch_size`` and ``seq_length`` arguments;
    2. the DataModule's ``micro_batch_size`` and ``seq_length`` attributes (as :class:`~lightning_4d.data.LMDataModule`
       has);
    3. the first batch of the train dataloader (the DataModule's or module's ``train_dataloader()``, or the
       ``train_dataloaders`` given to ``fit``), read from a fresh iterator before the fit loop starts and not taken
       from the run (random states are restored; the fit loop makes its own iterator): ``input_ids`` ``[b, s]`` of a
       dict, the first tensor of a tuple or list, or a ``[b, s]`` tensor. With pp > 1 the batch holds the
       ``num_microbatches`` micro-batches, so ``micro_batch_size = b / num_microbatches``;
    4. the module's ``example_input_array`` (the input of one forward: one micro-batch), by the same conventions.

    When it cannot check, it says so and why: with a lightning_4d Llama under FourDStrategy and an unknown batch shape
    it raises ``ValueError`` on CUDA (naming every place it looked, ``micro_batch_size=`` / ``seq_length=`` to pass,
    and ``enabled=False``) and warns elsewhere; a module with no lightning_4d Llama config (it cannot estimate other
    models), another strategy than FourDStrategy, no device memory (not CUDA and no ``device_memory``) or a precision
    the model does not cover: a warning (once per callback) that nothing was checked, and the fit goes on.

    Args:
        budget: fraction of the device memory the estimated peak may use (0.8: the paper's rule; our estimate
            already includes the overhead allowance, so 0.8 leaves a further margin).
        device_memory: bytes or a size such as ``"80GiB"`` / ``"94GB"``; default the CUDA device's total memory.
            Without CUDA and without this argument there is nothing to check against: a warning says so.
        formula: ``"lightning_4d"`` (:func:`~lightning_4d.planning.model.estimate_memory`) or ``"fujii2024"``.
        enabled: ``False`` turns the check off.
        micro_batch_size: the batch shape's sequences per micro-batch (default: found as above).
        seq_length: the batch shape's tokens per sequence (default: found as above).
        expert_load_imbalance: for a Mixture-of-Experts model under expert parallelism, the load the estimate
            assumes (:func:`~lightning_4d.planning.model.estimate_memory`: the rows the most loaded ep rank receives
            over the balanced figure, >= 1.0); default ``None``:
            :data:`~lightning_4d.features.moe.costs.DEFAULT_EXPERT_LOAD_IMBALANCE`.
            ``FourDStrategy(memory_check=True)`` adds the callback with the default; add your own
            ``MemoryEstimatorCallback(expert_load_imbalance=...)``
            to the trainer's callbacks to set it (the strategy then adds none).
        host_memory: bytes or a size of the node's host memory, against which ``activation_offload_layers``'s
            host copies and ``optimizer_offload``'s host states are checked (the worst pp rank's
            :attr:`~lightning_4d.planning.model.MemoryEstimate.host` times the processes per node, within
            ``budget``); default: the physical memory of this machine.

    Raises:
        MemoryBudgetExceeded: (in ``setup``) the estimate of the worst pipeline stage exceeds
            ``budget · device_memory``; the message gives its breakdown and up to three layouts of the same world
            size that fit. Or, with activation or optimizer offload, its host memory per node exceeds
            ``budget · host_memory``.
        ValueError: (at construction) a budget outside (0, 1], an unparsable ``device_memory``, an unknown formula,
            a ``micro_batch_size`` or ``seq_length`` that is not a positive int, an ``expert_load_imbalance`` below 1;
            (in ``setup``) on CUDA, a batch shape it cannot find (see above); with pp > 1, a first training batch
            whose number of sequences is not a multiple of ``num_microbatches``.
    """

    def __init__(
        self,
        budget: float = 0.8,
        device_memory: Union[None, int, str] = None,
        formula: str = "lightning_4d",
        enabled: bool = True,
        micro_batch_size: Optional[int] = None,
        seq_length: Optional[int] = None,
        expert_load_imbalance: Optional[float] = None,
        host_memory: Union[None, int, str] = None,
    ) -> None:
        from lightning_4d.features.moe.costs import check_expert_load_imbalance

        if expert_load_imbalance is not None:
            check_expert_load_imbalance(expert_load_imbalance)
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget!r} is not valid: expected a fraction in (0, 1], e.g. 0.8.")
        if formula not in ("lightning_4d", "fujii2024"):
            raise ValueError(f"formula={formula!r} is not valid: expected 'lightning_4d' or 'fujii2024'.")
        for name, value in (("micro_batch_size", micro_batch_size), ("seq_length", seq_length)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{name}={value!r} is not valid: expected a positive int, or None to find it in the data."
                )
        self.budget = budget
        self.device_memory = parse_bytes(device_memory) if device_memory is not None else None
        self.formula = formula
        self.enabled = enabled
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.expert_load_imbalance = expert_load_imbalance
        self.host_memory = parse_bytes(host_memory) if host_memory is not None else None
        self._fused_optimizer = True  # set per fit from the module (_steps_with_fused_adamw)
        self._document_masking = False  # set per fit from the module (_masks_documents)
        self._host_offloaded = 0  # set per fit by _estimate: the most host_offloaded_activations of any pp rank
        self.estimate: Any = None
        self._said: set[str] = set()

    def _warn_once(self, message: str) -> None:
        """A ``UserWarning`` on rank 0, the first time this callback has this to say."""
        if message not in self._said:
            self._said.add(message)
            rank_zero_warn(message)

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _model_config(pl_module: L.LightningModule) -> Any:
        """The ``LlamaConfig`` to estimate: the module's ``model_config`` (a ``CausalLMModule`` before
        ``configure_model``), else the config of the first model of a registered family it holds
        (:func:`lightning_4d.families.registry.estimate_config`: a transformers Llama is estimated as our Llama of the
        same shape), else ``None``."""
        from lightning_4d.families.registry import estimate_config
        from lightning_4d.models.llama_config import LlamaConfig

        cfg = optional_member(pl_module, "model_config")
        return cfg if isinstance(cfg, LlamaConfig) else estimate_config(pl_module)

    def _batch_shape(
        self, trainer: L.Trainer, pl_module: L.LightningModule, pp: int, num_microbatches: int
    ) -> tuple[dict[str, Optional[int]], dict[str, str], list[str]]:
        """``(shape, origin, looked)``: ``micro_batch_size`` and ``seq_length`` (``None`` where not found), where each
        came from, and what each place looked at gave (for the message when something is missing), from the sources
        of the class docstring in order.

        Raises:
            ValueError: pp > 1 and the first training batch's rows are not a multiple of ``num_microbatches``.
        """
        search = _ShapeSearch()
        search.take("the callback's arguments", self.micro_batch_size, self.seq_length)
        search.looked.append(
            "the callback's micro_batch_size= and seq_length= (not given)"
            if not search.origin
            else f"the callback's arguments (gave {', '.join(search.origin)})"
        )
        if search.missing:
            search.from_datamodule(optional_member(trainer, "datamodule"))
        if search.missing:
            search.from_first_batch(trainer, pp, num_microbatches)
        if search.missing:
            search.from_example_input(optional_member(pl_module, "example_input_array"))
        return search.shape, search.origin, search.looked

    def _device(self, trainer: L.Trainer) -> tuple[Optional[int], Optional[str], str]:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return self.device_memory or props.total_memory, props.name, "cuda"
        return self.device_memory, None, device.type

    # ------------------------------------------------------------------ the check
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Estimate the peak memory per rank and raise when it exceeds the budget; see the class docstring for what
        it reads and what it says when it cannot check.

        Raises:
            MemoryBudgetExceeded: over budget (the breakdown and layouts that fit in the message).
            ValueError: on CUDA, an unknown batch shape; with pp > 1, a first training batch not divisible into
                ``num_microbatches`` micro-batches.
        """
        if not self.enabled or stage != "fit":
            return
        job = self._checkable_job(trainer, pl_module)
        if job is None:
            return
        parallel_config, cfg, memory, gpu_name, device_type, precision = job
        self._fused_optimizer = _steps_with_fused_adamw(pl_module, trainer)
        self._document_masking = _masks_documents(pl_module)
        # micro-batches per step: the pipeline schedule's m (resolved by the strategy), else gradient accumulation
        m = parallel_config.microbatches if parallel_config.pp > 1 else trainer.accumulate_grad_batches
        shape = self._known_batch_shape(trainer, pl_module, parallel_config, device_type)
        if shape is None:
            return
        b, s, found = shape
        est, total, breakdown = self._estimate(cfg, parallel_config, b, s, m, precision, device_type, gpu_name)
        self.estimate = est
        limit = self.budget * memory
        layout = (
            f"tp={parallel_config.tp} pp={parallel_config.pp} cp={parallel_config.cp} dp={parallel_config.dp} "
            f"zero_stage={parallel_config.zero_stage} activation_checkpointing="
            f"{parallel_config.activation_checkpointing}, micro_batch_size={b}, seq_length={s} ({found}), "
            f"{precision}"
        )
        offloads = parallel_config.activation_offload_layers or parallel_config.optimizer_offload
        if offloads and self.formula == "lightning_4d":
            self._check_host(trainer, est, self._host_offloaded, parallel_config, layout)
        if total <= limit:
            rank_zero_info(
                f"MemoryEstimatorCallback ({self.formula}): {layout}: estimated peak {_size(total)} "
                f"per GPU = {100 * total / memory:.1f}% of {_size(memory)} (budget "
                f"{100 * self.budget:.0f}%)."
            )
            return
        lines = [
            f"estimated peak memory {_size(total)} per GPU exceeds the budget {_size(limit)} "
            f"({100 * self.budget:.0f}% of {_size(memory)}) for {layout} ({self.formula} estimate, "
            f"pp rank {est.pp_rank if isinstance(est, MemoryEstimate) else 0}; nothing was allocated). Breakdown:"
        ]
        lines += [f"  {k:<17}{_size(v):>14}" for k, v in breakdown.items()]
        if self.formula == "lightning_4d":
            lines.append(
                f"  (peak phase: {est.peak_phase}; total = parameters + optimizer_states + overhead + the "
                "largest phase, see docs/memory.md)"
            )
        suggestions = self._suggest(trainer, cfg, b, s, precision, memory, device_type, gpu_name)
        lines += self._suggestion_lines(suggestions, parallel_config.world_size, b)
        raise MemoryBudgetExceeded("\n".join(lines), est, suggestions)

    def _check_host(self, trainer: L.Trainer, est: Any, host: int, parallel_config: Any, layout: str) -> None:
        """With ``activation_offload_layers`` or ``optimizer_offload``: the host memory the node's ranks take
        (``host``: the most :attr:`~lightning_4d.planning.model.MemoryEstimate.host` of any pp rank, bytes: the
        offloaded activations and model states, times the processes per node) must fit ``budget · host_memory``.

        Raises:
            MemoryBudgetExceeded: it does not (the message names the bytes and what to offload less).
        """
        activations, states = parallel_config.activation_offload_layers, parallel_config.optimizer_offload
        memory = self.host_memory if self.host_memory is not None else physical_memory()
        per_node = host * trainer.num_devices
        if per_node <= self.budget * memory:
            return
        what = " and ".join(w for w, on in (("activation offload", activations), ("optimizer offload", states)) if on)
        options = ", ".join(
            o
            for o, on in ((f"activation_offload_layers={activations}", activations), ("optimizer_offload=True", states))
            if on
        )
        raise MemoryBudgetExceeded(
            f"{what} would hold {_size(per_node)} of host memory per node ({_size(host)} per rank x "
            f"{trainer.num_devices} processes), over the budget {_size(self.budget * memory)} "
            f"({100 * self.budget:.0f}% of {_size(memory)} host memory) for {layout}, {options} (nothing was "
            "allocated). Offload less (fewer layers; optimizer_offload=False or a higher ZeRO stage or dp, which "
            "shard the states more), or pass MemoryEstimatorCallback(host_memory=...) if this node has more memory "
            "than the process sees.",
            est,
            [],
        )

    def _checkable_job(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> Optional[tuple[Any, Any, int, Optional[str], str, str]]:
        """``(parallel_config, model config, device memory in bytes, GPU name, device type, precision)`` of the job,
        or ``None`` after a warning (once per callback) that says why nothing is checked: another strategy than
        FourDStrategy, a module with no lightning_4d Llama config, no device memory, a precision not modelled."""
        from lightning_4d.planning.model import PRECISIONS, normalize_precision

        layout = layout_strategy(trainer.strategy)
        if layout is None:
            self._warn_once(
                f"MemoryEstimatorCallback: nothing checked: it estimates FourDStrategy layouts and the "
                f"strategy is {type(trainer.strategy).__name__}. Use FourDStrategy, or remove the "
                "callback."
            )
            return None
        cfg = self._model_config(pl_module)
        if cfg is None:
            self._warn_once(
                f"MemoryEstimatorCallback: cannot estimate the memory of {type(pl_module).__name__}: it "
                "has no lightning_4d LlamaConfig (a `model_config` attribute, "
                "or a Llama model built before "
                f"configure_model), so nothing was checked. Silence this with {_DISABLE}."
            )
            return None
        memory, gpu_name, device_type = self._device(trainer)
        if memory is None:
            self._warn_once(
                f"MemoryEstimatorCallback: nothing checked: the device is {device_type}, not CUDA, and no "
                'device_memory was given; pass e.g. MemoryEstimatorCallback(device_memory="80GiB") to '
                "check against a GPU's memory."
            )
            return None
        try:
            precision = normalize_precision(str(trainer.precision))
        except ValueError:
            self._warn_once(
                f"MemoryEstimatorCallback: nothing checked: precision {trainer.precision!r} is not "
                f"modelled (modelled: {list(PRECISIONS)})."
            )
            return None
        return layout.parallel_config, cfg, memory, gpu_name, device_type, precision

    def _known_batch_shape(
        self, trainer: L.Trainer, pl_module: L.LightningModule, parallel_config: Any, device_type: str
    ) -> Optional[tuple[int, int, str]]:
        """``(micro_batch_size, seq_length, where they came from)`` (:meth:`_batch_shape`), or ``None`` after a
        warning when either is unknown off CUDA.

        Raises:
            ValueError: on CUDA, an unknown micro-batch size or sequence length (the message names every place
                looked at and the fix); see also :meth:`_batch_shape`.
        """
        shape, origin, looked = self._batch_shape(trainer, pl_module, parallel_config.pp, parallel_config.microbatches)
        b, s = shape["micro_batch_size"], shape["seq_length"]
        if b is None or s is None:
            unknown = [k for k, v in shape.items() if v is None]
            message = (
                f"MemoryEstimatorCallback cannot estimate the memory of this job: its {' and '.join(unknown)} "
                f"{'is' if len(unknown) == 1 else 'are'} unknown. "
                f"It looked, in order, at: {'; '.join(looked)}. Pass the shape, e.g. "
                "MemoryEstimatorCallback(micro_batch_size=1, seq_length=4096) in the Trainer's callbacks "
                f"(FourDStrategy then adds no other), or turn the check off with {_DISABLE}."
            )
            if device_type == "cuda":
                raise ValueError(message)
            self._warn_once(f"{message} Nothing was checked (not on CUDA: a warning, not an error).")
            return None
        if origin["micro_batch_size"] == origin["seq_length"]:
            found = f"batch shape from {origin['seq_length']}"
        else:
            found = f"micro_batch_size from {origin['micro_batch_size']}, seq_length from {origin['seq_length']}"
        return b, s, found

    def _estimate(
        self,
        cfg: Any,
        parallel_config: Any,
        b: int,
        s: int,
        m: int,
        precision: str,
        device_type: str,
        gpu_name: Optional[str],
    ) -> tuple[Any, float, dict[str, float]]:
        """``(estimate, its total in bytes, its parts in bytes by name)`` of this callback's formula (the worst pp
        rank's :class:`~lightning_4d.planning.model.MemoryEstimate`, or the paper's estimate)."""
        if self.formula == "fujii2024":
            from lightning_4d.planning.fujii2024 import fujii2024_of_layout

            est = fujii2024_of_layout(cfg, parallel_config, s, b, m)
            return est, est.total, {"model_states": est.model_states, "activations": est.activations}
        from lightning_4d.planning.model import estimate_all_pp_ranks

        work = Workload(
            cfg, b, s, precision, m, self.expert_load_imbalance, self._fused_optimizer, self._document_masking
        )
        ranks = estimate_all_pp_ranks(work, parallel_config, device_type=device_type, gpu_name=gpu_name)
        est = max(ranks, key=lambda e: e.total)  # the worst pp rank, as estimate_memory picks it
        # activation and optimizer offload: the pp rank that holds the most host memory
        self._host_offloaded = max(e.host for e in ranks)
        return (
            est,
            est.total,
            {
                "parameters": est.parameters,
                "gradients": est.gradients,
                "optimizer_states": est.optimizer_states,
                "activations": est.activations,
                "logits": est.logits,
                "buffers": est.buffers,
                "overhead": est.overhead,
            },
        )

    @staticmethod
    def _suggestion_lines(suggestions: list, world_size: int, b: int) -> list[str]:
        """The end of the over-budget message: the layouts that fit (or what to do when none does), and how to turn
        the check off."""
        lines = fitting_layout_lines([(suggestion_line(pc, b), e.total) for pc, e in suggestions], world_size)
        lines.append(
            "Disable this check with FourDStrategy(memory_check=False) or MemoryEstimatorCallback(enabled=False)."
        )
        return lines

    def _suggest(
        self,
        trainer: L.Trainer,
        cfg: Any,
        b: int,
        s: int,
        precision: str,
        memory: int,
        device_type: str,
        gpu_name: Optional[str],
    ) -> list:
        from lightning_4d.planning.planner import suggest_layouts

        pc = trainer.strategy.parallel_config
        try:
            work = Workload(
                cfg, b, s, precision, None, self.expert_load_imbalance, self._fused_optimizer, self._document_masking
            )
            return suggest_layouts(
                work,
                pc.world_size,
                memory,
                self.budget,
                gpus_per_node=trainer.num_devices,
                global_batch_size=b * pc.dp * (pc.microbatches if pc.pp > 1 else trainer.accumulate_grad_batches),
                device_type=device_type,
                gpu_name=gpu_name,
            )
        except ValueError as err:  # no suggestion is better than hiding the real error
            log.debug("no layout suggestions: %s", err)
            return []


def add_memory_check(trainer: Optional[L.Trainer]) -> None:
    """Add a :class:`MemoryEstimatorCallback` (budget 0.8) to ``trainer`` unless it has one (``FourDStrategy`` does
    so on CUDA, where ``memory_check=True``); ``None``: nothing."""
    if trainer is not None and not any(isinstance(cb, MemoryEstimatorCallback) for cb in trainer.callbacks):
        trainer.callbacks.append(MemoryEstimatorCallback())


def _masks_documents(pl_module: Any) -> bool:
    """Whether ``pl_module`` is a :class:`~lightning_4d.tasks.CausalLMModule` with document masking on (its masks
    are part of the estimate: ``Workload.document_masking``)."""
    from lightning_4d.tasks.causal_lm import CausalLMModule

    return isinstance(pl_module, CausalLMModule) and pl_module.documents is not None


def _steps_with_fused_adamw(pl_module: Any, trainer: Any = None) -> bool:
    """Whether ``pl_module`` configures :class:`~lightning_4d.tasks.CausalLMModule`'s optimizer and that is a fused
    AdamW under ``trainer`` (``CausalLMModule.uses_fused_adamw``: no temporaries at the step); any other optimizer is
    estimated as ``foreach`` AdamW (one moment's bytes of temporaries), the larger of torch's defaults."""
    from lightning_4d.tasks.causal_lm import CausalLMModule

    ours = isinstance(pl_module, CausalLMModule) and (
        type(pl_module).configure_optimizers is CausalLMModule.configure_optimizers
    )
    return ours and (trainer is None or bool(pl_module.uses_fused_adamw(trainer)))
