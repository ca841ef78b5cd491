"""The docs stay true (issue 27): every complete `lightning-4d estimate|plan ...` and `lightning-4d ... --help` that
README.md, docs/*.md and configs/*.yaml show runs (in process) with the exit code the page states (0 unless the text
right after it says `exits N`), and every figure between `<!-- figure: ... -->` markers is what its command prints
now. The conventions and the regenerating script: `benchmarks/docs_figures.py` (`make docs-figures`)."""

from __future__ import annotations

import importlib.util
import re
import sys

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


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: f"{c.page}:{c.line}")
def test_documented_command_exits_as_the_page_says(command):
    code, out, err = docs_figures.run(command.argv)
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
#: ``fit --config FILE`` commands whose FILE is not in the repository: the reader's own file, or one an earlier step
#: of the page writes (docs/tutorial.md's plan.yaml: tests/test_recipe.py runs those); parsed with configs/tiny.yaml in
#: its place (the flags after it are what the page shows)
NOT_IN_REPO = {"my.yaml", "/tmp/recipe/plan.yaml", "/tmp/tutorial/plan.yaml"}
_ALL_SHOWN = [c for c in docs_figures.commands(kinds=TRAINING) if c.argv and c.argv[0] in TRAINING]
#: one per distinct command line (several pages show ``fit --config configs/tiny.yaml``)
SHOWN = list({tuple(c.argv): c for c in reversed(_ALL_SHOWN)}.values())[::-1]


def _config_files(argv: list[str]) -> list[str]:
    return [b for a, b in zip(argv, argv[1:]) if a == "--config"]


def test_every_training_command_kind_is_shown_and_parsed():
    kinds = {c.argv[0] for c in SHOWN}
    assert kinds == set(TRAINING), kinds
    assert len(SHOWN) >= 25, [str(c) for c in SHOWN]
    assert {f for c in _ALL_SHOWN for f in _config_files(c.argv) if not (ROOT / f).is_file()} == NOT_IN_REPO


@pytest.mark.parametrize("command", SHOWN, ids=lambda c: f"{c.page}:{c.line}")
def test_documented_training_command_parses(command):
    """The command as the page shows it (optional parts included) parses: ``fit`` through LightningCLI with
    ``--print_config`` (the config files loaded, every key and value type-checked, nothing trained), the others with
    their argparse parsers (exit 2 on an unknown flag or a bad choice)."""
    import argparse

    from lightning_4d.data.prepare import _build_parser as prepare_data_parser
    from lightning_4d.export_hf import export_hf_parser
    from lightning_4d.planning.commands import command_parser

    kind, args = command.argv[0], command.argv[1:]
    if kind == "fit":
        argv = ["configs/tiny.yaml" if a in NOT_IN_REPO else a for a in command.argv]
        code, out, err = docs_figures.run([*argv, "--print_config"])
        assert code == 0 and "trainer:" in out, f"{command} exited {code}: {err.strip()[-2000:]}"
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
