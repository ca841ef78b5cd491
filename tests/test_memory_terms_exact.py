"""Exact bytes of the memory model's per-phase formulas (``planning/activations.py``, ``planning/buffers.py``) on
small odd-sized layouts, each against the tensors the formula's docstring names, written out as shapes and sized on
the meta device (``torch.empty(shape, dtype, device="meta").nbytes``): the activation-checkpointing backward ops, the
selective checkpoint's kept and recomputed sets, document masking's shared inputs, ``saved_bytes`` part by part
(``16-mixed``'s weight copies, MoE layers), FSDP2's units, gathered parameters and gradient buffers at ZeRO 2/3 (with
and without pp, tied and untied head, gradient accumulation), the gradients alive before backward, the optimizer
step's temporaries and the setup peak; sizes of parameters from the real module on the meta device. The measured
validation of the same formulas (``LiveTensorBytes`` on real runs): tests/test_memory_model.py,
tests/test_activation_checkpointing.py. Every value is also checked to be an ``int`` (bytes, never a float)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lightning_4d import ParallelConfig
from lightning_4d.features.context_parallel.costs import extra_saved_bytes, selective_attention_tokens
from lightning_4d.models import LlamaConfig, LlamaModel
from lightning_4d.partition import GRADIENT_BUCKET_BYTES
from lightning_4d.planning.activations import (
    _add_autocast_copies,
    document_masking_inputs,
    kept_layer_backward,
    layer_saved,
    layer_saved_parts,
    layer_selective_parts,
    layer_selective_recompute,
    norm_input_saved,
    recompute_backward,
    saved_bytes,
    saved_per_layer,
)
from lightning_4d.planning.buffers import (
    _fsdp_buffers,
    _fsdp_units,
    _zero3_backward_end,
    buffer_terms,
    initialization_bytes,
)
from lightning_4d.planning.float8_costs import (
    float8_backward_transient,
    float8_forward_transient,
    float8_tensor_parallel_saved,
)
from lightning_4d.planning.offload_costs import unpacked_bytes
from lightning_4d.planning.params import as_held, rank_layers, rank_layout, weighted_params
from lightning_4d.planning.states import fsdp_padded_numel, fsdp_shard_numel, model_state_bytes
from lightning_4d.planning.tensors import Dtypes, Param
from lightning_4d.planning.workload import Workload

BF16_MIXED = Dtypes.of("bf16-mixed")  # param 2, grad 4, master 4, compute 2, residual 2
F16_MIXED = Dtypes.of("16-mixed")  # param 4, compute 2, residual 4, autocast
F32 = Dtypes.of("32-true")
BF16_TRUE = Dtypes.of("bf16-true")  # param 2, no master: FSDP2 gathers and reduces in the parameters' dtype
TINY = LlamaConfig.from_preset("tiny-test")  # h=64, f=128, L=2, a=4, k=2, V=256
_DTYPE = {2: torch.bfloat16, 4: torch.float32, 8: torch.int64}

#: h = 96, 12 query heads of d = 8 (a·d = h), 4 kv heads, f = 160: every size divides by tp = 1, 2, 4
CFG = SimpleNamespace(hidden_size=96, num_heads=12, num_kv_heads=4, head_dim=8, intermediate_size=160)


def nbytes(dtype_bytes: int, *shape: int) -> int:
    """Bytes of a tensor of ``shape`` whose elements take ``dtype_bytes`` bytes (sized by torch on the meta device)."""
    return torch.empty(shape, dtype=_DTYPE[dtype_bytes], device="meta").nbytes


def meta_model(cfg: LlamaConfig) -> LlamaModel:
    """The real module of ``cfg`` on the meta device: its parameters' shapes and names, no memory."""
    with torch.device("meta"):
        return LlamaModel(cfg)


def exact(got, want: int) -> None:
    assert type(got) is int, f"{got!r} is not an int"
    assert got == want


def layout(tp: int = 1, cp: int = 1, sp: bool = False, ac: str = "full") -> SimpleNamespace:
    return SimpleNamespace(tp=tp, cp=cp, sp=sp and tp > 1, activation_checkpointing=ac)


# (b, s, tp, cp, sp, dt): T = b·s/cp tokens both below h = 96 (w2's weight gradient the larger) and above it (the
# SwiGLU product's backward the larger)
CASES = [
    (3, 40, 1, 1, False, F32),
    (3, 80, 1, 1, False, F16_MIXED),
    (3, 80, 2, 2, True, BF16_MIXED),
    (5, 64, 4, 1, True, F16_MIXED),
    (5, 64, 2, 2, False, F16_MIXED),
]


@pytest.mark.parametrize("b, s, tp, cp, sp, dt", CASES)
@pytest.mark.parametrize("kept", [False, True])
def test_recompute_backward_is_the_named_tensors(b, s, tp, cp, sp, dt, kept):
    """A recomputed layer's first backward ops (``recompute_backward``'s docstring), ``T = b·s/cp``: the output
    gradient ``[T/t (sp) or T, h]`` (residual dtype) + ``w2``'s input gradient ``[T, f/t]`` + the larger of ``w2``'s
    backward (under sp its gathered output gradient ``[T, h]``, its weight gradient ``[h, f/t]``, compute dtype) and
    the SwiGLU product's (one ``[T, f/t]`` more, + ``w2``'s ``.grad`` ``[h, f/t]`` in the parameters' dtype when no
    bucket takes it). Offloaded whole: the output gradient + three ``[T, f/t]`` + under sp two ``[T, h]`` + the kept
    ``.grad``. Neither: 0."""
    h, f, c, r = CFG.hidden_size, CFG.intermediate_size, dt.compute, dt.residual
    T = b * (s // cp)
    out_grad = nbytes(r, T // tp, h) if sp else nbytes(r, T, h)
    w2_grad = nbytes(dt.param, h, f // tp) if kept else 0
    w2 = (nbytes(c, T, h) if sp else 0) + nbytes(c, h, f // tp)
    swiglu = nbytes(c, T, f // tp) + w2_grad
    for ac in ("full", "selective"):
        want = out_grad + nbytes(c, T, f // tp) + max(w2, swiglu)
        exact(recompute_backward(CFG, layout(tp, cp, sp, ac), dt, b, s, gradients_kept=kept), want)
    offloaded = out_grad + 3 * nbytes(c, T, f // tp) + (2 * nbytes(c, T, h) if sp else 0) + w2_grad
    for ac in ("none", "full"):
        exact(recompute_backward(CFG, layout(tp, cp, sp, ac), dt, b, s, True, gradients_kept=kept), offloaded)
    exact(recompute_backward(CFG, layout(tp, cp, sp, "none"), dt, b, s, gradients_kept=kept), 0)
    if not kept:  # the defaults: not offloaded, the weight gradient taken by a bucket
        exact(recompute_backward(CFG, layout(tp, cp, sp), dt, b, s), out_grad + nbytes(c, T, f // tp) + max(w2, swiglu))
        exact(kept_layer_backward(CFG, layout(tp, cp, sp), dt, b, s), out_grad + nbytes(c, T, f // tp))


def test_recompute_backward_takes_the_larger_op():
    """Both sides of the ``max`` (tp1 ``32-true``): at T = 120 > h with ``w2``'s ``.grad`` kept the SwiGLU product's
    backward (120·160 + 96·160 > ``w2``'s 96·160 elements): 4·(120·96 + 2·120·160 + 96·160) B; at T = 20 kept, the
    product's side again (20·160 + 96·160): 4·(20·96 + 20·160 + 20·160 + 96·160); at T = 20 not kept, ``w2``'s
    weight gradient (96·160 > 20·160): 4·(20·96 + 20·160 + 96·160)."""
    exact(recompute_backward(CFG, layout(), F32, 3, 40, gradients_kept=True), 4 * (120 * 96 + 2 * 120 * 160 + 96 * 160))
    exact(recompute_backward(CFG, layout(), F32, 1, 20, gradients_kept=True), 4 * (20 * 96 + 2 * 20 * 160 + 96 * 160))
    exact(recompute_backward(CFG, layout(), F32, 1, 20), 4 * (20 * 96 + 20 * 160 + 96 * 160))


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (2, False), (4, True)])
@pytest.mark.parametrize("dt", [F32, F16_MIXED, BF16_MIXED])
def test_selective_parts_and_recompute_are_the_named_tensors(tp, sp, dt):
    """Selective checkpointing (``layer_selective_parts``' docstring), ``s' = s/t`` under sp: ``input`` the layer's
    input ``[b, s', h]`` (residual dtype); ``matmuls`` ``wq``/``wk``/``wv`` ``[b, s, (a + 2k)·d/t]`` and ``w1``/``w3``
    ``[b, s, f/t]`` each, + at tp = 1 ``wo``'s ``[b, s, h]``; ``attention`` the output ``[b, n, a/t, d]`` and float32
    log-sum-exp ``[b, a/t, n]`` for ``n`` attention tokens; ``reductions`` under tp ``wo``'s reduced output ``[b, s',
    h]``. The recompute (``layer_selective_recompute``): the saved set's ffn norm input, both rsqrt, the matmul inputs
    (``layer_saved_parts``), the rotated q and k ``[b, s, (a + k)/t, d]``, ``silu(w1 x)`` and the product ``[b, s,
    f/t]`` each, less the consumed kept q and k ``[b, s, (a + k)/t, d]`` and ``wo``'s kept output or reduction."""
    b, s, n = 3, 40, 56
    h, d, f, c, r = CFG.hidden_size, CFG.head_dim, CFG.intermediate_size, dt.compute, dt.residual
    a, k, s_sp = CFG.num_heads // tp, CFG.num_kv_heads // tp, s // tp if sp else s
    kept = layer_selective_parts(CFG, dt, b, s, tp, sp, n)
    for value in kept.values():
        assert type(value) is int
    wo = nbytes(c, b, s, h) if tp == 1 else 0
    assert kept == {
        "input": nbytes(r, b, s_sp, h),
        "matmuls": nbytes(c, b, s, a + 2 * k, d) + 2 * nbytes(c, b, s, f // tp) + wo,
        "attention": nbytes(c, b, n, a, d) + nbytes(4, b, a, n),
        "reductions": nbytes(c, b, s_sp, h) if tp > 1 else 0,
    }
    parts = layer_saved_parts(CFG, dt, b, s, tp, sp)
    norm = nbytes(r, b, s_sp, h) + nbytes(4, b, s_sp, 1)
    assert parts["norms"] == 2 * norm
    ffn_in = nbytes(c, b, s_sp, h) if sp else nbytes(c, b, s, h) * (2 if dt.autocast else 1)
    attn_in = nbytes(c, b, s_sp, h) if sp else nbytes(c, b, s, h) * (3 if dt.autocast else 1)
    rotated = nbytes(c, b, s, a + k, d)
    recomputed = 2 * norm - nbytes(r, b, s_sp, h) + attn_in + ffn_in + rotated + 2 * nbytes(c, b, s, f // tp)
    consumed = rotated + (nbytes(c, b, s_sp, h) if tp > 1 else nbytes(c, b, s, h))
    exact(layer_selective_recompute(CFG, dt, b, s, tp, sp), recomputed - consumed)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("dt", [F32, F16_MIXED])
def test_moe_layer_projection_inputs_are_the_named_tensors(tp, sp, dt):
    """An MoE layer (``layer_saved_parts`` with ``moe``) runs its feed-forward on the rank's ``s/t`` tokens under tp
    (``TokenParallel``): its input ``[b, s/t, h]`` is saved once (compute dtype), with or without sp, and at tp = 1
    as a dense layer's (``16-mixed``: one cast per linear, w1 and w3). The attention inputs stay a dense layer's."""
    cfg = LlamaConfig.from_preset("tiny-moe")
    b, s = 3, 40
    c, h = dt.compute, cfg.hidden_size
    parts = layer_saved_parts(cfg, dt, b, s, tp, sp, (1, 1.0))
    dense = layer_saved_parts(cfg, dt, b, s, tp, sp)
    for value in parts.values():
        assert type(value) is int
    ffn_in = nbytes(c, b, s // tp, h) if tp > 1 else nbytes(c, b, s, h) * (2 if dt.autocast else 1)
    exact(parts["ffn_in"], ffn_in)
    assert {k: v for k, v in parts.items() if k not in ("ffn_in", "swiglu")} == {
        k: v for k, v in dense.items() if k not in ("ffn_in", "swiglu")
    }


#: saved_bytes' models: tiny-test with 4 layers; tiny-moe with 4 layers, every other one MoE; every one MoE with a
#: dense feed-forward width (unused) larger than the experts' (a dense layer would save more than an MoE one)
SAVED_MODELS = {
    "dense": lambda: dataclasses.replace(TINY, num_layers=4),
    "moe-mixed": lambda: LlamaConfig.from_preset("tiny-moe", num_layers=4, moe_layer_interval=2),
    "moe-all": lambda: LlamaConfig.from_preset("tiny-moe", num_layers=4, intermediate_size=2048),
}
TP2 = {"tensor_parallel_size": 2}
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
ALLGATHER = {"context_parallel_size": 2, "context_parallel_method": "allgather"}
# (model, precision, layout, pp_rank, document_masking) of saved_bytes: its parts on each kind of rank
SAVED_CASES = [
    ("dense", "32-true", {}, 0, False),
    ("dense", "bf16-mixed", dict(TP2, sequence_parallel=False), 0, False),
    ("dense", "bf16-mixed", dict(TP2_SP, activation_checkpointing="full"), 0, True),
    ("dense", "16-mixed", dict(TP2_SP, activation_checkpointing="selective"), 0, False),
    ("dense", "bf16-mixed", dict(TP2_SP, activation_checkpointing="selective"), 0, False),
    ("dense", "32-true", {"pipeline_parallel_size": 2}, 0, False),
    ("dense", "32-true", {"pipeline_parallel_size": 2, "activation_checkpointing": "full"}, 1, False),
    ("dense", "bf16-mixed", ALLGATHER, 0, False),
    ("dense", "bf16-mixed", dict(ALLGATHER, activation_checkpointing="full"), 0, False),
    ("dense", "bf16-mixed", dict(TP2_SP, float8="tensorwise"), 0, False),
    ("moe-mixed", "bf16-mixed", TP2_SP, 0, False),
    ("moe-mixed", "bf16-mixed", dict(TP2_SP, activation_checkpointing="selective"), 0, False),
    ("moe-mixed", "32-true", {"activation_checkpointing": "full"}, 0, False),
    ("moe-all", "32-true", {"activation_checkpointing": "full"}, 0, False),
    ("moe-all", "32-true", {}, 0, False),
]


@pytest.mark.parametrize("model, precision, layout, pp_rank, masking", SAVED_CASES)
def test_saved_bytes_parts_are_the_named_tensors(model, precision, layout, pp_rank, masking):
    """``saved_bytes`` (``b`` = 3, ``s`` = 64; ``s'`` = s/cp, /t under sp), by part: the layers' (``layer_saved``
    each, + float8's tp inputs; an MoE layer's with its feed-forward; under full checkpointing each layer's input
    ``[b, s', h]`` only; under selective the dense layers' kept parts and the MoE layers' whole sets), the
    embedding's int64 token ids ``[b, s]`` (first stage), the float32 cos and sin ``[s, d/2]`` (or document masking's
    inputs), the head's norm input and the head's input ``[b, s', h]``, the loss' logits ``[b, s, V/t]`` (compute
    dtype) with a float32 and an int64 ``[b, s]`` (last stage), the all-gather cp extra per layer (kept, or made
    again in the recompute under checkpointing), ``16-mixed``'s weight copies (the autocast test above) and the
    recompute (the largest layer's whole saved set under full checkpointing, the selective recompute under
    selective). Every part an ``int``; ``saved_per_layer`` their layers' mean."""
    cfg = SAVED_MODELS[model]()
    pc = ParallelConfig(data_parallel_size=1, **layout)
    dt = Dtypes.of(precision)
    b, seq = 3, 64
    s = seq // pc.cp
    tp, sp, h, c, r = pc.tp, pc.sp, cfg.hidden_size, dt.compute, dt.residual
    s_sp = s // tp if sp else s
    n, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    n_moe = {"dense": 0, "moe-mixed": n // 2, "moe-all": n}[model]
    got = saved_bytes(cfg, pc, dt, b, seq, pp_rank, 1.0, **({"document_masking": True} if masking else {}))
    for value in got.values():
        assert type(value) is int, got
    dense = layer_saved(cfg, dt, b, s, tp, sp) + float8_tensor_parallel_saved(cfg, pc, c, b, s)
    moe = layer_saved(cfg, dt, b, s, tp, sp, (1, 1.0))
    if pc.float8:  # float8 saves its inputs in 1 byte: fewer bytes than the layer's
        assert float8_tensor_parallel_saved(cfg, pc, c, b, s) < 0
    if model == "moe-all":
        assert dense > moe  # the dense width is not a layer's: the MoE layer's set is the largest
    kv = extra_saved_bytes(cfg, pc, dt, b, seq)
    largest = max(dense if n > n_moe else 0, moe if n_moe else 0)
    if pc.activation_checkpointing == "full":
        layers, recompute = n * nbytes(r, b, s_sp, h), largest + kv
    elif pc.activation_checkpointing == "selective":
        kept = layer_selective_parts(cfg, dt, b, s, tp, sp, selective_attention_tokens(pc, s, seq))
        layers = (n - n_moe) * sum(kept.values()) + n_moe * moe
        recompute = layer_selective_recompute(cfg, dt, b, s, tp, sp)
    else:
        layers, recompute = (n - n_moe) * dense + n_moe * moe, 0
    weights, recast = _autocast_expected(cfg, pc, pp_rank) if dt.autocast else (0, 0)
    rope = document_masking_inputs(cfg, pc, dt, b, s) if masking else 2 * nbytes(4, s, cfg.head_dim // 2)
    if masking:
        assert rope != 2 * nbytes(4, s, cfg.head_dim // 2)
    assert norm_input_saved(r, b, s_sp, h) == nbytes(r, b, s_sp, h) + nbytes(4, b, s_sp, 1)
    head = norm_input_saved(r, b, s_sp, h) + nbytes(c, b, s_sp, h)
    loss = nbytes(c, b, s, cfg.padded_vocab_size // tp) + nbytes(4, b, s) + nbytes(8, b, s)
    assert got == {
        "layers": layers,
        "embedding": nbytes(8, b, s) if first else 0,
        "rope": rope,
        "head": head if last else 0,
        "loss": loss if last else 0,
        "compute_weights": weights,
        "context_parallel_kv": n * kv if pc.activation_checkpointing == "none" else 0,
        "recompute": recompute + recast,
    }
    assert saved_per_layer(got, n) == (got["layers"] + got["context_parallel_kv"]) / n
    assert saved_per_layer(got, 0) == got["layers"] + got["context_parallel_kv"]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dt", [F32, BF16_MIXED])
def test_document_masking_inputs_are_the_named_tensors(cp, dt):
    """Document masking's shared inputs (``document_masking_inputs``' docstring, ``s`` this rank's tokens): float32
    cos and sin ``[b, s, d/2]``, + without cp the additive mask ``[b, 1, s, s]`` (compute dtype), under cp the whole
    sequence's int64 document ids ``[b, s·cp]``."""
    b, s = 3, 40
    pc = SimpleNamespace(cp=cp)
    mask = nbytes(dt.compute, b, 1, s, s) if cp == 1 else nbytes(8, b, s * cp)
    exact(document_masking_inputs(CFG, pc, dt, b, s), 2 * nbytes(4, b, s, CFG.head_dim // 2) + mask)


def _cast_matrices(cfg: LlamaConfig, tp: int, layers: list[int], last: bool, ep: int = 1) -> int:
    """Bytes of autocast's bfloat16 copies of the matrices a rank multiplies with: every weight matrix of decoder
    layers ``layers`` (an MoE layer's router and its ``1/ep`` of the experts' ``[E, ., .]`` tensors) and (``last``)
    the head's (tied: the embedding's tensor, which the head multiplies with), each a local shard of ``1/tp`` of its
    elements; the embedding's lookup casts nothing. From the real module's parameters (built on the meta device)."""
    model = meta_model(cfg)
    mine = tuple(f"layers.{i}." for i in layers) + (("output.",) if last else ())
    params = model.named_parameters(remove_duplicate=False)  # tied: ``output.weight`` is the embedding's tensor
    return sum(
        nbytes(2, p.numel() // tp // (ep if ".experts." in name else 1))
        for name, p in params
        if p.dim() >= 2 and name.startswith(mine)
    )


# (tp, pp, schedule, pp_rank): a V schedule's rank 0 holds the first and the last stage (tied: one tensor)
AUTOCAST_RANKS = [
    (1, 1, "1f1b", 0),
    (2, 1, "1f1b", 0),
    (1, 2, "1f1b", 0),
    (2, 2, "1f1b", 1),
    (2, 2, "interleaved_1f1b", 1),
    (1, 2, "zbv", 0),
    (2, 2, "zbv", 1),
]
#: with each activation checkpointing a schedule takes (a zero-bubble one refuses "selective")
AUTOCAST_CASES = [
    (*r, ac) for r in AUTOCAST_RANKS for ac in ("none", "full", "selective") if (ac, r[2]) != ("selective", "zbv")
]


def _autocast_expected(cfg, pc: ParallelConfig, pp_rank: int, ep: int = 1) -> tuple[int, int]:
    """(``compute_weights``, ``recompute``'s added copies) of pp rank ``pp_rank`` (see the test below)."""
    layers = rank_layers(cfg.num_layers, pc, pp_rank)
    n_layers, _, last = rank_layout(cfg.num_layers, pc, pp_rank)
    assert n_layers == len(layers) and n_layers > 0
    head = _cast_matrices(cfg, pc.tp, [], last)
    in_layers = _cast_matrices(cfg, pc.tp, layers, False, ep)
    if pc.activation_checkpointing == "none":
        return head + in_layers, 0
    return head, in_layers // n_layers


@pytest.mark.parametrize("tp, pp, schedule, pp_rank, ac", AUTOCAST_CASES)
@pytest.mark.parametrize("tied", [False, True])
def test_autocast_weight_copies_are_the_cast_matrices(tp, pp, schedule, pp_rank, ac, tied):
    """``16-mixed`` (Lightning's autocast over float32 parameters): the bfloat16 copies of the rank's matrices
    (``_add_autocast_copies``' docstring: every local matrix but the embedding, the tied head too) are saved with
    the micro-batch; under activation checkpointing the decoder layers' copies are made again in their recompute
    (one layer's, beside what the recompute holds already) and only the head's stay saved. ``saved_bytes`` adds
    them under ``16-mixed`` only."""
    cfg = dataclasses.replace(TINY, num_layers=4, tie_word_embeddings=tied)
    pc = ParallelConfig(
        data_parallel_size=1,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_schedule=schedule,
        activation_checkpointing=ac,
    )
    _check_autocast_copies(cfg, pc, pp_rank)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("ep", [1, 2])
def test_autocast_weight_copies_of_moe_layers(ac, ep):
    """As above for tiny-moe (every layer MoE: a router ``[E, h]`` and three ``[E, f_e, h]`` expert tensors) at
    dp2 with ``ep`` = 1 or 2: a rank casts its ``E/ep`` experts."""
    cfg = LlamaConfig.from_preset("tiny-moe")
    pc = ParallelConfig(data_parallel_size=2, expert_parallel_size=ep, activation_checkpointing=ac)
    _check_autocast_copies(cfg, pc, 0, ep)


def _check_autocast_copies(cfg, pc: ParallelConfig, pp_rank: int, ep: int = 1) -> None:
    weights, recompute = _autocast_expected(cfg, pc, pp_rank, ep)
    layers = rank_layers(cfg.num_layers, pc, pp_rank)
    _, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    out = {"compute_weights": 0, "recompute": 7}
    _add_autocast_copies(out, as_held(cfg, pc), pc, layers, first, last)
    exact(out["compute_weights"], weights)
    exact(out["recompute"], 7 + recompute)
    exact(saved_bytes(cfg, pc, F16_MIXED, 2, 32, pp_rank, 1.0)["compute_weights"], weights)
    exact(saved_bytes(cfg, pc, BF16_MIXED, 2, 32, pp_rank, 1.0)["compute_weights"], 0)


def _root(vocab: int, h: int, tied: bool) -> list:
    """The root unit's parameters: the embedding ``[V, h]``, the final norm ``[h]`` and, untied, the head ``[V, h]``."""
    params = [(Param(vocab, h, True, "root", "embedding"), 1), (Param(h, 1, False, "root"), 1)]
    return params + ([] if tied else [(Param(vocab, h, True, "root", "head"), 1)])


def rank0_shard(params: list, world: int) -> int:
    """Elements of rank 0's ``torch.chunk`` of each root parameter's dim 0 (FSDP2's shard) over ``world`` ranks."""
    return sum(torch.chunk(torch.empty(p.rows, p.cols, device="meta"), world)[0].numel() for p, _ in params)


@pytest.mark.parametrize("dt", [F32, BF16_MIXED, F16_MIXED, BF16_TRUE])
@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_buffers_pipeline_and_zero2(dt, tied):
    """FSDP2's buffers (``_fsdp_buffers``' docstring) for a rank of units ``(layer 1,000 padded elements, its shard 250,
    all layers 3,000, root 7,000)``: under pp every parameter gathered (compute dtype under mixed precision) at both
    moments, every unsharded gradient (float32 under mixed precision) held; at ZeRO 2 every parameter gathered at the
    start, the root and one layer at the end, the root's and two layers' unsharded gradients (compute dtype + their
    float32 copy under mixed precision, else the parameters' dtype)."""
    units = (1_000, 250, 3_000, 7_000)
    gather = dt.compute if dt.master else dt.param
    params = _root(30, 12, tied)
    pp = SimpleNamespace(pp=2, zero_stage=3, zero_shard=4, ep=1, tp=1)
    everything = 7_000 * gather + 3_000 * gather
    got = _fsdp_buffers(pp, dt, params, units, 4, 77, tied)
    assert got == (everything, everything, 10_000 * (4 if dt.master else dt.param))
    assert all(type(v) is int for v in got)
    zero2 = SimpleNamespace(pp=1, zero_stage=2, zero_shard=4, ep=1, tp=1)
    unsharded = dt.compute + 4 if dt.master else dt.param
    got = _fsdp_buffers(zero2, dt, params, units, 1, 77, tied)
    assert got == (everything, 7_000 * gather + 1_000 * gather, (7_000 + 2 * 1_000) * unsharded)
    assert all(type(v) is int for v in got)


@pytest.mark.parametrize("dt", [F32, BF16_MIXED, F16_MIXED, BF16_TRUE])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("layer_numel", [20, 2_000])
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_buffers_zero3_moments(dt, tied, m, layer_numel, world):
    """ZeRO 3 without pp (``_zero3_backward_end``'s docstring; reduce dtype ``R``: float32 under mixed precision, else
    the parameters'; ``G``: the all-gather dtype): at the start the root and two layer units gathered; at the end the
    larger of (a) the first layer's backward: gathered root + two layers, the previous layer's reduce-scatter input
    ``layer·R``, the head's gradient, less the gradient shards not made yet (the first layer's, the root's: not made
    before the last micro-batch only at m = 1) and (b) the embedding's backward: gathered root, the reduce-scatter
    input, the root's unsharded gradients (compute dtype under mixed precision; tied: + the head's gradient and the
    sum, ``2·head``), less the root's shard. The root: embedding ``[31, 12]``, norm ``[12]``, head ``[31, 12]``
    (untied) sharded over 2 or 4 ranks by ``torch.chunk`` (rank 0's piece the largest: 16 of 31 rows over 2); a
    small layer (20 elements) gives moment (b), a large one (a). Without master weights (``16-mixed``'s float32
    parameters, ``bf16-true``) FSDP2 gathers and reduces in the parameters' dtype."""
    head_grad = 31 * 12 * dt.compute
    R = 4 if dt.master else dt.param
    G = dt.compute if dt.master else dt.param
    params = _root(31, 12, tied)
    root_numel = sum(p.numel for p, _ in params)
    units = (layer_numel, layer_numel // world, 5 * layer_numel, root_numel)
    pc = SimpleNamespace(pp=1, zero_stage=3, zero_shard=world, ep=1, tp=1)
    root_shard, layer_shard = (rank0_shard(params, world), layer_numel // world) if m == 1 else (0, 0)
    root_grads = root_numel * G + (2 * head_grad if tied else 0)
    start = root_numel * G + 2 * layer_numel * G
    a_buffers = layer_numel * R + head_grad - (layer_shard + root_shard) * R
    b_buffers = layer_numel * R + root_grads - root_shard * R
    if 2 * layer_numel * G + head_grad - layer_shard * R >= root_grads:
        want = (start, start, a_buffers)
    else:
        want = (start, root_numel * G, b_buffers)
    got = _fsdp_buffers(pc, dt, params, units, m, head_grad, tied)
    assert got == want
    assert all(type(v) is int for v in got)


def test_zero3_backward_end_tie_takes_the_first_layer():
    """At a tie of the two moments' changing parts (2·layer + head − layer shard = the root's gradients) moment (a)
    is taken: gathered root + 2 layers (100 + 2·40), buffers 16·4 + 10 − 3·4 − 2·4 = 54 (bf16-mixed: R = 4)."""
    got = _zero3_backward_end(BF16_MIXED, 100, 40, (16, 3, 2), 2 * 40 + 10 - 3 * 4, 10)
    assert got == (180, 16 * 4 - 2 * 4 + 10 - 3 * 4)
    got = _zero3_backward_end(BF16_MIXED, 100, 40, (16, 3, 2), 2 * 40 + 10 - 3 * 4 + 1, 10)
    assert got == (100, 16 * 4 - 2 * 4 + 79)


def _real_numels() -> tuple[int, int, int]:
    """(one decoder layer's, all parameters', the head's) elements of tiny-test, counted on the real module."""
    model = meta_model(TINY)
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
    return layer, sum(p.numel() for p in model.parameters()), model.output.weight.numel()


def _terms(precision: str, m: int = 1, b: int = 2, s: int = 64, **layout) -> tuple:
    """``buffer_terms`` of pp rank 0 of tiny-test on CPU, with the layout's ``Dtypes`` and ``ModelStates``."""
    pc = ParallelConfig(**layout)
    dt = Dtypes.of(precision)
    states = model_state_bytes(TINY, pc, precision, pp_rank=0, dp_cp_rank=0)
    return buffer_terms(Workload(TINY, b, s, precision, num_microbatches=m), pc, dt, 0, states, "cpu"), pc, dt, states


#: layouts of one rank (ZeRO 0) that each need gradient buckets for one reason alone: master weights, tp, a pipeline,
#: the optimizer's host copies; and the one that needs none
BUCKET_REASONS = [
    ("bf16-mixed", {}),
    ("32-true", {"tensor_parallel_size": 2}),
    ("32-true", {"pipeline_parallel_size": 2}),
    ("32-true", {"optimizer_offload": True, "zero_stage": 1}),
]


@pytest.mark.parametrize("precision, layout", BUCKET_REASONS + [("32-true", {}), ("bf16-true", {})])
def test_gradient_terms_with_and_without_buckets(precision, layout):
    """ZeRO 0 (optimizer offload: 1) on one rank (``Buffers``' fields; ``partition.gradient_buckets_needed``): with a
    reason for buckets (master weights, tp, pp, optimizer offload) no ``.grad`` is kept beside the backward ops; with
    none, nothing waits for a bucket (``gradient_buffers`` = ``first_bucket`` = 0) and autograd's ``.grad`` stays: the
    head's ``[V, h]`` and the final norm's ``[h]`` (``head_gradient_kept``), ``w2``'s ``[h, f/t]``
    (``kept_weight_gradient``), all in the parameters' dtype; a layer's gradient its share of the rank's gradients,
    ``gradients · layer / all`` (element counts of the real module), when no gradient is resident before backward (one
    micro-batch, no pipeline); ZeRO 0/1 gathers nothing (``gathered_*`` = 0); no ZeRO 3 root terms."""
    buf, pc, dt, states = _terms(precision, **{"zero_stage": 0, **layout}, data_parallel_size=1)
    layer, total, head = _real_numels()
    h, f = TINY.hidden_size, TINY.intermediate_size
    bucketed = (precision, layout) in BUCKET_REASONS
    assert (buf.gathered_start, buf.gathered_end, buf.gathered_loss, buf.root_regather) == (0, 0, 0, 0)
    assert buf.forward_gradients == 0
    exact(buf.head_gradient, nbytes(dt.param, head // pc.tp) if pc.pp == 1 else 0)  # pp: rank 0 holds no head
    if bucketed:
        assert (buf.head_gradient_kept, buf.kept_weight_gradient) == (0, 0)
        assert buf.gradient_buffers > 0
    else:
        exact(buf.head_gradient_kept, nbytes(dt.param, head) + nbytes(dt.param, h))
        exact(buf.kept_weight_gradient, nbytes(dt.param, h, f))
        assert (buf.gradient_buffers, buf.first_bucket) == (0, 0)
    if pc.pp == 1 and pc.tp == 1:  # (tp: the shares of tp-local elements, not counted here)
        exact(buf.layer_gradient, states.gradients * layer // total)
    elif pc.pp > 1:  # a pipeline's buckets exist from the first micro-batch's backward on
        assert (buf.layer_gradient, buf.resident_gradients) == (0, states.gradients)
    exact(buf.recompute_backward, 0)
    assert buf.recompute_apart_from_cp is False


@pytest.mark.parametrize("ac, offload", [("none", 0), ("full", 0), ("selective", 0), ("none", 1), ("none", 2)])
@pytest.mark.parametrize("b, s", [(1, 16), (4, 256)])
def test_gradient_terms_offloaded_whole(ac, offload, b, s):
    """One rank, ``32-true``, no buckets, ``activation_offload_layers`` of tiny-test's 2 layers: offloaded whole (2),
    the head's kept gradient also holds the later layer's gradients less what bringing the saved tensors back adds at
    the other moment (``unpacked_bytes``; ``_later_layers_gradients``: layer 1's elements, counted on the real
    module), at least 0 (the larger of the two moments); small b·s: the later layer's gradients are larger. The
    recompute phase's first backward ops (``recompute_backward``) of an offloaded layer (with ``w2``'s ``.grad``
    kept), apart from the cp transients only under checkpointing without a stage offloaded whole."""
    buf, pc, dt, _ = _terms(
        "32-true",
        b=b,
        s=s,
        data_parallel_size=1,
        activation_checkpointing=ac,
        **({"activation_offload_layers": offload} if offload else {}),
    )
    layer, _, head = _real_numels()
    whole = offload == 2
    later = nbytes(dt.param, layer) if whole else 0
    unpacked = unpacked_bytes(TINY, pc, dt, b, s) if whole else 0
    if whole:
        assert unpacked > 0
    kept = nbytes(dt.param, head) + nbytes(dt.param, TINY.hidden_size) + max(0, later - unpacked)
    exact(buf.head_gradient_kept, kept)
    if whole or ac != "none":
        exact(buf.recompute_backward, recompute_backward(TINY, pc, dt, b, s, whole, gradients_kept=True))
        assert buf.recompute_backward > recompute_backward(TINY, pc, dt, b, s, whole)
    else:
        exact(buf.recompute_backward, 0)
    assert buf.recompute_apart_from_cp is (ac != "none" and not whole)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gradient_terms_by_zero_stage(zero, pp, m, tied, precision):
    """dp2 ``bf16-mixed`` and ``16-mixed`` (``Buffers``' fields): the head's gradient ``[V, h]`` (untied: the head's;
    tied: the embedding's), in the compute dtype at ZeRO 2/3 with master weights (FSDP2's ``MixedPrecisionPolicy``),
    else the parameters' (``16-mixed``: float32); ZeRO
    2/3 without pp keeps the previous step's gradient shards through forward (``forward_gradients``); ZeRO 3 without
    pp: nothing gathered while the loss runs and the root's all-gather output ``[root elements]`` (compute dtype) beside
    it when the head's backward gathers the root again (``root_regather``; the parameters' dtype without master
    weights); else ``gathered_loss`` =
    ``gathered_start``. Under pp a tied head is held untied (its own ``[V, h]``)."""
    cfg = LlamaConfig.from_preset("tiny-test", tie_word_embeddings=tied) if tied else TINY
    pc = ParallelConfig(data_parallel_size=2, zero_stage=zero, pipeline_parallel_size=pp)
    dt = Dtypes.of(precision)
    G = dt.compute if dt.master else dt.param
    states = model_state_bytes(cfg, pc, precision, pp_rank=pp - 1, dp_cp_rank=0)
    buf = buffer_terms(Workload(cfg, 2, 64, precision, num_microbatches=m * pp), pc, dt, pp - 1, states, "cpu")
    model = meta_model(cfg)
    head = model.tok_embeddings.weight.numel()
    exact(buf.head_gradient, nbytes(G if zero >= 2 else dt.param, head))
    exact(buf.forward_gradients, states.gradients if zero >= 2 and pp == 1 else 0)
    # the root unit without pp: the embedding, the final norm and, untied, the head
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    if zero == 3 and pp == 1:
        exact(buf.gathered_loss, 0)
        exact(buf.root_regather, nbytes(G, root))
    else:
        exact(buf.gathered_loss, buf.gathered_start)
        exact(buf.root_regather, 0)
    if zero <= 1:
        assert (buf.gathered_start, buf.gathered_end) == (0, 0)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "16-mixed"])
def test_feature_terms_float8_gathered_forward(zero, pp, precision):
    """FSDP2's float8 all-gather (``"tensorwise"`` at ZeRO 2/3, ``_feature_terms``' ``gathered_forward``): the gathered
    parameters in a layer's forward (``gathered_start``) less ``G − 1`` bytes on each converted weight element
    (tiny-test's seven linears: a layer's elements less its two norms ``[h]``, counted on the real module; ``G`` the
    all-gather dtype: ``MixedPrecisionPolicy``'s compute dtype with master weights, else the parameters': float32
    under ``16-mixed``) of each gathered layer unit: at ZeRO 3 without pp the layer in forward and the prefetched one
    (2), else every layer of the rank (tiny-test with 4 layers: 4, or 2 of them under pp2)."""
    cfg = LlamaConfig.from_preset("tiny-test", num_layers=4)
    pc = ParallelConfig(data_parallel_size=2, zero_stage=zero, pipeline_parallel_size=pp, float8="tensorwise")
    dt = Dtypes.of(precision)
    states = model_state_bytes(cfg, pc, precision, pp_rank=0, dp_cp_rank=0)
    buf = buffer_terms(Workload(cfg, 2, 64, precision, num_microbatches=pp), pc, dt, 0, states, "cpu")
    layer, _, _ = _real_numels()
    units = 2 if zero == 3 and pp == 1 else cfg.num_layers // pp
    G = dt.compute if dt.master else dt.param
    exact(buf.gathered_forward, buf.gathered_start - units * (G - 1) * (layer - 2 * TINY.hidden_size))
    assert buf.gathered_start > 0
    # float8's cast transients (planning/float8_costs.py, measured there) are the buffers' fields
    exact(buf.float8_forward, float8_forward_transient(cfg, pc, 2, 64))
    exact(buf.float8_backward, float8_backward_transient(cfg, pc, 2, 64))
    assert buf.float8_forward > 0 and buf.float8_backward > 0


LAYOUTS = [
    dict(tensor_parallel_size=2, zero_stage=1),
    dict(tensor_parallel_size=2, sequence_parallel=False),
    dict(pipeline_parallel_size=2, zero_stage=3),
    dict(context_parallel_size=2, zero_stage=2, activation_checkpointing="full"),
    dict(data_parallel_size=2, zero_stage=3, activation_checkpointing="selective"),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1),  # sp: the head's transient on rank 1 only
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pp_rank", [0, 1])
def test_feature_terms_vocabulary_and_every_field_an_int(layout, pp_rank):
    """Every :class:`Buffers` field is a whole number of bytes (an ``int``; ``recompute_apart_from_cp`` a ``bool``),
    and the vocabulary terms (``_feature_terms``), ``V_t = V/t``: the loss' forward chunk on the last stage, float32
    ``[min(b·s/cp, loss_chunk_tokens(V_t)), V_t]``; under tp the embedding's whole-vocabulary gradient ``[V, h]``
    (compute dtype) on the first stage; under sp the head's backward transient on the last stage, 0 elsewhere."""
    from dataclasses import fields

    from lightning_4d.features.tensor_parallel.costs import head_backward_transient
    from lightning_4d.partition import loss_chunk_tokens

    layout = {"data_parallel_size": 1, **layout}
    pc = ParallelConfig(**layout)
    if pp_rank >= pc.pp:
        pp_rank = 0
    dt, b, s = BF16_MIXED, 2, 64
    states = model_state_bytes(TINY, pc, "bf16-mixed", pp_rank=pp_rank, dp_cp_rank=0)
    buf = buffer_terms(Workload(TINY, b, s, num_microbatches=pc.pp), pc, dt, pp_rank, states, "cpu")
    for field in fields(buf):
        assert type(getattr(buf, field.name)) is (bool if field.name == "recompute_apart_from_cp" else int), field.name
    first, last = pp_rank == 0, pp_rank == pc.pp - 1
    V, h, t = TINY.padded_vocab_size, TINY.hidden_size, pc.tp
    chunk = min(b * (s // pc.cp), loss_chunk_tokens(V // t))
    exact(buf.loss_forward, nbytes(4, chunk, V // t) if last else 0)
    exact(buf.embedding_gradient, nbytes(dt.compute, V, h) if t > 1 and first else 0)
    exact(buf.head_backward, head_backward_transient(TINY, pc, dt, b, s) if last else 0)
    if pc.sp and last:
        assert buf.head_backward > 0


@pytest.mark.parametrize("compression", ["none", "bf16", "powersgd"])
def test_bucket_buffers_largest_gradient_and_wire_copy(compression):
    """ZeRO 0 over dp2 (``_bucket_buffers``): the largest parameter's fresh gradient (tiny-test's ``[V, h]``, the
    largest tensor of the real module, in the parameters' dtype) until the hook adds it into its bucket, + with
    ``"bf16"`` compression every bucket's bfloat16 copy (2 bytes per gradient element: ``gradients / grad · 2``), with
    ``"powersgd"`` one bucket's float32 M (gradient + error), approximation and new error (a bucket: at most
    ``GRADIENT_BUCKET_BYTES`` of parameters, or the largest parameter alone)."""
    pc = ParallelConfig(data_parallel_size=2, gradient_compression=compression)
    dt = BF16_MIXED
    states = model_state_bytes(TINY, pc, "bf16-mixed", pp_rank=0, dp_cp_rank=0)
    buf = buffer_terms(Workload(TINY, 2, 64, num_microbatches=1), pc, dt, 0, states, "cpu")
    largest = max(p.numel() for p in meta_model(TINY).parameters())
    wire = states.gradients // dt.grad * 2 if compression == "bf16" else 0
    if compression == "powersgd":  # one bucket's float32 M, approximation and error: all gradient elements here
        wire = 3 * nbytes(4, max(min(GRADIENT_BUCKET_BYTES // dt.setup, states.gradients // dt.grad), largest))
    exact(buf.gradient_buffers, nbytes(dt.param, largest) + wire)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (2, False)])
@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_masked_ring_phase_sums_the_named_tensors(ac, tp, sp, method):
    """Document masking under the cp ring or all-to-all on CPU with the ``"eager"`` backend (explicit matmuls:
    ``_eager``), cp2, ``L = s/cp``, ``L' = L/t`` under sp (``masked_ring_phase``): the ring's or all-to-all's masked
    backward (``ring_masked_backward``, ``alltoall_masked_backward``, each 0 for the other method; explicit matmuls) +
    the layer's output gradient ``[b, L', h]`` (residual dtype) and the attention output's ``[b, L, a/t·d]`` (compute
    dtype) − what the feed-forward's backward freed (the ffn norm's input ``[b, L', h]`` and float32 rsqrt ``[b, L']``,
    ``w1``/``w3``'s input: ``[b, L', h]`` under sp, else ``[b, L, h]``, the SwiGLU tensors 4·``[b, L, f/t]``) − the
    layer transients ``cp`` − under full checkpointing the layer's input ``[b, L', h]`` the checkpoint holds."""
    from lightning_4d.features.context_parallel.costs import alltoall_masked_backward, ring_masked_backward
    from lightning_4d.planning.buffers import masked_ring_phase

    cfg = LlamaConfig.from_preset("tiny-test", attention_backend="eager")
    pc = ParallelConfig(
        data_parallel_size=1,
        context_parallel_size=2,
        tensor_parallel_size=tp,
        sequence_parallel=sp,
        activation_checkpointing=ac,
        context_parallel_method=method,
    )
    dt, b, s, transients = BF16_MIXED, 2, 128, 1_000
    L, h, f, c, r = s // 2, cfg.hidden_size, cfg.intermediate_size, dt.compute, dt.residual
    Lsp = L // tp if pc.sp else L
    work = Workload(cfg, b, s, document_masking=True, document_tokens=32)
    core = ring_masked_backward(cfg, pc, dt, b, s, True) + alltoall_masked_backward(cfg, pc, dt, b, s, True)
    assert core != ring_masked_backward(cfg, pc, dt, b, s, False) + alltoall_masked_backward(cfg, pc, dt, b, s, False)
    gradients = nbytes(r, b, Lsp, h) + nbytes(c, b, L, cfg.num_heads // tp * cfg.head_dim)
    freed = nbytes(r, b, Lsp, h) + nbytes(4, b, Lsp) + nbytes(c, b, Lsp, h) + 4 * nbytes(c, b, L, f // tp)
    kept = nbytes(r, b, Lsp, h) if ac == "full" else 0
    want = core + gradients - freed - transients - kept
    exact(masked_ring_phase(cfg, pc, dt, work, "cpu", transients), want)
    exact(masked_ring_phase(cfg, pc, dt, work, "cuda", transients), want)  # masked blocks: explicit matmuls on CUDA


def test_eager_follows_the_explicit_matmul_rule():
    """``_eager``'s rule (the runtime's ``_use_eager``): the ``"eager"`` backend always runs explicit matmuls; off CPU
    a masked block (default: ``masked``, as the masked ring asks) or a float32 one does; on CPU the fused kernel takes
    the rest. A config without ``attention_backend`` is ``"sdpa"``."""
    from lightning_4d.planning.buffers import _eager

    eager, sdpa, bare = SimpleNamespace(attention_backend="eager"), SimpleNamespace(attention_backend="sdpa"), object()
    for device in ("cpu", "cuda"):
        for masked in (False, True):
            for float32 in (False, True):
                assert _eager(eager, device, masked, float32) is True
                want = device != "cpu" and (masked or float32)
                assert _eager(sdpa, device, masked, float32) is want
                assert _eager(bare, device, masked, float32) is want
    assert (_eager(sdpa, "cuda"), _eager(sdpa, "cpu"), _eager(eager, "cpu")) == (True, False, True)
    assert _eager(sdpa, "cuda", masked=False) is False


@pytest.mark.parametrize(
    "device, backend, precision",
    [
        ("cpu", "sdpa", "32-true"),
        ("cpu", "sdpa", "bf16-mixed"),
        ("cpu", "eager", "bf16-mixed"),
        ("cuda", "sdpa", "bf16-mixed"),
        ("cuda", "sdpa", "32-true"),
    ],
)
@pytest.mark.parametrize("documents", [None, 32, 0])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (2, False)])
@pytest.mark.parametrize("last", [False, True])
def test_allgather_phase_sums_the_named_tensors(device, backend, precision, documents, tp, sp, last):
    """The cp ``"allgather"`` method, cp2, ``L = s/cp``, ``L' = L/t`` under sp (``allgather_phase``): its backward
    (``allgather_backward``, explicit matmuls by ``_eager``'s rule for a masked or float32 block; with document
    masking the documents' length: ``documents``, 0 unknown, None no masking; NCCL off CPU) − ``wo``'s input, freed
    before (``[b, L, a/t·d]``, compute dtype) − on the last stage what the head's backward freed (its norm's input
    ``[b, L', h]`` and float32 rsqrt ``[b, L']``, its input ``[b, L', h]`` compute), then the masked ring's sum with
    no cp transients (output gradients ``[b, L', h]`` + ``[b, L, a/t·d]``, − the feed-forward's freed set)."""
    from lightning_4d.features.context_parallel.costs import allgather_backward
    from lightning_4d.planning.buffers import allgather_phase

    cfg = LlamaConfig.from_preset("tiny-test", attention_backend=backend)
    pc = ParallelConfig(
        data_parallel_size=1,
        context_parallel_size=2,
        tensor_parallel_size=tp,
        sequence_parallel=sp,
        context_parallel_method="allgather",
    )
    dt, b, s = Dtypes.of(precision), 2, 128
    L, h, f, c, r = s // 2, cfg.hidden_size, cfg.intermediate_size, dt.compute, dt.residual
    Lsp, ad = (L // tp if pc.sp else L), cfg.num_heads // tp * cfg.head_dim
    masking = documents is not None
    work = Workload(cfg, b, s, precision, document_masking=masking, document_tokens=documents or None)
    eager = backend == "eager" or (device != "cpu" and (masking or dt.compute == 4))
    core = allgather_backward(cfg, pc, dt, b, s, eager, documents, device != "cpu")
    assert core > 0
    core -= nbytes(c, b, L, ad)
    if last:
        core -= nbytes(r, b, Lsp, h) + nbytes(4, b, Lsp) + nbytes(c, b, Lsp, h)
    freed = nbytes(r, b, Lsp, h) + nbytes(4, b, Lsp) + nbytes(c, b, Lsp, h) + 4 * nbytes(c, b, L, f // tp)
    want = core + nbytes(r, b, Lsp, h) + nbytes(c, b, L, ad) - freed
    exact(allgather_phase(cfg, pc, dt, work, device, last), want)
    if not masking:  # the phase reads the documents' length only under document masking
        other = Workload(cfg, b, s, precision, document_tokens=16)
        exact(allgather_phase(cfg, pc, dt, other, device, last), want)


def test_attention_phases_are_zero_for_the_other_methods():
    """``masked_ring_phase`` is 0 without cp and for ``"allgather"``; ``allgather_phase`` 0 without cp and for the
    ring and all-to-all (their masked backward is ``masked_ring_phase``'s)."""
    from lightning_4d.planning.buffers import allgather_phase, masked_ring_phase

    work = Workload(TINY, 2, 128, "32-true", document_masking=True, document_tokens=32)
    for cp, method in [(1, "ring"), (2, "ring"), (2, "alltoall"), (1, "allgather")]:
        pc = ParallelConfig(data_parallel_size=1, context_parallel_size=cp, context_parallel_method=method)
        for device in ("cpu", "cuda"):
            exact(allgather_phase(TINY, pc, F32, work, device, True), 0)
    for cp, method in [(1, "ring"), (2, "allgather")]:
        pc = ParallelConfig(data_parallel_size=1, context_parallel_size=cp, context_parallel_method=method)
        exact(masked_ring_phase(TINY, pc, F32, work, "cuda", 0), 0)


def test_zero3_tied_root_gradients_and_fsdp_buckets():
    """ZeRO 3, dp2, one micro-batch, ``bf16-mixed``, tiny-test with a tied 4,096-token vocabulary (elements counted on
    the real module): the embedding's backward is the later moment (``_zero3_backward_end`` (b)): the gathered root
    ``[root]`` (compute dtype) at the end of backward, beside the previous layer's float32 reduce-scatter input
    ``[layer]``, the root's unsharded gradients ``[root]`` (compute dtype) and, tied, the head's gradient and the sum
    (``2·[V, h]``), less the root's float32 gradient shard not made yet (rank 0's ``torch.chunk`` of each root
    tensor). One rank at ZeRO 2 and 3 (FSDP2, ``32-true``): no ``.grad`` kept beside the backward ops."""
    cfg = LlamaConfig.from_preset("tiny-test", vocab_size=4096, tie_word_embeddings=True)
    pc = ParallelConfig(data_parallel_size=2, zero_stage=3)
    dt = BF16_MIXED
    states = model_state_bytes(cfg, pc, "bf16-mixed", pp_rank=0, dp_cp_rank=0)
    buf = buffer_terms(Workload(cfg, 2, 64, num_microbatches=1), pc, dt, 0, states, "cpu")
    model = meta_model(cfg)
    root_tensors = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    root = sum(p.numel() for p in root_tensors)
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
    root_shard = sum(torch.chunk(p, 2)[0].numel() for p in root_tensors)
    head = nbytes(dt.compute, 4096, cfg.hidden_size)
    exact(buf.gathered_end, nbytes(dt.compute, root))
    exact(buf.gradient_buffers, nbytes(4, layer) + nbytes(dt.compute, root) + 2 * head - nbytes(4, root_shard))
    for zero in (2, 3):
        buf, _, _, _ = _terms("32-true", data_parallel_size=1, zero_stage=zero)
        assert (buf.head_gradient_kept, buf.kept_weight_gradient) == (0, 0)


def _padded_total(numel: int, world: int) -> int:
    """``numel`` elements padded to a multiple of ``world`` (a ZeRO 0/1 gradient bucket's length)."""
    return -(-numel // world) * world


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("m", [1, 2])
def test_resident_gradients_by_zero_stage_pipeline_and_accumulation(zero, pp, m):
    """Gradients alive before backward starts (``_resident_gradients``' docstring), dp2 ``bf16-mixed`` tiny-test:
    ZeRO 0/1 with a pipeline or accumulation (m > 1) and ZeRO 2/3 accumulating without a pipeline hold every
    gradient from the first backward on (the states' gradients); ZeRO 2/3 otherwise none; ZeRO 0/1 with one
    micro-batch and no pipeline only the bucket that takes the head's gradient, the first of backward: here the one
    bucket of all 106,816 elements (25 MiB holds them), padded to a multiple of the 2 ranks, in float32."""
    buf, pc, dt, states = _terms("bf16-mixed", m=m, data_parallel_size=2, zero_stage=zero, pipeline_parallel_size=pp)
    if zero <= 1 and (pp > 1 or m > 1) or zero >= 2 and pp == 1 and m > 1:
        expected = (states.gradients, 0)
        assert states.gradients > 0
    elif zero >= 2:
        expected = (0, 0)
    else:
        _, total, _ = _real_numels()
        expected = (0, nbytes(4, _padded_total(total, 2)))
    assert (buf.resident_gradients, buf.first_bucket) == expected


def test_first_bucket_holds_the_dense_parameters_only():
    """Under ep the experts' gradients have buckets of their own (``GradientBuckets``' groups): tiny-moe dp2 ep2
    ZeRO 1, one micro-batch: the first bucket holds the dense parameters (every parameter but the experts'
    ``[E, ., .]`` tensors, counted on the real module), padded to the 2 ranks, float32."""
    cfg = LlamaConfig.from_preset("tiny-moe")
    pc = ParallelConfig(data_parallel_size=2, expert_parallel_size=2, zero_stage=1)
    states = model_state_bytes(cfg, pc, "bf16-mixed", pp_rank=0, dp_cp_rank=0)
    work = Workload(cfg, 2, 64, "bf16-mixed", num_microbatches=1, expert_load_imbalance=1.0)
    buf = buffer_terms(work, pc, BF16_MIXED, 0, states, "cpu")
    model = meta_model(cfg)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    exact(buf.first_bucket, nbytes(4, _padded_total(dense, 2)))


#: (precision, layout, fused): the optimizer step's temporaries at ZeRO 0-3, fused or foreach AdamW
STEP_CASES = [
    ("32-true", {"data_parallel_size": 2, "zero_stage": 0}, False),
    ("32-true", {"data_parallel_size": 2, "zero_stage": 0}, True),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 1}, True),
    ("bf16-mixed", {"data_parallel_size": 4, "zero_stage": 1}, False),
    ("32-true", {"data_parallel_size": 1, "zero_stage": 1, "optimizer_offload": True}, True),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 0, "gradient_compression": "powersgd"}, False),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 3}, False),
]


@pytest.mark.parametrize("precision, layout, fused", STEP_CASES)
def test_step_temporaries_are_one_moment_and_one_gathered_bucket(precision, layout, fused):
    """The optimizer step's temporaries (``_step_temporaries``' docstring), tiny-test (106,816 elements, the largest
    the head's 16,384): foreach AdamW's sqrt of the second moments, one float32 moment of the elements this rank
    steps (all at ZeRO 0, its owned share at ZeRO 1, its shard at ZeRO 3: Adam's two moments are half the optimizer
    states but master weights and PowerSGD's states; none on the device with optimizer offload); fused AdamW none.
    At ZeRO 1 over more than one rank the all-gather of one bucket (here all the parameters: 25 MiB holds them) in
    the parameters' dtype, the gathered bucket and this rank's range of it: ``bucket·(1 + 1/world)``."""
    pc = ParallelConfig(**layout)
    dt = Dtypes.of(precision)
    states = model_state_bytes(TINY, pc, precision, pp_rank=0, dp_cp_rank=0)
    work = Workload(TINY, 2, 64, precision, num_microbatches=1, fused_optimizer=fused)
    buf = buffer_terms(work, pc, dt, 0, states, "cpu")
    _, total, _ = _real_numels()
    world = pc.zero_shard
    moments = states.optimizer_states - states.master_weights - states.compression
    if pc.optimizer_offload:  # the states and their step on the host: no device temporaries
        assert moments == 0
    elif pc.zero_stage == 0:
        assert moments == 2 * nbytes(4, total)
    elif pc.zero_stage == 1:  # rank 0's range of the one bucket, padded to the ranks
        assert moments == 2 * nbytes(4, _padded_total(total, world) // world)
    # ZeRO 3's moments are FSDP2's shards (torch.chunk per tensor): the states tests check them
    temporaries = 0 if fused else moments // 2
    if pc.zero_stage == 1 and world > 1:
        bucket = nbytes(dt.param, total)
        temporaries += bucket + bucket // world
    exact(buf.step_temporaries, temporaries)


#: the dim a parameter of the real module is split on under tp (column-parallel 0, row-parallel 1; norms replicated)
_TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "tok_embeddings": 0, "output": 0, "wo": 1, "w2": 1}


def _local_shapes(cfg: LlamaConfig, tp: int, layers: list[int], root: bool) -> dict[str, list[tuple[int, ...]]]:
    """The rank's local parameter shapes by FSDP2 unit (``layers.i`` or ``root``: embedding, final norm, head) of
    the real dense module (meta device), each split over ``tp`` on its tp dim."""
    model = meta_model(cfg)
    units: dict[str, list[tuple[int, ...]]] = {}
    for name, p in model.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        if (unit == "root" and not root) or (unit != "root" and int(unit.split(".")[1]) not in layers):
            continue
        shape = list(p.shape)
        dim = _TP_DIM.get(name.split(".")[-2])
        if dim is not None:
            shape[dim] //= tp
        units.setdefault(unit, []).append(tuple(shape))
    return units


@pytest.mark.parametrize("tp, world, f", [(1, 2, 128), (1, 3, 128), (2, 3, 128), (2, 4, 128), (1, 2, 99)])
def test_fsdp_units_are_padded_all_gathers_and_rank0_shards(tp, world, f):
    """``_fsdp_units`` of tiny-test with 4 layers on a rank holding them all: (the largest layer unit's all-gather
    elements, rank 0's shard of it, all layer units' all-gather elements, the root's): FSDP2 shards dim 0 of each
    local tensor with ``torch.chunk`` over ``world`` ranks and pads it to ``world`` equal pieces (the all-gather
    output); counted on the real module's local shapes (world 3: 64 rows pad to 66; ``f`` = 99: w1's and w3's rows
    are cut 50 + 49, rank 0's the larger)."""
    cfg = dataclasses.replace(TINY, num_layers=4, intermediate_size=f)
    units = _local_shapes(cfg, tp, list(range(4)), root=True)

    def padded(shapes):
        return sum(
            torch.chunk(torch.empty(s, device="meta"), world)[0].shape[0] * world * s[1:].numel()
            for s in map(torch.Size, shapes)
        )

    def shard0(shapes):
        return sum(torch.chunk(torch.empty(s, device="meta"), world)[0].numel() for s in shapes)

    layer_units = [u for name, u in units.items() if name != "root"]
    assert len(layer_units) == 4
    params = weighted_params(cfg, tp, list(range(4)), True, True)
    got = _fsdp_units(params, world, 1, tp)
    for value in got:
        assert type(value) is int
    assert got == (padded(layer_units[0]), shard0(layer_units[0]), sum(map(padded, layer_units)), padded(units["root"]))


@pytest.mark.parametrize("world, tp, experts", [(2, 1, 8), (4, 1, 8), (1, 2, 3)])
def test_fsdp_units_keep_dense_and_moe_units_apart(world, tp, experts):
    """An MoE model's dense and MoE layer units are separate FSDP2 units (tiny-moe with 4 layers, every other one
    MoE, dp ``world`` x ep 2, or 3 experts under tp2 without ep): the largest unit is the larger of the two kinds,
    the layers' total counts each kind's layers, rank 0's shard is the largest unit's (FSDP2's shard of each
    parameter over its group, ``fsdp_shard_numel``: under tp an MoE layer's over ``dp_cp_tp``, where the rank of
    dp rank 0 and tp rank 0 holds 2 of the 3 experts, tp rank 1 one)."""
    ep = 2 if tp == 1 else 1
    cfg = LlamaConfig.from_preset("tiny-moe", num_layers=4, moe_layer_interval=2, num_experts=experts)
    params = weighted_params(cfg, tp, list(range(4)), True, True, ep)
    kinds = {p.unit for p, _ in params if p.unit != "root"}
    assert len(kinds) == 2
    per_unit = {
        u: (
            sum(fsdp_padded_numel(p, world, ep, tp) for p, _ in params if p.unit == u),
            sum(fsdp_shard_numel(p, world, 0, ep, tp, 0) for p, _ in params if p.unit == u),
        )
        for u in kinds
    }
    largest = max(per_unit.values())
    all_layers = 2 * sum(n for n, _ in per_unit.values())  # two layers of each kind
    layer, shard, total, _ = _fsdp_units(params, world, ep, tp)
    assert (layer, shard, total) == (largest[0], largest[1], all_layers)
    assert per_unit[min(kinds)] != per_unit[max(kinds)]


#: (precision, layout, pp_rank, model): the setup peak on ranks holding the embedding, the head, both, experts
INIT_CASES = [
    ("32-true", {"pipeline_parallel_size": 2}, 0, "dense"),
    ("32-true", {"pipeline_parallel_size": 2}, 1, "dense"),
    ("32-true", {"tensor_parallel_size": 2}, 0, "dense"),
    ("bf16-mixed", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1}, 0, "dense"),
    ("bf16-mixed", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1}, 1, "dense"),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 2}, 0, "dense"),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 3}, 0, "dense"),
    ("bf16-mixed", {"data_parallel_size": 2, "zero_stage": 1, "expert_parallel_size": 2}, 0, "moe"),
]


@pytest.mark.parametrize("precision, layout, pp_rank, model", INIT_CASES)
def test_initialization_bytes_is_the_larger_setup_moment(precision, layout, pp_rank, model):
    """The peak of setup (``initialization_bytes``' docstring): the rank's parameters in the setup dtype (float32;
    at ZeRO 2/3 FSDP2's shards as held) + the larger of the largest whole parameter of its stages in float32 (the
    piece copied out of it) and, at ZeRO 0/1 with master weights, the master weights + the largest local parameter
    in the parameters' dtype (the cast being made). The largest parameters counted on the real module (the
    embedding and the head ``[V, h]``, tp-split on dim 0; an MoE layer's expert tensors ``[E/ep, ., .]``)."""
    cfg = dataclasses.replace(TINY, num_layers=4) if model == "dense" else LlamaConfig.from_preset("tiny-moe")
    pc = ParallelConfig(**{"data_parallel_size": 1, **layout})
    dt = Dtypes.of(precision)
    states = model_state_bytes(cfg, pc, precision, pp_rank=pp_rank, dp_cp_rank=0)
    work = Workload(cfg, 2, 64, precision, num_microbatches=pc.pp, expert_load_imbalance=1.0)
    buf = buffer_terms(work, pc, dt, pp_rank, states, "cpu")
    layers = rank_layers(cfg.num_layers, pc, pp_rank)
    _, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    module = meta_model(cfg)
    mine = (
        tuple(f"layers.{i}." for i in layers) + (("tok_embeddings.",) if first else ()) + (("output.",) if last else ())
    )
    held = [(n, p) for n, p in module.named_parameters() if n.startswith(mine)]
    largest = max(p.numel() for _, p in held)
    ep = pc.ep
    largest_local = max(
        p.numel() // (pc.tp if p.dim() >= 2 and ".experts." not in n else 1) // (ep if ".experts." in n else 1)
        for n, p in held
    )
    params = states.parameters if pc.zero_stage >= 2 else states.parameters // dt.param * 4
    cast = states.master_weights + nbytes(dt.param, largest_local) if pc.zero_stage < 2 and dt.master else 0
    if cast:
        assert cast > 4 * largest
    exact(initialization_bytes(cfg, pc, dt, pp_rank, states, buf), params + max(nbytes(4, largest), cast))
