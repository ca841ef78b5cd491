"""``lightning-4d plan --emit-config``: the plan's first layout as a LightningCLI config that trains.

The file holds the planned layout (every ``FourDStrategy`` argument the row decides), the batch sizes, and the rest of
a pretraining job: a step budget, the learning-rate schedule, gradient clipping, a validation interval, a
``ModelCheckpoint`` at the row's checkpoint interval, a ``CSVLogger`` and the :class:`~lightning_4d.monitor.StepMonitor`
(tokens/s, MFU, peak memory against the estimate: ``docs/monitoring.md``). The data paths are placeholders that the
launch line in the file's header replaces (``--data.tokenizer``, ``--data.data_path``).

Torch-free, like the rest of ``planning/``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from lightning_4d.features import moe
from lightning_4d.layout import strategy_arguments

#: the emitted config's step budget (as ``configs/llama3_8b.yaml``): set ``trainer.max_steps`` to your token budget
#: divided by the tokens per step (global batch x sequence length)
MAX_STEPS = 10_000
#: validate every this many optimizer steps, on this many validation batches (and checkpoint at most this far apart)
VALIDATION_INTERVAL_STEPS = 1000
VALIDATION_BATCHES = 20
#: the placeholders of the data section: the data module refuses a tokenizer file that does not exist, so a launch
#: that forgets ``--data.tokenizer`` stops with one line naming it
TOKENIZER_PLACEHOLDER = "path/to/tokenizer.json"
DATA_PATH_PLACEHOLDER = "/data/corpus.bin"


@dataclass(frozen=True)
class PretrainingDefaults:
    """The optimizer settings of a pretraining run, from the Llama 2 paper (Touvron et al. 2023, "Llama 2: Open
    Foundation and Fine-Tuned Chat Models", arXiv 2307.09288, section 2.2 and Table 1): AdamW, cosine decay after
    2,000 warm-up steps to 10% of the peak, weight decay 0.1, gradient clipping 1.0, peak learning rate 3e-4 for
    the 7B and 13B models and 1.5e-4 for 34B and 70B. Llama 3's paper states them only for 405B (8e-5, 8,000
    warm-up steps). ``configs/llama3_8b.yaml`` and ``configs/llama3_70b.yaml`` use these values
    (``tests/test_cli.py`` checks that they agree with :func:`pretraining_defaults`)."""

    learning_rate: float
    warmup_steps: int = 2000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    gradient_clip_val: float = 1.0


#: Llama 2's Table 1 changes the peak learning rate between its 13B and 34B models
LARGE_MODEL_PARAMETERS = 20 * 10**9


def pretraining_defaults(num_parameters: int) -> PretrainingDefaults:
    """:class:`PretrainingDefaults` for a model of ``num_parameters`` parameters: peak learning rate 3e-4 below
    :data:`LARGE_MODEL_PARAMETERS`, 1.5e-4 from there on (Llama 2, Table 1)."""
    return PretrainingDefaults(learning_rate=3e-4 if num_parameters < LARGE_MODEL_PARAMETERS else 1.5e-4)


def _preset_parameters(model: str) -> Any:
    """The parameter count of preset ``model`` (``None``: ``--model`` named a file, whose own job settings stay).

    Raises:
        ValueError: the preset serves ``estimate`` / ``plan`` only (``LlamaConfig.unimplemented_features``): a
            config from it would not train.
    """
    from lightning_4d.models.llama_config import LlamaConfig

    if _is_file(model):
        return None
    config = LlamaConfig.from_name(model)
    config.check_trainable(f"--emit-config for {model!r}")
    return config.num_parameters()


def check_emittable(model: str) -> None:
    """Check, before any search, that ``--emit-config`` can write a config for ``--model`` ``model`` (a preset the
    model implements, or a YAML file).

    Raises:
        ValueError: the preset serves ``estimate`` / ``plan`` only (:func:`_preset_parameters`).
    """
    _preset_parameters(model)


def _is_file(model: str) -> bool:
    return str(model).endswith((".yaml", ".yml")) or Path(model).is_file()


def _file_validation(model: str, accumulate: int) -> dict[str, Any]:
    """For a ``--model`` YAML file: its ``trainer.val_check_interval`` (counted in batches, so sized for the file's
    own ``accumulate_grad_batches``) rescaled to the emitted ``accumulate`` batches per optimizer step, so that the
    file validates every as many optimizer steps as before; ``{}`` when the file sets no batch count."""
    import yaml

    trainer = (yaml.safe_load(Path(model).read_text()) or {}).get("trainer") or {}
    interval, before = trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches") or 1
    if not isinstance(interval, int) or isinstance(interval, bool) or not isinstance(before, int):
        return {}
    return {"val_check_interval": max(1, interval // before) * accumulate, "check_val_every_n_epoch": None}


def _trainer(out: dict[str, Any], c: dict[str, Any], init_args: dict[str, Any]) -> dict[str, Any]:
    """The ``trainer`` section: devices x num_nodes = the job's GPUs, precision, m accumulated batches (pp = 1), the
    strategy with the row's layout."""
    num_gpus, per_node = out["num_gpus"], out["gpus_per_node"]
    return {
        "accelerator": "gpu",
        "devices": min(num_gpus, per_node),
        "num_nodes": max(1, num_gpus // per_node),
        "precision": out["precision"],
        "accumulate_grad_batches": 1 if c["pp"] > 1 else c["num_microbatches"],
        "strategy": {"class_path": "lightning_4d.FourDStrategy", "init_args": init_args},
    }


def _job(out: dict[str, Any], c: dict[str, Any], trainer: dict[str, Any], defaults: PretrainingDefaults) -> dict:
    """The trainer's job settings: steps, clipping, validation every :data:`VALIDATION_INTERVAL_STEPS` optimizer
    steps (Lightning counts ``val_check_interval`` in batches: times the accumulated ones), a ``CSVLogger``, the
    ``StepMonitor`` and a ``ModelCheckpoint`` every :func:`checkpoint_steps`."""
    name = str(out["model"])
    return {
        "max_steps": MAX_STEPS,
        "gradient_clip_val": defaults.gradient_clip_val,
        "val_check_interval": VALIDATION_INTERVAL_STEPS * trainer["accumulate_grad_batches"],
        "check_val_every_n_epoch": None,
        "limit_val_batches": VALIDATION_BATCHES,
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": "lightning_logs", "name": name},
        },
        "callbacks": [  # ModelCheckpoint last: `--trainer.callbacks.dirpath DIR` sets its folder
            {"class_path": "lightning_4d.callbacks.StepMonitor"},
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": f"checkpoints/{name}",
                    "every_n_train_steps": checkpoint_steps(c.get("checkpoint_interval_steps")),
                    "save_last": True,  # also when training ends
                    "enable_version_counter": False,  # a new run in this folder replaces last.ckpt
                },
            },
        ],
    }


def checkpoint_steps(interval_steps: Optional[int]) -> int:
    """Optimizer steps between checkpoints: the plan row's Young interval (``checkpoint_interval_steps``), at most
    :data:`VALIDATION_INTERVAL_STEPS` (a small model's interval can exceed any run: it still saves that often; a
    layout without the row's interval, ``None``: that many)."""
    if interval_steps is None:
        return VALIDATION_INTERVAL_STEPS
    return max(1, min(int(interval_steps), VALIDATION_INTERVAL_STEPS))


def plan_config(out: dict[str, Any]) -> dict[str, Any]:
    """The first layout of a ``plan`` result (``out``, as ``--json`` prints it) as a LightningCLI config for
    ``lightning-4d fit`` (docs/estimate_and_plan.md, "From a row to a config"): ``trainer`` (devices x num_nodes =
    the job's GPUs, precision, ``accumulate_grad_batches`` = m with pp = 1, else 1, and ``strategy``:
    ``lightning_4d.FourDStrategy`` with every dimension of the layout) and ``data``'s ``seq_length``,
    ``micro_batch_size`` and ``global_batch_size`` (= b·dp·m). When ``--model`` named a preset, also the job
    (:func:`_job`), ``model`` (the preset, :func:`pretraining_defaults`, ``document_masking`` when the plan was made
    with ``--document-tokens``) and the data placeholders; with a ``--model`` YAML file, that file keeps its own.

    Raises:
        ValueError: ``out`` has no layout (none fits).
    """
    if not out["layouts"]:
        raise ValueError("no layout fits, so there is no first pick to write")
    from lightning_4d.planning.planner import Candidate

    c = out["layouts"][0]
    layout = Candidate(**{f.name: c[f.name] for f in fields(Candidate)})
    trainer = _trainer(out, c, strategy_arguments(layout.parallel_config()))
    data = {
        "seq_length": out["seq_length"],
        "micro_batch_size": c["micro_batch_size"],
        "global_batch_size": c["micro_batch_size"] * c["dp"] * c["num_microbatches"],
    }
    num_parameters = _preset_parameters(out["model"])
    if num_parameters is None:
        trainer.update(_file_validation(out["model"], trainer["accumulate_grad_batches"]))
        return {"trainer": trainer, "data": data}
    defaults = pretraining_defaults(num_parameters)
    trainer.update(_job(out, c, trainer, defaults))
    model: dict[str, Any] = {"model_config": out["model"]}
    model.update({f.name: getattr(defaults, f.name) for f in fields(defaults) if f.name != "gradient_clip_val"})
    if out.get("document_tokens") is not None:
        model["document_masking"] = True
    data = {"tokenizer": TOKENIZER_PLACEHOLDER, "data_path": DATA_PATH_PLACEHOLDER, **data}
    return {"seed_everything": 0, "trainer": trainer, "model": model, "data": data}


def fit_command(out: dict[str, Any], path: str) -> str:
    """The ``lightning-4d fit`` command that runs the config ``path`` written for ``out``: with a ``--model`` YAML
    file, that file first (for its model and the rest of its job), then ``path``."""
    if "model" in plan_config(out):
        return f"lightning-4d fit --config {path}"
    return f"lightning-4d fit --config {out['model']} --config {path}"


def write_plan_config(out: dict[str, Any], path: str, command: str) -> str:
    """Write :func:`plan_config` of ``out`` to ``path`` as YAML under a comment naming the plan ``command``, the
    layout's prediction and how to run it; returns ``path``."""
    import yaml

    config = plan_config(out)
    c = out["layouts"][0]
    run = fit_command(out, path)
    header = [
        f"# The first pick of: {command}",
        f"# tp={c['tp']} pp={c['pp']} cp={c['cp']} dp={c['dp']} ep={moe.plan_cell(c)} "
        f"b={c['micro_batch_size']} m={c['num_microbatches']} "
        f"ZeRO {c['zero_stage']} checkpointing={c['activation_checkpointing']}: {c['memory_gib']:.1f} GiB per GPU "
        f"({100 * c['fraction']:.0f}% of {out['gpu']}), predicted step {c['step_time']:.4g} s (not measured).",
        f"#   {run} --data.data_path {DATA_PATH_PLACEHOLDER} --data.tokenizer {TOKENIZER_PLACEHOLDER}",
        "#   (a weighted blend of prepared corpora: --data.data_path '[0.7, /data/web.bin, 0.3, /data/code.bin]')",
        '# (rows to arguments: docs/estimate_and_plan.md, "From a row to a config")',
    ]
    if "model" in config:  # a preset: the job is this file's
        header += [
            "# (the learning rate, warm-up and clipping are the Llama 2 paper's:",
            "# lightning_4d.planning.emit.pretraining_defaults; set trainer.max_steps to your budget)",
        ]

    class _Dumper(yaml.SafeDumper):  # lists of numbers (the layer split) on one line: [7, 8, 8, 7]
        pass

    def _list(dumper: yaml.SafeDumper, value: list) -> Any:
        flat = not any(isinstance(x, (dict, list)) for x in value)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flat)

    _Dumper.add_representer(list, _list)
    text = (
        "\n".join(header)
        + "\n"
        + yaml.dump(config, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 30)
    )
    Path(path).write_text(text)
    return path
