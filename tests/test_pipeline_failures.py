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

from lightning_4d.features.pipeline.runtime import PEER_FAILURES, PipelineStepError, describe_step_failure
from tests._launch import SCRIPTS, torchrun

WHERE = "pipeline rank 1 of 2 (global rank 7, stages [1])"
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:40337. This is typically caused by a remote worker crashing."
)


def wrapped(inner: BaseException) -> RuntimeError:
    """``inner`` as torch.distributed.pipelining's stage forward re-raises it (``stage.py``: ``raise
    RuntimeError(exc_msg) from e``, the message starting with a newline)."""
    try:
        try:
            raise inner
        except Exception as e:
            raise RuntimeError("\n            [Stage 1] failed to run forward:\n            args: ()\n") from e
    except RuntimeError as outer:
        return outer


def test_a_stage_error_wrapped_by_pipelining_is_named_on_the_first_line():
    line = describe_step_failure(wrapped(ValueError("logits [2, 16, 256] vs labels [2, 15]")), WHERE)
    assert line == (f"{WHERE} failed in its schedule step: ValueError: logits [2, 16, 256] vs labels [2, 15]")
    assert "\n" not in line


def test_a_lost_peer_is_named_as_such():
    line = describe_step_failure(wrapped(RuntimeError(GLOO_CLOSED)), WHERE)
    assert line.startswith(f"{WHERE} failed in its schedule step: RuntimeError: [/__w/pytorch")
    assert "Connection closed by peer" in line and "a collective lost its peer" in line
    # not wrapped (a receive outside a stage's compute raises gloo's error itself): still named, with the hint
    line = describe_step_failure(RuntimeError(GLOO_CLOSED), WHERE)
    assert line is not None and "a collective lost its peer" in line


def test_an_error_raised_while_handling_another_is_followed_to_its_first():
    """A signal handler's collective that fails inside a stage's backward (Lightning's SIGTERM handler broadcasts):
    the chain goes through ``__context__``."""
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError:
            raise KeyError("while handling it")  # noqa: B904 - the implicit chain is what is tested
    except KeyError as second:
        line = describe_step_failure(wrapped(second), WHERE)
    assert "RuntimeError: [/__w/pytorch" in line and "lost its peer" in line


def test_an_error_that_says_what_it_is_passes_unchanged():
    assert describe_step_failure(ValueError("a batch of 3 sequences cannot be split"), WHERE) is None
    assert describe_step_failure(wrapped(ValueError("")), WHERE) == (
        f"{WHERE} failed in its schedule step: ValueError: (no message)"
    )


def test_a_cycle_in_the_chain_ends():
    a, b = RuntimeError(""), RuntimeError("the first")
    a.__cause__, b.__cause__ = b, a
    assert describe_step_failure(a, WHERE) == f"{WHERE} failed in its schedule step: RuntimeError: the first"


def test_every_peer_failure_mark_is_one_gloo_or_nccl_says():
    assert "Connection closed by peer" in PEER_FAILURES and "Connection reset by peer" in PEER_FAILURES
    assert issubclass(PipelineStepError, RuntimeError)  # what a caller caught before still catches it


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_peer_failure")
    torchrun(4, SCRIPTS / "pipeline_peer_failure.py", "--out", str(out), timeout=300)
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.slow
def test_the_ranks_left_when_one_ends_name_the_lost_peer(records):
    """pp2 x tp2: the last stage's tp rank 1 (global rank 3) ends its process as its forward begins. Its tp peer
    (rank 2) fails inside the stage's forward, where pipelining's wrapper gives a blank first line (before: the error
    read "RuntimeError:" and nothing else); the first stage's ranks lose their pp peers. Each names itself, its stage
    and gloo's error on the first line."""
    assert sorted(records) == [0, 1, 2], records  # rank 3 ended without a word
    for rank, r in records.items():
        first = r["message"].splitlines()[0]
        stage = r["pp_rank"]
        assert r["type"] == "PipelineStepError", r
        assert first.startswith(f"pipeline rank {stage} of 2 (global rank {rank}, stages [{stage}]) failed"), r
        assert any(mark in first for mark in PEER_FAILURES) and "a collective lost its peer" in first, r
    assert (records[2]["pp_rank"], records[2]["tp_rank"]) == (1, 0)
    assert records[2]["cause"].splitlines()[0].strip() == "", records[2]  # pipelining's wrapper: a blank first line
    assert "failed to run forward" in records[2]["cause"], records[2]
