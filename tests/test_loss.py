"""The causal-LM loss (``lightning_4d.parallel.loss``): exact against ``F.cross_entropy``, lean in what it keeps.

- exactness: the loss and the logits' gradient equal ``F.cross_entropy(logits.float(), labels)``'s (float32: to 1e-6
  of the largest magnitude; bfloat16 logits: the gradient is bfloat16 and equals the float32 reference cast once),
  with and without ignored labels (-100), for chunks of one token, of a size that does not divide N, of N and more;
- tp=2 (gloo, ``tests/scripts/vocab_parallel_loss.py``): the loss and the gradient of vocabulary-sharded logits equal
  the single-process reference to 1e-6 in float32;
- memory: ``saved_tensors_hooks`` sees exactly the logits (their own storage, not a copy), the float32 log-sum-exp
  and the labels; no float32 temporary larger than one chunk is made (bfloat16 logits).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_4d.partition as config
from lightning_4d.parallel.loss import causal_lm_loss, vocab_parallel_cross_entropy
from tests._launch import SCRIPTS, torchrun

N, V = 37, 50


def _case(dtype: torch.dtype, ignore: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore:
        labels[::3] = -100
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().float().clone().requires_grad_()
    loss = F.cross_entropy(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def _ours(logits: torch.Tensor, labels: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, **kw)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 5, N, 100])
def test_float32_equals_cross_entropy(ignore, chunk):
    logits, labels = _case(torch.float32, ignore)
    loss, grad = _ours(logits, labels, chunk_tokens=chunk)
    ref_loss, ref_grad = _reference(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * ref_grad.abs().max().item())


@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 5, N])
def test_bfloat16_gradient_is_the_float32_gradient_cast(ignore, chunk):
    logits, labels = _case(torch.bfloat16, ignore, seed=1)
    loss, grad = _ours(logits, labels, chunk_tokens=chunk)
    ref_loss, ref_grad = _reference(logits, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16
    # the same float32 value up to 1e-6, cast once: equal, or one bfloat16 step (at most 2^-7 of the value) apart
    # where the float32 value lies at a rounding boundary
    torch.testing.assert_close(grad, ref_grad.to(torch.bfloat16), rtol=2**-7, atol=0)


def test_causal_lm_loss_shapes_and_every_label_ignored():
    logits = torch.randn(2, 5, V, requires_grad=True)
    labels = torch.randint(0, V, (2, 5))
    loss = causal_lm_loss(logits, labels)
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten()), rtol=1e-6, atol=0
    )
    loss.backward()
    assert logits.grad.shape == logits.shape
    # as F.cross_entropy: a nan loss and a zero gradient when no label counts
    x = torch.randn(N, V, requires_grad=True)
    loss = vocab_parallel_cross_entropy(x, torch.full((N,), -100))
    loss.backward()
    assert loss.isnan() and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_the_logits_the_log_sum_exp_and_the_labels(dtype):
    logits, labels = _case(dtype, ignore=True)
    logits = logits.view(1, N, V).requires_grad_()  # [b, s, V] as the model makes them
    labels = labels.view(1, N)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        causal_lm_loss(logits, labels)
    assert len(saved) == 3
    kept, lse, kept_labels = saved
    # the logits as given: the same storage, dtype and shape (no float32 copy)
    assert kept.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert kept.dtype == dtype and kept.shape == logits.shape
    assert lse.dtype == torch.float32 and lse.shape == (N,)
    assert kept_labels.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr()


class _Float32Outputs(TorchDispatchMode):
    """Records the element count of every float32 tensor an ATen op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


def test_float32_temporaries_are_one_chunk(monkeypatch):
    """With bfloat16 logits no op makes a float32 tensor larger than one chunk of the default rule
    (``loss_chunk_tokens``; here with a 4-token chunk), in forward or backward."""
    monkeypatch.setattr(config, "LOSS_CHUNK_BYTES", 4 * 4 * V)
    assert config.loss_chunk_tokens(V) == 4
    logits, labels = _case(torch.bfloat16, ignore=True)
    logits.requires_grad_()
    mode = _Float32Outputs()
    with mode:
        loss = vocab_parallel_cross_entropy(logits, labels)
        loss.backward()
    assert max(mode.sizes) == 4 * V
    assert logits.grad.dtype == torch.bfloat16


def test_bad_inputs_are_named():
    x = torch.randn(4, V)
    with pytest.raises(ValueError, match=r"labels of shape \(5,\) do not match logits of shape \(4, 50\)"):
        vocab_parallel_cross_entropy(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels have dtype torch.float32"):
        vocab_parallel_cross_entropy(x, torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_tokens=0 is not valid"):
        vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long), chunk_tokens=0)


@pytest.mark.slow
def test_tensor_parallel_equals_single_process(tmp_path):
    """tp=2 on gloo: ``causal_lm_loss`` on a ``Shard(-1)`` DTensor and the function on the local shard (chunks of 1,
    3, 4, 5 and 14 tokens) equal ``F.cross_entropy`` on the full logits; the loss is a plain float32 tensor, the same
    bits on both ranks; the gradient is a ``Shard(-1)`` DTensor of the logits' dtype; the saved logits are the shard."""
    torchrun(2, SCRIPTS / "vocab_parallel_loss.py", "--out", str(tmp_path))
    records = [x for r in range(2) for x in json.loads((tmp_path / f"loss_rank{r}.json").read_text())]
    assert len(records) == 2 * 5
    for x in records:
        assert x["plain_loss"] and x["same_on_ranks"] and x["grad_is_shard"] and x["saved_logits_no_copy"], x
        assert x["grad_dtype"] == x["case"][3], x
        assert max(x["loss"], x["direct_loss"]) <= 1e-6, x
        if x["case"][3] == "torch.float32":
            assert max(x["grad"], x["direct_grad"]) <= 1e-6, x
        else:  # bfloat16: the float32 reference gradient cast once (at most one bfloat16 step apart)
            assert max(x["grad_cast"], x["direct_grad_cast"]) <= 2**-7, x
