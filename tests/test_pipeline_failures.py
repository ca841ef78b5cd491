"""A failed pipeline step says where it failed and why in its first line (``PipelineStepError``).

``torch.distributed.pipelining`` wraps an error raised inside a stage's forward or backward in a ``RuntimeError`` whose
message starts with a blank line ("\\n  [Stage 1] failed to run forward: ..."), so a log's last line read
``RuntimeError:`` and nothing else. That is what the 8-rank launch (cp2 x pp2 x tp2) recorded on rank 7 when it
failed once; the same picture comes back when one rank of that launch is ended (SIGKILL, or a Python error raised in
it): every other rank prints ``RuntimeError:`` over gloo's "Connection closed by peer", the real error being on the
rank that failed first. The runner now names the rank, its stages and the innermost error, and says when that is a
collective that lost its peer."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward

from lightning_4d.features.pipeline.runtime import (
    PEER_FAILURES,
    PipelineRunner,
    PipelineStepError,
    describe_step_failure,
)
from tests._launch import SCRIPTS, torchrun

WHERE = "pipeline rank 1 of 2 (global rank 7, stages [1])"
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:40337. This is typically caused by a remote worker crashing."
)
NCCL_TIMEOUT = (
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before timing out."
)


class _Raises(torch.autograd.Function):
    """Identity whose backward raises ``error`` (a stage's backward failing: a shape error, a lost peer)."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


def failed_stage_backward(error: BaseException) -> BaseException:
    """What torch's own pipelining raises when a stage's backward raises ``error`` (``stage_backward``, the function
    its schedules call): a ``RuntimeError`` whose message starts with a blank line, ``error`` its cause."""
    x = torch.ones(3, requires_grad=True)
    try:
        stage_backward(_Raises.apply(x, error).sum(), None, [x])
    except RuntimeError as raised:
        return raised
    raise AssertionError("stage_backward did not raise")


def named(error: BaseException) -> BaseException:
    """``error`` as :class:`PipelineRunner` re-raises it from a schedule step."""
    runner = PipelineRunner.__new__(PipelineRunner)  # the context needs only ``where``
    runner.where = WHERE
    try:
        with runner._named_failure():
            raise error
    except BaseException as raised:
        return raised
    raise AssertionError("not re-raised")


def test_torchs_pipelining_still_hides_a_stage_error_behind_a_blank_first_line():
    """The reason for all of this, checked on the installed torch: if this fails, torch names the error itself."""
    raised = failed_stage_backward(ValueError("logits [2, 16, 256] vs labels [2, 15]"))
    assert str(raised).split("\n", 1)[0].strip() == ""
    assert isinstance(raised.__cause__, ValueError)


def test_a_stage_error_is_named_on_the_first_line():
    raised = named(failed_stage_backward(ValueError("logits [2, 16, 256] vs labels [2, 15]")))
    assert isinstance(raised, PipelineStepError) and isinstance(raised, RuntimeError)
    assert str(raised) == f"{WHERE} failed in its schedule step: ValueError: logits [2, 16, 256] vs labels [2, 15]"
    assert isinstance(raised.__cause__.__cause__, ValueError)  # the chain is kept


def test_a_lost_peer_inside_a_stage_is_named_as_such():
    raised = named(failed_stage_backward(RuntimeError(GLOO_CLOSED)))
    assert isinstance(raised, PipelineStepError)
    assert str(raised).startswith(f"{WHERE} failed in its schedule step: RuntimeError: [/__w/pytorch")
    assert "Connection closed by peer" in str(raised) and "a collective lost its peer" in str(raised)


def test_a_lost_peer_outside_a_stage_keeps_its_type_and_gets_a_note():
    """A receive between stages' compute raises gloo's (or NCCL's) error itself, first line intact: a caller that
    catches ``torch.distributed.DistError`` still catches it; the line is a note under the message."""
    raised = named(torch.distributed.DistBackendError(NCCL_TIMEOUT))
    assert type(raised) is torch.distributed.DistBackendError
    (note,) = raised.__notes__
    assert note.startswith(f"{WHERE} failed in its schedule step: DistBackendError: [Rank 3] Watchdog")
    assert "a collective lost its peer" in note


def test_a_lost_peer_anywhere_in_the_chain_counts():
    """Lightning's SIGTERM handler broadcasts on the world group; on a dead peer that fails inside whatever the rank
    was running, and the stage's error is raised from it."""
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as gloo:
            raise KeyError("while the broadcast failed") from gloo
    except KeyError as outer:
        line = describe_step_failure(failed_stage_backward(outer), WHERE)
    assert "RuntimeError: [/__w/pytorch" in line and "a collective lost its peer" in line


def test_only_what_follows_from_causes_is_named():
    """An error raised while another was being handled (``__context__``, not ``raise ... from``) is not taken for its
    cause: the stage's own error is named."""
    try:
        try:
            {}["k"]
        except KeyError:
            raise ValueError("logits vs labels")  # noqa: B904 - the implicit context is the point
    except ValueError as inner:
        raised = named(failed_stage_backward(inner))
    assert str(raised) == f"{WHERE} failed in its schedule step: ValueError: logits vs labels"


def test_a_users_timed_out_is_not_a_lost_peer():
    assert describe_step_failure(ValueError("request timed out: Timed out after 3 s"), WHERE) is None
    line = describe_step_failure(failed_stage_backward(ValueError("Timed out reading the cache")), WHERE)
    assert "lost its peer" not in line


def test_an_error_that_says_what_it_is_passes_unchanged():
    error = ValueError("a batch of 3 sequences cannot be split into num_microbatches=2")
    assert named(error) is error and not hasattr(error, "__notes__")
    assert str(named(failed_stage_backward(ValueError("")))) == (
        f"{WHERE} failed in its schedule step: ValueError: (no message)"
    )


def test_every_gloo_and_nccl_lost_peer_message_is_recognised():
    """The messages of gloo's ``pair.cc`` / ``unbound_buffer.cc`` and NCCL's watchdog the runner names (their texts in
    torch 2.13's libraries)."""
    for text in (
        GLOO_CLOSED,
        NCCL_TIMEOUT,
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:56029: Connection reset by peer",
        "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete",
        "[gloo/transport/tcp/pair.cc:598] Socket closed",
        "NCCL error: remote process exited or there was a network error",
    ):
        line = describe_step_failure(RuntimeError(text), WHERE)
        assert line is not None and "a collective lost its peer" in line, text
    assert all(isinstance(mark, str) and mark for mark in PEER_FAILURES)


def test_a_cycle_in_the_chain_ends():
    a, b = RuntimeError(""), RuntimeError("the first")
    a.__cause__, b.__cause__ = b, a
    assert describe_step_failure(a, WHERE) == f"{WHERE} failed in its schedule step: RuntimeError: the first"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_peer_failure")
    torchrun(4, SCRIPTS / "pipeline_peer_failure.py", "--out", str(out), timeout=300)
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.slow
def test_the_ranks_left_when_one_ends_name_the_lost_peer(records):
    """pp2 x tp2: the last stage's tp rank 1 (global rank 3) ends its process as its forward begins. Its tp peer
    (rank 2) fails inside the stage's forward, where pipelining's wrapper gives a blank first line (before: the error
    read "RuntimeError:" and nothing else): it raises PipelineStepError naming itself, its stage and gloo's error. The
    first stage's ranks lose their pp peers at a receive, whose gloo error keeps its type and gets that line as a
    note."""
    assert sorted(records) == [0, 1, 2], records  # rank 3 ended without a word
    for rank, r in records.items():
        stage = r["pp_rank"]
        line = r["message"].splitlines()[0] if r["type"] == "PipelineStepError" else r["notes"][-1]
        assert line.startswith(f"pipeline rank {stage} of 2 (global rank {rank}, stages [{stage}]) failed"), r
        assert any(mark in line for mark in PEER_FAILURES) and "a collective lost its peer" in line, r
    assert (records[2]["pp_rank"], records[2]["tp_rank"]) == (1, 0)
    assert records[2]["type"] == "PipelineStepError", records[2]
    assert records[2]["cause"].splitlines()[0].strip() == "", records[2]  # pipelining's wrapper: a blank first line
    assert "failed to run forward" in records[2]["cause"], records[2]
