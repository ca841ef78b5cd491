"""The strategy's process groups: ``FourDStrategy(timeout=...)`` limits each of them, as it limits the default group
(torch gives every group made after ``init_process_group`` its own 30-minute default otherwise)."""

from __future__ import annotations

import json

import pytest

from tests._launch import SCRIPTS, torchrun


@pytest.mark.slow
def test_a_peer_missing_from_a_tp_collective_fails_it_within_the_strategys_timeout(tmp_path):
    """dp2 x tp2 with ``timeout`` 5 s: rank 1 sleeps 15 s before a tp all-reduce; rank 0, its tp peer, fails with
    gloo's "Timed out" after ~5 s (before, the mesh's groups kept torch's 30 minutes: with 2 s and 8 s, rank 0 waited
    the 8 s and the all-reduce completed), and the other tp group's all-reduce completes."""
    torchrun(4, SCRIPTS / "group_timeout.py", "--out", str(tmp_path), "--sleep", "15", timeout=300)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["sleeper"] for r in records] == [False, True, False, False]
    waiting = records[0]
    assert waiting["error"] is not None and "Timed out" in waiting["error"], waiting
    assert 4 < waiting["seconds"] < 12, waiting
    assert records[1]["error"] is not None  # its peer has given up: it cannot complete either
    assert records[2]["error"] is None and records[3]["error"] is None, records
