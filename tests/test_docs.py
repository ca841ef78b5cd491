"""The docs stay true (issue 27): every complete `lightning-4d estimate|plan ...` and `lightning-4d ... --help` that
README.md, docs/*.md and configs/*.yaml show runs (in process) with the exit code the page states (0 unless the text
right after it says `exits N`), and every figure between `<!-- figure: ... -->` markers is what its command prints
now. The conventions and the regenerating script: `benchmarks/docs_figures.py` (`make docs-figures`)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests._launch import ROOT


def _docs_figures():
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "benchmarks" / "docs_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


docs_figures = _docs_figures()
COMMANDS = docs_figures.commands()
RUNNABLE = [c for c in COMMANDS if c.argv is not None]


def test_extraction_finds_the_commands_of_every_kind():
    """Code blocks with continuations, inline spans (also across a line break), YAML comments, `--help`."""
    shown = {(c.page, c.argv[0] if c.argv else None) for c in RUNNABLE}
    assert ("README.md", "estimate") in shown and ("README.md", "plan") in shown and ("README.md", "--help") in shown
    assert ("docs/memory.md", "estimate") in shown and ("configs/tiny_pp.yaml", "estimate") in shown
    readme = [c for c in RUNNABLE if c.page == "README.md" and c.argv[0] == "estimate"][0]
    assert readme.argv[-2:] == ["--gpu-memory", "H100-80GB"]  # the `\` line joined, `[--json]` left out
    assert len(RUNNABLE) >= 8, [str(c) for c in RUNNABLE]
    # templates are recognized as such, not run
    assert any("placeholder" in c.why_not_run for c in COMMANDS)


def test_the_extraction_and_the_exit_convention_on_a_sample(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\nlightning-4d estimate --model tiny --dp 1 \\\n"
        "    --micro-batch-size 1 --seq-length 64   # fits\n```\n"
        "Too big: `lightning-4d estimate --model llama3-70b --dp 1 --micro-batch-size 1 --seq-length 8192` exits 1.\n"
        "A template: `lightning-4d estimate --model M --tp T`; a mention: `lightning-4d plan`.\n"
    )
    (tmp_path / "configs" / "x.yaml").write_text(
        "# check: lightning-4d plan --model tiny --num-gpus 2 \\\n"
        "#   --seq-length 64 --global-batch-size 2\nseed_everything: 0\n"
    )
    found = docs_figures.commands(tmp_path)
    runnable = [(c.line, c.argv, c.expected_exit) for c in found if c.argv]
    assert runnable == [
        (2, ["estimate", "--model", "tiny", "--dp", "1", "--micro-batch-size", "1", "--seq-length", "64"], 0),
        (5, ["estimate", "--model", "llama3-70b", "--dp", "1", "--micro-batch-size", "1", "--seq-length", "8192"], 1),
        (1, ["plan", "--model", "tiny", "--num-gpus", "2", "--seq-length", "64", "--global-batch-size", "2"], 0),
    ]
    assert sorted(c.why_not_run for c in found if not c.argv) == [
        "placeholder value M",
        "the command named, no arguments",
    ]
    for _, argv, code in runnable:
        assert docs_figures.run(argv)[0] == code


def _emit_target(argv: list[str]) -> Optional[str]:
    """The ``--emit-config`` file of a ``plan`` command line (``None`` without one)."""
    return next((b for a, b in zip(argv, argv[1:]) if a == "--emit-config"), None)


def _redirected(argv: list[str], folder: Path) -> list[str]:
    """``argv`` with its ``--emit-config`` file moved into ``folder`` (the pages name /shared/... or the cwd)."""
    target = _emit_target(argv)
    return [str(folder / Path(a).name) if a == target else a for a in argv]


#: the configs the pages' ``plan ... --emit-config FILE`` commands write, by FILE
EMITTED = {_emit_target(c.argv): c for c in RUNNABLE if c.argv[0] == "plan" and _emit_target(c.argv)}


def test_pages_emit_configs():
    assert {"/shared/llama3.1-8b-plan.yaml", "/tmp/tutorial/plan.yaml", "llama3-8b-plan.yaml"} <= set(EMITTED), EMITTED


#: the command lines the pages' figures run with --json
FIGURE_ARGVS = docs_figures.figure_argvs()


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: f"{c.page}:{c.line}")
def test_documented_command_exits_as_the_page_says(command, tmp_path):
    """A command that also backs figures runs once per session, with ``--json`` (the figures read the same run):
    ``main`` returns its exit code from the same result, and prints the table from the same object it writes as
    JSON (``print_plan`` / ``print_estimate``), which is printed here from the JSON; any other command runs as
    shown."""
    from lightning_4d.planning.printing import print_estimate, print_plan

    if tuple(command.argv) in FIGURE_ARGVS and "--json" not in command.argv:
        assert command.argv[0] in ("plan", "estimate") and "--emit-config" not in command.argv, command
        code, data = docs_figures.run_json(command.argv)
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            (print_plan if command.argv[0] == "plan" else print_estimate)(data)
        assert table.getvalue().strip(), command
        err = ""
    else:
        code, out, err = docs_figures.run(_redirected(command.argv, tmp_path))
    assert code == command.expected_exit, (
        f"{command} exited {code}, the page says {command.expected_exit} "
        f"(write `exits {code}` after it if that is meant): {err.strip()[-2000:]}"
    )


PAGES_WITH_FIGURES = [p for p in docs_figures.pages() if docs_figures.figure_count(p.read_text())]


def test_pages_mark_their_figures():
    names = {str(p.relative_to(ROOT)) for p in PAGES_WITH_FIGURES}
    assert {"docs/context_parallel.md", "docs/memory.md"} <= names, names
    # the GPU configs' header comments quote their own estimate (issue 36): under markers, so checked below
    assert {"configs/llama3_8b.yaml", "configs/llama3_70b.yaml", "configs/llama3_8b_128k.yaml"} <= names, names


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_FIGURES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_figures_are_what_the_commands_print(page):
    stale = docs_figures.stale_figures(page)
    assert not stale, "stale figures (run `make docs-figures`):\n" + "\n".join(stale)


@pytest.mark.slow
def test_a_changed_figure_is_caught(tmp_path):
    """The check can fail: one figure changed by hand, inline (docs/memory.md) or in a generated table
    (docs/context_parallel.md), is reported, and regenerating restores the page."""
    for name, pattern, typed in (
        ("docs/memory.md", docs_figures._INLINE, "12345.6"),
        ("docs/context_parallel.md", docs_figures._ROWS, "| 1 | 8 | 99.9 |"),
        ("configs/llama3_8b.yaml", docs_figures._INLINE, "39.00"),  # a config header's figure
    ):
        text = (ROOT / name).read_text()
        m = pattern.search(text)
        assert m, f"{name} has no such figure"
        name = name.split("/")[-1]
        body = m["body"]
        wrong = typed if pattern is docs_figures._INLINE else body.replace(body.split("\n")[2], typed + " x |")
        copy = tmp_path / name
        copy.write_text(text[: m.start("body")] + wrong + text[m.end("body") :])
        stale = docs_figures.stale_figures(copy)
        assert len(stale) == 1, stale
        assert docs_figures.main(["--check", str(copy)]) == 1
        assert docs_figures.main([str(copy)]) == 0 and copy.read_text() == text


def test_block_figure_is_the_commands_output(tmp_path):
    cmd = "lightning-4d estimate --model tiny --dp 1 --micro-batch-size 1 --seq-length 64"
    page = tmp_path / "page.md"
    page.write_text(f"Before.\n\n<!-- figure: {cmd} -->\n```text\ntyped by hand\n```\n<!-- /figure -->\n\nAfter.\n")
    assert len(docs_figures.stale_figures(page)) == 1
    assert docs_figures.main(["--check", str(page)]) == 1
    assert docs_figures.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith(f"Before.\n\n<!-- figure: {cmd} -->\n```text\n") and text.endswith(
        "<!-- /figure -->\n\nAfter.\n"
    )
    assert "fits within the 80% budget" in text and "typed by hand" not in text
    assert docs_figures.stale_figures(page) == [] and docs_figures.main(["--check", str(page)]) == 0


# the GPU configs name a placeholder tokenizer path that LMDataModule refuses: every launch line of theirs must pass
# --data.tokenizer (issue 36, item 1)
_FIT_LINE = re.compile(r"fit --config (configs/llama3\w*\.yaml)((?:[^\n`]|\\\n)*)")


def test_gpu_config_launch_lines_name_the_tokenizer():
    shown = []
    for path in docs_figures.pages():
        text = path.read_text().replace("\\\n", " ")
        for m in _FIT_LINE.finditer(text):
            config = (ROOT / m[1]).read_text()
            if "tokenizer: path/to/" in config:
                shown.append(f"{path.relative_to(ROOT)}: {m[0][:80]}")
                assert "--data.tokenizer" in m[2], f"{path.relative_to(ROOT)}: `{m[0]}` omits --data.tokenizer"
    assert len(shown) >= 6, shown


def test_the_paste_check_on_samples():
    """The check finds what a reader would paste and fail on, and leaves legitimate shell alone."""
    refused = {
        "lightning-4d plan --num-gpus 8 [--emit-config FILE.yaml]": "optional part [--emit-config FILE.yaml]",
        "lightning-4d export-hf ckpt out [--dtype bfloat16]": "optional part [--dtype bfloat16]",
        "lightning-4d export-hf [CKPT] out": "optional part [CKPT]",
        "lightning-4d estimate --model <name>": "placeholder <name>",
        "lightning-4d estimate --tp T --cp 2": "placeholder value --tp T",
        "lightning-4d plan --plot FILE.png": "placeholder value --plot FILE.png",
        "lightning-4d fit --config a.yaml ...": "an ellipsis",
        "lightning-4d fit --data.tokenizer path/to/tokenizer.json": "a path/to/ placeholder",
    }
    for line, problem in refused.items():
        assert docs_figures.paste_problems(line) == [problem], line
    legitimate = [
        "[[ -f corpus.idx ]] && echo ready",
        'if [ -n "$SLURM_JOB_ID" ]; then echo "$SLURM_NODEID"; fi',
        "nodes=(a b); echo ${nodes[0]} ${MASTER_PORT:-29500}",
        "nodes[1]=b",
        "pip install 'lightning-4d[flash]' lightning-4d[plot]",
        "ls /data/shard-[0-9]*.bin 2>&1 | tee log <in",
        "lightning-4d fit --data.data_path '[0.7, /data/web.bin, 0.3, /data/code.bin]'",
        "lightning-4d fit --trainer.callbacks=[a,b] --gpu-memory H100-80GB --precision 32-true",
        "python -c \"print('...')\"  # quoted text is the program's",
        "cat <<EOF",
    ]
    for line in legitimate:
        assert docs_figures.paste_problems(docs_figures._strip_comment(line)) == [], line


def test_every_shell_block_runs_as_printed():
    """No line of a shell code block in README.md or docs/ holds an optional part in brackets or a placeholder:
    pasted, each runs (optional parts go in a second block or a comment)."""
    lines = docs_figures.shell_lines()
    assert len(lines) >= 40 and any(page == "docs/recipe.md" for page, _, _ in lines)
    found = [(page, line, docs_figures.paste_problems(text)) for page, line, text in lines]
    bad = [f"{page}:{line}: {problems}" for page, line, problems in found if problems]
    assert not bad, "\n".join(bad)


def _table_cells(page: str, header: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start:end]


def test_reference_tables_name_every_field():
    """docs/models.md names every preset with its parameter count and every LlamaConfig field; the FourDStrategy
    table of docs/reference/strategy.md every argument of FourDStrategy.__init__ (issue 36, item 14)."""
    import dataclasses
    import inspect

    from lightning_4d import FourDStrategy
    from lightning_4d.models import LlamaConfig

    presets = _table_cells("docs/models.md", "| preset |")
    for name in LlamaConfig.preset_names():
        cfg = LlamaConfig.from_preset(name)
        assert f"| `{name}` |" in presets and f"{cfg.num_parameters():,}" in presets, name
    fields = _table_cells("docs/models.md", "| field | default | meaning |")
    for f in dataclasses.fields(LlamaConfig):
        assert f"| `{f.name}` |" in fields, f.name
    arguments = _table_cells("docs/reference/strategy.md", "| argument | default | meaning |")
    for name in list(inspect.signature(FourDStrategy.__init__).parameters)[1:]:
        assert f"| `{name}` |" in arguments, name


#: the commands that train or write files: each one the pages show with its arguments is parsed by its own parser
#: (flags, choices, config files and keys), not run (runs: tests/test_recipe.py runs docs/tutorial.md's last block:
#: prepare-data, fit, a resume and export-hf; tests/test_measure.py runs measure)
TRAINING = ("fit", "measure", "prepare-data", "export-hf")
#: ``fit --config FILE`` commands whose FILE is the reader's own (not in the repository, not written by a page's
#: ``plan --emit-config``): parsed with configs/tiny.yaml in its place (the flags after it are what the page shows).
#: A FILE that a page's ``plan --emit-config`` writes is written by running that plan, then parsed as it is.
NOT_IN_REPO = {"my.yaml"}
_ALL_SHOWN = [c for c in docs_figures.commands(kinds=TRAINING) if c.argv and c.argv[0] in TRAINING]
#: one per distinct command line (several pages show ``fit --config configs/tiny.yaml``)
SHOWN = list({tuple(c.argv): c for c in reversed(_ALL_SHOWN)}.values())[::-1]


def _config_files(argv: list[str]) -> list[str]:
    return [b for a, b in zip(argv, argv[1:]) if a == "--config"]


def test_every_training_command_kind_is_shown_and_parsed():
    kinds = {c.argv[0] for c in SHOWN}
    assert kinds == set(TRAINING), kinds
    assert len(SHOWN) >= 25, [str(c) for c in SHOWN]
    missing = {f for c in _ALL_SHOWN for f in _config_files(c.argv) if not (ROOT / f).is_file()}
    assert missing - set(EMITTED) == NOT_IN_REPO and missing & set(EMITTED), missing


def _emitted_config(path: str, folder: Path) -> str:
    """Run the page's ``plan ... --emit-config path`` with the file written into ``folder``; the file's path."""
    argv = _redirected(EMITTED[path].argv, folder)
    code, _, err = docs_figures.run(argv)
    assert code == 0, f"{EMITTED[path]} exited {code}: {err.strip()[-2000:]}"
    return _emit_target(argv)


@pytest.mark.parametrize("command", SHOWN, ids=lambda c: f"{c.page}:{c.line}")
def test_documented_training_command_parses(command, tmp_path):
    """The command as the page shows it parses: ``fit`` through LightningCLI with ``--print_config`` (the config
    files loaded, every key and value type-checked, nothing trained; a config a page's ``plan --emit-config`` writes
    is written first, and its data placeholders are what the page's flags replace), the others with their argparse
    parsers (exit 2 on an unknown flag or a bad choice)."""
    import argparse

    from lightning_4d.data.prepare import _build_parser as prepare_data_parser
    from lightning_4d.export_hf import export_hf_parser
    from lightning_4d.planning.commands import command_parser

    kind, args = command.argv[0], command.argv[1:]
    if kind == "fit":
        argv = ["configs/tiny.yaml" if a in NOT_IN_REPO else a for a in command.argv]
        argv = [_emitted_config(a, tmp_path) if a in EMITTED else a for a in argv]
        code, out, err = docs_figures.run([*argv, "--print_config"])
        assert code == 0 and "trainer:" in out, f"{command} exited {code}: {err.strip()[-2000:]}"
        if any(a in EMITTED for a in command.argv):  # the page fills in the emitted file's data placeholders
            import yaml

            data = yaml.safe_load(out)["data"]
            assert "path/to/" not in str(data["tokenizer"]) and data["data_path"] != "/data/corpus.bin", data
        return
    parser: argparse.ArgumentParser = {
        "measure": lambda: command_parser("measure"),
        "prepare-data": prepare_data_parser,
        "export-hf": export_hf_parser,
    }[kind]()
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{command}: {parser.prog} refuses its arguments (exit {exc.code})") from None


_LAB_NOTE = re.compile(r"\bissues? #?\d+|\(#\d+\)|\bload average\b|\bmeasured (?:on )?\d{4}-\d\d-\d\d", re.I)


def test_code_and_cli_help_hold_no_issue_numbers_or_dated_notes():
    """The package's source (comments, docstrings, CLI help) and README name no tracker issue and carry no dated lab
    notes: measurements live in docs/validation.md, and a reader of the code has no tracker to look them up in."""
    found = []
    for path in [*sorted((ROOT / "lightning_4d").rglob("*.py")), ROOT / "README.md"]:
        text = path.read_text()
        for m in _LAB_NOTE.finditer(text):
            found.append(f"{path.relative_to(ROOT)}:{1 + text.count(chr(10), 0, m.start())}: {m[0]}")
        if path.suffix == ".py":  # dates in comments and docstrings (results file names excepted: they are paths)
            for i, line in enumerate(text.splitlines(), 1):
                comment = line.split("#", 1)[1] if "#" in line else ""
                if re.search(r"(?<![\w_])20\d\d-\d\d-\d\d(?![\w.])", comment):
                    found.append(f"{path.relative_to(ROOT)}:{i}: a dated comment")
    assert not found, "\n".join(found)
    assert not _LAB_NOTE.search("see the support matrix") and _LAB_NOTE.search("fixed in issue 32")
