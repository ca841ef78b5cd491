"""The `lightning-4d` program: LightningCLI fit from YAML with command-line overrides, resume, bad input."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_4d.planning.workload import Workload
from tests._launch import ROOT, python_run, torchrun, worker_env

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 4
  max_steps: 6
  val_check_interval: 3
  check_val_every_n_epoch: null
  limit_val_batches: 2
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  strategy:
    class_path: lightning_4d.FourDStrategy
    init_args: {data_parallel_size: 2, tensor_parallel_size: 2, zero_stage: 1, process_group_backend: gloo}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {save_dir: OUT/logs, name: run}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {dirpath: OUT/ckpt, save_last: true, every_n_train_steps: 3}
    - class_path: lightning_4d.callbacks.TrainingSummary
      init_args: {prompt: "def ", max_new_tokens: 8}
    - class_path: lightning_4d.callbacks.StepMonitor
      init_args: {peak_tflops: 0.1}   # a nominal CPU peak, so that mfu is logged (test_step_monitor_logs_sane_values)
    - class_path: lightning_4d.memory_check.MemoryEstimatorCallback
      init_args: {device_memory: 64GiB}   # on CPU the estimate needs a memory to check against
model:
  model_config: tiny-test
  learning_rate: 1.0e-3
  warmup_steps: 2
data:
  seq_length: 32
  micro_batch_size: 2
  val_samples: 4
"""


def _cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return python_run("-m", "lightning_4d", *args, cwd=cwd, timeout=timeout)


def _cli_ranks(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``lightning-4d ARGS`` on ``nproc`` ranks forked from the test forkserver under torchrun's environment
    (Lightning then starts no processes of its own; the ``fitted`` fixture runs Lightning's launcher, a fresh
    interpreter per rank, as ``make run`` does): ~2.5 s of imports less per rank."""
    return torchrun(nproc, "-m", "lightning_4d", *args, cwd=cwd, check=False)


def _metrics(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    config = out / "config.yaml"
    config.write_text(CONFIG.replace("OUT", str(out)))
    proc = _cli("fit", "--config", str(config), cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, config, proc


@pytest.mark.slow
def test_fit_from_yaml_trains_and_summarizes(fitted):
    out, _, proc = fitted
    rows = _metrics(next((out / "logs" / "run").glob("version_*/metrics.csv")))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 6
    assert any(r.get("val_loss") for r in rows) and any(r.get("tokens_per_sec") for r in rows)
    assert "final validation loss" in proc.stdout + proc.stderr
    assert "corpus unigram entropy" in proc.stdout + proc.stderr
    assert (out / "ckpt" / "last.ckpt" / ".metadata").exists()


@pytest.mark.slow
def test_step_monitor_logs_sane_values(fitted):
    """StepMonitor in a real 4-process CPU fit (dp=2 x tp=2): one row per optimizer step with tokens_per_sec > 0,
    mfu in (0, 1) equal to tokens_per_sec x (6N + 12·L·h·s) / (peak x world size) with N counted on the real
    parameters of a plain LlamaModel (PaLM's count), and the pre-fit estimate logged equal to estimate_memory's for
    the same job; no peak_memory_gib on CPU (no device allocator statistics)."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.models import LlamaConfig, LlamaModel
    from lightning_4d.planning.hardware import GIB
    from lightning_4d.planning.model import estimate_memory

    out, _, _ = fitted
    rows = [r for r in _metrics(next((out / "logs" / "run").glob("version_*/metrics.csv"))) if r.get("mfu")]
    assert len(rows) == 6, rows  # every optimizer step
    cfg = LlamaConfig.from_name("tiny-test")
    n = sum(p.numel() for p in LlamaModel(cfg).parameters())
    flops_per_token = 6 * n + 12 * cfg.num_layers * cfg.hidden_size * 32  # s = 32
    for r in rows:
        tokens_per_sec, mfu = float(r["tokens_per_sec"]), float(r["mfu"])
        assert tokens_per_sec > 0 and 0 < mfu < 1, r
        assert mfu == pytest.approx(tokens_per_sec * flops_per_token / (0.1e12 * 4), rel=1e-6)
        assert "peak_memory_gib" not in r or not r["peak_memory_gib"]
    pc = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, zero_stage=1).resolve(4)
    est = estimate_memory(Workload(cfg, 2, 32, "32-true", num_microbatches=1), pc, device_type="cpu")
    assert est.overhead == 0  # on CPU: the tensor bytes, as StepMonitor logs them
    logged = {float(r["estimated_memory_gib"]) for r in rows}  # one value, logged as float32
    assert len(logged) == 1 and logged.pop() == pytest.approx(est.total / GIB, rel=1e-6)


@pytest.mark.slow
def test_resume_with_ckpt_path(fitted):
    out, config, _ = fitted
    ckpt = str(out / "ckpt" / "last.ckpt")
    proc = _cli_ranks(4, "fit", "--config", str(config), "--ckpt_path", ckpt, "--trainer.max_steps=9", cwd=out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    versions = sorted((out / "logs" / "run").glob("version_*/metrics.csv"))
    rows = [r for r in _metrics(versions[-1]) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [6, 7, 8]  # continues after step 6 (0-based steps 6..8), not from scratch
    # the 6-step LR schedule the run was started with continues (ended: its final LR), not one over 9 steps
    from lightning_4d.tasks import lr_lambda

    assert [float(r["lr"]) for r in rows] == pytest.approx([1e-3 * lr_lambda(k, 2, 6, 0.1) for k in (6, 7, 8)])


@pytest.mark.slow
def test_command_line_overrides(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path)))
    proc = _cli_ranks(
        2,
        "fit",
        "--config",
        str(config),
        "--trainer.devices=2",
        "--trainer.strategy.tensor_parallel_size=1",
        "--trainer.strategy.zero_stage=3",
        "--trainer.max_steps=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _metrics(next((tmp_path / "logs" / "run").glob("version_*/metrics.csv")))
    assert len([r for r in rows if r.get("train_loss")]) == 2


@pytest.mark.slow
def test_activation_checkpointing_choices(tmp_path):
    """The strategy's ``activation_checkpointing`` is a Literal of config.ACTIVATION_CHECKPOINTING: "selective"
    parses, an unknown mode is refused by the parser in one line with the valid ones (``--print_config``: nothing
    runs); the ``estimate`` command takes it too."""
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path)))
    proc = _cli(
        "fit",
        "--config",
        str(config),
        "--trainer.strategy.activation_checkpointing=selective",
        "--print_config",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "activation_checkpointing: selective" in proc.stdout
    bad = _cli(
        "fit",
        "--config",
        str(config),
        "--trainer.strategy.activation_checkpointing=some",
        "--print_config",
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert "activation_checkpointing='some' is not valid: expected one of ['none', 'full', 'selective']" in bad.stderr
    estimate = _cli(
        "estimate",
        "--model",
        "llama3-8b",
        "--num-gpus",
        "8",
        "--tp",
        "8",
        "--micro-batch-size",
        "1",
        "--seq-length",
        "8192",
        "--activation-checkpointing",
        "selective",
        "--json",
        cwd=tmp_path,
    )
    assert estimate.returncode in (0, 1), estimate.stderr  # 1: does not fit
    assert json.loads(estimate.stdout)["layout"]["activation_checkpointing"] == "selective"


@pytest.mark.slow
def test_model_that_tp_cannot_split_fails_before_process_group(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path)))
    proc = _cli(
        "fit",
        "--config",
        str(config),
        "--trainer.devices=4",
        "--trainer.strategy.tensor_parallel_size=4",
        "--trainer.strategy.data_parallel_size=1",
        "--model.model_config=tiny-test",
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "num_kv_heads=2 is not divisible by tensor_parallel_size=4" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_help_and_console_script_are_the_same_program():
    proc = _cli("--help", cwd=ROOT)
    assert proc.returncode == 0 and "fit" in proc.stdout and "lightning-4d" in proc.stdout
    script = Path(sys.executable).parent / "lightning-4d"
    if script.exists():
        proc2 = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=worker_env())
        assert proc2.stdout == proc.stdout


def test_estimate_proposes_the_planners_layer_split(capsys):
    """`estimate --pp 16` of Llama 3.1 405B (126 layers, not a multiple of 16) estimates with the planner's split
    (7, 8, ..., 8, 7), says so in one line, and gives the estimate of that split given explicitly."""
    from lightning_4d.cli import main
    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.planner import propose_layer_split

    assert "llama3.1-405b" in LlamaConfig.preset_names()
    split = [7] + [8] * 14 + [7]
    assert propose_layer_split(126, 16) == split
    base = [
        "estimate",
        "--model",
        "llama3.1-405b",
        "--tp",
        "8",
        "--pp",
        "16",
        "--dp",
        "64",
        "--micro-batch-size",
        "1",
        "--seq-length",
        "8192",
        "--activation-checkpointing",
        "full",
        "--num-microbatches",
        "32",
    ]
    assert main(base) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "pipeline_layer_split" in line]
    assert len(lines) == 1, lines
    assert f"pipeline_layer_split={split}" in lines[0] and "--pipeline-layer-split overrides it" in lines[0]
    assert main(base + ["--json"]) == 0
    proposed = json.loads(capsys.readouterr().out)
    assert main(base + ["--json", "--pipeline-layer-split", *map(str, split)]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert proposed.pop("pipeline_layer_split_proposed") and not explicit.pop("pipeline_layer_split_proposed")
    assert proposed["layout"]["pipeline_layer_split"] == split
    assert proposed == explicit and proposed["fits"]


def test_estimate_that_does_not_fit_names_the_layouts_that_fit(capsys):
    """`estimate` on a layout over budget (Llama 3 8B, dp8 ZeRO 0 on H100s) exits 1 and names, as the memory check
    does (suggest_layouts + suggestion_line), the layouts of the same 8 GPUs that fit; each one, estimated again with
    `estimate`, fits with the figure printed. A layout that fits names none."""
    from lightning_4d.cli import main
    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.planner import suggest_layouts, suggestion_line

    base = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--micro-batch-size", "1", "--seq-length", "8192"]
    assert main(base + ["--zero-stage", "0"]) == 1
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "Layouts of the same 8 GPUs that fit (fastest predicted first):" in text
    printed = [line.strip() for line in text.splitlines() if line.strip().startswith("FourDStrategy(")]
    expected = suggest_layouts(
        Workload(LlamaConfig.from_preset("llama3-8b"), 1, 8192, "bf16-mixed"), 8, 80 * 2**30, 0.8, gpu_name="H100-80GB"
    )
    assert expected and [p.split(":")[0] for p in printed] == [suggestion_line(pc, 1) for pc, _ in expected]
    assert main(base + ["--zero-stage", "0", "--json"]) == 1
    suggestions = json.loads(capsys.readouterr().out)["suggestions"]
    assert [s["line"] for s in suggestions] == [suggestion_line(pc, 1) for pc, _ in expected]
    for s in suggestions:
        lay = s["layout"]
        again = [
            "estimate",
            "--model",
            "llama3-8b",
            "--micro-batch-size",
            "1",
            "--seq-length",
            "8192",
            "--json",
            "--tp",
            str(lay["tp"]),
            "--pp",
            str(lay["pp"]),
            "--cp",
            str(lay["cp"]),
            "--dp",
            str(lay["dp"]),
            "--zero-stage",
            str(lay["zero_stage"]),
            "--activation-checkpointing",
            lay["activation_checkpointing"],
            "--cp-method",
            lay["context_parallel_method"],
        ]
        if s["accumulate_grad_batches"] > 1:  # the job's global batch, accumulated on this layout's dp
            again += ["--num-microbatches", str(s["accumulate_grad_batches"])]
        if lay["pp"] > 1:
            again += [
                "--pipeline-schedule",
                lay["pipeline_schedule"],
                "--num-microbatches",
                str(lay["num_microbatches"]),
                "--virtual-pipeline-stages",
                str(lay["virtual_pipeline_stages"]),
            ]
        if lay["tp"] > 1:
            again += ["--sequence-parallel", str(lay["sequence_parallel"]).lower()]
        assert main(again) == 0, s["line"]
        assert json.loads(capsys.readouterr().out)["total"] == s["total"]
    assert main(base + ["--zero-stage", "3"]) == 0  # fits: nothing suggested
    assert "Layouts of the same" not in capsys.readouterr().out


def _check_the_job(config: dict, row: dict) -> None:
    """The emitted config's job beside the layout: data placeholders, Llama 2's optimizer settings for a model under
    20B parameters, steps, clipping, the validation interval in batches, the checkpoint at the row's interval."""
    trainer, data = config["trainer"], config["data"]
    assert data == {
        "tokenizer": "path/to/tokenizer.json",  # the placeholders the header's launch line replaces
        "data_path": "/data/corpus.bin",
        "seq_length": 256,
        "micro_batch_size": row["micro_batch_size"],
        "global_batch_size": 64,
    }
    # the job: Llama 2's optimizer settings for a model under 20B parameters, a checkpoint every row's interval
    assert config["model"] == {
        "model_config": "tiny",
        "learning_rate": 3e-4,
        "warmup_steps": 2000,
        "min_lr_ratio": 0.1,
        "weight_decay": 0.1,
    }
    assert trainer["max_steps"] == 10_000 and trainer["gradient_clip_val"] == 1.0
    assert trainer["val_check_interval"] == 1000 * trainer["accumulate_grad_batches"]  # Lightning counts batches
    (checkpoint,) = [c["init_args"] for c in trainer["callbacks"] if c["class_path"].endswith(".ModelCheckpoint")]
    assert checkpoint["save_last"] and checkpoint["dirpath"] == "checkpoints/tiny"
    assert checkpoint["every_n_train_steps"] == max(1, min(row["checkpoint_interval_steps"], 1000))
    assert trainer["callbacks"][-1]["class_path"].endswith(".ModelCheckpoint")  # --trainer.callbacks.dirpath sets it
    assert {c["class_path"] for c in trainer["callbacks"]} >= {"lightning_4d.callbacks.StepMonitor"}
    assert trainer["logger"]["class_path"] == "lightning.pytorch.loggers.CSVLogger"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ["--pp", "2", "--tp", "2"], ["--tp", "2", "--tensor-parallel-overlap"], ["--compile"]],
    ids=["first-pick", "pp2-tp2", "tp2-overlap", "compile"],
)
def test_plan_emit_config_is_a_fit_config(tmp_path, capsys, monkeypatch, extra):
    """`plan --emit-config FILE.yaml` writes the first row as a LightningCLI config: it parses with yaml, the
    strategy builds from its init_args (no process group needed) with the row's sizes, devices x num_nodes is the
    job's GPUs, data's batch sizes are the row's, and `lightning-4d fit --config FILE.yaml --print_config` accepts
    it as it is. No layout that fits, or a folder that does not exist: exit 2, one line naming the value."""
    import yaml

    from lightning_4d import FourDStrategy
    from lightning_4d.cli import main

    base = [
        "plan",
        "--model",
        "tiny",
        "--num-gpus",
        "16",
        "--gpus-per-node",
        "8",
        "--seq-length",
        "256",
        "--global-batch-size",
        "64",
        *extra,
    ]
    assert main(base + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    path = tmp_path / "plan.yaml"
    assert main(base + ["--emit-config", str(path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if str(path) in line]
    assert len(lines) == 1 and "wrote" in lines[0], lines

    config = yaml.safe_load(path.read_text())
    trainer = config["trainer"]
    assert trainer["strategy"]["class_path"] == "lightning_4d.FourDStrategy"
    init_args = trainer["strategy"]["init_args"]
    pc = FourDStrategy(**init_args).parallel_config
    assert (pc.tp, pc.pp, pc.cp, pc.dp) == (row["tp"], row["pp"], row["cp"], row["dp"])
    assert pc.zero_stage == row["zero_stage"] and pc.activation_checkpointing == row["activation_checkpointing"]
    assert pc.sp == row["sequence_parallel"] and pc.context_parallel_method == row["context_parallel_method"]
    assert pc.tensor_parallel_overlap == row["tensor_parallel_overlap"] == ("--tensor-parallel-overlap" in extra)
    assert pc.compile == row["compile"] == ("--compile" in extra)
    assert trainer["devices"] * trainer["num_nodes"] == 16 and trainer["devices"] == 8
    _check_the_job(config, row)
    if row["pp"] > 1:
        assert pc.microbatches == row["num_microbatches"] and trainer["accumulate_grad_batches"] == 1
        assert pc.pipeline_schedule == row["pipeline_schedule"] and pc.v == row["virtual_pipeline_stages"]
        assert pc.pipeline_layer_split == row["pipeline_layer_split"]
    else:
        assert trainer["accumulate_grad_batches"] == row["num_microbatches"]
    assert row["micro_batch_size"] * row["dp"] * row["num_microbatches"] == 64

    monkeypatch.setattr(sys, "argv", ["lightning-4d"])  # LightningCLI warns when given args beside pytest's argv
    with pytest.raises(SystemExit) as exit_info:  # LightningCLI exits 0 after printing the config
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"] | init_args == printed["trainer"]["strategy"]["init_args"]
    assert printed["data"]["micro_batch_size"] == row["micro_batch_size"]
    assert printed["trainer"]["max_steps"] == 10_000 and printed["model"]["warmup_steps"] == 2000

    # the header's data arguments (one corpus, or a weighted blend) are what fit parses
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    blend = [shlex.split(line.split(":", 1)[1].rstrip(")")) for line in header if "weighted blend" in line]
    assert blend and blend[0][0] == "--data.data_path", header
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), *blend[0], "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["data"]["data_path"] == [0.7, "/data/web.bin", 0.3, "/data/code.bin"]

    missing = tmp_path / "no-such-folder" / "plan.yaml"
    assert main(base + ["--emit-config", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-folder" in err[0] and not missing.exists()
    too_big = ["plan", "--model", "llama3-70b", "--num-gpus", "1", "--seq-length", "8192", "--global-batch-size", "8"]
    assert main(too_big + ["--emit-config", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no layout fits" in err[0] and "none.yaml" in err[0]
    assert not (tmp_path / "none.yaml").exists()


def test_suggested_layouts_keep_the_jobs_global_batch(capsys):
    """A layout over budget with 64 accumulated micro-batches (Llama 3 8B, dp8 ZeRO 3, 66.9 GiB of an 80 GiB H100's
    64 GiB budget): each suggestion runs the same 512 sequences per step on its own dp (its accumulate_grad_batches,
    printed in its line) and fits with them; dp8 ZeRO 3 without checkpointing fits only at one micro-batch (63.0
    GiB), so it is not suggested."""
    from lightning_4d.cli import main

    base = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--micro-batch-size", "1", "--seq-length", "8192"]
    assert main(base + ["--zero-stage", "3", "--num-microbatches", "64", "--json"]) == 1
    suggestions = json.loads(capsys.readouterr().out)["suggestions"]
    assert suggestions
    for s in suggestions:
        lay, m = s["layout"], s["accumulate_grad_batches"]
        assert lay["pp"] > 1 or m * lay["dp"] == 512, s
        assert s["total"] <= 0.8 * 80 * 2**30 and f"accumulate_grad_batches={m}" in s["line"], s
        assert not (lay["dp"] == 8 and lay["activation_checkpointing"] == "none"), s


def test_emitted_config_masks_documents_when_the_plan_did(tmp_path, capsys):
    """A plan made with --document-tokens emits ``model.document_masking: true`` (the module then masks what the
    estimate counted); without it the key is absent (the module's default, off)."""
    import yaml

    from lightning_4d.cli import main

    base = ["plan", "--model", "tiny", "--num-gpus", "4", "--seq-length", "256", "--global-batch-size", "16"]
    for extra, masked in (([], None), (["--document-tokens", "64"], True)):
        path = tmp_path / f"plan{len(extra)}.yaml"
        assert main(base + extra + ["--emit-config", str(path)]) == 0
        capsys.readouterr()
        assert yaml.safe_load(path.read_text())["model"].get("document_masking") is masked


def test_emitted_config_over_a_model_file_keeps_its_validation_every_as_many_optimizer_steps(tmp_path, capsys):
    """With a ``--model`` YAML file the emitted config replaces the file's ``accumulate_grad_batches``; Lightning
    counts ``val_check_interval`` in batches, so the file's interval is rescaled: configs/llama3_8b.yaml validates
    every 128000 / 128 = 1000 optimizer steps, and so does the emitted job at the plan's own accumulation."""
    import yaml

    from lightning_4d.cli import main

    path = tmp_path / "plan.yaml"
    model = str(ROOT / "configs" / "llama3_8b.yaml")
    args = ["plan", "--model", model, "--seq-length", "8192", "--num-gpus", "16", "--gpu-memory", "H100-80GB"]
    assert main([*args, "--global-batch-size", "256", "--emit-config", str(path)]) == 0
    capsys.readouterr()
    trainer = yaml.safe_load(path.read_text())["trainer"]
    accumulate = trainer["accumulate_grad_batches"]
    assert accumulate > 1 and trainer["val_check_interval"] == 1000 * accumulate
    assert trainer["check_val_every_n_epoch"] is None


def test_emit_config_refuses_an_estimate_only_preset(tmp_path, capsys, monkeypatch):
    """A preset whose architecture the model does not implement (Llama 4's) serves estimate and plan only: a config
    from it would not train, so --emit-config says so in one line and writes nothing, before the search (a plan of
    64 GPUs takes seconds)."""
    from lightning_4d.cli import main
    from lightning_4d.planning import planner

    def no_search(*args, **kwargs):
        raise AssertionError("planned before refusing --emit-config")

    monkeypatch.setattr(planner, "plan", no_search)
    path = tmp_path / "scout.yaml"
    args = ["plan", "--model", "llama4-scout-17b-16e", "--seq-length", "8192", "--num-gpus", "64"]
    assert main([*args, "--global-batch-size", "256", "--gpu-memory", "H100-80GB", "--emit-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot build this model" in err[0], err
    assert not path.exists()


@pytest.mark.parametrize("name", ["llama3_8b", "llama3_70b"])
def test_gpu_configs_use_the_emitted_pretraining_defaults(name):
    """The shipped pretraining configs and ``plan --emit-config`` share one definition of the optimizer settings
    (``planning.emit.pretraining_defaults``, Llama 2's): the YAML values equal it for the config's model."""
    import inspect

    import yaml

    from lightning_4d.models import LlamaConfig
    from lightning_4d.planning.emit import pretraining_defaults
    from lightning_4d.tasks import CausalLMModule

    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    defaults = pretraining_defaults(LlamaConfig.from_name(config["model"]["model_config"]).num_parameters())
    model, trainer = config["model"], config["trainer"]
    module_defaults = inspect.signature(CausalLMModule).parameters  # what a config leaves out
    for key in ("learning_rate", "warmup_steps", "min_lr_ratio", "weight_decay"):
        assert model.get(key, module_defaults[key].default) == getattr(defaults, key), key
    assert trainer["gradient_clip_val"] == defaults.gradient_clip_val
    # Lightning counts val_check_interval in batches: the configs validate every 1000 optimizer steps
    assert trainer["val_check_interval"] == 1000 * trainer["accumulate_grad_batches"]


@pytest.mark.slow
def test_prepare_data_subcommand(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.txt").write_text("def f(x):\n    return x\n" * 50)
    proc = _cli(
        "prepare-data",
        "--input",
        str(tmp_path / "*.txt"),
        "--output",
        str(tmp_path / "corpus.bin"),
        "--val-fraction",
        "0",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "corpus.bin").exists()
    bad = _cli(
        "prepare-data", "--input", str(tmp_path / "missing*.txt"), "--output", str(tmp_path / "x.bin"), cwd=tmp_path
    )
    assert bad.returncode == 2 and "missing" in bad.stderr


def _main_job(config: str, steps: int, cwd: Path, *extra: str) -> tuple[float, float]:
    """Run ``configs/<config>`` shortened to ``steps`` steps (validation at the end; ``extra``: more command-line
    arguments): (final validation loss, corpus unigram entropy) as its summary prints them."""
    import re

    fit = [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.limit_val_batches=4"]
    proc = _cli_ranks(4, "fit", "--config", str(ROOT / "configs" / config), *fit, *extra, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    val = float(re.search(r"final validation loss : ([0-9.]+)", out).group(1))
    return val, float(re.search(r"corpus unigram entropy: ([0-9.]+)", out).group(1))


@pytest.mark.slow
def test_main_job_config_learns_below_unigram_entropy(tmp_path):
    """configs/tiny.yaml (what `make run` runs: dp=2 x tp=2, ZeRO 1, 4 processes), shortened to 30 steps (its
    warmup): validation loss 2.82 measured against the corpus' unigram entropy of 3.24 nats/token (2.53 at 60 steps;
    a step is ~0.7 s of this launch on 2 cores)."""
    val, entropy = _main_job("tiny.yaml", 30, tmp_path)
    print(f"\nmain job, 30 steps: val_loss {val:.4f} nats/token vs unigram entropy {entropy:.4f}")
    assert val < entropy
    assert (tmp_path / "checkpoints" / "tiny" / "last.ckpt").is_dir()


@pytest.mark.slow
def test_moe_main_job_config_runs_with_global_routing_statistics(tmp_path):
    """configs/tiny_moe.yaml (dp=2 x tp=2, ep=2, ZeRO 1, 4 processes), shortened to 25 steps: it learns below the
    unigram entropy (validation loss 2.89 measured against 3.24 nats/token), and the logged tokens per expert are
    the global batch's (16 sequences x 256 tokens x top-2 / 8 experts = 1024 per expert on average, summed over
    dp x tp: the tp ranks route disjoint halves of each sequence), with the load-balancing loss logged;
    ``ExpertLoadMonitor`` (added on the command line) logs the ep ranks' load imbalance every step, between 1
    (balanced) and ep = 2, and its running max."""
    monitor = "--trainer.callbacks+=lightning_4d.callbacks.ExpertLoadMonitor"
    val, entropy = _main_job("tiny_moe.yaml", 25, tmp_path, monitor, "--trainer.log_every_n_steps=1")
    rows = _metrics(next((tmp_path / "lightning_logs" / "tiny_moe").glob("version_*/metrics.csv")))
    means = {float(r["moe_tokens_per_expert_mean"]) for r in rows if r.get("moe_tokens_per_expert_mean")}
    aux = [float(r["train_aux_loss"]) for r in rows if r.get("train_aux_loss")]
    assert aux, "train_aux_loss not logged"
    print(f"\nMoE main job, 25 steps: val_loss {val:.4f} vs entropy {entropy:.4f}; aux {aux[0]:.3f}..{aux[-1]:.3f}")
    assert val < entropy
    assert means == {1024.0}
    load = [
        (float(r["moe_expert_load_imbalance"]), float(r["moe_expert_load_imbalance_max"]))
        for r in rows
        if r.get("moe_expert_load_imbalance")
    ]
    print(f"expert load imbalance over {len(load)} steps: max {max(x for x, _ in load):.4f}")
    assert len(load) == 25 and all(1.0 <= x <= 2.0 for x, _ in load)
    assert [m for _, m in load] == [max(x for x, _ in load[: i + 1]) for i in range(len(load))]
    assert (tmp_path / "checkpoints" / "tiny_moe" / "last.ckpt").is_dir()


def test_estimate_counts_gradient_accumulation_at_pp1(capsys):
    """`estimate` at pp = 1 counts `--num-microbatches` (or `--accumulate-grad-batches`) as gradient-accumulation
    steps, as `plan` and the pre-fit check do (issue 36, item 4): Llama 3 8B tp2 dp4 ZeRO 1 full checkpointing with
    m = 128 (configs/llama3_8b.yaml) is estimate_memory's 39.58 GiB, not the 37.88 GiB of one micro-batch."""
    from lightning_4d import ParallelConfig, estimate_memory
    from lightning_4d.cli import main
    from lightning_4d.models import LlamaConfig

    base = "estimate --model llama3-8b --tp 2 --num-gpus 8 --micro-batch-size 1 --seq-length 8192 --zero-stage 1 "
    base += "--activation-checkpointing full --gpu-memory H100-80GB --json"
    pc = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, zero_stage=1, activation_checkpointing="full")
    expected = estimate_memory(
        Workload(LlamaConfig.from_preset("llama3-8b"), 1, 8192, "bf16-mixed", num_microbatches=128),
        pc,
        gpu_name="H100-80GB",
    )
    assert round(expected.total / 2**30, 2) == 39.58
    totals = []
    for flag in ("--num-microbatches", "--accumulate-grad-batches"):
        assert main([*base.split(), flag, "128"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layout"]["num_microbatches"] == 128
        totals.append(out["total"])
    assert totals == [expected.total, expected.total]
    assert main(base.split()) == 0  # one micro-batch per step: less memory (no gradient held during forward)
    assert json.loads(capsys.readouterr().out)["total"] < expected.total


def test_compile_with_selective_checkpointing_is_one_line_exit_2(capsys):
    """`--compile` is the layout registry's (estimate, measure, plan): with selective checkpointing, which
    compile=True refuses (``config.check_compile``), estimate and measure exit 2 with one line naming it, before
    anything runs."""
    from lightning_4d.cli import main

    for command in ("estimate", "measure"):
        argv = [command, "--model", "tiny", "--tp", "2", "--num-gpus", "2", "--seq-length", "64"]
        assert main(argv + ["--micro-batch-size", "1", "--activation-checkpointing", "selective", "--compile"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "compile=True with activation_checkpointing='selective'" in err[0], err
