"""StepMonitor's counting, without a Trainer: tokens and model FLOPs of an accumulated step with document masking."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import lightning_4d.monitor as monitor
from lightning_4d.models import LlamaConfig
from lightning_4d.models.document_mask import DOCUMENT_IDS


def test_step_monitor_counts_documents_once_per_step_after_its_last_micro_batch(monkeypatch):
    """Two accumulated micro-batches ``[b=2, s=8]`` with document masking: the logged mfu is the sum over the
    micro-batches of tokens x (6N + 12·L·h·Σn_d²/(b·s)) (PaLM's count over the documents of each window, by hand),
    over the step's seconds and the peak; the document ids are read only at the step's end (reading them on CUDA
    syncs the device, which inside the step would time the sync)."""
    cfg = LlamaConfig.from_name("tiny-test")
    calls: list[int] = []
    real = monitor.attention_context
    monkeypatch.setattr(monitor, "attention_context", lambda ids: calls.append(1) or real(ids))
    logged: dict[str, float] = {}
    module = SimpleNamespace(model_config=cfg, log=lambda name, value, **_: logged.__setitem__(name, value))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0, callbacks=[], world_size=1
    )
    batches = [
        {"input_ids": torch.zeros(2, 8, dtype=torch.long), DOCUMENT_IDS: torch.tensor([[0] * 8, [0] * 4 + [1] * 4])},
        {"input_ids": torch.zeros(2, 8, dtype=torch.long), DOCUMENT_IDS: torch.tensor([[0] * 2 + [1] * 6, [0] * 8])},
    ]
    step = monitor.StepMonitor(peak_tflops=1.0)
    step.on_train_start(trainer, module)
    for i, batch in enumerate(batches):
        step.on_train_batch_start(trainer, module, batch, i)
        if i == 1:
            time.sleep(0.01)
            trainer.global_step = 1  # the optimizer stepped after the last micro-batch
        step.on_train_batch_end(trainer, module, None, batch, i)
        if i == 0:
            assert calls == [] and logged == {}
    assert len(calls) == 2  # once per micro-batch, both at the step's end
    n = cfg.num_parameters()
    contexts = [(64 + 16 + 16) / 16, (4 + 36 + 64) / 16]  # Σ n_d² / (b·s) of each micro-batch, by hand
    flops = sum(16 * (6 * n + 12 * cfg.num_layers * cfg.hidden_size * c) for c in contexts)
    seconds = 32 / logged["tokens_per_sec"]
    assert logged["mfu"] == pytest.approx(flops / seconds / 1e12, rel=1e-9)
    assert step._work_of == []  # the next step starts from nothing
