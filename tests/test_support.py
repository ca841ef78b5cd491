"""The support matrix (lightning_4d/support.py, issue 32): each status is what the code says. Refused rows raise
the exact error the row shows (the project's own validation, before anything runs), the others pass it; every CPU
test a row names exists; the smoke matrix is parametrized by every row not refused; docs/support.md is the
command's output; and a CPU dry run of representative rows runs, with finite losses and no decoder layer changing
the residual stream's dtype."""

from __future__ import annotations

import ast
import json
import re
import subprocess

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
    """A result written without its commit claims nothing of the code now: "commit not recorded", not "ok"."""
    row = support.smoke_rows()[0]
    assert support.cuda_results(tmp_path) == {}
    assert "not run on CUDA yet" in support.markdown(tmp_path)
    cpu = {"device": "cpu", "device_name": "cpu", "date": "2026-11-27", "rows": {row.id: {"status": "ok"}}}
    (tmp_path / "smoke_cpu_2026-11-27.json").write_text(json.dumps(cpu))
    assert support.cuda_results(tmp_path) == {}
    gpu = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "date": "2026-11-28"}
    gpu["rows"] = {row.id: {"status": "ok", "error": None}}
    (tmp_path / "smoke_NVIDIA_H100_80GB_HBM3_2026-11-28.json").write_text(json.dumps(gpu))
    page = support.markdown(tmp_path)
    # whether a file the row exercises changed on or after that date, as git log says it
    log = subprocess.run(
        ["git", "log", "--since=2026-11-28 00:00:00", "--name-only", "--format=", "--", *row.exercises()],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    note = "; *code it exercises changed on or after that date*" if log.strip() else ""
    assert f"| ran on NVIDIA H100 80GB HBM3, 2026-11-28 (ok), commit not recorded{note} |" in page
    assert "ok on NVIDIA" not in page
    counts = support.summary(support.cuda_results(tmp_path))
    assert counts["ok on CUDA"] == 0 and counts["ran on CUDA, commit not recorded"] == 1


def _smoke_file(tmp_path, name, commit, rows, clean=True, changed=()):
    """A CUDA smoke result as run_smoke writes it, run at ``commit``."""
    code = {"commit": commit, "clean": clean, "changed": list(changed), "time": f"2026-12-01T00:00:0{len(name)}"}
    data = {"device": "cuda", "device_name": "NVIDIA H200", "date": "2026-12-01", "code": code, "rows": rows}
    (tmp_path / f"smoke_NVIDIA_H200_2026-12-01_{name}.json").write_text(json.dumps(data))


def _history(monkeypatch, answers):
    """git's answer to "which files changed since <commit>", per commit (``None``: git cannot say); a commit not in
    ``answers`` (the real one a result without a commit is dated at) asks git."""
    from lightning_4d import provenance

    real = provenance.changed_files
    monkeypatch.setattr(
        provenance,
        "changed_files",
        lambda commit, root=provenance.ROOT: answers[commit] if commit in answers else real(commit, root),
    )


def test_cuda_column_names_the_commit_and_marks_rows_changed_since(tmp_path, monkeypatch):
    """A row run at a commit is "ok at <commit>" while none of the files it exercises differs from that commit,
    *changed since* (naming them) once one does, and says so when git cannot tell."""
    from lightning_4d import provenance

    pp = support.row_by_id("pp2-1f1b")
    z3 = support.row_by_id("z3-bf16-mixed")
    assert "lightning_4d/features/pipeline/" in pp.exercises() and "lightning_4d/parallel/fsdp.py" in z3.exercises()
    assert "lightning_4d/features/pipeline/" not in z3.exercises()
    commit = "a" * 40
    _smoke_file(tmp_path, "x", commit, {pp.id: {"status": "ok"}, z3.id: {"status": "ok"}})
    _history(monkeypatch, {commit: ["lightning_4d/features/pipeline/runtime.py", "README.md"]})
    results = support.cuda_results(tmp_path)
    assert support.cuda_state(z3, results) == {
        "kind": "current",
        "text": f"ok at {commit[:10]} on NVIDIA H200, 2026-12-01",
        "changed": [],
    }
    state = support.cuda_state(pp, results)
    assert state["kind"] == "changed" and state["changed"] == ["lightning_4d/features/pipeline/runtime.py"]
    assert (
        state["text"]
        == f"ok at {commit[:10]} on NVIDIA H200, 2026-12-01; *changed since*: features/pipeline/runtime.py"
    )
    counts = support.summary(results)
    assert counts["ok on CUDA"] == 1 and counts["ok on CUDA, changed since"] == 1
    # uncommitted changes to a file the row exercises, when it ran: not the commit's code
    _smoke_file(
        tmp_path, "yy", commit, {z3.id: {"status": "ok"}}, clean=False, changed=["lightning_4d/parallel/fsdp.py"]
    )
    state = support.cuda_state(z3, support.cuda_results(tmp_path))
    assert state["kind"] == "changed" and "with uncommitted changes" in state["text"]
    # no git here (a wheel install) or a commit git does not know
    _history(monkeypatch, {commit: None})
    monkeypatch.setattr(provenance, "git_available", lambda root=provenance.ROOT: False)
    state = support.cuda_state(pp, results)
    assert state["kind"] == "unknown" and state["text"].endswith("changed since: unknown (no git history here)")


def test_smoke_plan_runs_what_nothing_backs_first(tmp_path, monkeypatch):
    """The GPU check's order: rows never run on CUDA, then failed ones, then those changed since their run or run
    without a recorded commit, then those ok at their current code; the matrix's order within each."""
    current, changed, failed, unrecorded = (
        support.row_by_id(x) for x in ("z0-fp32", "z1-bf16-mixed", "pp2-zbv", "tp2-sp")
    )
    old, new = "b" * 40, "c" * 40
    _smoke_file(tmp_path, "a", new, {current.id: {"status": "ok"}, failed.id: {"status": "failed", "error": "peak"}})
    _smoke_file(tmp_path, "bb", old, {changed.id: {"status": "ok"}})
    legacy = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "date": "2026-11-27"}
    legacy["rows"] = {unrecorded.id: {"status": "ok"}}
    (tmp_path / "smoke_NVIDIA_H100_80GB_HBM3_2026-11-27.json").write_text(json.dumps(legacy))
    _history(monkeypatch, {new: [], old: ["lightning_4d/strategy.py"]})
    plan = support.smoke_plan(tmp_path)
    ids = [row.id for row, _ in plan]
    ran = {current.id, changed.id, failed.id, unrecorded.id}
    never = [r.id for r in support.ROWS if r.refused is None and not r.smoke_skip and r.id not in ran]
    assert ids == [*never, failed.id, changed.id, unrecorded.id, current.id]
    reasons = dict((row.id, reason) for row, reason in plan)
    assert reasons[never[0]] == "never run on CUDA" and reasons[failed.id] == "failed on CUDA"
    assert reasons[changed.id] == "changed since its CUDA run"
    assert reasons[unrecorded.id] == "its CUDA run recorded no commit"
    assert reasons[current.id] == "ok on CUDA at its current code"


def test_every_file_a_row_exercises_exists():
    from lightning_4d.support_rows import CORE_FILES, EXERCISES

    paths = {*CORE_FILES, *(p for files in EXERCISES.values() for p in files)}
    assert sorted(p for p in paths if not (ROOT / p).exists() or (ROOT / p).is_dir() != p.endswith("/")) == []


def _gpu_check():
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_budget_keeps_the_floors_of_later_checks_and_records_skips():
    gpu_check = _gpu_check()
    now = [0.0]
    checks = [("smoke", 230.0, 120.0), ("compat", 50.0, 30.0)]
    budget = gpu_check.Budget(250.0, checks, clock=lambda: now[0])
    assert budget.limit("smoke") == 220.0  # 250 less compat's floor
    now[0] = 215.0
    assert budget.limit("compat") == 35.0 and budget.skipped == []
    now[0] = 240.0
    assert budget.limit("compat") == 0.0
    assert budget.skipped == ["compat: out of time (10 s left of 250 s)"]
    # the planned parts fit two calls of 6 minutes: every part's caps within its budget, floors first
    for part, part_checks in gpu_check.PARTS.items():
        assert sum(floor for _, _, floor in part_checks) < gpu_check.PART_BUDGET_S, part
    assert {"smoke"} <= {c[0] for c in gpu_check.PARTS[1]}
    assert {"numerics", "measure", "step"} <= {c[0] for c in gpu_check.PARTS[2]}


def test_provenance_without_git_reads_a_stamp(tmp_path):
    """A copy of the tree without .git: the commit from the stamp, clean while every file has its blob hash."""
    import subprocess

    from lightning_4d import provenance

    (tmp_path / "a.py").write_text("x = 1\n")
    sha = subprocess.run(
        ["git", "hash-object", str(tmp_path / "a.py")], capture_output=True, text=True, check=False
    ).stdout.strip()
    assert provenance.blob_hash(tmp_path / "a.py") == (sha or provenance.blob_hash(tmp_path / "a.py"))
    assert provenance.code_state(tmp_path, tmp_path / "none.json")["commit"] is None
    stamp = tmp_path / "code.json"
    stamp.write_text(json.dumps({"commit": "d" * 40, "files": {"a.py": provenance.blob_hash(tmp_path / "a.py")}}))
    assert provenance.code_state(tmp_path, stamp) == {
        "commit": "d" * 40,
        "clean": True,
        "changed": [],
        "source": "stamp",
    }
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.code_state(tmp_path, stamp)["changed"] == ["a.py"]


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
    from lightning_4d.planning.printing import print_plan

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
    plan = json.loads(capsys.readouterr().out)
    layouts = plan["layouts"]
    assert layouts and all(c["untested_pairs"] for c in layouts)
    for c in layouts:
        assert c["untested_pairs"] == [list(p) for p in support.untested_pairs(c, moe=True)]
    print_plan(plan)  # what `plan` without --json prints of the same search (one search instead of two)
    out = capsys.readouterr().out
    assert "no*" in out and "* tested: no = the layout combines features" in out


_VERDICT = re.compile(r"\b(?P<refused>[Rr]efused)\b|\b(?P<runs>runs?|loads?|tested)\b")
_CITED = re.compile(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`")


def limit_claims(text: str) -> list[tuple[str, str]]:
    """``(row id, "refused" | "runs")`` for each support-matrix row id a prose text cites in backticks: the verdict
    word nearest before it in its sentence (``refused``; ``runs``, ``loads``, ``tested``), else the first after it;
    ``"none"`` when the sentence says neither."""
    ids = {row.id for row in support.ROWS}
    claims = []
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z*`(])", text.replace("\n", " ")):
        verdicts = [(m.start(), "refused" if m["refused"] else "runs") for m in _VERDICT.finditer(sentence)]
        for m in _CITED.finditer(sentence):
            if m[1] not in ids:
                continue
            before = [v for at, v in verdicts if at < m.start()]
            after = [v for at, v in verdicts if at > m.start()]
            claims.append((m[1], before[-1] if before else after[0] if after else "none"))
    return claims


def test_limit_claims_on_samples():
    text = (
        "Refused: too few micro-batches (`pp2-1f1b-m1`). Tied embeddings run under pp (`pp2-tied`). "
        "Activation offload is refused with checkpointing (`offload-checkpointing`) and runs under cp (`offload-cp`). "
        "A transformers Llama with `activation_checkpointing` (`hf-llama-checkpointing`) is refused. "
        "Something about `pp2-gpipe`. Unknown `not-a-row` ids are not claims."
    )
    assert limit_claims(text) == [
        ("pp2-1f1b-m1", "refused"),
        ("pp2-tied", "runs"),
        ("offload-checkpointing", "refused"),
        ("offload-cp", "runs"),
        ("hf-llama-checkpointing", "refused"),
        ("pp2-gpipe", "none"),
    ]


def test_known_limits_agree_with_the_matrix():
    """docs/support.md's hand-written "Known limits" cite the matrix rows they speak of: a row they call refused is a
    refused row, a row they say runs is not, every refused row is cited (the prose names every refusal the matrix
    holds), and no cited row lacks a verdict."""
    page = (ROOT / "docs" / "support.md").read_text()
    limits = page.split("## Known limits", 1)[1].split("## The matrix", 1)[0]
    claims = limit_claims(limits)
    wrong = [
        f"`{row_id}`: the prose says {verdict}, the matrix says {support.row_by_id(row_id).status}"
        for row_id, verdict in claims
        if verdict == "none" or (verdict == "refused") != (support.row_by_id(row_id).refused is not None)
    ]
    assert not wrong, "\n".join(wrong)
    uncited = {row.id for row in support.ROWS if row.refused} - {row_id for row_id, _ in claims}
    assert not uncited, f"refused rows the Known limits do not cite: {sorted(uncited)}"
