"""Lightning's private names: the strategy's and the precision plugin's members ``FourDStrategy`` and
``FourDPrecision`` use, the fit loop's training data and loader, the checkpoint path lookup, a module's Trainer and
device mesh, the Trainer's SIGTERM handler; and torch's LR scheduler's last rates (set by the task)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.strategies.model_parallel import (  # noqa: F401  (re-exported)
    _rekey_optimizer_state_if_needed as rekey_optimizer_state_if_needed,
)
from lightning.fabric.utilities.init import (  # noqa: F401
    _materialize_distributed_module as materialize_distributed_module,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME as LIGHTNING_METADATA_FILENAME  # noqa: F401
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: F401
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.fabric.utilities.types import _PATH as PATH  # noqa: F401  (str | os.PathLike)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.connectors.signal_connector import log as _signal_log

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

#: private members of Lightning's ``ModelParallelStrategy`` that ``FourDStrategy`` (a subclass) reads, sets or
#: overrides; ``tests/test_compat.py`` checks each exists on an instance of the installed version
MODEL_PARALLEL_STRATEGY_PRIVATE = (
    "_configure_launcher",
    "_setup_distributed",
    "_device_mesh",
    "_data_parallel_size",
    "_tensor_parallel_size",
    "_save_distributed_checkpoint",
)


#: protected members of Lightning's ``Precision`` that ``lightning_4d.precision.FourDPrecision`` (placed before the
#: Trainer's plugin class) calls: ``_wrap_closure(model, optimizer, closure)`` runs the closure, then
#: ``on_before_optimizer_step`` and clipping, as ``Precision.optimizer_step`` passes it to ``optimizer.step``
PRECISION_PRIVATE = ("_wrap_closure",)


def attached_trainer(module: Any) -> Optional[Trainer]:
    """The ``Trainer`` a ``LightningModule`` is attached to, or ``None`` (also for ``None`` or another object)
    (``LightningModule._trainer``: the public ``trainer`` property raises instead of returning ``None`` when the
    module is not attached)."""
    return module._trainer if isinstance(module, LightningModule) else None


#: the members of the training data source (``trainer.fit_loop._data_source``, Lightning's ``_DataLoaderSource``) that
#: :func:`train_data_source`'s callers use; ``tests/test_compat.py`` checks each exists
TRAIN_DATA_SOURCE_MEMBERS = ("instance", "dataloader", "is_defined")


def train_data_source(trainer: Any) -> Any:
    """Where ``trainer.fit`` takes its training data from: ``trainer.fit_loop._data_source`` (Lightning's
    ``_DataLoaderSource``, set by ``fit`` before any hook runs). ``.instance`` is the LightningModule, the DataModule
    or the ``train_dataloaders`` object; ``.is_defined()`` whether a train dataloader can be had (a module overrides
    ``train_dataloader``); ``.dataloader()`` returns it (calling that hook, or the object itself). ``None`` for an
    object that is not a Trainer (a test's stand-in)."""
    return trainer.fit_loop._data_source if isinstance(trainer, Trainer) else None


def forget_train_loader(trainer: Any) -> None:
    """Make the fit loop request the training loader again at its next ``setup_data`` (``trainer.fit_loop.
    _combined_loader = None``, Lightning's ``CombinedLoader``): a loader built before a checkpoint's data position was
    restored (``trainer.estimated_stepping_batches`` builds it during the strategy's setup) would otherwise be kept.
    No-op for an object that is not a Trainer."""
    if isinstance(trainer, Trainer):
        trainer.fit_loop._combined_loader = None


def resolve_ckpt_path(trainer: Any, fn: str, ckpt_path: Any, model_provided: bool = True) -> Any:
    """The file or folder Lightning's ``trainer.<fn>(ckpt_path=...)`` would load: ``"last"``, ``"hpc"``, ``"best"``
    and ``"registry"`` resolved as Lightning does (``trainer._checkpoint_connector._parse_ckpt_path``, its
    ``ModelCheckpoint`` lookup), a path as it is; ``None`` when nothing would be loaded. ``fn``: ``"fit"``,
    ``"validate"``, ``"test"`` or ``"predict"``."""
    from lightning.pytorch.trainer.states import TrainerFn

    state = {"fit": TrainerFn.FITTING, "validate": TrainerFn.VALIDATING, "test": TrainerFn.TESTING}
    state_fn = state.get(fn, TrainerFn.PREDICTING)
    return trainer._checkpoint_connector._parse_ckpt_path(state_fn, ckpt_path, model_provided, False)


def set_module_device_mesh(module: Any, mesh: "DeviceMesh") -> None:
    """Make ``module.device_mesh`` return ``mesh`` (``LightningModule._device_mesh``: the public property has no
    setter; Lightning's ``ModelParallelStrategy.setup_environment`` sets the private attribute the same way)."""
    module._device_mesh = mesh


def set_scheduler_lrs(scheduler: Any, lrs: list[float]) -> None:
    """Set the learning rates of ``scheduler``'s optimizer's param groups to ``lrs`` and its ``get_last_lr()`` to
    match, between steps: torch's ``LRScheduler`` keeps the last rates in the private ``_last_lr`` (no public
    setter)."""
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


def record_sigterm_without_collective(trainer: Trainer) -> None:
    """Make ``trainer``'s SIGTERM handler only record the signal: it sets ``trainer.received_sigterm`` and, on the
    first SIGTERM, forwards it to the processes a launcher of Lightning's started, as Lightning's own handler does;
    it issues no collective. Lightning then raises ``SIGTERMException`` on each rank at the end of the training step
    (or evaluation batch) in which that rank's handler ran; ``srun`` and torchrun signal every rank at once, and a
    rank blocked in a collective runs its handler when the collective returns, within the same step.

    Why: Lightning's notifier (``trainer._signal_connector._sigterm_notifier_fn``, private; Lightning 2.6,
    ``trainer/connectors/signal_connector.py``) also calls ``torch.distributed.broadcast`` on the world group from
    inside the handler. A signal runs its handler when the interrupted rank's main thread is next in Python, and a
    rank blocked in a collective of another group (a pipeline send or receive, a data-parallel gradient reduction) is
    not there, so the ranks waited for each other: measured on 2 gloo ranks, pp2 and dp2 ZeRO 1, each sent SIGTERM
    mid-step as ``srun`` does on preemption, both ranks ended on gloo's timeout error after the process group's
    ``timeout`` (60 s in that run, 30 s in ``tests/test_preemption.py``; 30 minutes by default).

    Call it before ``register_signal_handlers`` (``Trainer._run`` calls that after ``Strategy.setup``, for fit,
    validate, test and predict alike): the handler is bound when it is registered. Raises ``AttributeError`` when
    the installed Lightning has no such connector or notifier (``tests/test_compat.py`` checks both)."""
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn  # noqa: B018  (the private name must exist: AttributeError otherwise)

    def _record_sigterm(signum: int, _frame: Any) -> None:
        _signal_log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = _record_sigterm
