"""``CausalLMModule``'s validation metrics (torchmetrics, :class:`lightning_4d.tasks.TokenMeanLoss`): the logged
``val_loss`` (token-weighted mean) and ``val_ppl`` (its ``exp``) on every rank of dp2×tp2, pp2×dp2 and cp2×dp2 equal
one process's on the same data (``tests/scripts/pp_eval.py --validate-only``; 4 CPU processes, gloo)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_4d.tasks import TokenMeanLoss
from tests._launch import SCRIPTS, torchrun

VAL = ("--validate-only", "--val-samples", "16")  # 4 batches in one process, 2 per dp rank


def test_token_mean_loss_weights_by_tokens():
    """Batches of different token counts: the mean over tokens, not over batches; the perplexity is its exp."""
    loss, ppl = TokenMeanLoss(), TokenMeanLoss(perplexity=True)
    for metric in (loss, ppl):
        metric.update(torch.tensor(2.0), 30)
        metric.update(torch.tensor(4.0), torch.tensor(10))
    assert loss.compute().item() == pytest.approx(2.5, rel=1e-6)
    assert ppl.compute().item() == pytest.approx(math.exp(2.5), rel=1e-6)
    loss.reset()
    loss.update(torch.tensor(1.0), 4)
    assert loss.compute().item() == pytest.approx(1.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain Lightning, one process, no FourDStrategy: it must log both metrics too."""
    out = tmp_path_factory.mktemp("ref")
    torchrun(1, SCRIPTS / "pp_eval.py", "--out", str(out), *VAL)
    record = json.loads((out / "eval_rank0.json").read_text())
    assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]), rel=1e-5)
    return record


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [("--tp", "2", "--dp", "2"), ("--pp", "2", "--dp", "2"), ("--cp", "2", "--dp", "2")],
    ids=["dp2xtp2", "pp2xdp2", "cp2xdp2"],
)
def test_val_metrics_equal_one_process(tmp_path, reference, layout):
    torchrun(4, SCRIPTS / "pp_eval.py", "--out", str(tmp_path), *VAL, *layout)
    for rank in range(4):
        got = json.loads((tmp_path / f"eval_rank{rank}.json").read_text())
        for name in ("val_loss", "val_ppl"):
            assert abs(got[name] - reference[name]) <= 1e-5 * abs(reference[name]), (rank, name, got, reference)
