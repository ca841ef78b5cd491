"""One process: fit tiny-test one step under FourDStrategy (ZeRO 1) and save a sharded folder, then hand crafted
checkpoints (``tests/_crafted.py``) to ``Trainer.fit`` / ``validate`` / ``predict`` ``ckpt_path`` (Python, not the
CLI: the strategy's own ``load_checkpoint``). Writes ``<out>/results.json``: ``{case: "ExceptionType: message"}``."""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import replace
from pathlib import Path

import lightning as L

from lightning_4d import FourDStrategy
from lightning_4d.data import LMDataModule
from lightning_4d.models import LlamaConfig
from lightning_4d.tasks import CausalLMModule
from tests._crafted import crafted_file, crafted_folder


def _trainer(precision: str = "32-true") -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        precision=precision,
        devices=1,
        strategy=FourDStrategy(zero_stage=1, process_group_backend="gloo"),
        max_steps=1,
        limit_val_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _data() -> LMDataModule:
    return LMDataModule(seq_length=32, micro_batch_size=2, global_batch_size=2, val_samples=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    warnings.filterwarnings("ignore")
    trainer = _trainer()
    trainer.fit(CausalLMModule("tiny-test", warmup_steps=0), datamodule=_data())
    good = out / "good.ckpt"
    trainer.save_checkpoint(good)
    marker = out / "marker"
    cases = {
        "fit full file": ("fit", crafted_file(out / "full.ckpt", marker)),
        "fit folder metadata": ("fit", crafted_folder(good, out / "meta.ckpt", marker, "meta")),
        "fit earlier optimizer files": ("fit", crafted_folder(good, out / "legacy.ckpt", marker, "legacy")),
        "fit dcp metadata": ("fit", crafted_folder(good, out / "dcp.ckpt", marker, "dcp")),
        "validate full file": ("validate", out / "full.ckpt"),
        "predict full file": ("predict", out / "full.ckpt"),
    }
    results = {}
    for case, (fn, path) in cases.items():
        # bf16-mixed: a ShardedOptimizer (float32 masters) on one rank, the optimizer that read per-rank files
        trainer = _trainer("bf16-mixed" if "optimizer" in case else "32-true")
        dm = _data()
        kwargs = {"datamodule": dm} if fn != "predict" else {}
        if fn == "predict":
            dm.setup("validate")
            kwargs["dataloaders"] = dm.val_dataloader()
        try:
            getattr(trainer, fn)(CausalLMModule("tiny-test", warmup_steps=0), ckpt_path=str(path), **kwargs)
            results[case] = "loaded"
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            results[case] = f"{type(e).__name__}: {e}"
        results[case + " marker"] = marker.exists()
    # a folder (and a full file) of another model: the first differing tensor named, nothing loaded
    base = LlamaConfig.from_preset("tiny-test")
    others = {
        "other model wider": replace(base, hidden_size=128, intermediate_size=256),
        "other model shallower": replace(base, num_layers=1),  # the folder holds layer 1 that the model lacks
    }
    for case, config in others.items():
        try:
            _trainer().validate(CausalLMModule(config), datamodule=_data(), ckpt_path=str(good))
            results[case] = "loaded"
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            results[case] = f"{type(e).__name__}: {e}"
    # the good folder still loads (the safe reader reads what we write)
    trainer = _trainer()
    trainer.validate(CausalLMModule("tiny-test"), datamodule=_data(), ckpt_path=str(good))
    results["good folder"] = "loaded"
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
