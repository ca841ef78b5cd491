"""A ModelCheckpoint save loads back on the same layout and training continues with the same losses."""

from __future__ import annotations

import json

import pytest

from tests._launch import SCRIPTS, torchrun

LAYOUTS = [
    {"dp": 2, "tp": 2, "zero": 1},
    {"dp": 2, "tp": 2, "zero": 3},
    {"dp": 4, "zero": 0},
    {"dp": 4, "zero": 2},
    # save_distributed_checkpoint=False: one full file from rank 0, every rank keeps its shards on load
    {"dp": 2, "tp": 2, "zero": 3, "sdc": False},
    {"dp": 4, "zero": 0, "sdc": False},
    # bf16-mixed: the fp32 master weights are saved with the optimizer states (else the resumed run would restart
    # from the bf16-rounded weights and drift)
    {"dp": 2, "tp": 2, "zero": 1, "precision": "bf16-mixed"},
    {"dp": 4, "zero": 0, "precision": "bf16-mixed"},
    {"dp": 2, "tp": 2, "zero": 3, "precision": "bf16-mixed", "sdc": False},
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    torchrun(
        4,
        SCRIPTS / "run_layouts.py",
        "--out",
        str(out),
        "--steps",
        "6",
        "--resume-check",
        "--layouts",
        json.dumps(LAYOUTS),
        timeout=900,
    )
    records = [
        [json.loads(p.read_text()) for p in sorted(out.glob(f"resume{i}_rank*.json"))] for i in range(len(LAYOUTS))
    ]
    assert [len(r) for r in records] == [4] * len(LAYOUTS)  # one record per rank of the 4-process run
    return records


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(x) for x in LAYOUTS])
def test_resume_continues_with_the_same_losses(resumed, index):
    for record in resumed[index]:
        straight, first, second = record["straight"], record["first"], record["resumed"]
        print(f"\n{record['layout']}: straight {straight}\n  first half {first} + resumed {second}")
        assert len(first) == 3 and len(second) == 3
        assert first + second == pytest.approx(straight, rel=1e-6)
        if record["layout"].get("sdc", True):
            assert ".metadata" in record["files"]  # a DCP folder
        else:
            assert record["files"] == ["<file>"]
