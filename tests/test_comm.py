"""CommMeter (lightning_4d/parallel/comm.py): the bytes a rank sends per step, per mesh dimension and collective,
equal the volumes derived by hand from the model's sizes on small layouts (2 gloo processes, tiny model, fp32)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.parallel.comm import bytes_sent
from tests._launch import SCRIPTS, torchrun

LAYOUTS = [
    {"dp": 2, "zero": 0},
    {"dp": 2, "zero": 1},
    {"dp": 2, "zero": 2},
    {"dp": 2, "zero": 3},
    {"tp": 2},
    {"pp": 2, "m": 2},
    {"cp": 2},
    {"cp": 2, "method": "alltoall"},
]
GLOBAL_BATCH, SEQ = 8, 32
F32 = 4


def test_bytes_sent_conventions():
    """Ring all-reduce 2(D-1)/D·n, reduce-scatter / all-gather / all-to-all / broadcast (D-1)/D·n, send n."""
    assert bytes_sent("all_reduce", 1000, 4) == 1500
    assert bytes_sent("reduce_scatter", 1000, 4) == bytes_sent("all_gather", 1000, 4) == 750
    assert bytes_sent("all_to_all", 1000, 4) == bytes_sent("broadcast", 1000, 4) == 750
    assert bytes_sent("send", 1000, 2) == 1000 and bytes_sent("recv", 1000, 2) == 0
    assert bytes_sent("all_reduce", 1000, 1) == 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    layouts = [dict(layout, comm=True) for layout in LAYOUTS]
    torchrun(
        2,
        SCRIPTS / "run_layouts.py",
        "--out",
        str(out),
        "--steps",
        "2",
        "--global-batch",
        str(GLOBAL_BATCH),
        "--seq-length",
        str(SEQ),
        "--layouts",
        json.dumps(layouts),
    )
    return [json.loads((out / f"layout{i}_rank0.json").read_text()) for i in range(len(LAYOUTS))]


def _events(record):
    """The second step's collectives: ``Counter((dim, kind, bytes, group size))``, without the 4-byte all-reduce
    of the logged loss (Lightning's mean of ``train_loss`` over the ranks)."""
    return Counter(tuple(e) for e in record["bytes"]["comm_events"][1] if not (e[1] == "all_reduce" and e[2] == 4))


def _params(record) -> dict[str, int]:
    return {name: math.prod(shape) for name, (shape, _) in record["param_shapes"].items()}


@pytest.mark.slow
def test_zero0_all_reduces_every_bucket_once(measured):
    record = measured[0]
    buckets = record["bytes"]["bucket_bytes"]
    assert sum(buckets) == F32 * sum(_params(record).values())  # one bucket per 25 MiB: the whole tiny model
    assert _events(record) == Counter({("dp_cp", "all_reduce", b, 2): 1 for b in buckets})


@pytest.mark.slow
def test_zero1_reduce_scatters_and_all_gathers_every_bucket(measured):
    record = measured[1]
    (bucket,) = record["bytes"]["bucket_bytes"]
    assert _events(record) == Counter(
        {("dp_cp", "reduce_scatter", bucket, 2): 1, ("dp_cp", "all_gather", bucket, 2): 1}
    )


def _fsdp_units(record, dp: int) -> dict[str, int]:
    """FSDP2 units (one per decoder layer, the rest in the root) and their all-gathered bytes: every parameter's
    rows padded to a multiple of dp (torch.chunk over dim 0)."""
    units: Counter = Counter()
    for name, (shape, elem) in record["param_shapes"].items():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        rows = -(-shape[0] // dp) * dp
        units[unit] += rows * math.prod(shape[1:]) * elem
    return dict(units)


@pytest.mark.slow
@pytest.mark.parametrize("index,gathers", [(2, 1), (3, 2)])
def test_fsdp_gathers_once_or_twice_and_reduce_scatters_once(measured, index, gathers):
    """ZeRO 2 (reshard_after_forward=False): each unit gathered once per step; ZeRO 3: forward and backward; the
    root (embedding, final norm, head) stays gathered from forward to backward in both; one reduce-scatter each."""
    record = measured[index]
    units = _fsdp_units(record, 2)
    expected: Counter = Counter()
    for unit, nbytes in units.items():
        expected[("dp_cp", "all_gather", nbytes, 2)] += gathers if unit != "root" else 2 if gathers == 2 else 1
        expected[("dp_cp", "reduce_scatter", nbytes, 2)] += 1
    assert _events(record) == expected


@pytest.mark.slow
def test_tensor_parallel_collectives_per_layer(measured):
    """tp=2 with sequence parallelism, b·s·h fp32 activations per collective. Per layer: all-gathers before wq/wk/wv
    and w1/w3 (forward), the same two again in backward (the saved sequence shards, features/tensor_parallel/runtime.py)
    and the two that transpose wo's and w2's reduce-scatters; reduce-scatters after wo and w2 and of the gradients of
    the gathered inputs: 6 all-gathers, 4 reduce-scatters. Outside the layers: the embedding's output scattered to
    the sequence (reduce-scatter; all-gather of its gradient), the head's input gathered (forward, backward again)
    and its gradient reduce-scattered. The replicated RMSNorm weights' gradients are all-reduced (2 per layer +
    the final norm), and the vocabulary-parallel loss all-reduces the max and the (sum, target) per token."""
    record = measured[4]
    cfg = LlamaConfig.from_preset("tiny-test")
    act = GLOBAL_BATCH * SEQ * cfg.hidden_size * F32
    tokens = GLOBAL_BATCH * SEQ
    L = cfg.num_layers
    assert _events(record) == Counter(
        {
            ("tp", "all_gather", act, 2): 6 * L + 3,
            ("tp", "reduce_scatter", act, 2): 4 * L + 2,
            ("tp", "all_reduce", cfg.hidden_size * F32, 2): 2 * L + 1,
            ("tp", "all_reduce", tokens * F32, 2): 1,
            ("tp", "all_reduce", 2 * tokens * F32, 2): 1,
        }
    )


@pytest.mark.slow
def test_pipeline_sends_one_activation_per_micro_batch(measured):
    """pp=2, m=2: rank 0 sends each micro-batch's hidden states [b/m, s, h] forward and receives its gradient."""
    record = measured[5]
    cfg = LlamaConfig.from_preset("tiny-test")
    hidden = GLOBAL_BATCH // 2 * SEQ * cfg.hidden_size * F32
    events = _events(record)
    assert events[("pp", "send", hidden, 2)] == 2 and events[("pp", "recv", hidden, 2)] == 2
    assert sum(n for (dim, kind, n, _), c in events.items() if dim == "pp" and kind == "send") == hidden


@pytest.mark.slow
def test_context_parallel_ring_passes_kv_around(measured):
    """cp=2 ring (features/context_parallel/runtime.py): per layer, K and V of the local s/cp tokens (stacked) are
    passed cp-1 times forward; backward passes K/V cp-1 times again and their gradients cp-1 times (from the rank after
    the owner round to the owner, a reduce-scatter's volume): 3·(cp - 1) sends per layer, the minimum. Counted under cp
    although with dp=1 the cp group is the dp_cp group."""
    record = measured[6]
    cfg = LlamaConfig.from_preset("tiny-test")
    kv = 2 * GLOBAL_BATCH * (SEQ // 2) * cfg.num_kv_heads * cfg.head_dim * F32  # K and V stacked
    events = _events(record)
    sends = {key: c for key, c in events.items() if key[1] == "send"}
    assert set(sends) == {("cp", "send", kv, 2)}
    assert sends[("cp", "send", kv, 2)] == 3 * (2 - 1) * cfg.num_layers


@pytest.mark.slow
def test_context_parallel_alltoall_exchanges_qkv_and_output(measured):
    """cp=2 alltoall (Ulysses, features/context_parallel/runtime.py): per layer forward one all-to-all of this rank's q,
    k, v ``[b, s/cp, a + 2k, d]`` (packed) and one of the attention output ``[b, s/cp, a, d]``; backward the same two
    (the output gradient, then dq/dk/dv packed): each sends (cp−1)/cp of its buffer (planning/step_time.py's
    ``"alltoall"`` term), counted under cp; no point-to-point traffic."""
    record = measured[7]
    cfg = LlamaConfig.from_preset("tiny-test")
    tokens = GLOBAL_BATCH * (SEQ // 2)
    qkv = tokens * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * F32
    out = tokens * cfg.num_heads * cfg.head_dim * F32
    events = _events(record)
    a2a = {key: c for key, c in events.items() if key[1] == "all_to_all"}
    assert a2a == {("cp", "all_to_all", qkv, 2): 2 * cfg.num_layers, ("cp", "all_to_all", out, 2): 2 * cfg.num_layers}
    assert not any(kind in ("send", "recv") for _, kind, _, _ in events)
    sent = sum(bytes_sent("all_to_all", n, 2) * c for (_, _, n, _), c in a2a.items())
    assert sent == 2 * (2 - 1) / 2 * (qkv + out) * cfg.num_layers  # the step-time model's per-layer volume


@pytest.mark.slow
def test_expert_all_to_all_bytes_exact_from_the_routed_counts(tmp_path):
    """One MoE layer (``tiny-moe``, 8 experts, top-2) forward + backward on 4 gloo ranks at ep2 (dp4: two ep groups)
    and ep4 (the ep group is ``dp_cp``): the meter counts under ``ep``, every rank, exactly the bytes the routing
    implies. Rank j of an ep group, with ``C[s, e]`` the rows source s routes to expert e and ``own`` j's experts:
    ``out = Σ_{e∉own} C[j, e]`` rows leave it in the dispatch, ``in = Σ_{s≠j} Σ_{e∈own} C[s, e]`` in the combine,
    and backward sends the same again in reverse: ``2·(out + in)·h·4`` bytes (float32 rows), plus the counts' equal
    all-to-all of E int64, ``(ep−1)/ep·E·8``."""
    torchrun(4, SCRIPTS / "comm_ep.py", "--out", str(tmp_path))
    for ep in (2, 4):
        for rank in range(4):
            r = json.loads((tmp_path / f"ep{ep}_rank{rank}.json").read_text())
            counts, j, n_experts = r["counts"], r["ep_rank"], r["num_experts"]
            local = n_experts // ep
            own = range(j * local, (j + 1) * local)
            rows_out = sum(c for e, c in enumerate(counts[j]) if e not in own)
            rows_in = sum(counts[s][e] for s in range(ep) if s != j for e in own)
            assert rows_out > 0 and rows_in > 0  # the routing crosses ranks
            expected = 2 * (rows_out + rows_in) * r["row_bytes"] + (ep - 1) * n_experts * 8 // ep
            assert r["sent"]["ep"] == {"all_to_all": expected}, (ep, rank, r["sent"])
            assert r["calls"]["ep"] == {"all_to_all": 5}  # counts, dispatch, combine; both again backward
            assert set(r["sent"]) == {"ep"}  # nothing else communicates (no stats group, no gradient sync here)
