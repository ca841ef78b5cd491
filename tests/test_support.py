"""The support matrix (lightning_4d/support.py, issue 32): each status is what the code says. Refused rows raise
the exact error the row shows (the project's own validation, before anything runs), the others pass it; every CPU
test a row names exists; the smoke matrix is parametrized by every row not refused; docs/support.md is the
command's output; and a CPU dry run of representative rows runs, with finite losses and no decoder layer changing
the residual stream's dtype."""

from __future__ import annotations

import ast
import json

import pytest

from lightning_4d import support
from tests._launch import ROOT


def _row_ids(rows):
    return [r.id for r in rows]


def test_rows_are_unique_and_use_the_small_presets():
    ids = _row_ids(support.ROWS)
    assert len(ids) == len(set(ids)), ids
    # a bound that catches a generator gone wrong (the matrix grows by a few rows per feature; 101 rows now)
    assert 30 <= len(ids) <= 150
    for row in support.ROWS:
        opts = row.options()
        assert opts["model"] in ("small", "small-tied", "tiny-moe") and opts["seq_length"] <= 2048, row.id
        assert row.family in support.FAMILIES, row.id
        assert row.refused is not None or row.cpu_tests or row.status == "not tested on CPU"


@pytest.mark.parametrize("row", support.ROWS, ids=_row_ids(support.ROWS))
def test_status_is_what_the_validation_says(row):
    """A refused row raises exactly its message from the project's checks; any other row passes them."""
    if row.refused is None:
        support.validate_row(row)
        return
    with pytest.raises(Exception) as info:
        support.validate_row(row)
    assert type(info.value).__name__ == row.error_type
    assert str(info.value) == row.refused


def _test_functions(path):
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_cpu_test_named_exists():
    missing = []
    for row in support.ROWS:
        for node in row.cpu_tests:
            path, _, name = node.partition("::")
            if not (ROOT / path).is_file() or name not in _test_functions(path):
                missing.append(f"{row.id}: {node}")
    assert not missing, missing
    assert sum(bool(r.cpu_tests) for r in support.ROWS) >= 40


def test_the_smoke_matrix_is_every_row_not_refused():
    from tests.cuda import test_smoke

    params = list(test_smoke._params())
    assert [p.id for p in params] == [r.id for r in support.ROWS if r.refused is None]
    skipped = {p.id: [m.kwargs["reason"] for m in p.marks] for p in params if p.marks}
    assert skipped == {r.id: [r.smoke_skip] for r in support.ROWS if r.refused is None and r.smoke_skip}
    assert all(reason for reasons in skipped.values() for reason in reasons)


def test_docs_page_is_the_commands_output():
    from tests.test_docs import docs_figures

    page = ROOT / "docs" / "support.md"
    assert "<!-- figure: lightning-4d support --markdown -->" in page.read_text()
    assert docs_figures.stale_figures(page) == []
    for name in ("README.md", "docs/index.md", "mkdocs.yml"):
        assert "support.md" in (ROOT / name).read_text(), name


def test_cuda_column_reads_only_cuda_smoke_results(tmp_path):
    row = support.smoke_rows()[0]
    assert support.cuda_results(tmp_path) == {}
    assert "not run on CUDA yet" in support.markdown(tmp_path)
    cpu = {"device": "cpu", "device_name": "cpu", "date": "2026-11-27", "rows": {row.id: {"status": "ok"}}}
    (tmp_path / "smoke_cpu_2026-11-27.json").write_text(json.dumps(cpu))
    assert support.cuda_results(tmp_path) == {}
    gpu = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "date": "2026-11-28"}
    gpu["rows"] = {row.id: {"status": "ok", "error": None}}
    (tmp_path / "smoke_NVIDIA_H100_80GB_HBM3_2026-11-28.json").write_text(json.dumps(gpu))
    assert "| ok on NVIDIA H100 80GB HBM3, 2026-11-28 |" in support.markdown(tmp_path)
    assert support.summary(support.cuda_results(tmp_path))["ok on CUDA"] == 1


def test_smoke_refuses_refused_rows_and_unknown_ids(capsys):
    refused = next(r for r in support.ROWS if r.refused is not None)
    with pytest.raises(ValueError, match="is refused"):
        support.run_row(refused)
    assert support.main(["--smoke", "--device", "cpu", "--rows", "no-such-row"]) == 2
    assert "valid ids" in capsys.readouterr().err


#: one row per kind of code the dry run exercises: ZeRO 3 (FSDP2), pp with an uneven zero-bubble split and
#: offload, cp ring under tp, MoE under pp (the residual dtype the CUDA run broke), compile under tp
REPRESENTATIVE = ["z3-bf16-mixed", "offload-pp-zbv", "cp2-tp2", "moe-pp2", "compile-tp2"]


@pytest.mark.slow
def test_cpu_dry_run_of_representative_rows(tmp_path):
    rows = [support.row_by_id(x) for x in REPRESENTATIVE]
    path = support.run_smoke(rows, "cpu", tmp_path)
    assert path.name.startswith("smoke_cpu_") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and set(data["rows"]) == set(REPRESENTATIVE)
    for row_id, result in data["rows"].items():
        assert result["status"] == "ok", (row_id, result["error"])
        assert result["decoder_layers"] > 0 and result["losses"] and result["peak"] > 0 and result["estimate"] > 0
        compiled = support.row_by_id(row_id).options().get("compile")
        assert (result["compiled_graphs"] > 0) == bool(compiled), (row_id, result["compiled_graphs"])


@pytest.mark.slow
def test_the_dtype_check_sees_a_layer_that_changes_the_dtype(tmp_path, monkeypatch):
    """The check can fail: a decoder layer made to return float32 under bf16-mixed is reported."""
    from lightning_4d.models import llama

    forward = llama.TransformerBlock.forward

    def upcast(self, *args, **kwargs):
        return forward(self, *args, **kwargs).float()

    monkeypatch.setattr(llama.TransformerBlock, "forward", upcast)
    result = support.run_row(support.row_by_id("z1-bf16-mixed"), "cpu", seq_length=64, micro_batch_size=1)
    assert result["status"] in ("failed", "error"), result
    assert "dtype" in (result["error"] or ""), result


@pytest.mark.slow
def test_plan_flags_layouts_the_matrix_has_not_tested(capsys):
    """`plan` marks a proposed layout whose features no CPU test of the matrix combines (issue 36, item 9): the
    Mixtral rows that put ep beside ZBV or ZeRO 2 beside pp are flagged, with the pairs (ZeRO 2 beside ep is tested:
    the offload-ep row); every tested row itself is covered;
    a plain tp2 dp4 layout is not flagged."""
    from lightning_4d.cli import main

    for row in support.ROWS:
        if row.refused is None and row.family == "ours":
            assert support.untested_pairs(row.options(), support._row_is_moe(row)) == [], row.id
    assert support.untested_pairs({"tp": 2, "dp": 4, "zero_stage": 1}) == []
    mixtral = {"pp": 8, "pipeline_schedule": "zbv", "cp": 2, "dp": 4, "expert_parallel_size": 8, "zero_stage": 2}
    pairs = support.untested_pairs(mixtral, moe=True)
    assert ("ep", "pp zbv") in pairs and ("ZeRO 2", "pp") in pairs and ("MoE", "pp zbv") in pairs
    assert ("cp", "ep") not in pairs  # the moe-cp2-tp2-ep2 row
    assert ("ZeRO 2", "ep") not in pairs
    argv = "plan --model mixtral-8x7b --num-gpus 64 --seq-length 8192 --global-batch-size 512 --top 3".split()
    assert main(argv + ["--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts and all(c["untested_pairs"] for c in layouts)
    for c in layouts:
        assert c["untested_pairs"] == [list(p) for p in support.untested_pairs(c, moe=True)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no*" in out and "* tested: no = the layout combines features" in out
