"""Activation checkpointing (``lightning_4d.parallel.activation_checkpoint``) on the tiny Llama, one process, CPU,
float32:
every mode gives the loss and gradients of no checkpointing; the selective policy keeps the matmul, attention and
tp-reduction outputs and nothing else, so its backward runs no matmul again (full runs the forward's again). The
multi-process cases (tp=2, pp=2, cp=2, ZeRO 3) are in ``tests/test_parity.py``, ``tests/test_pipeline.py`` and
``tests/test_context_parallel.py``; the bytes each mode keeps in ``tests/test_memory_model.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode

from lightning_4d.config import ACTIVATION_CHECKPOINTING
from lightning_4d.models import LlamaConfig, LlamaModel
from lightning_4d.models.llama import canonical_name
from lightning_4d.parallel.activation_checkpoint import apply_activation_checkpointing, selective_checkpoint_policy

TINY = LlamaConfig.from_preset("tiny-test")  # h=64, f=128, L=2, a=4, k=2, V=256


def _loss(mode: str, ids: torch.Tensor) -> tuple[LlamaModel, torch.Tensor]:
    model = LlamaModel(TINY, init_seed=3)
    apply_activation_checkpointing(model.layers, mode)
    logits = model(ids[:, :-1])
    return model, F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _grads(model: LlamaModel) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_and_gradients_as_no_checkpointing(mode):
    ids = torch.randint(0, TINY.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    ref_model, ref = _loss("none", ids)
    ref.backward()
    model, loss = _loss(mode, ids)
    assert sum(type(b).__name__ == "CheckpointWrapper" for b in model.layers.values()) == TINY.num_layers
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    grads, ref_grads = _grads(model), _grads(ref_model)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_selective_backward_runs_no_matmul_again():
    """Matmul FLOPs of the backward pass: selective's equal no checkpointing's (the saved matmul outputs are taken
    back, not recomputed); full's are larger by the forward's up to ``w1``/``w3`` (every layer's forward runs again,
    and stops once it has rebuilt what the layer's backward needs: the SwiGLU product, ``w2``'s input)."""
    ids = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    flops = {}
    for mode in ACTIVATION_CHECKPOINTING:
        _, loss = _loss(mode, ids)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[mode] = counter.get_total_flops()
    # per layer, 2 FLOPs x 64 tokens x (wq + wk + wv + wo + w1 + w3 elements)
    layer_forward = 2 * 64 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 64 * 128)
    assert flops["selective"] == flops["none"]
    assert flops["full"] == flops["none"] + TINY.num_layers * layer_forward


@pytest.mark.parametrize(
    "op, saved",
    [
        (torch.ops.aten.mm.default, True),
        (torch.ops.aten.addmm.default, True),
        (torch.ops.aten.bmm.default, True),
        (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, True),
        (torch.ops.aten._scaled_dot_product_flash_attention.default, True),
        (torch.ops.aten._scaled_dot_product_efficient_attention.default, True),
        (torch.ops.aten._scaled_dot_product_cudnn_attention.default, True),
        (torch.ops.aten._grouped_mm.default, True),  # the routed experts' GEMMs on CUDA, as the loop's mm
        (torch.ops._c10d_functional.reduce_scatter_tensor.default, True),
        (torch.ops._c10d_functional.all_reduce.default, True),
        # sequence parallelism's all-gather is made again (its output is tp times the shard it gathers)
        (torch.ops._c10d_functional.all_gather_into_tensor.default, False),
        (torch.ops._c10d_functional.wait_tensor.default, False),
        (torch.ops.aten.rsqrt.default, False),
        (torch.ops.aten.mean.dim, False),
        (torch.ops.aten.silu.default, False),
        (torch.ops.aten.mul.Tensor, False),
        (torch.ops.aten.add.Tensor, False),
        (torch.ops.aten._to_copy.default, False),
        (torch.ops.aten.view.default, False),
    ],
    ids=str,
)
def test_selective_policy(op, saved):
    expected = CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_checkpoint_policy(None, op) is expected


def test_none_leaves_the_model_alone_and_unknown_modes_are_refused():
    model = LlamaModel(TINY, init_seed=3)
    blocks = list(model.layers.values())
    apply_activation_checkpointing(model.layers, "none")
    assert list(model.layers.values()) == blocks
    with pytest.raises(ValueError, match=r"activation_checkpointing='some' .*\['none', 'full', 'selective'\]"):
        apply_activation_checkpointing(model.layers, "some")
