"""Fake ranks: torch's fake process group, and the answers its ranks would otherwise receive from their neighbours
(pipeline stage metadata, the MoE layers' token counts), so that one process can measure any rank of any layout."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.distributed as _dist
from torch import Tensor

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
    # the hidden state a stage receives requires grad, as a real neighbour's output does: a stage told otherwise
    # computes no input gradient, and under ZBV / DualPipeV (backward split into an input and a weight pass) no
    # weight gradient either (the weight pass works from the input pass' graph), so a fake run of the V's last stage
    # held no gradients and no optimizer states for its parameters
    received = boundary.detach().requires_grad_(True)
    try:  # torch >= 2.13
        from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas
    except ImportError:  # pragma: no cover - earlier torch: the stages receive through recv_object_list
        return _answered_object_lists(received)
    forward, backward = extract_tensor_metas((received,)), extract_tensor_metas((boundary.detach(),))
    for stage in stages:

        def recv_meta(src_stage: int, stage: Any = stage) -> Any:
            if src_stage < stage.stage_index:
                return _StageForwardMeta(forward_metas=forward)
            return _StageBackwardMeta(backward_metas=backward)

        stage._recv_meta = recv_meta
    return contextlib.nullcontext()


@contextlib.contextmanager
def _answered_object_lists(received: Tensor) -> Iterator[None]:
    """While entered: ``torch.distributed.recv_object_list`` receives ``(received,)`` (a stage's metadata on
    torch < 2.13, :func:`answer_pipeline_metadata`)."""
    original = _dist.recv_object_list

    def recv_object_list(object_list: list, *args: Any, **kwargs: Any) -> None:
        object_list[0] = (received,)

    _dist.recv_object_list = recv_object_list
    try:
        yield
    finally:
        _dist.recv_object_list = original


def answer_count_exchange(groups: list, answer: Callable[[Tensor], Tensor]) -> Any:
    """A context manager: while it is entered, ``torch.distributed.all_to_all_single`` called with equal splits (no
    split sizes) on an integer tensor over a process group in ``groups`` (the row-count exchange of MoE's
    all-to-all dispatch under ep, :mod:`lightning_4d.features.moe`) writes ``answer(input)`` into its output (same
    shape and dtype) after the group has run it; every other call is the group's alone. For a fake process group
    (:func:`init_fake_process_group`), whose all-to-all leaves the output as it was: the rank then receives the
    rows ``answer`` states, and the uneven all-to-all that follows allocates them. The function is replaced on the
    ``torch.distributed`` module while entered (the callers look it up there at each call), as
    :func:`answer_pipeline_metadata` replaces ``recv_object_list``.

    Raises:
        ValueError: ``answer`` returns a tensor whose shape differs from the input's (on the call).
    """
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
