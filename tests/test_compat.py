"""Every private torch / Lightning / flash-attn name ``lightning_4d.parallel._compat`` wraps (one module per feature)
exists on the installed versions, with the arguments the package passes; a name that disappears fails here, not
silently at run time.

Nothing is skipped: flash-attn is checked when it is importable, and otherwise the wrapper must raise the ImportError
that names the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import lightning_4d.parallel._compat.checkpoint
import lightning_4d.parallel._compat.collectives
import lightning_4d.parallel._compat.compile
import lightning_4d.parallel._compat.dispatch
import lightning_4d.parallel._compat.dtensor
import lightning_4d.parallel._compat.fake
import lightning_4d.parallel._compat.fsdp
import lightning_4d.parallel._compat.hf
import lightning_4d.parallel._compat.kernels
import lightning_4d.parallel._compat.lightning
import lightning_4d.parallel._compat.pipeline
import lightning_4d.parallel._compat.process  # noqa: F401  (each as _compat.<module>)
from lightning_4d.parallel import _compat


def test_lightning_private_names_resolve():
    from lightning.fabric.strategies import model_parallel as fabric_mp
    from lightning.fabric.utilities import init, load, optimizer, types

    assert _compat.lightning.rekey_optimizer_state_if_needed is fabric_mp._rekey_optimizer_state_if_needed
    assert _compat.lightning.materialize_distributed_module is init._materialize_distributed_module
    assert _compat.lightning.LIGHTNING_METADATA_FILENAME == load._METADATA_FILENAME == "meta.pt"
    assert _compat.lightning.optimizers_to_device is optimizer._optimizers_to_device
    assert _compat.lightning.PATH is types._PATH


def test_model_parallel_strategy_private_members_exist():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy()
    missing = [name for name in _compat.lightning.MODEL_PARALLEL_STRATEGY_PRIVATE if not hasattr(strategy, name)]
    assert not missing, (
        f"Lightning's ModelParallelStrategy lost {missing}: update FourDStrategy and parallel/_compat/lightning.py"
    )
    assert callable(strategy._configure_launcher) and callable(strategy._setup_distributed)


def test_lightning_module_trainer_and_device_mesh():
    import lightning.pytorch as pl

    module = pl.LightningModule()
    assert _compat.lightning.attached_trainer(module) is None
    assert _compat.lightning.attached_trainer(None) is None
    assert "_trainer" in vars(module), "LightningModule no longer keeps its trainer in `_trainer`"
    mesh = object()
    _compat.lightning.set_module_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh, "LightningModule.device_mesh no longer reads `_device_mesh`"


def test_lightning_sigterm_notifier_is_bound_when_registered():
    """``record_sigterm_without_collective`` replaces ``trainer._signal_connector._sigterm_notifier_fn`` before the
    Trainer registers its handlers: the connector and that method exist, ``register_signal_handlers`` reads the
    method from the instance (so the replacement is what gets registered), and the ``log`` and
    ``rank_prefixed_message`` the replacement uses are where it imports them from."""
    import inspect

    import lightning.pytorch as pl
    from lightning.fabric.utilities.rank_zero import rank_prefixed_message  # noqa: F401
    from lightning.pytorch.trainer.connectors import signal_connector

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    connector = trainer._signal_connector
    assert isinstance(connector, signal_connector._SignalConnector)
    assert callable(connector._sigterm_notifier_fn) and connector.received_sigterm is False
    assert "self._sigterm_notifier_fn" in inspect.getsource(signal_connector._SignalConnector.register_signal_handlers)
    assert signal_connector.log is not None
    _compat.lightning.record_sigterm_without_collective(trainer)
    assert connector._sigterm_notifier_fn.__name__ == "_record_sigterm"


def test_train_data_source_of_a_trainer():
    """``trainer.fit_loop._data_source`` exists with the members the memory check uses: ``dataloader()`` returns the
    ``train_dataloaders`` object itself, or calls the module's ``train_dataloader()`` hook, and ``is_defined()`` says
    whether the module overrides that hook."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    source = _compat.lightning.train_data_source(trainer)
    missing = [name for name in _compat.lightning.TRAIN_DATA_SOURCE_MEMBERS if not hasattr(source, name)]
    assert not missing, (
        f"Lightning's train data source lost {missing}: update _compat.lightning.train_data_source's callers"
    )
    assert source is trainer.fit_loop._data_source and source.instance is None
    loader = DataLoader(range(4), batch_size=2)
    source.instance = loader  # what trainer.fit(model, train_dataloaders=loader) sets
    assert source.is_defined() and source.dataloader() is loader

    class Module(pl.LightningModule):
        def train_dataloader(self):
            return loader

    module = Module()
    module.trainer = trainer
    source.instance = module  # trainer.fit(module)
    assert source.is_defined() and source.dataloader() is loader
    source.instance = pl.LightningModule()  # no train_dataloader hook
    assert not source.is_defined()
    assert _compat.lightning.train_data_source(object()) is None


def test_fit_loop_keeps_its_training_loader_where_forget_train_loader_clears_it():
    """``trainer.fit_loop._combined_loader`` exists (None before ``fit``); ``forget_train_loader`` sets it to None so
    the loop builds the loader again (what the data module does when a checkpoint's data position arrives)."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert "_combined_loader" in vars(trainer.fit_loop), "Lightning's fit loop lost _combined_loader"
    trainer.fit_loop._combined_loader = object()
    _compat.lightning.forget_train_loader(trainer)
    assert trainer.fit_loop._combined_loader is None
    _compat.lightning.forget_train_loader(object())  # not a Trainer: nothing to do


@pytest.fixture(scope="module")
def single_rank_group():
    """A one-rank gloo process group (pipeline stages need one), destroyed afterwards."""
    if dist.is_initialized():  # pragma: no cover - another test left one
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_inner_tensors_of_a_dtensor(single_rank_group):
    """``inner_tensors`` reads the attributes a wrapper subclass's ``__tensor_flatten__`` names: a DTensor's local
    tensor (what the measure counts the storage of)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
    assert _compat.dispatch.is_traceable_wrapper_subclass(dt)
    tensors = [t for t in _compat.dispatch.inner_tensors(dt) if torch.is_tensor(t)]  # and its device mesh
    assert len(tensors) == 1 and tensors[0] is dt._local_tensor


def test_checkpointed_module_is_the_wrapped_one():
    """``CheckpointWrapper._checkpoint_wrapped_module`` is the module ``checkpoint_wrapper`` wrapped; an unwrapped
    module is its own."""
    layer = nn.Linear(2, 2)
    wrapped = _compat.fsdp.checkpoint_wrapper(layer, checkpoint_impl=_compat.fsdp.CheckpointImpl.NO_REENTRANT)
    assert _compat.fsdp.checkpointed_module(wrapped) is layer
    assert _compat.fsdp.checkpointed_module(layer) is layer


def test_local_tensor_is_the_dtensor_storage(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    t = torch.ones(3)
    assert _compat.dtensor.local_tensor(t) is t
    dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
    _compat.dtensor.local_tensor(dt).add_(1)  # in place, through the wrapper, reaches the DTensor
    assert torch.equal(dt.to_local(), torch.full((4,), 2.0))


def test_flatten_mesh(single_rank_group):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    assert callable(getattr(DeviceMesh, "_flatten", None)), "DeviceMesh._flatten is gone: update flatten_mesh"
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    flat = _compat.dtensor.flatten_mesh(mesh["dp", "cp"], "dp_cp")
    assert flat.mesh_dim_names == ("dp_cp",) and flat.size() == 1
    assert flat.get_group() is not None


def test_precision_private_members_exist():
    """Lightning's ``Precision`` still has the protected members ``FourDPrecision`` calls, and ``_wrap_closure``
    still runs the closure before the ``on_before_optimizer_step`` hooks and clipping (``_after_closure``)."""
    from lightning.pytorch.plugins.precision import Precision

    plugin = Precision()
    missing = [name for name in _compat.lightning.PRECISION_PRIVATE if not callable(getattr(plugin, name, None))]
    assert not missing, (
        f"Lightning's Precision lost {missing}: update lightning_4d/precision.py and parallel/_compat/lightning.py"
    )
    assert list(inspect.signature(plugin._wrap_closure).parameters) == ["model", "optimizer", "closure"]
    source = inspect.getsource(Precision._wrap_closure)
    assert source.index("closure()") < source.index("self._after_closure(model, optimizer)")


def test_layout_by_name_rebuilds_a_pickled_layout():
    """DCP's ``.metadata`` pickles ``torch.strided`` as ``torch.serialization._get_layout('torch.strided')``: the
    name :mod:`lightning_4d.safe_load`'s unpickler admits must be the one pickle writes."""
    import pickle
    import pickletools

    import torch.serialization

    assert _compat.checkpoint.layout_by_name is torch.serialization._get_layout
    assert _compat.checkpoint.layout_by_name("torch.strided") is torch.strided
    assert "_get_layout" in [arg for _, arg, _ in pickletools.genops(pickle.dumps(torch.strided))]


def test_torch_utils_private_names_of_the_comm_meter():
    from torch.utils import _python_dispatch, _pytree

    assert _compat.dispatch.TorchDispatchMode is _python_dispatch.TorchDispatchMode
    assert _compat.dispatch.tree_flatten is _pytree.tree_flatten
    assert _compat.dispatch.tree_flatten({"a": [1, (2, 3)]})[0] == [1, 2, 3]
    assert _compat.dispatch.untracked is _python_dispatch._disable_current_modes


@pytest.mark.slow
def test_exit_distributed_process_runs_exit_handlers_and_keeps_the_status(tmp_path):
    """``exit_distributed_process``: the atexit handlers run (CPython's ``atexit._run_exitfuncs`` exists), buffered
    output is flushed, the process ends with the given status and nothing after the call runs."""
    import atexit
    import subprocess
    import sys

    assert callable(atexit._run_exitfuncs)
    marker = tmp_path / "handler_ran"
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "from lightning_4d.parallel._compat.process import exit_distributed_process\n"
        "sys.stdout.write('buffered')\n"
        "exit_distributed_process(3)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered"
    assert marker.read_text() == "yes"


@pytest.mark.slow
def test_module_wrapper_prefixes():
    """The module levels wrappers insert into parameter names are torch's (written once, in ``module_tree.py``: the
    model and the parallel code both import it; issue 33)."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
    from torch.distributed.fsdp import _common_utils

    from lightning_4d import module_tree

    assert _compat.fsdp.checkpoint_wrapper is cw.checkpoint_wrapper and _compat.fsdp.CheckpointImpl is cw.CheckpointImpl
    assert module_tree.CHECKPOINT_WRAPPED_MODULE == cw._CHECKPOINT_WRAPPED_MODULE
    assert module_tree.FSDP1_WRAPPED_MODULE == _common_utils.FSDP_WRAPPED_MODULE
    wrapped = _compat.fsdp.checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=_compat.fsdp.CheckpointImpl.NO_REENTRANT)
    assert hasattr(wrapped, module_tree.CHECKPOINT_WRAPPED_MODULE)
    compiled = torch.compile(nn.Linear(2, 2))  # wraps lazily: nothing is compiled before a call
    assert [n for n, _ in compiled.named_parameters()][0].startswith(module_tree.COMPILED_MODULE + ".")
    assert set(module_tree.MODULE_WRAPPER_PREFIXES) == {
        module_tree.CHECKPOINT_WRAPPED_MODULE,
        module_tree.COMPILED_MODULE,
        module_tree.FSDP1_WRAPPED_MODULE,
    }


def test_compiled_graph_count_counts_compiled_graphs_and_not_eager_fallbacks():
    """A compiled function adds one graph on its first call and none on the next (cached); one whose backend fails
    and falls back to eager (``suppress_errors``) adds none, so the count tells a compilation from a silent
    fall-back."""
    import torch._dynamo

    def f(x):
        return torch.sin(x) + 1

    def failing_backend(gm, example_inputs):
        raise RuntimeError("planted backend failure")

    torch._dynamo.reset()
    before = _compat.compile.compiled_graph_count()
    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(3))
    assert _compat.compile.compiled_graph_count() == before + 1
    compiled(torch.ones(3))
    assert _compat.compile.compiled_graph_count() == before + 1
    torch._dynamo.reset()
    with torch._dynamo.config.patch(suppress_errors=True):
        out = torch.compile(lambda x: torch.cos(x) * 2, backend=failing_backend)(torch.ones(3))
    assert torch.equal(out, torch.cos(torch.ones(3)) * 2)  # ran eagerly
    assert _compat.compile.compiled_graph_count() == before + 1
    torch._dynamo.reset()


def test_async_collective_input_is_waited_for_with_its_gradient():
    """An ``AsyncCollectiveTensor`` (tp's embedding output) becomes, before a compiled layer, a plain tensor of the
    same values whose gradient reaches it (``parallel/compile.py``; that compiled layers with it are right:
    tests/test_compile.py). Measured on torch 2.13: ``torch.compile`` alone (``aot_eager`` too) returns an output
    that does not require grad for such an input."""
    from lightning_4d.parallel.compile import _WaitAsyncCollective

    values = torch.arange(6.0).reshape(2, 3)
    x = _compat.compile.AsyncCollectiveTensor(values.clone()).requires_grad_()
    out = _WaitAsyncCollective.apply(x)
    assert type(out) is torch.Tensor and torch.equal(out, values)
    (out * values).sum().backward()
    assert torch.equal(x.grad, values)


def test_dynamo_dynamic_scalars_sets_both_flags_inside_only():
    """``dynamo_dynamic_scalars`` turns on Dynamo's two flags (the private names it patches exist on this torch) for
    its block only."""
    import torch._dynamo.config as config

    before = (config.capture_scalar_outputs, config.capture_dynamic_output_shape_ops)
    with _compat.compile.dynamo_dynamic_scalars():
        assert config.capture_scalar_outputs and config.capture_dynamic_output_shape_ops
    assert (config.capture_scalar_outputs, config.capture_dynamic_output_shape_ops) == before == (False, False)


def test_canonical_parameter_names_strip_every_wrapper_prefix():
    """The model strips the wrapper levels of ``module_tree.MODULE_WRAPPER_PREFIXES`` (the one definition, issue 33:
    the model's own copy is gone), wherever they sit in the dotted path."""
    from lightning_4d.models.llama import canonical_name
    from lightning_4d.module_tree import MODULE_WRAPPER_PREFIXES

    for prefix in MODULE_WRAPPER_PREFIXES:
        assert canonical_name(f"{prefix}.layers.0.{prefix}.attention.wq.weight") == "layers.0.attention.wq.weight"


def test_module_apply_signature():
    """``nn.Module._apply`` (behind ``to``, ``to_empty``, ...), which the model and the pipeline stage override."""
    assert list(inspect.signature(nn.Module._apply).parameters) == ["self", "fn", "recurse"]


@pytest.mark.parametrize("name", sorted(_compat.kernels.ATEN_FLASH_OPS))
def test_aten_flash_ops_exist_with_the_arguments_passed(name):
    assert hasattr(torch.ops.aten, name), f"torch.ops.aten.{name} is gone: update aten_flash_forward/backward"
    schema = getattr(torch.ops.aten, name).default._schema
    expected = _compat.kernels.ATEN_FLASH_OPS[name]
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert tuple(positional[: len(expected)]) == expected, f"aten.{name} changed its arguments: {schema}"
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only]


@pytest.mark.parametrize("name", _compat.fsdp.SAC_SAVED_PRIVATE_OPS)
def test_selective_checkpointing_ops_exist(name):
    """Each op selective activation checkpointing saves resolves under the name the policy compares (flash-attn's
    when flash-attn is installed; otherwise it must be the forward of :data:`_compat.kernels.FLASH_ATTN_FUNCTIONS`)."""
    import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)

    namespace, op = name.split("::")
    if namespace == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        assert op in _compat.kernels.FLASH_ATTN_FUNCTIONS
        return
    if namespace == "flash_attn":
        importlib.import_module("flash_attn.flash_attn_interface")  # registers torch.ops.flash_attn
    packet = getattr(getattr(torch.ops, namespace), op, None)
    assert packet is not None, f"torch.ops.{namespace}.{op} is gone: update SAC_SAVED_PRIVATE_OPS"
    assert packet.default.name() == name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_aten_flash_cpu_matches_sdpa(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    scale = 0.5
    out, lse = _compat.kernels.aten_flash_forward(q, k, v, causal=True, scale=scale)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    assert lse.shape == (2, 3, 8)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    ref.backward(dout)
    dq, dk, dv = _compat.kernels.aten_flash_backward(dout, (q, k, v), out, lse, causal=True, scale=scale)
    for got, t in zip((dq, dk, dv), (q, k, v)):
        torch.testing.assert_close(got, t.grad)


def test_flash_attn_names_or_clear_import_error():
    if importlib.util.find_spec("flash_attn") is not None:
        fa = importlib.import_module("flash_attn.flash_attn_interface")
        for name, expected in _compat.kernels.FLASH_ATTN_FUNCTIONS.items():
            assert hasattr(fa, name), f"flash_attn.flash_attn_interface.{name} is gone"
            params = list(inspect.signature(getattr(fa, name)).parameters)
            assert tuple(params[: len(expected)]) == expected, f"{name} changed its parameters: {params}"
        assert _compat.kernels.flash_attn_interface() is fa
        return
    x = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ImportError, match=r"lightning-4d\[flash\]"):
        _compat.kernels.flash_attn_interface()
    with pytest.raises(ImportError, match=r"lightning-4d\[flash\]"):
        _compat.kernels.flash_attn_forward(x, x, x, causal=True, scale=1.0)
    with pytest.raises(ImportError, match=r"lightning-4d\[flash\]"):
        _compat.kernels.flash_attn_backward(x, (x, x, x), x, x[..., 0], (x, x, x), causal=True, scale=1.0)


def test_flash_attn_pin_matches_the_signature():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"flash-attn>=2.7,<2.9"' in pyproject


# ---------------------------------------------------------------------------------------------------- schedules
#: every schedule the strategy offers (config.PIPELINE_SCHEDULES) and the stages per rank it needs
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


def test_schedule_table_covers_the_offered_schedules():
    from lightning_4d.config import PIPELINE_SCHEDULES

    assert set(SCHEDULES) == set(PIPELINE_SCHEDULES)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_reset_schedule_metadata_resets_the_init_flags(single_rank_group, name):
    """One step sets the flags the schedule's metadata inference is keyed on; the reset clears exactly those (and
    they are all the ``*_initialized`` flags the schedule has); the next step infers again."""
    from torch.distributed import pipelining

    cls_name, n_stages = SCHEDULES[name]
    cls = getattr(pipelining, cls_name)
    torch.manual_seed(0)
    stages = [pipelining.PipelineStage(nn.Linear(4, 4), i, n_stages, torch.device("cpu")) for i in range(n_stages)]
    schedule = cls(stages[0] if n_stages == 1 else stages, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    base = next(b for b in _compat.pipeline.SCHEDULE_INIT_FLAGS if isinstance(schedule, b))
    flags = _compat.pipeline.SCHEDULE_INIT_FLAGS[base]
    state = {k for k in vars(schedule) if k.endswith("_initialized") and isinstance(vars(schedule)[k], bool)}
    assert state == set(flags), f"{cls_name} keeps its init state in {sorted(state)}, _compat resets {flags}"

    def step() -> None:
        schedule.step(torch.randn(4, 4), target=torch.zeros(4, 4), losses=[])
        assert all(getattr(schedule, f) is True for f in flags), f"{cls_name}.step no longer sets {flags}"

    step()
    _compat.pipeline.reset_schedule_metadata(schedule)
    assert all(getattr(schedule, f) is False for f in flags)
    step()  # metadata inferred again over the same stages


def test_reset_schedule_metadata_rejects_unknown_objects():
    with pytest.raises(RuntimeError, match="not a torch.distributed.pipelining schedule"):
        _compat.pipeline.reset_schedule_metadata(object())


def test_reset_schedule_metadata_raises_when_flags_are_gone():
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = ScheduleGPipe.__new__(ScheduleGPipe)  # no __init__: none of the flags are set
    with pytest.raises(RuntimeError, match="changed the pipelining schedules' private state"):
        _compat.pipeline.reset_schedule_metadata(schedule)


def test_flat_collectives_use_the_current_names():
    """torch 2.10+ renamed the flat all-gather / reduce-scatter (the old names warn a FutureWarning per call)."""
    import torch.distributed as dist

    from lightning_4d.parallel import _compat

    assert _compat.collectives.all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert _compat.collectives.reduce_scatter_single is getattr(
        dist, "reduce_scatter_single", dist.reduce_scatter_tensor
    )


def test_process_group_lookups_of_the_comm_meter():
    """CommMeter names a collective's group: c10d operators pass it as a ScriptObject (ProcessGroup.unbox), the
    functional collectives by name (distributed_c10d._resolve_process_group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    assert callable(getattr(dist.ProcessGroup, "unbox", None))
    assert callable(getattr(distributed_c10d, "_resolve_process_group", None))


def test_dcp_storage_info_fields(tmp_path):
    """DCP's private _StorageInfo still has the fields the truncation check reads (torch 2.13: relative_path,
    offset, length)."""
    import torch.distributed.checkpoint as dcp

    from lightning_4d.parallel._compat.checkpoint import DCP_STORAGE_INFO_FIELDS, dcp_file_extents

    dcp.save({"a": torch.zeros(3), "b": torch.ones(5)}, checkpoint_id=tmp_path, no_dist=True)
    storage = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    info = next(iter(storage.values()))
    assert all(hasattr(info, f) for f in DCP_STORAGE_INFO_FIELDS)
    extents = dcp_file_extents(storage)
    assert extents and all((tmp_path / name).stat().st_size >= end for name, end in extents.items())


def test_scheduler_last_lr_is_what_set_scheduler_lrs_sets():
    """``LRScheduler._last_lr`` (private) still backs ``get_last_lr()``: ``set_scheduler_lrs`` writes both."""
    import torch

    from lightning_4d.parallel._compat.lightning import set_scheduler_lrs

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    set_scheduler_lrs(sched, [0.25])
    assert sched.get_last_lr() == [0.25] and opt.param_groups[0]["lr"] == 0.25


def test_grouped_mm_and_local_offset():
    """``torch._grouped_mm`` (MoE experts on CUDA, bfloat16) is found when torch has it; ``local_offset`` reads a
    DTensor shard's global offset (Mixtral ``init_from`` under ZeRO 3)."""
    assert _compat.kernels.grouped_mm is getattr(torch, "_grouped_mm", None)
    assert _compat.kernels.grouped_mm is None or callable(_compat.kernels.grouped_mm)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert callable(compute_local_shape_and_global_offset)


def test_fully_shard_takes_shard_placement_fn():
    """ZeRO 2/3 shard expert weights on dim 1 through FSDP2's ``shard_placement_fn`` (``parallel/fsdp.py``): the
    installed torch has it, and the flag says so."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    assert "shard_placement_fn" in inspect.signature(fully_shard).parameters
    assert _compat.fsdp.FULLY_SHARD_PLACEMENT_FN is True


def test_fake_process_group_and_pipeline_metadata_names():
    """``lightning-4d measure`` (lightning_4d/measure.py): torch's fake process group module and what
    ``answer_pipeline_metadata`` replaces (torch >= 2.13: ``PipelineStage._recv_meta`` and the metadata classes it
    returns; earlier: ``torch.distributed.recv_object_list``, public)."""
    import importlib

    from torch.distributed.pipelining import PipelineStage

    fake = importlib.import_module(_compat.fake.FAKE_PG_MODULE)
    assert hasattr(fake, "FakeStore")
    if hasattr(PipelineStage, "_recv_meta"):
        from torch.distributed.pipelining import _utils

        for name in ("_StageForwardMeta", "_StageBackwardMeta", "extract_tensor_metas"):
            assert hasattr(_utils, name), name
        import inspect

        assert list(inspect.signature(PipelineStage._recv_meta).parameters) == ["self", "src_stage"]
    else:
        assert hasattr(PipelineStage, "_shape_inference")


def test_cuda_memory_history_names():
    """``benchmarks/cuda_memory_peak.py``: the allocator's recording and snapshot
    (``_compat.process.record_cuda_memory_history``,
    ``_compat.process.cuda_memory_snapshot``)."""
    import inspect

    from torch.cuda import memory

    assert "enabled" in inspect.signature(memory._record_memory_history).parameters
    assert "max_entries" in inspect.signature(memory._record_memory_history).parameters
    assert callable(memory._snapshot)


def test_schedule_rank_operations_names():
    """The memory model's V-schedule action lists are checked against torch's through
    ``_compat.pipeline.schedule_rank_actions``: each schedule class still computes one rank's list from the attributes
    set."""
    import inspect

    from torch.distributed.pipelining import schedules

    for name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        method = getattr(schedules, name)._calculate_single_rank_operations
        assert list(inspect.signature(method).parameters) == ["self", "rank"]
        source = inspect.getsource(method)
        used = {a for a in _compat.pipeline.SCHEDULE_RANK_OPERATIONS_ATTRIBUTES if f"self.{a}" in source}
        assert used and used <= set(_compat.pipeline.SCHEDULE_RANK_OPERATIONS_ATTRIBUTES), name
    assert _compat.pipeline.schedule_rank_actions("ScheduleZBVZeroBubble", 2, 0, 4)[:3] == [(0, "F")] * 3


def test_all_to_all_single_takes_what_answer_count_exchange_reads():
    """``answer_count_exchange`` replaces ``torch.distributed.all_to_all_single`` and reads its arguments by position
    and name: output, input, output_split_sizes, input_split_sizes, group."""
    params = list(inspect.signature(dist.all_to_all_single).parameters)
    assert params[:5] == ["output", "input", "output_split_sizes", "input_split_sizes", "group"]


def test_device_mesh_flatten_and_unflatten_signatures():
    """``_compat.dtensor.flatten_mesh`` / ``unflatten_mesh`` call ``DeviceMesh._flatten(name)`` and
    ``DeviceMesh._unflatten(dim, sizes, names)`` (the latter torch >= 2.9, expert parallelism's meshes)."""
    from torch.distributed.device_mesh import DeviceMesh

    assert list(inspect.signature(DeviceMesh._flatten).parameters)[:2] == ["self", "mesh_dim_name"]
    assert list(inspect.signature(DeviceMesh._unflatten).parameters)[:4] == [
        "self",
        "dim",
        "mesh_sizes",
        "mesh_dim_names",
    ]


def test_checkpoint_connector_parses_the_ckpt_path():
    """``_compat.lightning.resolve_ckpt_path`` calls the Trainer's ``_checkpoint_connector._parse_ckpt_path(state_fn,
    ckpt_path, model_provided, model_connected)``; a path that is not a special name comes back as it is."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    params = list(inspect.signature(trainer._checkpoint_connector._parse_ckpt_path).parameters)
    assert params == ["state_fn", "ckpt_path", "model_provided", "model_connected"]
    assert _compat.lightning.resolve_ckpt_path(trainer, "fit", "some/file.ckpt") == "some/file.ckpt"
    assert _compat.lightning.resolve_ckpt_path(trainer, "fit", None) is None


def test_transformers_attention_implementation_switch():
    """``_compat.hf.set_attention_implementation``: transformers 5's public ``set_attn_implementation``, else (4.x)
    the config's private ``_attn_implementation``, which a tiny Llama then reads."""
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    _compat.hf.set_attention_implementation(model, "eager")
    assert model.config._attn_implementation == "eager"


def test_process_group_count_counts_new_groups(single_rank_group):
    from lightning_4d.parallel._compat.process import process_group_count

    before = process_group_count()
    assert before >= 1  # the default group
    torch.distributed.new_group([0])
    assert process_group_count() == before + 1


def test_clear_sharding_caches_empties_dtensors_propagation_cache(single_rank_group):
    """``clear_sharding_caches``: a DTensor op leaves its propagation in the native cache (its stats, a pair of
    counters, nonzero), and the call resets it (and this thread's Python cache, which the native path leaves empty)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from lightning_4d.parallel._compat.dtensor import clear_sharding_caches

    mesh = init_device_mesh("cpu", (1,))
    a = distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])
    _ = a @ a
    assert sum(torch._C._get_DTensor_sharding_propagator_cache_stats()) > 0
    clear_sharding_caches()
    assert tuple(torch._C._get_DTensor_sharding_propagator_cache_stats()) == (0, 0)
    assert DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize == 0


def test_process_group_timeout_set_and_read(single_rank_group):
    """``set_process_group_timeout`` (``_set_pg_timeout``) changes a group's limit, which ``process_group_timeout``
    (the backend's ``options._timeout``) reads back; a new group starts at torch's default (30 minutes for gloo)."""
    from datetime import timedelta

    from lightning_4d.parallel._compat.process import process_group_timeout, set_process_group_timeout

    group = torch.distributed.new_group([0])
    assert process_group_timeout(group) == timedelta(minutes=30)
    set_process_group_timeout(group, timedelta(seconds=7))
    assert process_group_timeout(group) == timedelta(seconds=7)


def test_collective_trace_records_each_collective_with_its_group_and_thread():
    """``collective_trace``: torch's flight recorder (``_dump_fr_trace``, enabled by ``TORCH_FR_BUFFER_SIZE`` before
    the groups exist: a process of its own) keeps each gloo collective with its group, sequence number, op, sizes,
    dtypes, thread and Python frames; ``_world.pg_names`` gives each group's ranks."""
    import json
    import subprocess
    import sys

    code = (
        "import json, os, torch, torch.distributed as dist\n"
        "from lightning_4d.parallel._compat.process import FLIGHT_RECORDER_ENV, collective_trace\n"
        "from lightning_4d.safe_load import loads_plain\n"
        "os.environ[FLIGHT_RECORDER_ENV] = '10'\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "group = dist.new_group([0])\n"
        "dist.all_reduce(torch.ones(3), group=group)\n"
        "dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))\n"
        "trace, groups = collective_trace()\n"
        "entries = loads_plain(trace, 'trace')['entries']\n"
        "keys = ('process_group', 'collective_seq_id', 'profiling_name', 'input_sizes', 'input_dtypes', 'thread_id')\n"
        "rows = [[e[k] for k in keys] + [e['frames'][0]['name']] for e in entries]\n"
        "print(json.dumps({'rows': rows, 'groups': groups, 'name': group.group_name}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    (first, second) = out["rows"]
    assert first[0][0] == out["name"] and first[1:5] == [1, "gloo:all_reduce", [[3]], ["Float"]], first
    assert second[1:4] == [1, "gloo:all_gather", [[2]]] and second[5] == first[5], second
    assert first[6] == "all_reduce"  # the innermost Python frame: torch.distributed's function
    assert out["groups"][out["name"]] == [0] and sorted(out["groups"].values()) == [[0], [0]]


def test_restarted_worker_store_keys_are_the_attempts_own(monkeypatch):
    """A worker torchrun restarted gets the agent's store under ``/lightning_4d/attempt_<n>/`` (torch 2.13's
    ``_create_c10d_store`` no longer prefixes per attempt while the agent keeps its store); the first attempt and other
    launchers get ``None`` (the default rendezvous)."""
    from datetime import timedelta

    from lightning_4d.parallel._compat.process import restarted_worker_store

    agent = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )  # the agent's
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "WORLD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarted_worker_store(timedelta(seconds=10)) is None  # not torchrun's agent store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restarted_worker_store(timedelta(seconds=10)) is None  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    agent.set("rank_0", "stale address of an earlier attempt")
    store = restarted_worker_store(timedelta(seconds=10))
    store.set("rank_0", "fresh")
    assert agent.get("/lightning_4d/attempt_2/rank_0") == b"fresh"
    assert agent.get("rank_0") == b"stale address of an earlier attempt"
