"""The strategy's process groups: ``FourDStrategy(timeout=...)`` limits each of them, as it limits the default group
(torch gives every group made after ``init_process_group`` its own 30-minute default otherwise), and a mesh's DTensors
communicate on that mesh's groups (``tests/scripts/process_groups.py``, one 4-rank launch for both)."""

from __future__ import annotations

import json

import pytest

from tests._launch import SCRIPTS, torchrun


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("process_groups")
    torchrun(4, SCRIPTS / "process_groups.py", "--out", str(out), "--sleep", "15", timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_a_second_mesh_of_the_same_layout_communicates_on_its_own_groups(records):
    """``build_mesh`` twice with the same layout: the DTensor product on the second mesh's tp dim carries the second
    mesh's group (before, DTensor's sharding caches, keyed by meshes that compare equal whatever their groups, gave
    it the first mesh's: measured with two plain ``(dp, tp)`` meshes, group '3' where its own was '7')."""
    for r in records:
        first, second = r["groups"]["first"], r["groups"]["second"]
        assert first["mesh"] != second["mesh"], r
        assert first["product"] == first["mesh"] and second["product"] == second["mesh"], r


@pytest.mark.slow
def test_a_peer_missing_from_a_tp_collective_fails_it_within_the_strategys_timeout(records):
    """dp2 x tp2 with ``timeout`` 5 s: rank 1 sleeps 15 s before a tp all-reduce; rank 0, its tp peer, fails with
    gloo's "Timed out" after ~5 s (before, the mesh's groups kept torch's 30 minutes: with 2 s and 8 s, rank 0 waited
    the 8 s and the all-reduce completed), and the other tp group's all-reduce completes."""
    assert [r["sleeper"] for r in records] == [False, True, False, False]
    waiting = records[0]
    assert waiting["error"] is not None and "Timed out" in waiting["error"], waiting
    assert 4 < waiting["seconds"] < 12, waiting
    assert records[1]["error"] is not None  # its peer has given up: it cannot complete either
    assert records[2]["error"] is None and records[3]["error"] is None, records
