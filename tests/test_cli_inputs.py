"""`lightning-4d estimate` / `plan` on bad input: one line naming the bad value, exit 2, never a traceback; model
YAML files complete or starting from a preset; `lightning-4d --help` lists every command and warns nothing."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from lightning_4d.cli import COMMANDS, KNOWN_WARNINGS, filter_known_warnings, main
from tests._launch import ROOT, python_run, worker_env

PLAN = ["plan", "--model", "llama3-8b", "--num-gpus", "8", "--seq-length", "4096", "--global-batch-size", "16"]
ESTIMATE = ["estimate", "--model", "llama3-8b", "--dp", "8", "--micro-batch-size", "1", "--seq-length", "4096"]


def _one_line_error(capsys, argv: list[str], *expected: str) -> str:
    with pytest.raises(SystemExit) as info:  # argparse's errors exit; others return 2
        code = main(argv)
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--budget", "-0.5"], ["--budget", "'-0.5'", "(0, 1]"]),
        (["--budget", "1.5"], ["--budget", "'1.5'", "(0, 1]"]),
        (["--budget", "nan"], ["--budget", "'nan'", "(0, 1]"]),
        (["--gpu-memory", "0GiB"], ["'0GiB'", "must be positive", "H100-80GB"]),
        (["--top", "0"], ["--top", "'0'", ">= 1"]),
        (["--top", "-1"], ["--top", "'-1'", ">= 1"]),
        (["--peak-tflops", "-1"], ["--peak-tflops", "'-1'", "> 0"]),
        (["--peak-tflops", "inf"], ["--peak-tflops", "'inf'"]),
        (["--num-gpus", "x"], ["--num-gpus", "'x'", "integer"]),
        (["--tp", "3"], ["tensor_parallel_size=3", "[1, 2, 4, 8]"]),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(capsys, extra, expected):
    err = _one_line_error(capsys, PLAN + extra, *expected)
    assert err.startswith("lightning-4d plan: error:")


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--sequence-parallel", "ture", "--tp", "2"], ["--sequence-parallel", "'ture'", "true or false"]),
        (["--micro-batch-size", "0"], ["--micro-batch-size", "'0'"]),
        (["--pipeline-layer-split", "16", "-1", "--pp", "2"], ["--pipeline-layer-split", "'-1'"]),
        (["--budget", "0"], ["--budget", "'0'"]),
    ],
)
def test_estimate_bad_input_is_one_line_exit_2(capsys, extra, expected):
    _one_line_error(capsys, ESTIMATE + extra, *expected)


def test_strict_booleans_are_accepted(capsys):
    assert main(
        ESTIMATE[:3]
        + [
            "--tp",
            "2",
            "--num-gpus",
            "8",
            "--micro-batch-size",
            "1",
            "--seq-length",
            "4096",
            "--sequence-parallel",
            "FALSE",
            "--json",
        ]
    ) in (0, 1)
    assert '"sequence_parallel": false' in capsys.readouterr().out


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", ["is empty"]),
        ("a: [1,\n", ["not valid YAML", "line 2"]),
        ("- 1\n- 2\n", ["a list, not a mapping"]),
        ("hidden_size: 4096\nfoo: 1\n", ["unknown field(s) ['foo']", "num_kv_heads"]),
        ("hidden_size: 4096\nnum_layers: 32\n", ["missing field(s)", "vocab_size", "preset"]),
        ("model:\n  model_config: {preset: llama3-8b, hidden: 1}\n", ["unknown field(s) ['hidden']"]),
        ("rope_scaling: {factr: 2}\npreset: llama3-8b\n", ["rope_scaling", "factr"]),
        ("trainer: {}\n", ["unknown field(s) ['trainer']"]),
    ],
)
def test_model_yaml_must_be_complete_and_known(capsys, tmp_path, text, expected):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    err = _one_line_error(capsys, ["plan", "--model", str(path)] + PLAN[3:], *expected)
    assert str(path) in err or "rope_scaling" in err


def test_model_yaml_from_a_preset_or_complete_fields(capsys, tmp_path):
    from lightning_4d.models.llama_config import LlamaConfig
    from lightning_4d.planning.commands import load_model_config

    (tmp_path / "p.yaml").write_text("preset: llama3-8b\nnum_layers: 16\n")
    assert load_model_config(str(tmp_path / "p.yaml")) == LlamaConfig.from_preset("llama3-8b", num_layers=16)
    full = "vocab_size: 1024\nhidden_size: 256\nintermediate_size: 512\nnum_layers: 2\nnum_heads: 4\nnum_kv_heads: 2\n"
    (tmp_path / "f.yaml").write_text(full)
    assert load_model_config(str(tmp_path / "f.yaml")).vocab_size == 1024
    for config in sorted((ROOT / "configs").glob("*.yaml")):  # every shipped training config still loads
        assert isinstance(load_model_config(str(config)), LlamaConfig)


def test_help_lists_every_command_and_warns_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_4d", "--help"],
        cwd=ROOT,
        env={**worker_env(), "PYTHONWARNINGS": "default"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS) and {
        "fit",
        "validate",
        "test",
        "predict",
        "estimate",
        "plan",
        "prepare-data",
    } <= set(listed)
    no_args = subprocess.run(
        [sys.executable, "-m", "lightning_4d"], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=120
    )
    assert no_args.returncode == 2 and "commands:" in no_args.stderr


def test_known_third_party_warnings_are_filtered_once_at_start():
    """Lightning 2.6's pytree copy builds torch's deprecated LeafSpec on every step of every rank: filtered by its
    exact message; other FutureWarnings still show."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings()
        from torch.utils._pytree import LeafSpec

        LeafSpec()
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]
    assert len(KNOWN_WARNINGS) >= 1


#: bad input of ``lightning-4d fit`` (over configs/tiny.yaml): each one line naming the value, exit 2, before any
#: process group (each raised while the arguments are parsed or the Trainer, the strategy, the model or the data are
#: built, in this process)
FIT_BAD_INPUT = [
    (["--trainer.strategy.zero_stage=7"], ["zero_stage=7", "[0, 1, 2, 3]"]),
    (["--trainer.strategy.tensor_parallel_size=0"], ["tensor_parallel_size=0", "positive integer"]),
    (["--trainer.strategy.context_parallel_size=-2"], ["context_parallel_size=-2"]),
    (["--trainer.strategy.context_parallel_method=rings"], ["context_parallel_method='rings'", "'alltoall'"]),
    (["--trainer.strategy.pipeline_schedule=1f2b"], ["pipeline_schedule='1f2b'", "'interleaved_1f1b'"]),
    (["--trainer.strategy.activation_checkpointing=some"], ["activation_checkpointing='some'", "'selective'"]),
    (["--trainer.strategy.tensor_paralel_size=2"], ["tensor_paralel_size='2'", "trainer.strategy"]),
    (["--trainer.strategy.virtual_pipeline_stages=3", "--trainer.strategy.pipeline_schedule=zbv"], ["zbv"]),
    (["--trainer.strategy.activation_offload_layers=-1"], ["activation_offload_layers=-1"]),
    (["--trainer.strategy.tensor_parallel_overlap=true", "--trainer.strategy.sequence_parallel=false"], ["overlap"]),
    (["--trainer.strategy.compile=true", "--trainer.strategy.activation_checkpointing=selective"], ["compile=True"]),
    (["--trainer.strategy.gradient_compression=powersgd", "--trainer.strategy.zero_stage=3"], ["powersgd"]),
    (["--trainer.devices=3"], ["world size 3", "pp*dp*cp*tp"]),
    (["--trainer.precision=16-mixed"], ["16-mixed", "bf16-mixed"]),
    (["--data.seq_length=0"], ["seq_length", "0"]),
    (["--data.micro_batch_size=x"], ["data.micro_batch_size", "x"]),
    (["--model.model_config=nope"], ["model_config='nope'", "preset"]),
    (["--model.learning_rate=-1"], ["learning_rate"]),
    (["--trainer.bogus=1"], ["--trainer.bogus=1"]),
    (["--ckpt_path", "/nonexistent/last.ckpt"], ["/nonexistent/last.ckpt"]),
    (["--ckpt_path", "http://example.com/last.ckpt"], ["'http://example.com/last.ckpt' is a URL", "local files"]),
    (["--ckpt_path", "https://example.com/x.ckpt", "--trainer.strategy=auto"], ["is a URL"]),
    (["--weights_only=false"], ["--weights_only=false is not honoured"]),
    (["--data.data_path=[-0.5, x.bin, 1.5, y.bin]"], ["blend weight -0.5", "> 0"]),
    (["--data.data_path=[0.5, x.bin, 0.5]"], ["3 entries", "[weight, path, weight, path, ...]"]),
    # the fixture writes corrupt.bin with an index that is not Megatron's
    (["--data.data_path=corrupt.bin"], ["corrupt.idx"]),
    # the fixture puts a crafted checkpoint where configs/tiny.yaml's ModelCheckpoint keeps last.ckpt
    (["--ckpt_path", "last"], ["--ckpt_path last", "checkpoints/tiny/last.ckpt"]),
    (["--ckpt_path", "last", "--trainer.strategy=auto", "--trainer.devices=1"], ["checkpoints/tiny/last.ckpt"]),
]


@pytest.fixture(scope="module")
def fit_bad_input_runs(tmp_path_factory):
    """Every :data:`FIT_BAD_INPUT` case, then a full-file checkpoint whose ``hyper_parameters`` set a learning rate
    and an ``init_from``, through ``lightning_4d.cli.main`` in one fresh process
    (``tests/scripts/fit_bad_input.py``: its exit code and stderr per case; ``Trainer.fit`` replaced by a refusal, so
    a case that is not refused before training never starts processes)."""
    import json

    import torch

    from tests._crafted import crafted_file

    cwd = tmp_path_factory.mktemp("fit_bad_input")
    hparams = {"model_config": "tiny", "learning_rate": 0.5, "init_from": str(cwd / "elsewhere.ckpt")}
    torch.save({"state_dict": {}, "hyper_parameters": hparams, "epoch": 0, "global_step": 0}, cwd / "other.ckpt")
    extra = [["--ckpt_path", str(cwd / "other.ckpt"), "--trainer.strategy=auto", "--trainer.devices=1"]]
    cases = [
        ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger=false", *e]
        for e in [e for e, _ in FIT_BAD_INPUT] + extra
    ]
    (cwd / "corrupt.bin").write_bytes(bytes(64))
    (cwd / "corrupt.idx").write_bytes(b"not an index")
    (cwd / "checkpoints" / "tiny").mkdir(parents=True)
    crafted_file(cwd / "checkpoints" / "tiny" / "last.ckpt", cwd / "code_ran")
    proc = python_run(str(ROOT / "tests" / "scripts" / "fit_bad_input.py"), json.dumps(cases), cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (cwd / "code_ran").exists(), "a crafted checkpoint's code ran"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FIT_BAD_INPUT)), ids=[" ".join(e) for e, _ in FIT_BAD_INPUT])
def test_fit_bad_input_is_one_line_and_exit_2(fit_bad_input_runs, index):
    code, err = fit_bad_input_runs[index]
    assert code == 2, (code, err)
    assert "Traceback" not in err and "usage:" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # (Lightning logs "Seed set to 0" too)
    assert len(lines) == 1 and lines[0].startswith("lightning-4d fit: error: "), err
    for text in FIT_BAD_INPUT[index][1]:
        assert text in lines[0], lines[0]


@pytest.mark.slow
def test_checkpoint_hyper_parameters_are_named_and_never_name_a_file(fit_bad_input_runs):
    """Lightning merges a full-file checkpoint's ``hyper_parameters`` over the model's arguments: the learning rate
    it sets is named on stderr, its ``init_from`` is not taken (the run reaches ``Trainer.fit``, which the driver
    refuses, instead of failing on the missing file the checkpoint named)."""
    code, err = fit_bad_input_runs[len(FIT_BAD_INPUT)]
    assert "reached Trainer.fit" in str(code), (code, err)
    assert "elsewhere.ckpt" not in str(code) + err, (code, err)
    line = next(x for x in err.splitlines() if "hyper_parameters set" in x)
    assert "--model.learning_rate=0.5 (was 0.003)" in line and "init_from" not in line, line


def test_fit_bad_input_traceback_on_request(capsys, tmp_path, monkeypatch):
    from lightning_4d.cli import TRACEBACK_ENV

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(Exception, match="zero_stage=7"):
        main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.strategy.zero_stage=7"])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_prints(command, capsys):
    """``lightning-4d <command> --help`` prints its options and exits 0 (argparse formats each option's help with
    ``%``: a literal ``%`` in a help text must be written ``%%``, else ``--help`` raises)."""
    try:
        code = main([command, "--help"])
    except SystemExit as e:  # argparse's exit; some commands return it instead
        code = e.code
    assert code == 0
    assert "--help" in capsys.readouterr().out
