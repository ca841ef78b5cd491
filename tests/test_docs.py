"""The docs stay true (issue 27): every complete `lightning-4d estimate|plan ...` and `lightning-4d ... --help` that
README.md, docs/*.md and configs/*.yaml show runs (in process) with the exit code the page states (0 unless the text
right after it says `exits N`), and every figure between `<!-- figure: ... -->` markers is what its command prints
now. The conventions and the regenerating script: `benchmarks/docs_figures.py` (`make docs-figures`)."""

from __future__ import annotations

import importlib.util
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


@pytest.mark.parametrize("page", PAGES_WITH_FIGURES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_figures_are_what_the_commands_print(page):
    stale = docs_figures.stale_figures(page)
    assert not stale, "stale figures (run `make docs-figures`):\n" + "\n".join(stale)


def test_a_changed_figure_is_caught(tmp_path):
    """The check can fail: one figure changed by hand, inline (docs/memory.md) or in a generated table
    (docs/context_parallel.md), is reported, and regenerating restores the page."""
    for name, pattern, typed in (
        ("memory.md", docs_figures._INLINE, "12345.6"),
        ("context_parallel.md", docs_figures._ROWS, "| 1 | 8 | 99.9 |"),
    ):
        text = (ROOT / "docs" / name).read_text()
        m = pattern.search(text)
        assert m, f"docs/{name} has no such figure"
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
