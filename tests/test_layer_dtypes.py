"""No decoder layer changes the dtype of the residual stream, under every precision, in every model family.

A layer that returns float32 from bfloat16 input breaks a pipeline (each stage's output is checked against the dtype
the schedule inferred: ``PipeliningShapeError ... expected torch.bfloat16 actual torch.float32``, seen on an H100
with MoE under pp in ``bf16-mixed``), and without pp it silently doubles the residual stream's bytes, the expert
all-to-all volumes and the saved activations from that layer on.

The fault appeared only on CUDA: CUDA autocast runs some ops (``sum``, ``cumsum``, ``softmax``, ``exp``, ``pow``,
...) in float32 where CPU autocast keeps the low-precision dtype. :class:`CudaAutocastFloat32Ops` reproduces that
policy on the CPU (PyTorch's AMP docs, "CUDA Ops that can autocast to float32"), so the check runs here and fails
before the fix; the CUDA smoke matrix repeats it on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_4d.models import LlamaConfig
from lightning_4d.models.llama import LlamaModel

#: PyTorch's AMP documentation, "CUDA Ops that can autocast to float32" (torch 2.x): under CUDA autocast these ops
#: run in float32 whatever their floating inputs; CPU autocast's float32 list is shorter and omits e.g. ``sum``
CUDA_AUTOCAST_FLOAT32_OPS = frozenset(
    "__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin cosh cumprod cumsum dist erfinv exp expm1 group_norm "
    "layer_norm log log_softmax log10 log1p log2 norm normalize pow prod reciprocal rsqrt sinh softmax softmin "
    "softplus sum renorm tan".split()
)


class CudaAutocastFloat32Ops(TorchFunctionMode):
    """While CPU autocast is on, the ops of :data:`CUDA_AUTOCAST_FLOAT32_OPS` get their float16/bfloat16 tensor
    arguments cast to float32, as CUDA autocast does (functions and ``Tensor`` methods alike)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and getattr(func, "__name__", None) in CUDA_AUTOCAST_FLOAT32_OPS:

            def up(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) else x

            args = tuple(up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def test_the_emulation_upcasts_what_cuda_autocast_upcasts():
    x = torch.ones(4, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert x.sum(0).dtype == torch.bfloat16  # CPU autocast keeps sum in bfloat16 ...
        with CudaAutocastFloat32Ops():
            assert x.sum(0).dtype == torch.float32  # ... CUDA autocast runs it in float32
            assert torch.softmax(x, -1).dtype == torch.float32
            assert (x @ x).dtype == torch.bfloat16  # matmuls stay in the autocast dtype
    with CudaAutocastFloat32Ops():
        assert x.sum(0).dtype == torch.bfloat16  # autocast off: nothing changes


#: precision -> (parameter dtype, autocast dtype or None): what FourDStrategy runs each with on our Llama
#: (bf16-mixed: bfloat16 compute copies of the fp32 masters, under Lightning's autocast; 16-mixed: Lightning's
#: autocast over float32 parameters, refused by FourDStrategy but modelled by the estimator)
PRECISIONS = {
    "32-true": (torch.float32, None),
    "bf16-mixed": (torch.bfloat16, torch.bfloat16),
    "bf16-true": (torch.bfloat16, None),
    "16-mixed": (torch.float32, torch.float16),
}


def _layer_dtypes(model: torch.nn.Module, layers, run) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """``(layer name, input dtype, output dtype)`` of every decoder layer in ``layers`` while ``run()`` runs."""
    seen = []
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, name=name: seen.append(
                (name, args[0].dtype, (out[0] if isinstance(out, tuple) else out).dtype)
            )
        )
        for name, layer in layers
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _under(precision: str, fn):
    _, autocast = PRECISIONS[precision]
    with CudaAutocastFloat32Ops():
        if autocast is None:
            return fn()
        with torch.autocast("cpu", dtype=autocast):
            return fn()


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("preset", ["tiny-test", "tiny-moe"])
def test_our_decoder_layers_keep_the_residual_dtype(preset, precision):
    torch.manual_seed(0)
    dtype, _ = PRECISIONS[precision]
    config = LlamaConfig.from_preset(preset)
    model = LlamaModel(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (2, 32))

    def step():
        model(ids).float().sum().backward()

    seen = _layer_dtypes(model, list(model.layers.items()), lambda: _under(precision, step))
    assert len(seen) == config.num_layers
    changed = [(name, a, b) for name, a, b in seen if a != b]
    assert not changed, f"{preset} {precision}: layers changed the residual stream's dtype: {changed}"
    assert {a for _, a, _ in seen} == {dtype}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_transformers_decoder_layers_keep_the_residual_dtype(family, precision):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    dtype, _ = PRECISIONS[precision]
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        )
    model = model.to(dtype)
    ids = torch.randint(0, 128, (2, 16))

    def step():
        model(input_ids=ids).logits.float().sum().backward()

    layers = list(model.model.layers.named_children())
    seen = _layer_dtypes(model, layers, lambda: _under(precision, step))
    assert len(seen) == 2
    changed = [(name, a, b) for name, a, b in seen if a != b]
    assert not changed, f"{family} {precision}: layers changed the residual stream's dtype: {changed}"
