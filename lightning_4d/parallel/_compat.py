"""Every private torch / Lightning / flash-attn name the package uses, in one place.

Private APIs change without deprecation. Each one the package calls is reached through this module only, and
``tests/test_compat.py`` checks that every name still exists on the installed versions, so an upgrade that removes
one fails that test loudly instead of silently taking another code path (a missed attribute reset in a pipeline
schedule leaves stale receive buffers and gives wrong results, not an error).

Tested with torch 2.13.0 and lightning 2.6.6; flash-attn 2.7-2.8 for the ``flash`` kernel (see ``pyproject.toml``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

import torch
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401  (re-exported)
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

# ---------------------------------------------------------------------------------------------------- collectives
import torch.distributed as _dist  # noqa: E402

#: ``all_gather_single(output, input, group=, async_op=)``: torch's current name of the flat all-gather (its older
#: name ``all_gather_into_tensor``, same signature, warns a FutureWarning on every call since torch 2.10)
all_gather_single = getattr(_dist, "all_gather_single", None) or _dist.all_gather_into_tensor
#: ``reduce_scatter_single(output, input, op=, group=, async_op=)``: the current name of ``reduce_scatter_tensor``
reduce_scatter_single = getattr(_dist, "reduce_scatter_single", None) or _dist.reduce_scatter_tensor


#: ``TorchDispatchMode``: the base of a mode that sees every ATen op below autograd (``torch.utils._python_dispatch``;
#: the communication meter, ``parallel/comm.py``); ``untracked()``: a context in which no such mode sees the ops
#: (``_disable_current_modes``: the activation offload's host copies, ``parallel/offload.py``, are not device memory
#: for ``LiveTensorBytes``); ``is_traceable_wrapper_subclass(t)``: ``t`` is a tensor subclass wrapping inner tensors
#: (DTensor, float8, ...) that ``t.__tensor_flatten__()`` names (``lightning_4d.measure`` counts their storages)
from torch.utils._python_dispatch import (  # noqa: E402, F401  (re-exported)
    TorchDispatchMode,
    _disable_current_modes as untracked,
    is_traceable_wrapper_subclass,
)

#: ``tree_flatten(obj) -> (leaves, spec)`` of nested lists / tuples / dicts (``torch.utils._pytree``)
from torch.utils._pytree import tree_flatten  # noqa: E402, F401  (re-exported)


def unbox_process_group(obj: Any) -> Any:
    """The ``ProcessGroup`` a ``torch.ops.c10d`` operator receives as a ``torch.ScriptObject`` argument, else
    ``None`` (a ``ReduceOp`` or ``Work`` object) (``ProcessGroup.unbox``: a TorchScript binding, not documented)."""
    try:
        return _dist.ProcessGroup.unbox(obj)
    except (RuntimeError, TypeError):
        return None


def process_group_of_name(name: str) -> Any:
    """The ``ProcessGroup`` registered under ``name`` (the ``group_name`` functional collectives carry)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ---------------------------------------------------------------------------------------------------- MoE
#: ``torch._grouped_mm(x [N, k], w [G, k, n], offs=int32 [G]) -> [N, n]``: one GEMM per row group of ``x`` (group g the
#: rows up to ``offs[g]``) with ``w[g]``, CUDA and bfloat16 (the Mixture-of-Experts experts,
#: ``lightning_4d/features/moe/layer.py``; torchtitan's grouped experts); ``None`` on a torch without it (the loop then)
grouped_mm = getattr(torch, "_grouped_mm", None)

#: ``torch.serialization._get_layout(name) -> torch.layout``: how a pickled ``torch.layout`` is rebuilt (DCP's
#: ``.metadata`` names it; torch's own weights-only unpickler allows it; :mod:`lightning_4d.safe_load` too)
layout_by_name = torch.serialization._get_layout

# ---------------------------------------------------------------------------------------------------- Lightning
from lightning.fabric.strategies.model_parallel import (  # noqa: E402, F401  (re-exported)
    _rekey_optimizer_state_if_needed as rekey_optimizer_state_if_needed,
)
from lightning.fabric.utilities.init import (  # noqa: E402, F401
    _materialize_distributed_module as materialize_distributed_module,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME as LIGHTNING_METADATA_FILENAME  # noqa: E402, F401
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: E402, F401
from lightning.fabric.utilities.types import _PATH as PATH  # noqa: E402, F401  (str | os.PathLike)

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


def attached_trainer(module: Any) -> Any:
    """The ``Trainer`` a ``LightningModule`` is attached to, or ``None`` (``LightningModule._trainer``: the public
    ``trainer`` property raises instead of returning ``None`` when the module is not attached)."""
    return getattr(module, "_trainer", None) if module is not None else None


#: the members of the training data source (``trainer.fit_loop._data_source``, Lightning's ``_DataLoaderSource``) that
#: :func:`train_data_source`'s callers use; ``tests/test_compat.py`` checks each exists
TRAIN_DATA_SOURCE_MEMBERS = ("instance", "dataloader", "is_defined")


def train_data_source(trainer: Any) -> Any:
    """Where ``trainer.fit`` takes its training data from: ``trainer.fit_loop._data_source`` (Lightning's
    ``_DataLoaderSource``, set by ``fit`` before any hook runs). ``.instance`` is the LightningModule, the DataModule
    or the ``train_dataloaders`` object; ``.is_defined()`` whether a train dataloader can be had (a module overrides
    ``train_dataloader``); ``.dataloader()`` returns it (calling that hook, or the object itself). ``None`` for an
    object without a ``fit_loop`` (not a Trainer)."""
    loop = getattr(trainer, "fit_loop", None)
    return None if loop is None else loop._data_source


#: the fit loop's attribute holding the training loader it built (``trainer.fit_loop._combined_loader``, Lightning's
#: ``CombinedLoader``); ``tests/test_compat.py`` checks it exists
FIT_LOOP_LOADER = "_combined_loader"


def forget_train_loader(trainer: Any) -> None:
    """Make the fit loop request the training loader again at its next ``setup_data`` (``trainer.fit_loop.
    _combined_loader = None``): a loader built before a checkpoint's data position was restored (``trainer.
    estimated_stepping_batches`` builds it during the strategy's setup) would otherwise be kept. No-op without a fit
    loop or before it built one."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is not None and getattr(loop, FIT_LOOP_LOADER, None) is not None:
        setattr(loop, FIT_LOOP_LOADER, None)


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


# ---------------------------------------------------------------------------------------------------- DTensor
def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor as the very storage the DTensor holds (``DTensor._local_tensor``; in-place
    updates reach the DTensor, which ``to_local()`` does not promise under autograd); ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_offset(t: DTensor) -> tuple[int, ...]:
    """The global index of this rank's shard's first element of DTensor ``t``, per dimension
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


# ---------------------------------------------------------------------------------------------------- DeviceMesh
def flatten_mesh(mesh: "DeviceMesh", name: str) -> "DeviceMesh":
    """The 1D mesh over all ranks of ``mesh`` (a sub-mesh such as ``world["dp", "cp"]``), registered under ``name``
    (``DeviceMesh._flatten``). Keep the object this returns: it is the one whose process group is set up."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: "DeviceMesh", sizes: tuple[int, ...], names: tuple[str, ...]) -> "DeviceMesh":
    """The 1D ``mesh`` (e.g. the flattened ``dp_cp``) split into ``len(sizes)`` dims, the last innermost (consecutive
    ranks of ``mesh``), with process groups for each (``DeviceMesh._unflatten``, torch >= 2.9; its root is the world
    mesh's)."""
    unflatten = getattr(mesh, "_unflatten", None)
    if unflatten is None:  # pragma: no cover - older torch
        raise RuntimeError(
            f"expert parallelism needs DeviceMesh._unflatten (torch >= 2.9), torch {torch.__version__} lacks it"
        )
    return unflatten(0, tuple(sizes), tuple(names))


# ---------------------------------------------------------------------------------------------------- FSDP2
def _fully_shard_takes(name: str) -> bool:
    import inspect

    from torch.distributed.fsdp import fully_shard

    return name in inspect.signature(fully_shard).parameters


#: whether FSDP2's ``fully_shard`` takes ``shard_placement_fn`` (a public argument; ZeRO 2/3 shard expert weights
#: on dim 1 through it, ``parallel/fsdp.py``): torch 2.6 added it, ``tests/test_compat.py`` checks it on the installed
#: torch
FULLY_SHARD_PLACEMENT_FN = _fully_shard_takes("shard_placement_fn")


# ---------------------------------------------------------------------------------------------------- compile
def compiled_graph_count() -> int:
    """Graphs Dynamo has compiled in this process so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``,
    counted once the backend has returned the compiled graph: a frame whose compilation failed and silently fell back
    to eager adds none). The tests read it before and after a ``compile=True`` run."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


#: ``AsyncCollectiveTensor``: the wrapper in which a functional collective's result waits to be read
#: (``torch.distributed._functional_collectives``); DTensor's redistributions return one as the local tensor (the
#: sequence-sharded embedding output of tensor parallelism). ``lightning_4d/parallel/compile.py`` resolves it before
#: a compiled layer: AOTAutograd, given one as an input, traces its waited inner tensor, which does not require grad
#: (torch 2.13)
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # noqa: E402, F401  (re-exported)


def dynamo_dynamic_scalars() -> Any:
    """A context in which Dynamo traces host reads of tensor values (``.tolist()``, ``.item()``) as unbacked
    symbolic integers and ops with data-dependent output shapes (``bincount``, ``nonzero``) instead of breaking the
    graph there (``torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)``):
    the dynamic-shape alternative ``benchmarks/compile_moe.py`` measures for Mixture-of-Experts layers."""
    import torch._dynamo.config as config

    return config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


# ---------------------------------------------------------------------------------------------------- selective AC
#: the private ops whose outputs selective activation checkpointing saves (``parallel/activation_checkpoint.py``), by
#: qualified name without the overload (``OpOverload.name()`` up to the first dot): ATen's fused attention kernels
#: (those ``scaled_dot_product_attention`` dispatches to on CPU and CUDA, and the flash kernels context parallelism
#: calls), the routed experts' grouped GEMM on CUDA (``torch._grouped_mm``, saved as the expert loop's ``aten::mm``
#: is on CPU, so that the memory model's selective set holds on both), flash-attn 2's forward (a torch custom op
#: since flash-attn 2.7) and the functional collectives with which DTensor tensor parallelism reduces a row-parallel
#: matmul's partial sums (``all_reduce``; ``reduce_scatter_tensor`` under sequence parallelism).
#: ``tests/test_compat.py`` checks that each resolves to an op (flash-attn's when flash-attn is installed).
SAC_SAVED_PRIVATE_OPS = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_grouped_mm",
    "flash_attn::_flash_attn_forward",
    "_c10d_functional::all_reduce",
    "_c10d_functional::reduce_scatter_tensor",
)


# ---------------------------------------------------------------------------------------------------- ATen attention
#: ATen's fused flash-attention kernels that return the log-sum-exp (the public SDPA does not); each name with the
#: leading arguments it is called with (``tests/test_compat.py`` checks these against the op schemas)
ATEN_FLASH_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": ("query", "key", "value", "dropout_p", "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "dropout_p",
        "is_causal",
    ),
    "_scaled_dot_product_flash_attention": ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"),
    "_scaled_dot_product_flash_attention_backward": (
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
        "philox_seed",
        "philox_offset",
    ),
}


#: the head dimensions ATen's CUDA flash kernel takes: the public SDPA's guard (``check_head_dim_size_flash``: a
#: multiple of 8, at most 256); the private kernels called here skip that guard
ATEN_FLASH_MAX_HEAD_DIM = 256


def aten_flash_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ATen's CUDA flash kernel (:func:`aten_flash_forward` off the CPU) takes ``[b, heads, s, head_dim]``
    blocks of ``dtype``: float16 or bfloat16, ``head_dim`` a multiple of 8 and at most
    :data:`ATEN_FLASH_MAX_HEAD_DIM`."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= ATEN_FLASH_MAX_HEAD_DIM


def aten_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """``(out, logsumexp)`` of ATen's flash kernel on ``[b, heads, s, d]`` tensors (k, v with as many heads as q), no
    dropout: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype),
    ``_scaled_dot_product_flash_attention`` elsewhere (CUDA, float16/bfloat16). ``mask`` (CPU only): an additive
    ``[b, 1, s_q, s_k]`` mask in q's dtype (the CPU kernel refuses a boolean one); a query row it refuses entirely
    comes back with output 0 and log-sum-exp 0 (measured on torch 2.13), which the caller corrects."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse
    if mask is not None:
        raise ValueError("ATen's CUDA flash kernel takes no attention mask")
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def aten_flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`aten_flash_forward` given the output gradient and the final ``out`` and ``lse``
    (``[b, heads, s_q]`` float32; made contiguous here, as the CUDA kernel reads it as a dense array).

    On CUDA the cumulative sequence lengths are passed as ``None`` (an undefined tensor, as the forward returns them
    for dense batches): a defined one, even empty, selects the variable-length kernel, which wants int32 lengths
    (``RuntimeError: cu_seqlens_q must have dtype int32``). The random-number state arguments are unused without
    dropout; they are passed as the forward returns them on this device and torch version
    (:func:`_flash_rng_state`). ``mask``: as in :func:`aten_flash_forward` (CPU only)."""
    aten = torch.ops.aten
    lse = lse.contiguous()
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
        return dq, dk, dv
    if mask is not None:
        raise ValueError("ATen's CUDA flash kernel takes no attention mask")
    sq, sk = q.shape[2], k.shape[2]
    seed, offset = _flash_rng_state(q.device, q.dtype)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _flash_rng_state(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(philox_seed, philox_offset)`` as ATen's flash forward returns them on ``device`` (their dtype, shape and
    device changed across torch versions), from one forward on a ``[1, 1, 8, 8]`` block, once per device and dtype."""
    tiny = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype)
    res = torch.ops.aten._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, False, False)
    return res[6], res[7]


# ---------------------------------------------------------------------------------------------------- flash-attn
#: the extra that installs the flash-attn range whose private kernels :func:`flash_attn_forward` calls
FLASH_ATTN_EXTRA = "lightning-4d[flash]"
#: the private functions of ``flash_attn.flash_attn_interface`` used, and the leading parameters they are called
#: with (flash-attn 2.7.0 - 2.8.x: ``window_size_left/right`` and ``softcap``; 2.6 took a ``window_size`` tuple)
FLASH_ATTN_FUNCTIONS = {
    "_flash_attn_forward": (
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "return_softmax",
    ),
    "_flash_attn_backward": (
        "dout",
        "q",
        "k",
        "v",
        "out",
        "softmax_lse",
        "dq",
        "dk",
        "dv",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "deterministic",
    ),
}


def flash_attn_interface() -> Any:
    """``flash_attn.flash_attn_interface``, imported on first use.

    Raises:
        ImportError: flash-attn is not installed (or lacks the functions of :data:`FLASH_ATTN_FUNCTIONS`).
    """
    try:
        from flash_attn import flash_attn_interface as fa
    except ImportError as err:
        raise ImportError(
            f"the 'flash' attention kernel needs flash-attn 2.7-2.8, which is not installed: pip install "
            f"'{FLASH_ATTN_EXTRA}' on a CUDA machine, or use the 'sdpa' kernel."
        ) from err
    missing = [name for name in FLASH_ATTN_FUNCTIONS if not hasattr(fa, name)]
    if missing:
        raise ImportError(
            f"the installed flash-attn has no {missing}: the 'flash' kernel needs flash-attn 2.7-2.8 "
            f"(pip install '{FLASH_ATTN_EXTRA}')."
        )
    return fa


def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, softmax_lse)`` of flash-attn 2's forward on ``[b, s, heads, d]`` tensors (GQA native), no dropout, no
    window, no softcap; ``softmax_lse`` is ``[b, heads, s]`` float32."""
    fa = flash_attn_interface()
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
    return out, lse


def flash_attn_backward(
    dout: Tensor,
    qkv: tuple[Tensor, Tensor, Tensor],
    out: Tensor,
    lse: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
    causal: bool,
    scale: float,
    deterministic: bool = False,
) -> None:
    """flash-attn 2's backward of :func:`flash_attn_forward` on ``[b, s, heads, d]`` tensors (``qkv``: its q, k and
    v), writing ``grads`` = (dq, dk, dv) (allocated by the caller) in place."""
    fa = flash_attn_interface()
    (q, k, v), (dq, dk, dv) = qkv, grads
    fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, deterministic)


# ---------------------------------------------------------------------------------------------------- pipelining
#: the flags a ``torch.distributed.pipelining`` schedule sets once its stages' shapes are inferred (single-stage
#: schedules: ``_stage_*``; multi-stage schedules: ``_stages_*``)
SCHEDULE_INIT_FLAGS = {
    "PipelineScheduleSingle": ("_stage_forward_initialized", "_stage_backward_initialized"),
    "PipelineScheduleMulti": ("_stages_forward_initialized", "_stages_backward_initialized"),
}


def reset_schedule_metadata(schedule: Any) -> None:
    """Make ``schedule`` re-infer its stages' metadata (shapes, receive buffers) on its next step, after another
    schedule over the same stages ran in between.

    Raises:
        RuntimeError: the schedule's class derives from neither ``PipelineScheduleSingle`` nor
            ``PipelineScheduleMulti``, or lacks the flags :data:`SCHEDULE_INIT_FLAGS` names (torch changed them).
    """
    from torch.distributed import pipelining

    for base, flags in SCHEDULE_INIT_FLAGS.items():
        if isinstance(schedule, getattr(pipelining.schedules, base)):
            missing = [f for f in flags if not hasattr(schedule, f)]
            if missing:
                raise RuntimeError(
                    f"{type(schedule).__name__} has no attribute(s) {missing}: this torch version changed the "
                    "pipelining schedules' private state; update lightning_4d/parallel/_compat.py."
                )
            for f in flags:
                setattr(schedule, f, False)
            return
    raise RuntimeError(f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule this package knows.")


# ---------------------------------------------------------------------------------------------------- fake ranks
#: where torch keeps its fake process group (``FakeStore`` + the ``"fake"`` backend it registers on import): every
#: collective and send/recv returns at once without moving data, so one process can run any rank of any world size
FAKE_PG_MODULE = "torch.testing._internal.distributed.fake_pg"


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Initialize the default process group as rank ``rank`` of ``world_size`` on torch's fake backend
    (:data:`FAKE_PG_MODULE`; Megatron-LM's ``--fake-process-group`` uses the same). Collectives carry no data."""
    import importlib

    fake = importlib.import_module(FAKE_PG_MODULE)
    _dist.init_process_group("fake", store=fake.FakeStore(), rank=rank, world_size=world_size)


def answer_pipeline_metadata(stages: list, boundary: Tensor) -> Any:
    """Make the pipeline ``stages`` of this rank learn their neighbours' metadata without receiving it, for a fake
    process group (which receives nothing): every stage-to-stage tensor of a :class:`StageChunk` pipeline is the
    hidden state, whose shape, stride and dtype ``boundary`` (a meta tensor) gives, received as requiring grad (as a
    real neighbour's output is), and its gradient has the same shape.

    torch >= 2.13 exchanges ``_StageForwardMeta`` / ``_StageBackwardMeta`` objects through
    ``PipelineStage._recv_meta(src_stage)``: each stage's method is replaced on the instance. Earlier torch
    (``_shape_inference``) receives one tuple of meta tensors through ``torch.distributed.recv_object_list``: the
    returned context manager replaces that function while it is entered (use it around the run).

    Returns:
        A context manager (``contextlib.nullcontext`` on torch >= 2.13).
    """
    import contextlib

    # the hidden state a stage receives requires grad, as a real neighbour's output does: a stage told otherwise
    # computes no input gradient, and under ZBV / DualPipeV (backward split into an input and a weight pass) no
    # weight gradient either (the weight pass works from the input pass' graph), so a fake run of the V's last stage
    # held no gradients and no optimizer states for its parameters
    received = boundary.detach().requires_grad_(True)
    if all(hasattr(stage, "_recv_meta") for stage in stages):
        from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas

        forward, backward = extract_tensor_metas((received,)), extract_tensor_metas((boundary.detach(),))
        for stage in stages:

            def recv_meta(src_stage: int, stage: Any = stage) -> Any:
                if src_stage < stage.stage_index:
                    return _StageForwardMeta(forward_metas=forward)
                return _StageBackwardMeta(backward_metas=backward)

            stage._recv_meta = recv_meta
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def answered() -> Any:
        original = _dist.recv_object_list

        def recv_object_list(object_list: list, *args: Any, **kwargs: Any) -> None:
            object_list[0] = (received,)

        _dist.recv_object_list = recv_object_list
        try:
            yield
        finally:
            _dist.recv_object_list = original

    return answered()


def answer_count_exchange(groups: list, answer: Callable[[Tensor], Tensor]) -> Any:
    """A context manager: while it is entered, ``torch.distributed.all_to_all_single`` called with equal splits (no
    split sizes) on an integer tensor over a process group in ``groups`` (the per-expert count exchange of
    :meth:`lightning_4d.features.moe.expert.ExpertDispatch.exchange`) writes ``answer(input)`` into its output (same
    shape and dtype) after the group has run it; every other call is the group's alone. For a fake process group
    (:func:`init_fake_process_group`), whose all-to-all leaves the output as it was: the rank then receives the
    rows ``answer`` states, and the uneven all-to-all that follows allocates them. The function is replaced on the
    ``torch.distributed`` module while entered (the callers look it up there at each call), as
    :func:`answer_pipeline_metadata` replaces ``recv_object_list``.

    Raises:
        ValueError: ``answer`` returns a tensor whose shape differs from the input's (on the call).
    """
    import contextlib

    ids = {id(g) for g in groups}

    @contextlib.contextmanager
    def answered() -> Any:
        original = _dist.all_to_all_single

        def all_to_all_single(output: Tensor, input: Tensor, output_split_sizes: Any = None, *args: Any, **kw: Any):
            work = original(output, input, output_split_sizes, *args, **kw)
            group = kw.get("group", args[1] if len(args) > 1 else None)
            equal = output_split_sizes is None and kw.get("input_split_sizes", args[0] if args else None) is None
            if equal and id(group) in ids and not input.is_floating_point():
                got = answer(input)
                if got.shape != output.shape:
                    raise ValueError(
                        f"answer_count_exchange: answered {tuple(got.shape)}, expected {tuple(output.shape)}"
                    )
                output.copy_(got)
            return work

        _dist.all_to_all_single = all_to_all_single
        try:
            yield
        finally:
            _dist.all_to_all_single = original

    return answered()


#: the fields of DCP's ``_StorageInfo`` (a private class: the values of ``Metadata.storage_data``) we read
DCP_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length")


def dcp_file_extents(storage_data: dict) -> dict[str, int]:
    """``{shard file name: the end of the last byte range .metadata records in it}`` from a DCP ``Metadata``'s
    ``storage_data`` (values: ``torch.distributed.checkpoint.filesystem._StorageInfo``), for the truncation check of
    :func:`lightning_4d.checkpoint._check_complete`."""
    extents: dict[str, int] = {}
    for info in storage_data.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents


def set_attention_implementation(model: Any, name: str) -> None:
    """Make a transformers model use the attention function registered as ``name`` in its ``AttentionInterface``:
    the public ``set_attn_implementation`` (transformers 5), else the config's private ``_attn_implementation``
    (transformers 4.x, where it is the only way)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def set_scheduler_lrs(scheduler: Any, lrs: list[float]) -> None:
    """Set the learning rates of ``scheduler``'s optimizer's param groups to ``lrs`` and its ``get_last_lr()`` to
    match, between steps: torch's ``LRScheduler`` keeps the last rates in the private ``_last_lr`` (no public
    setter)."""
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


# ---------------------------------------------------------------------------------------------------- process exit
import atexit as _atexit  # noqa: E402

#: ``atexit._run_exitfuncs()``: runs the registered exit handlers now, last registered first (CPython, undocumented)
RUN_EXIT_HANDLERS = "_run_exitfuncs"


def exit_distributed_process(code: int = 0) -> NoReturn:
    """End a process that used gloo process groups without CPython's interpreter finalization.

    Why: a gloo worker thread drops its reference to a finished collective *after* the caller's ``wait()`` returns;
    when that is the last reference it releases the collective's tensors, which needs the GIL. A thread that asks for
    the GIL while CPython finalizes is ended by ``pthread_exit``, whose unwinding through torch's ``noexcept`` work
    destructor calls ``std::terminate``: the process aborts with SIGABRT ("terminate called without an active
    exception") after a correct run. Core dump of one such abort (torch 2.13.0, Python 3.11, a 2-rank Lightning fit,
    1 run in 5 on 2 busy cores): main thread in ``Py_FinalizeEx``'s last garbage collection, a
    ``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``PyThread_exit_thread``
    (pytorch/pytorch#179291 describes the same). ``destroy_process_group`` does not join those threads (measured:
    they live until the last Python reference to the group, e.g. a ``DeviceMesh``, dies).

    So this flushes ``sys.stdout``/``sys.stderr``, runs the ``atexit`` handlers (Lightning's destroys the process
    group, ``logging`` flushes its handlers) while the interpreter is whole, and leaves with ``os._exit(code)``.

    Args:
        code: the process exit status.

    Raises:
        Nothing: it does not return.
    """
    import os
    import sys

    getattr(_atexit, RUN_EXIT_HANDLERS)()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # a closed or replaced stream has nothing left to write
            pass
    os._exit(code)


def record_cuda_memory_history(enabled: bool, max_entries: int = 200_000) -> None:
    """Start (``enabled``) or stop recording every CUDA caching-allocator event with its Python and C++ stack:
    ``torch.cuda.memory._record_memory_history`` (PyTorch's "Understanding CUDA Memory Usage" guide; private name).
    ``max_entries``: the newest events kept."""
    from torch.cuda import memory

    if enabled:
        memory._record_memory_history(enabled="all", max_entries=max_entries)
    else:
        memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict:
    """The recorded allocator state and event trace: ``torch.cuda.memory._snapshot()`` (private name), a dict with
    ``segments`` and ``device_traces`` (per device, events with ``action`` ("alloc", "free_completed", ...), ``addr``,
    ``size`` in bytes and ``frames``)."""
    from torch.cuda import memory

    return memory._snapshot()


#: the private method of torch's V schedules that lists one rank's actions, and the attributes it reads
SCHEDULE_RANK_OPERATIONS = "_calculate_single_rank_operations"
SCHEDULE_RANK_OPERATIONS_ATTRIBUTES = ("pp_group_size", "_n_microbatches", "num_stages")


def schedule_rank_actions(class_name: str, pp: int, rank: int, n_microbatches: int) -> list[tuple[int, str]]:
    """One rank's action list of a V-shaped ``torch.distributed.pipelining`` schedule (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``: two stages per rank, ``2·pp`` stages), computed without stages or a process group by the
    schedule's private ``_calculate_single_rank_operations`` (:data:`SCHEDULE_RANK_OPERATIONS`), as
    ``(stage index, kind)`` with kind ``F`` (forward), ``I`` (input gradient), ``W`` (weight gradient) or ``B`` (full
    backward); an overlapped forward + backward action is listed as its two sub-actions, in order. Idle slots
    (``None``) are dropped. ``tests/test_memory_model.py`` compares the memory model's lists with these.

    Raises:
        AttributeError: ``class_name`` is not a schedule of the installed torch.
    """
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name)
    schedule = cls.__new__(cls)  # no stages: the method reads only the attributes set here
    for name, value in zip(SCHEDULE_RANK_OPERATIONS_ATTRIBUTES, (pp, n_microbatches, 2 * pp)):
        setattr(schedule, name, value)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out: list[tuple[int, str]] = []
    for action in getattr(schedule, SCHEDULE_RANK_OPERATIONS)(rank):
        if action is None:
            continue
        for sub in action.sub_actions or (action,):
            out.append((sub.stage_index, kinds[sub.computation_type.name]))
    return out
