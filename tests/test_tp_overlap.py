"""``tensor_parallel_overlap``: the ring projections of ``lightning_4d/features/tensor_parallel/runtime.py``
(all-gather-matmul and matmul-reduce-scatter as ``t`` send/recv steps overlapped with the matmuls, never gathering the
whole sequence).

- unit level, 2 and 4 gloo processes (``tests/scripts/tp_overlap_unit.py``, float64): each autograd function's output
  and every gradient equal one-process autograd of the gathered problem and the all-gather version within 1e-6, and
  its tp bytes equal the all-gather + reduce-scatter bytes exactly;
- training (``tests/scripts/run_layouts.py`` with ``"overlap": true``), float32, FLOAT32_STEPS (5) AdamW steps:
  per-step losses within 1e-5 relative of one process and final weights within WEIGHT_ATOL (as
  ``tests/test_parity.py``) for tp2 and tp4 with sp (also under full and selective activation checkpointing), dp2×tp2
  ZeRO 1 and 3, pp2×tp2, cp2×tp2; ``bf16-mixed`` dp2×tp2 (10 steps, in ``tests/test_parity.py``'s bf16 launch)
  against one-process ``bf16-mixed`` at ``tests/test_parity.py``'s measured bf16-mixed tolerances (``_check_bf16``);
  what the layers save and the model states: the same bytes with and without the ring;
- bytes on the wire (``CommMeter``): every step's bytes per mesh dimension with the overlap equal those without it;
- the option's validation and its command-line / YAML form.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lightning_4d import FourDStrategy, ParallelConfig
from tests._launch import FLOAT32_STEPS, SCRIPTS, torchrun, trained
from tests.test_parity import (
    REFERENCES,
    TP_OVERLAP_BF16,
    WORLD4_BF16_LAUNCH,
    _check_bf16,
    _check_offloaded,
    _check_parity,
    _layout_id,
    shared,
)

UNIT_ATOL = 1e-6
LAYERS = 2  # tiny-test
KV4 = {"num_kv_heads": 4}  # tiny-test has 2 kv heads: tp4 needs 4
WORLD2 = [{"tp": 2, "zero": 0, "overlap": True, "comm": True}, {"tp": 2, "zero": 0, "comm": True}]
# the rings inside checkpointed layers: recomputed in backward (full activation checkpointing; selective is refused)
WORLD2_AC = [{"tp": 2, "zero": 0, "overlap": True, "ac": "full"}]
# activation offload (parallel/offload.py) shares these launches: tp2 with sp, one of two layers, and both layers with
# the rings (their chunks saved through the offload's hooks)
WORLD2_OFFLOAD = [{"tp": 2, "zero": 0, "offload": 1}, {"tp": 2, "zero": 0, "overlap": True, "offload": 2}]
WORLD4 = [
    {"tp": 4, "zero": 0, "overlap": True, "config": KV4},
    {"dp": 2, "tp": 2, "zero": 1, "overlap": True},
    {"dp": 2, "tp": 2, "zero": 3, "overlap": True},
    {"pp": 2, "tp": 2, "zero": 1, "m": 2, "overlap": True},
    {"cp": 2, "tp": 2, "zero": 1, "overlap": True},
    # activation offload: pp2 x tp2 (each stage's one layer offloaded, two micro-batches in flight on stage 0) and
    # ZeRO 3 (FSDP2's gathered weights are parameters: never copied)
    {"pp": 2, "tp": 2, "zero": 1, "m": 2, "offload": 1},
    {"dp": 2, "tp": 2, "zero": 3, "offload": 1},
]
#: the float32 rows (FLOAT32_STEPS, a launch of this file) and the bf16-mixed row (test_parity's STEPS, trained in
#: test_parity's 4-process bf16 launch: WORLD4_BF16_LAUNCH)
WORLD4_FLOAT32 = WORLD4
WORLD4 = WORLD4_FLOAT32 + TP_OVERLAP_BF16


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process: plain Lightning in float32 (tiny-test, and with 4 kv heads for tp4), FourDStrategy in
    bf16-mixed."""
    fp32 = shared(tmp_path_factory, "reference")  # test_parity's: one launch for both files
    bf16 = shared(tmp_path_factory, "bf16_reference")
    assert REFERENCES[3]["config"] == KV4
    return {"fp32": fp32[0], "kv4": fp32[3], "bf16": bf16[0]}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    layouts = WORLD2 + WORLD2_AC + WORLD2_OFFLOAD
    return trained(tmp_path_factory, "overlap_world2", 2, layouts, steps=FLOAT32_STEPS)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """The results of WORLD4's rows, in its order: this file's float32 launch, then test_parity's bf16 one."""
    float32 = trained(tmp_path_factory, "overlap_world4", 4, WORLD4_FLOAT32, steps=FLOAT32_STEPS)
    bf16 = shared(tmp_path_factory, "world4_bf16")[len(WORLD4_BF16_LAUNCH) - len(TP_OVERLAP_BF16) :]
    assert [r[0] for r in bf16] == TP_OVERLAP_BF16, [r[0] for r in bf16]  # the launch's last rows are this file's
    return float32 + bf16


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_functions_match_the_gathered_version(tmp_path, nproc):
    torchrun(nproc, SCRIPTS / "tp_overlap_unit.py", "--out", str(tmp_path), timeout=300)
    for rank in range(nproc):
        d = json.loads((tmp_path / f"unit_rank{rank}.json").read_text())
        print(f"\nrank {rank}: {d}")
        for key in ("col_ring_out", "col_ring_dw", "col_ring_dx", "col_ring_vs_allgather"):
            assert d[key] <= UNIT_ATOL, key
        for key in ("row_ring_out", "row_ring_dy", "row_ring_dw"):
            assert d[key] <= UNIT_ATOL, key
        # the all-gather version checked against the same reference: the harness compares like with like
        for key in ("col_allgather_out", "col_allgather_dw", "col_allgather_dx"):
            assert d[key] <= UNIT_ATOL, key
        # bytes: the column ring sends what the all-gather (forward, backward) and the reduce-scatter send
        assert d["col_ring_tp_bytes"] == d["col_allgather_tp_bytes"] > 0
        assert d["row_ring_tp_bytes"] == d["row_reduce_scatter_bytes"] + d["row_allgather_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "index",
    range(len(WORLD2 + WORLD2_AC + WORLD2_OFFLOAD)),
    ids=[_layout_id(x) for x in WORLD2 + WORLD2_AC + WORLD2_OFFLOAD],
)
def test_parity_world2(references, world2, index):
    _check_parity(references["fp32"], world2[index])
    _check_offloaded(world2[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_parity_world4(references, world4, index):
    layout = WORLD4[index]
    if layout.get("precision") == "bf16-mixed":
        _check_bf16(references["bf16"], world4[index])
    else:
        _check_parity(references["kv4" if "config" in layout else "fp32"], world4[index])
    _check_offloaded(world4[index])


def _per_step_dims(record: dict) -> list[dict[str, int]]:
    """Bytes sent per mesh dimension at every step (``CommMeter`` events: ``(dim, kind, nbytes, group size)``)."""
    from lightning_4d.parallel.comm import bytes_sent

    steps = []
    for events in record["bytes"]["comm_events"]:
        dims: dict[str, int] = {}
        for dim, kind, nbytes, size in events:
            dims[dim] = dims.get(dim, 0) + bytes_sent(kind, nbytes, size)
        steps.append(dims)
    return steps


@pytest.mark.slow
def test_bytes_per_dimension_equal_without_overlap(world2):
    """Every step, every rank: the ring's send bytes under ``tp`` equal the all-gathers' and reduce-scatters' bytes
    (and every other dimension is unchanged); the overlapped run really replaces the projections' collectives by
    point-to-point messages on tp."""
    (_, on, _), (_, off, _) = world2[:2]
    assert len(on) == len(off) == 2
    for r_on, r_off in zip(on, off):
        steps_on, steps_off = _per_step_dims(r_on), _per_step_dims(r_off)
        assert len(steps_on) == FLOAT32_STEPS
        assert steps_on == steps_off
        assert steps_on[0]["tp"] > 0
        calls_on = Counter(e[1] for e in r_on["bytes"]["comm_events"][1] if e[0] == "tp")
        calls_off = Counter(e[1] for e in r_off["bytes"]["comm_events"][1] if e[0] == "tp")
        # per layer and step (t = 2: one message per ring pass): the column rings (wq/wk/wv, w1/w3) one pass forward
        # and two backward, the row rings (wo, w2) one forward and one backward: 10; the head 1 + 2
        assert calls_on["send"] == calls_on["recv"] == 10 * LAYERS + 3
        # each replaced one all-gather or reduce-scatter; left: the embedding's reduce-scatter and its backward
        # all-gather; the all-reduces (loss, norms' gradients) unchanged
        assert calls_on["all_gather"] == calls_on["reduce_scatter"] == 1
        assert calls_off["all_gather"] + calls_off["reduce_scatter"] - 2 == calls_on["send"]
        assert calls_on["all_reduce"] == calls_off["all_reduce"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tensor_parallel_overlap": True},
        {"tensor_parallel_overlap": True, "tensor_parallel_size": 2, "sequence_parallel": False},
        {"tensor_parallel_overlap": "yes", "tensor_parallel_size": 2},
        {"tensor_parallel_overlap": True, "tensor_parallel_size": 2, "activation_checkpointing": "selective"},
    ],
)
def test_bad_values_are_refused_before_any_process_group(kwargs):
    import torch.distributed as dist

    with pytest.raises(ValueError, match="tensor_parallel_overlap="):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match="tensor_parallel_overlap="):
        FourDStrategy(**kwargs)
    assert not dist.is_initialized()
    assert ParallelConfig(tensor_parallel_size=2, tensor_parallel_overlap=True).sp


@pytest.mark.slow
def test_saved_activations_and_states_unchanged(tmp_path):
    """What the layers save for backward (``saved_tensors_hooks``, every storage once) and the model states: the
    same bytes with the ring as without it (the ring saves the rank's input shard and the weights, as the all-gather
    projection and ``RowwiseParallel``'s linear do), and the memory model's figures within 5% / exact, unchanged."""
    layouts = [{"tp": 2, "zero": 0, "overlap": True}, {"tp": 2, "zero": 0}]
    shapes = [[1, 64], [2, 128]]
    torchrun(
        2,
        SCRIPTS / "measure_memory.py",
        "--out",
        str(tmp_path),
        "--layouts",
        json.dumps(layouts),
        "--shapes",
        json.dumps(shapes),
        timeout=300,
    )
    for rank in range(2):
        on, off = (json.loads((tmp_path / f"layout{i}_rank{rank}.json").read_text()) for i in range(2))
        assert on["states"] == off["states"] == on["estimated_states"]
        for row_on, row_off in zip(on["activations"], off["activations"]):
            print(
                f"\nrank {rank} b={row_on['b']} s={row_on['s']}: saved {row_on['measured']} B with the ring, "
                f"{row_off['measured']} B without; estimated {row_on['estimated']} B"
            )
            assert row_on["measured"] == row_off["measured"]
            assert abs(row_on["estimated"] / row_on["measured"] - 1) <= 0.05


@pytest.mark.slow
def test_command_line_and_yaml_take_the_option(tmp_path):
    """``--trainer.strategy.tensor_parallel_overlap`` (the jsonargparse plumbing of FourDStrategy's arguments)."""
    from tests.test_cli import CONFIG, _cli

    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path)))
    proc = _cli(
        "fit",
        "--config",
        str(config),
        "--trainer.strategy.tensor_parallel_overlap=true",
        "--print_config",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tensor_parallel_overlap: true" in proc.stdout


@pytest.mark.slow
def test_measured_peak_lower_without_the_gathered_input(tmp_path):
    """A real tp2 run (gloo, live CPU tensor bytes, ``tests/scripts/measure_peak.py``): the ring's peak is below the
    all-gather version's by at least one gathered ``[b, s, h]`` float32 input (the ring holds two shards instead),
    with the same model states."""
    b, s, h = 4, 512, 64  # tiny-test's hidden size
    peaks = {}
    for overlap in (False, True):
        out = tmp_path / str(overlap)
        out.mkdir()
        layout = {"tensor_parallel_size": 2, "zero_stage": 0, "tensor_parallel_overlap": overlap}
        torchrun(
            2,
            SCRIPTS / "measure_peak.py",
            "--out",
            str(out),
            "--layout",
            json.dumps(layout),
            "--seq-length",
            str(s),
            "--micro-batch-size",
            str(b),
            timeout=300,
        )
        peaks[overlap] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for off, on in zip(peaks[False], peaks[True]):
        print(f"\npeak: {off['peak_allocated']} B without the ring, {on['peak_allocated']} B with it")
        assert {k: v for k, v in on.items() if k != "peak_allocated"} == {
            k: v for k, v in off.items() if k != "peak_allocated"
        }
        assert on["peak_allocated"] <= off["peak_allocated"] - 4 * b * s * h


def test_transformers_llama_refuses_the_option():
    """The rings hook into our Llama's modules: a transformers ``LlamaForCausalLM`` refuses the option by name (at
    ``validate``, before anything is split), ours takes it."""
    from tests.test_families import HF_LLAMA, LLAMA, _ours, _theirs

    config = ParallelConfig(tensor_parallel_size=2, tensor_parallel_overlap=True).resolve(2)
    with pytest.raises(ValueError, match="tensor_parallel_overlap=True is not supported for a transformers"):
        HF_LLAMA.validate(_theirs(), config)
    LLAMA.validate(_ours(), config)
