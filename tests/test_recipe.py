"""The end-to-end path at CPU size (docs/tutorial.md, "8. The whole path on your own text"), run as the page shows it.

The commands are read from the page (so the page and this test cannot drift): ``prepare-data`` on the docs' own
text, ``estimate``, ``plan --emit-config`` (which the docs' command check runs without the option), a 4-process
``fit`` from the emitted config with a ``ModelCheckpoint``, a resume of it at another ZeRO stage, and ``export-hf``;
``/tmp/tutorial`` becomes this test's folder. Then: every command exits 0, the resumed run continued from step 3 to
step 5, and the exported directory is a Hugging Face Llama of the tiny preset that transformers loads and runs (the
export's numbers against the checkpoint: tests/test_hf_checkpoints.py).
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from tests._launch import ROOT, python_run, worker_env

PAGE = ROOT / "docs" / "tutorial.md"


def recipe_commands() -> list[str]:
    """The bash block under the page's last section, one string per command (continuations joined, comments,
    ``export``, ``mkdir`` and ``pip`` lines dropped: the test's folder and extras exist)."""
    text = PAGE.read_text().split("## 8. The whole path on your own text", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "export ", "mkdir ", "pip ")):  # the test's environment has the extras
            continue
        commands.append(line)
    return commands


def test_the_recipe_lists_every_step():
    names = [shlex.split(c)[1] for c in recipe_commands()]
    assert names == ["prepare-data", "estimate", "plan", "fit", "fit", "export-hf"], names


@pytest.mark.slow
def test_the_cpu_recipe_runs(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    env = worker_env()
    for command in recipe_commands():
        argv = shlex.split(command.replace("/tmp/tutorial", str(tmp_path)))
        assert argv[0] == "lightning-4d", command
        proc = python_run("-m", "lightning_4d", *argv[1:], env=env, timeout=600)
        # estimate and plan exit 1 when nothing fits; the recipe's layouts fit
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    last = tmp_path / "ckpt" / "last.ckpt"
    if last.is_dir():  # a sharded (DCP) checkpoint: Lightning's metadata file holds the loop state
        from lightning_4d.parallel._compat.lightning import LIGHTNING_METADATA_FILENAME

        meta = torch.load(last / LIGHTNING_METADATA_FILENAME, map_location="cpu", weights_only=False)
    else:
        meta = torch.load(last, map_location="cpu", weights_only=False, mmap=True)
    assert meta["global_step"] == 5  # resumed at step 3, ran to max_steps 5
    # the emitted config's CSVLogger, its folder set on the command line: one version per fit (3 and 2 steps log no
    # metrics row at Lightning's default log_every_n_steps of 50)
    assert len(list((tmp_path / "logs" / "tiny").glob("version_*/hparams.yaml"))) == 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (hf.config.hidden_size, hf.config.num_hidden_layers) == (128, 4)  # the tiny preset
    logits = hf(torch.randint(0, 256, (1, 16))).logits
    assert logits.shape == (1, 16, 256) and torch.isfinite(logits).all()
