"""The support matrix: which feature combinations lightning_4d runs, defined once (issue 32).

Every combination a user can ask for (ZeRO 0-3 x precision x tp/sp (+ overlap) x pp (each schedule, uneven split) x
cp (ring, allgather) x activation checkpointing x activation offload x compile x Mixture-of-Experts (ep, tp, pp,
ZeRO) x model family) collapsed into the rows (:data:`ROWS`) that exercise distinct code. Each row has an id, a
short description, its layout as the options of ``lightning-4d measure`` (:meth:`Row.argv`; presets ``small``,
``small-tied`` and ``tiny-moe``, s <= 2048) and three statuses:

- *refused*: the exact error the project's own validation raises before anything runs (``Row.refused``;
  :func:`validate_row` reproduces it and ``tests/test_support.py`` asserts the text is what it raises);
- *tested on CPU*: the pytest node ids that run the combination (``Row.cpu_tests``; ``tests/test_support.py``
  asserts each exists);
- *run on CUDA*: the card and date of the newest CUDA smoke result under ``benchmarks/results/``
  (``smoke_<device>_<date>.json``, written by :func:`run_smoke`; :func:`cuda_results`).

The same rows parametrize the CUDA smoke matrix (``tests/cuda/test_smoke.py``; ``benchmarks/gpu_check.sh`` runs it
first) and generate ``docs/support.md`` (``lightning-4d support --markdown``), so the three cannot drift.

The smoke run (:func:`run_row`): one rank of the row's layout on torch's fake process group
(:func:`lightning_4d.measure.measure_rank`; what its collectives would receive zero-filled,
:func:`defined_collectives`) for 2 steps, checking that it runs, the loss is finite, no decoder layer
returns a tensor of another dtype than it was given (the residual stream's dtype), and, on CUDA, that the measured
peak is within 5% of the estimate once the CUDA libraries' workspaces (measured before the fit) are counted. On CPU
(a dry run: ``python -m lightning_4d.support --smoke --device cpu --out DIR``) the peak and the estimate are
recorded, not asserted.

This module imports no torch: the CLI lists the matrix without it; the smoke run imports it when it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
#: where the CUDA smoke results are read from (and gpu_check writes them)
RESULTS = ROOT / "benchmarks" / "results"
#: the layout every row starts from (``lightning-4d measure``'s option names, as argparse stores them)
DEFAULTS: dict[str, Any] = {
    "model": "small",
    "seq_length": 1024,
    "micro_batch_size": 2,
    "precision": "bf16-mixed",
    "dp": 1,
    "zero_stage": 1,
}
#: the model families (``Row.family``)
FAMILIES = {"ours": "lightning_4d Llama", "hf-llama": "transformers Llama", "hf-mixtral": "transformers Mixtral"}
#: the largest |measured - (estimate + CUDA library workspaces)| / measured the CUDA smoke matrix accepts
PEAK_TOLERANCE = 0.05
#: why the smoke runner cannot run a transformers model (yet): it builds lightning_4d's CausalLMModule
HF_SMOKE_REASON = (
    "the smoke runner builds lightning_4d's CausalLMModule (measure); a transformers model needs its own "
    "LightningModule (tests/scripts/hf_llama_4d.py), not in the smoke runner yet"
)
#: measure's own refusal of ep > 1 (lightning_4d.measure.measure_rank), why ep rows are not smoke-run
EP_SMOKE_REASON = (
    "measure cannot run expert parallelism on torch's fake process group (its all-to-all carries no token "
    "counts); ep runs on gloo in the CPU tests"
)


def _flags(options: dict) -> list[str]:
    """``lightning-4d measure`` flags for ``options`` (argparse names; booleans of switches as the bare flag)."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + ("cp-method" if key == "cp_method" else key.replace("_", "-"))
        if key in ("compile", "tensor_parallel_overlap"):
            out += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


@dataclass(frozen=True)
class Row:
    """One feature combination of the support matrix.

    Attributes:
        id: a short unique name (``[a-z0-9-]``).
        description: what it exercises, one line.
        layout: the options of ``lightning-4d measure`` that differ from :data:`DEFAULTS` (argparse names:
            ``tp``, ``pp``, ``cp``, ``dp``, ``ep``, ``zero_stage``, ``precision``, ``cp_method``, ...; ``compile``).
        family: ``ours``, ``hf-llama`` or ``hf-mixtral`` (:data:`FAMILIES`); the transformers families use a
            transformers config of the preset's sizes.
        refused: the exact message of the error the project raises before anything runs, or ``None``.
        error_type: the type of that error (``ValueError``; ``NotImplementedError`` for compile under tp).
        cpu_tests: pytest node ids (``tests/test_x.py::test_name``) that run the combination on CPU.
        smoke_skip: why the smoke runner cannot run the row (``None``: it runs).
    """

    id: str
    description: str
    layout: dict = field(default_factory=dict)
    family: str = "ours"
    refused: Optional[str] = None
    error_type: str = "ValueError"
    cpu_tests: tuple = ()
    smoke_skip: Optional[str] = None

    def options(self) -> dict[str, Any]:
        """The full layout: :data:`DEFAULTS` updated with :attr:`layout`."""
        return {**DEFAULTS, **self.layout}

    def argv(self, **overrides: Any) -> list[str]:
        """The row's arguments of ``lightning-4d measure`` (``overrides`` replace options, e.g. ``seq_length``)."""
        return _flags({**self.options(), **overrides})

    def command(self) -> str:
        """``lightning-4d measure ...`` for this row (a transformers family: the sizes of its preset)."""
        return "lightning-4d measure " + " ".join(self.argv())

    @property
    def status(self) -> str:
        """``refused``, ``tested on CPU`` or ``not tested on CPU``."""
        if self.refused is not None:
            return "refused"
        return "tested on CPU" if self.cpu_tests else "not tested on CPU"


def _hf_row(row_id: str, description: str, layout: dict, family: str, test: str) -> Row:
    """A transformers-family row the CPU tests run and the smoke runner cannot (:data:`HF_SMOKE_REASON`)."""
    return Row(row_id, description, layout, family=family, cpu_tests=(test,), smoke_skip=HF_SMOKE_REASON)


P = "tests/test_parity.py::"
PP = "tests/test_pipeline.py::"
CP = "tests/test_context_parallel.py::"
MOE_PP = "tests/test_moe_pipeline.py::test_moe_pp2_every_schedule_equals_one_process"
MOE_TP = "tests/test_moe_tensor_parallel.py::test_moe_under_tp_and_cp_equals_one_process"
MOE_DP = "tests/test_moe.py::test_dp2_zero_losses_aux_and_routing_equal_one_process"
EP = "tests/test_expert_parallel.py::test_ep_losses_aux_routing_norm_and_states_equal_one_process"
OFFLOAD = (
    "tests/test_activation_offload.py::test_offload_gives_the_same_loss_and_gradients_and_moves_the_saved_bytes_to_host"
)
TIED = "tests/test_tied_pipeline.py::"
HF_LLAMA = "tests/test_hf_llama_4d.py::test_hf_llama_layout_matches_one_process"
COMPILE = "tests/test_compile.py::test_compiled_layout_matches_one_process"
HF_MIXTRAL = "tests/test_hf_mixtral.py::test_hf_mixtral_layout_matches_one_process"

#: the support matrix (order: ZeRO and precision, tp/sp, pp, cp, checkpointing / offload / compile, MoE, families)
ROWS: list[Row] = [
    # ---------------------------------------------------------------- ZeRO x precision (dp2)
    Row(
        "z0-fp32",
        "dp2 ZeRO 0 float32: gradient buckets all-reduced",
        {"dp": 2, "zero_stage": 0, "precision": "32-true"},
        cpu_tests=(P + "test_parity_world2", P + "test_parity_world4"),
    ),
    Row(
        "z0-bf16-mixed",
        "dp2 ZeRO 0 bf16-mixed: fp32 master weights beside the buckets",
        {"dp": 2, "zero_stage": 0},
        cpu_tests=(P + "test_bf16_mixed_parity_world2",),
    ),
    Row(
        "z1-bf16-mixed",
        "dp2 ZeRO 1 bf16-mixed: sharded optimizer, reduce-scattered buckets, fp32 masters",
        {"dp": 2, "zero_stage": 1},
        cpu_tests=(P + "test_bf16_mixed_parity_world2", P + "test_parity_world4"),
    ),
    Row(
        "z2-bf16-mixed",
        "dp2 ZeRO 2 bf16-mixed: FSDP2 without resharding after forward",
        {"dp": 2, "zero_stage": 2},
        cpu_tests=(P + "test_parity_world4",),
    ),
    Row(
        "z3-bf16-mixed",
        "dp2 ZeRO 3 bf16-mixed: FSDP2 with MixedPrecisionPolicy",
        {"dp": 2, "zero_stage": 3},
        cpu_tests=(P + "test_bf16_mixed_parity_world2", P + "test_parity_world4"),
    ),
    Row(
        "z1-tp2-bf16-true",
        "tp2 dp2 ZeRO 1 bf16-true: bf16 parameters and optimizer states, no masters",
        {"tp": 2, "dp": 2, "zero_stage": 1, "precision": "bf16-true"},
        cpu_tests=(P + "test_bf16_close_to_float32",),
    ),
    Row(
        "z3-tp2-bf16-true",
        "tp2 dp2 ZeRO 3 bf16-true: FSDP2 + DTensor tp in bfloat16",
        {"tp": 2, "dp": 2, "zero_stage": 3, "precision": "bf16-true"},
        cpu_tests=(P + "test_bf16_close_to_float32",),
    ),
    Row(
        "fp16-mixed",
        "float16 with a gradient scaler (any ZeRO stage)",
        {"dp": 2, "zero_stage": 0, "precision": "16-mixed"},
        refused="precision='16-mixed' is not supported by FourDStrategy: float16 mixed precision needs a gradient "
        "scaler whose overflow check and unscaling span every gradient shard (tp, pp, ZeRO buckets, experts), which "
        "neither FourDStrategy nor Lightning's ModelParallelStrategy provides. Use one of ['32-true', 'bf16-mixed', "
        "'bf16-true'] ('bf16-mixed' trains at the speed of float16 on Ampere and newer GPUs, with no scaler).",
    ),
    # ---------------------------------------------------------------- tp / sp
    Row(
        "tp2-sp",
        "tp2 with sequence parallelism (the default under tp)",
        {"tp": 2},
        cpu_tests=(P + "test_parity_world2", P + "test_parity_world4"),
    ),
    Row(
        "tp2-nosp-selective",
        "tp2 without sp, selective checkpointing (row-parallel outputs all-reduced, kept)",
        {"tp": 2, "sequence_parallel": False, "zero_stage": 0, "activation_checkpointing": "selective"},
        cpu_tests=(P + "test_parity_world2",),
    ),
    Row(
        "tp2-dp2-z3",
        "tp2 dp2 ZeRO 3: FSDP2 over DTensor tp shards",
        {"tp": 2, "dp": 2, "zero_stage": 3},
        cpu_tests=(P + "test_parity_world4",),
    ),
    Row(
        "tp2-overlap",
        "tp2 with the overlapped tp rings (sp all-gathers / reduce-scatters inside the matmuls)",
        {"tp": 2, "dp": 2, "tensor_parallel_overlap": True},
        cpu_tests=("tests/test_tp_overlap.py::test_parity_world2", "tests/test_tp_overlap.py::test_parity_world4"),
    ),
    Row(
        "tp2-overlap-nosp",
        "the tp overlap without sequence parallelism",
        {"tp": 2, "tensor_parallel_overlap": True, "sequence_parallel": False},
        refused="tensor_parallel_overlap=True is not valid with tensor_parallel_size=2 and sequence_parallel=False: "
        "the ring overlaps the sequence-parallel all-gathers and reduce-scatters, so it needs tensor_parallel_size > 1 "
        "and sequence_parallel None or True (or set tensor_parallel_overlap=False).",
    ),
    Row(
        "tp2-overlap-selective",
        "the tp overlap with selective checkpointing",
        {"tp": 2, "tensor_parallel_overlap": True, "activation_checkpointing": "selective"},
        refused=(
            "tensor_parallel_overlap=True is not supported with activation_checkpointing='selective' yet: the"
            " selective policy keeps wo's reduced output and nothing of w2 by marking those modules, and the "
            "rings run them elsewhere (their chunk products would be kept, the [b, s, h] partial sums the "
            "policy avoids, and the memory estimate would be low). Use activation_checkpointing='none' or "
            "'full' with the overlap, or tensor_parallel_overlap=False with 'selective'."
        ),
    ),
    # ---------------------------------------------------------------- pp
    Row(
        "pp2-gpipe",
        "pp2 GPipe, m=2",
        {"pp": 2, "pipeline_schedule": "gpipe", "num_microbatches": 2},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row("pp2-1f1b", "pp2 1F1B, m=4", {"pp": 2, "num_microbatches": 4}, cpu_tests=(PP + "test_pipeline_world2",)),
    Row(
        "pp2-interleaved",
        "pp2 interleaved 1F1B, v=3 (one layer per stage), m=2",
        {"pp": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 3, "num_microbatches": 2},
        cpu_tests=(PP + "test_pipeline_world2", PP + "test_pipeline_world4"),
    ),
    Row(
        "pp2-zbv",
        "pp2 ZBV zero bubble (V-shape, two stages per rank), m=4, uneven split 2,1,1,2",
        {"pp": 2, "pipeline_schedule": "zbv", "num_microbatches": 4, "pipeline_layer_split": [2, 1, 1, 2]},
        cpu_tests=(PP + "test_pipeline_world2", PP + "test_pipeline_world4"),
    ),
    Row(
        "pp2-dualpipev",
        "pp2 DualPipeV, m=4, uneven split 2,1,1,2",
        {"pp": 2, "pipeline_schedule": "dualpipev", "num_microbatches": 4, "pipeline_layer_split": [2, 1, 1, 2]},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "pp2-uneven",
        "pp2 1F1B with an uneven layer split (4 + 2: fewer layers beside the head)",
        {"pp": 2, "num_microbatches": 2, "pipeline_layer_split": [4, 2]},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "pp2-dp2-z3",
        "pp2 dp2 ZeRO 3 bf16-mixed: FSDP2 per stage chunk",
        {"pp": 2, "dp": 2, "zero_stage": 3, "num_microbatches": 2},
        cpu_tests=(P + "test_bf16_mixed_parity_world4", PP + "test_pipeline_world4"),
    ),
    Row("pp2-tp2", "pp2 tp2 1F1B", {"pp": 2, "tp": 2, "num_microbatches": 2}, cpu_tests=(PP + "test_pipeline_world4",)),
    Row(
        "pp2-tied",
        "pp2 1F1B, tied embeddings: the last stage's copy of the [V, h] matrix, gradients summed over the embedding "
        "group; checkpoints hold it once",
        {"model": "small-tied", "pp": 2, "num_microbatches": 2},
        cpu_tests=(
            TIED + "test_tied_pp_world2_equals_one_process",
            TIED + "test_tied_pp2_checkpoint_holds_the_weight_once_and_reshards_to_pp1_and_back",
        ),
    ),
    Row(
        "pp2-tied-zbv",
        "pp2 ZBV, tied embeddings: rank 0 holds the first and last stage, the weight truly tied there (ZeRO 0/1)",
        {"model": "small-tied", "pp": 2, "pipeline_schedule": "zbv", "num_microbatches": 4},
        cpu_tests=(TIED + "test_tied_pp_world2_equals_one_process", TIED + "test_tied_pp_world4_equals_one_process"),
    ),
    Row(
        "pp2-tp2-tied",
        "pp2 tp2, tied embeddings (both copies vocabulary-sharded over tp)",
        {"model": "small-tied", "pp": 2, "tp": 2, "num_microbatches": 2},
        cpu_tests=(TIED + "test_tied_pp_world4_equals_one_process", TIED + "test_tied_pp_measure_equals_estimate"),
    ),
    Row(
        "pp2-1f1b-m1",
        "1F1B with fewer micro-batches than stages",
        {"pp": 2, "num_microbatches": 1},
        refused=(
            "num_microbatches=1 is too small for pipeline_schedule='1f1b' with pipeline_parallel_size=2: 1F1B"
            " needs at least p=2 micro-batches (use num_microbatches >= 2, ideally several times p to shrink "
            "the bubble (p-1)/(m+p-1), or pipeline_schedule='gpipe')."
        ),
    ),
    Row(
        "pp2-1f1b-v2",
        "1F1B with two virtual stages per rank",
        {"pp": 2, "virtual_pipeline_stages": 2, "num_microbatches": 2},
        refused=(
            "virtual_pipeline_stages=2 is not supported by pipeline_schedule='1f1b', which runs 1 stage(s) "
            "per rank; schedules that take 2 stages per rank: ['interleaved_1f1b', 'zbv', 'dualpipev']."
        ),
    ),
    Row(
        "pp2-zbv-selective",
        "a zero-bubble schedule with selective checkpointing",
        {
            "pp": 2,
            "pipeline_schedule": "zbv",
            "num_microbatches": 4,
            "pipeline_layer_split": [2, 1, 1, 2],
            "activation_checkpointing": "selective",
        },
        refused=(
            "activation_checkpointing='selective' does not work with pipeline_schedule='zbv': a zero-bubble "
            "schedule runs each layer's backward in two passes (input gradients, then weight gradients) and "
            "PyTorch's selective checkpointing can recompute a layer only once. Use "
            "activation_checkpointing='full' with it, or 'selective' with one of ['gpipe', '1f1b', "
            "'interleaved_1f1b']."
        ),
    ),
    # ---------------------------------------------------------------- cp
    Row(
        "cp2-ring",
        "cp2 ring attention (zigzag shards, K/V passed around)",
        {"cp": 2},
        cpu_tests=(CP + "test_context_parallel_world2", CP + "test_context_parallel_bf16_close_to_float32"),
    ),
    Row(
        "cp2-allgather-z3",
        "cp2 all-gather attention, ZeRO 3",
        {"cp": 2, "cp_method": "allgather", "zero_stage": 3},
        cpu_tests=(CP + "test_context_parallel_world2",),
    ),
    Row(
        "cp2-ring-selective",
        "cp2 ring attention, selective checkpointing",
        {"cp": 2, "zero_stage": 0, "activation_checkpointing": "selective"},
        cpu_tests=(CP + "test_context_parallel_world2",),
    ),
    Row(
        "cp2-tp2",
        "cp2 x tp2 ring attention on head shards",
        {"cp": 2, "tp": 2},
        cpu_tests=(CP + "test_context_parallel_world4", P + "test_bf16_mixed_parity_world4"),
    ),
    Row(
        "cp2-pp2-tp2",
        "cp2 x pp2 x tp2, 1F1B",
        {"cp": 2, "pp": 2, "tp": 2, "num_microbatches": 2},
        cpu_tests=(CP + "test_context_parallel_world8",),
    ),
    Row(
        "cp2-bad-sequence",
        "cp2 with a sequence that does not split into 2*cp chunks",
        {"cp": 2, "seq_length": 1022},
        refused="seq_length=1022 is not a multiple of 4 (2*cp=4); use e.g. seq_length=1024.",
    ),
    # ---------------------------------------------------------------- checkpointing, offload, compile
    Row(
        "full-checkpointing",
        "dp2 full activation checkpointing",
        {"dp": 2, "activation_checkpointing": "full"},
        cpu_tests=(
            "tests/test_activation_checkpointing.py::test_same_loss_and_gradients_as_no_checkpointing",
            P + "test_parity_world4",
        ),
    ),
    Row(
        "selective-z3",
        "tp2 dp2 ZeRO 3 selective checkpointing (op-level save list)",
        {"tp": 2, "dp": 2, "zero_stage": 3, "activation_checkpointing": "selective"},
        cpu_tests=(
            "tests/test_activation_checkpointing.py::test_selective_backward_runs_no_matmul_again",
            P + "test_parity_world4",
        ),
    ),
    Row(
        "offload",
        "activation offload of 2 layers per stage to host memory, tp2 dp2 ZeRO 3",
        {"tp": 2, "dp": 2, "zero_stage": 3, "activation_offload_layers": 2},
        cpu_tests=(OFFLOAD, "tests/test_tp_overlap.py::test_parity_world4"),
    ),
    Row(
        "offload-pp-zbv",
        "activation offload under pp2 ZBV",
        {
            "pp": 2,
            "pipeline_schedule": "zbv",
            "num_microbatches": 4,
            "pipeline_layer_split": [2, 1, 1, 2],
            "activation_offload_layers": 1,
        },
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "offload-checkpointing",
        "activation offload with activation checkpointing",
        {"activation_offload_layers": 2, "activation_checkpointing": "full"},
        refused=(
            "activation_offload_layers=2 is not supported with activation_checkpointing='full': a "
            "checkpointed layer's own saved-tensor hooks take what it keeps, so nothing of it would reach "
            "host memory (Megatron-Core refuses the combination too). Use activation_checkpointing='none' "
            "with the offload, or activation_offload_layers=0."
        ),
    ),
    Row(
        "compile-z3",
        "torch.compile per layer, dp2 ZeRO 3",
        {"dp": 2, "zero_stage": 3, "compile": True},
        cpu_tests=(P + "test_parity_world2",),
    ),
    Row(
        "compile-tp2",
        "torch.compile under tp",
        {"tp": 2, "compile": True},
        refused=(
            "compile=True with tensor_parallel_size=2 is not supported yet (torch.compile of tensor-parallel "
            "layers fails in backward in AOTAutograd with this PyTorch); use compile=False, or compile=True with "
            "tensor_parallel_size=1 (dp/ZeRO, pp, cp and ep layouts)."
        ),
        error_type="NotImplementedError",
    ),
    Row(
        "compile-selective",
        "torch.compile with selective activation checkpointing",
        {"compile": True, "activation_checkpointing": "selective"},
        refused=(
            "compile=True with activation_checkpointing='selective' is not supported: a graph break inside the "
            "checkpointed layer (context-parallel attention, Mixture-of-Experts layers) would run it eagerly. Use "
            "activation_checkpointing='full' or 'none' with compile=True."
        ),
    ),
    Row(
        "compile-offload",
        "torch.compile per layer with activation offload, pp2 dp2 1F1B",
        {"pp": 2, "dp": 2, "num_microbatches": 2, "compile": True, "activation_offload_layers": 1},
        cpu_tests=(COMPILE,),
    ),
    Row(
        "compile-cp2-checkpointing",
        "torch.compile per layer, cp2 dp2 (ring attention eager), full checkpointing",
        {"cp": 2, "dp": 2, "compile": True, "activation_checkpointing": "full"},
        cpu_tests=(COMPILE,),
    ),
    Row(
        "compile-moe-ep2",
        "torch.compile per layer, MoE dp2 ep2 (the MoE feed-forward eager)",
        {"model": "tiny-moe", "dp": 2, "ep": 2, "compile": True},
        cpu_tests=(COMPILE,),
    ),
    # ---------------------------------------------------------------- Mixture-of-Experts (tiny-moe)
    Row(
        "moe-dp2-z1",
        "MoE dp2 ZeRO 1 (grouped GEMM experts, router, aux loss)",
        {"model": "tiny-moe", "dp": 2},
        cpu_tests=(MOE_DP,),
    ),
    Row("moe-dp2-z3", "MoE dp2 ZeRO 3", {"model": "tiny-moe", "dp": 2, "zero_stage": 3}, cpu_tests=(MOE_DP,)),
    Row(
        "moe-full-checkpointing",
        "MoE dp2 ZeRO 0, full checkpointing",
        {"model": "tiny-moe", "dp": 2, "zero_stage": 0, "activation_checkpointing": "full"},
        cpu_tests=(MOE_DP,),
    ),
    Row(
        "moe-tp2",
        "MoE tp2 ZeRO 1: MoE layers token parallel over tp",
        {"model": "tiny-moe", "tp": 2},
        cpu_tests=(MOE_TP,),
    ),
    Row(
        "moe-tp2-z3",
        "MoE under tp at ZeRO 3",
        {"model": "tiny-moe", "tp": 2, "zero_stage": 3},
        refused=(
            "zero_stage=3 is not supported for a Mixture-of-Experts model with tensor_parallel_size=2: its "
            "MoE layers run token parallel over tp and their gradients are summed over dp*cp*tp by ZeRO 0/1's"
            " gradient buckets, which FSDP2 (ZeRO 2/3, over dp*cp) does not do. Use zero_stage=0 or 1 with "
            "tp, or tensor_parallel_size=1 with ZeRO 2/3 (docs/moe.md)."
        ),
    ),
    Row("moe-cp2", "MoE cp2 ring attention", {"model": "tiny-moe", "cp": 2}, cpu_tests=(MOE_TP,)),
    Row(
        "moe-pp2",
        "MoE pp2 1F1B bf16-mixed (the stage boundary's dtype)",
        {"model": "tiny-moe", "pp": 2, "num_microbatches": 2},
        cpu_tests=(MOE_PP,),
    ),
    Row(
        "moe-ep2",
        "MoE dp2 ep2 ZeRO 1: experts split over ep, all-to-all dispatch",
        {"model": "tiny-moe", "dp": 2, "ep": 2},
        cpu_tests=(EP,),
        smoke_skip=EP_SMOKE_REASON,
    ),
    Row(
        "moe-ep2-z3",
        "MoE dp2 ep2 ZeRO 3: expert FSDP2 units over the edp group",
        {"model": "tiny-moe", "dp": 2, "ep": 2, "zero_stage": 3},
        cpu_tests=(EP,),
        smoke_skip=EP_SMOKE_REASON,
    ),
    Row(
        "moe-pp2-ep2",
        "MoE pp2 dp2 ep2 1F1B",
        {"model": "tiny-moe", "pp": 2, "dp": 2, "ep": 2, "num_microbatches": 2},
        cpu_tests=("tests/test_moe_pipeline.py::test_moe_pp2_dp2_ep2_equals_one_process",),
        smoke_skip=EP_SMOKE_REASON,
    ),
    Row(
        "ep-dense",
        "expert parallelism for a dense model",
        {"dp": 2, "ep": 2},
        refused=(
            "expert_parallel_size=2 needs a Mixture-of-Experts model (num_experts > 0); this model is dense "
            "(num_experts=0): the only valid expert_parallel_size is 1."
        ),
    ),
    # ---------------------------------------------------------------- transformers families
    _hf_row(
        "hf-llama-dp2-z3", "transformers LlamaForCausalLM, dp2 ZeRO 3", {"dp": 2, "zero_stage": 3}, "hf-llama", HF_LLAMA
    ),
    _hf_row(
        "hf-llama-compile",
        "transformers LlamaForCausalLM, dp2 ZeRO 1, torch.compile per decoder layer",
        {"dp": 2, "compile": True},
        "hf-llama",
        HF_LLAMA,
    ),
    _hf_row(
        "hf-llama-tp2-cp2",
        "transformers LlamaForCausalLM, tp2 cp2 (its tp plan, our cp attention)",
        {"tp": 2, "cp": 2},
        "hf-llama",
        HF_LLAMA,
    ),
    _hf_row(
        "hf-llama-pp2",
        "transformers LlamaForCausalLM, pp2 1F1B",
        {"pp": 2, "num_microbatches": 2},
        "hf-llama",
        HF_LLAMA,
    ),
    _hf_row(
        "hf-llama-offload",
        "transformers LlamaForCausalLM, tp2 with activation offload",
        {"tp": 2, "activation_offload_layers": 2},
        "hf-llama",
        HF_LLAMA,
    ),
    Row(
        "hf-llama-checkpointing",
        "transformers LlamaForCausalLM with activation checkpointing",
        {"dp": 2, "activation_checkpointing": "full"},
        family="hf-llama",
        refused=(
            "activation_checkpointing='full' is not supported for a transformers LlamaForCausalLM yet: use "
            "activation_checkpointing='none' (or call the model's gradient_checkpointing_enable() yourself)"
        ),
    ),
    Row(
        "hf-llama-overlap",
        "transformers LlamaForCausalLM with the tp overlap",
        {"tp": 2, "tensor_parallel_overlap": True},
        family="hf-llama",
        refused=(
            "tensor_parallel_overlap=True is not supported for a transformers LlamaForCausalLM yet (the ring "
            "projections hook into lightning_4d's own Llama modules): use tensor_parallel_overlap=False"
        ),
    ),
    _hf_row(
        "hf-mixtral-ep2",
        "transformers MixtralForCausalLM, dp2 ep2 ZeRO 1",
        {"model": "tiny-moe", "dp": 2, "ep": 2},
        "hf-mixtral",
        HF_MIXTRAL,
    ),
    _hf_row(
        "hf-mixtral-z3",
        "transformers MixtralForCausalLM, dp2 ZeRO 3",
        {"model": "tiny-moe", "dp": 2, "zero_stage": 3},
        "hf-mixtral",
        HF_MIXTRAL,
    ),
    Row(
        "hf-mixtral-tp2",
        "transformers MixtralForCausalLM under tp",
        {"model": "tiny-moe", "tp": 2},
        family="hf-mixtral",
        refused=(
            "tensor_parallel_size=2 is not supported for a transformers MixtralForCausalLM: it trains with "
            "data parallelism, ZeRO stages 0-3 and expert parallelism (data_parallel_size, zero_stage, "
            "expert_parallel_size); set tensor_parallel_size=1, or train the checkpoint as a lightning_4d "
            "Llama (CausalLMModule with init_from=<the Hugging Face directory>), which takes tp, pp and cp."
        ),
    ),
]


#: decoder layer classes whose input and output dtypes the smoke run compares (ours, transformers')
DECODER_LAYERS = ("TransformerBlock", "LlamaDecoderLayer", "MixtralDecoderLayer")
#: the CPU dry run's sizes (every row's code paths at a size 2 cores run in seconds)
CPU_SEQ_LENGTH = 256
CPU_MICRO_BATCH_SIZE = 1


def row_by_id(row_id: str) -> Row:
    """The row named ``row_id``.

    Raises:
        ValueError: no row has that id (the message lists the ids).
    """
    for row in ROWS:
        if row.id == row_id:
            return row
    raise ValueError(f"support row {row_id!r} does not exist; valid ids: {', '.join(r.id for r in ROWS)}.")


def smoke_rows() -> list[Row]:
    """The rows the CUDA smoke matrix parametrizes: every row that is not refused (those the runner cannot run
    carry ``smoke_skip``)."""
    return [row for row in ROWS if row.refused is None]


# ------------------------------------------------------------------------------------------- a layout's coverage
def layout_features(options: dict[str, Any], moe: bool = False) -> frozenset[str]:
    """The features a layout combines, as the support matrix tells them apart: ``tp``, ``sp off``, ``tp overlap``,
    ``pp`` (and ``pp <schedule>`` for a schedule other than 1F1B), ``cp`` (and ``cp allgather``), ``ZeRO 0/2/3``
    (ZeRO 1 is every row's default), ``<mode> checkpointing``, ``offload``, ``compile``, ``MoE``, ``ep``.

    ``options``: a row's :meth:`Row.options` (``measure``'s names) or one of ``plan``'s layouts (its ``--json``
    names: ``context_parallel_method``, ``expert_parallel_size``, ...); sizes absent count as 1."""
    get = options.get
    tp, pp, cp = get("tp", 1), get("pp", 1), get("cp", 1)
    ep = get("ep", get("expert_parallel_size", 1)) or 1
    out = set()
    if tp > 1:
        out.add("tp")
        if get("sequence_parallel") is False:
            out.add("sp off")
        if get("tensor_parallel_overlap"):
            out.add("tp overlap")
    if pp > 1:
        out.add("pp")
        schedule = get("pipeline_schedule") or "1f1b"
        if schedule != "1f1b":
            out.add(f"pp {schedule}")
    if cp > 1:
        out.add("cp")
        if (get("cp_method") or get("context_parallel_method") or "ring") == "allgather":
            out.add("cp allgather")
    zero = get("zero_stage", 1)
    if zero != 1:
        out.add(f"ZeRO {zero}")
    ckpt = get("activation_checkpointing") or "none"
    if ckpt != "none":
        out.add(f"{ckpt} checkpointing")
    if get("activation_offload_layers"):
        out.add("offload")
    if get("compile"):
        out.add("compile")
    if moe:
        out.add("MoE")
    if ep > 1:
        out.add("ep")
    return frozenset(out)


def _row_is_moe(row: Row) -> bool:
    return row.family == "hf-mixtral" or row.options()["model"] == "tiny-moe"


def untested_pairs(options: dict[str, Any], moe: bool = False, family: str = "ours") -> list[tuple[str, str]]:
    """The pairs of features of a layout (:func:`layout_features`) that no row of the matrix tested on CPU (of
    ``family``) combines: ``[]`` when every two of its features ran together in some CPU test. The matrix lists
    combinations, not every layout, so this is the honest coarse answer to "has this layout been tested?": a pair
    listed here has not run together in any test the matrix names (``plan`` marks such layouts)."""
    tested = [
        layout_features(r.options(), _row_is_moe(r))
        for r in ROWS
        if r.family == family and r.refused is None and r.cpu_tests
    ]
    features = sorted(layout_features(options, moe))
    return [
        (a, b) for i, a in enumerate(features) for b in features[i + 1 :] if not any(a in t and b in t for t in tested)
    ]


# ------------------------------------------------------------------------------------------------- validation
def _parse(row: Row, **overrides: Any) -> tuple[argparse.Namespace, Any, Any]:
    """``lightning-4d measure``'s arguments, model config and validated layout for ``row`` (as ``measure`` checks
    them before it runs anything)."""
    from lightning_4d.memory.cli import command_parser, layout_from_args, load_model_config

    args = command_parser("measure").parse_args(row.argv(**overrides))
    cfg = load_model_config(args.model)
    pc, _ = layout_from_args(args, cfg)
    pc.validate_sequence(args.seq_length)
    pc.validate_microbatches(pc.microbatches)
    return args, cfg, pc


def _transformers_module(family: str, cfg: Any) -> Any:
    """A LightningModule holding a transformers model of ``cfg``'s sizes, built on the meta device."""
    import lightning as L
    import torch
    import transformers

    sizes = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_length,
    )

    class TransformersModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                if family == "hf-mixtral":
                    config = transformers.MixtralConfig(
                        **sizes,
                        intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                        num_local_experts=cfg.num_experts,
                        num_experts_per_tok=cfg.num_experts_per_token,
                    )
                    self.model = transformers.MixtralForCausalLM(config)
                else:
                    config = transformers.LlamaConfig(**sizes, intermediate_size=cfg.intermediate_size)
                    self.model = transformers.LlamaForCausalLM(config)

    return TransformersModule()


def validate_row(row: Row) -> None:
    """Run every check the project makes of ``row``'s layout before anything is allocated, in the order a run
    makes them: ``measure``'s argument and layout checks (``ParallelConfig``: sizes, model, sequence,
    micro-batches; before them the precision, :func:`~lightning_4d.config.check_training_precision`),
    ``FourDStrategy``'s constructor (compile, checkpoint format), Lightning's ``Trainer`` (the
    precision its ``ModelParallelStrategy`` accepts), the strategy's precision check
    (:func:`~lightning_4d.parallel.sharded_optimizer.validate_precision`) and its check against the LightningModule
    (the model family's :meth:`validate`; a transformers family gets a model of the preset's sizes on the meta device).

    Raises:
        ValueError: the layout is refused (``NotImplementedError`` for ``compile`` under tp).
    """
    import lightning as L

    from lightning_4d.config import check_training_precision
    from lightning_4d.measure import _strategy_kwargs
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.parallel.sharded_optimizer import validate_precision
    from lightning_4d.strategy import FourDStrategy

    # the precision first, as `lightning-4d fit` checks it before the Trainer exists (measure's --precision refuses
    # it while parsing, with the same message)
    check_training_precision(row.layout.get("precision", DEFAULTS["precision"]))
    args, cfg, pc = _parse(row)
    strategy = FourDStrategy(**_strategy_kwargs(pc), memory_check=False, compile=args.compile)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=pc.world_size,
        strategy=strategy,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validate_precision(args.precision, pc.zero_stage)
    if row.family == "ours":
        from lightning_4d.tasks import CausalLMModule

        module = CausalLMModule(cfg)
    else:
        module = _transformers_module(row.family, cfg)
    validate_against_module(trainer.strategy.parallel_config, module)


# ------------------------------------------------------------------------------------------------- smoke run
def _checks_callback() -> Any:
    """A Lightning callback recording each decoder layer whose output dtype differs from its input's, and the
    training losses (the smoke run's checks)."""
    import lightning as L
    import torch

    class SmokeChecks(L.Callback):
        def __init__(self) -> None:
            self.dtype_changes: list[str] = []
            self.losses: list[float] = []
            self.layers = 0
            self._handles: list = []

        def _hook(self, name: str) -> Any:
            def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
                given = args[0] if args and torch.is_tensor(args[0]) else None
                if given is None:
                    given = next((v for v in kwargs.values() if torch.is_tensor(v) and v.is_floating_point()), None)
                out = output[0] if isinstance(output, (tuple, list)) else output
                if torch.is_tensor(given) and torch.is_tensor(out) and given.dtype != out.dtype:
                    change = f"{name} ({type(module).__name__}): {given.dtype} in, {out.dtype} out"
                    if change not in self.dtype_changes:
                        self.dtype_changes.append(change)

            return hook

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            for name, module in pl_module.named_modules():
                # FSDP2 swaps a layer's class for a subclass (FSDPTransformerBlock): match the class or a base
                if any(cls.__name__ in DECODER_LAYERS for cls in type(module).__mro__):
                    self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
            self.layers = len(self._handles)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if torch.is_tensor(loss):
                self.losses.append(float(loss.detach().float().cpu()))

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    return SmokeChecks()


#: collectives whose first argument is written with data from other ranks (c10d's in-place ops)
_WRITES_FIRST_ARG = (
    "recv_",
    "recv_any_source_",
    "_allgather_base_",
    "allgather_",
    "allgather_into_tensor_coalesced_",
    "allgather_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "alltoall_",
    "gather_",
    "scatter_",
)
#: functional collectives that return a new tensor of data from other ranks
_RETURNS_RECEIVED = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
)


def defined_collectives() -> Any:
    """A ``TorchDispatchMode`` that zero-fills what the fake process group's collectives would have received.

    torch's fake process group completes every collective at once and writes nothing: a receive buffer, an
    all-gather's or a reduce-scatter's output stay uninitialized memory, which can hold NaN (measured: cp ring, pp
    and tp-overlap rows gave NaN losses on CPU). Filling those outputs with zeros right after each collective
    (the fake group's work is already complete) makes every value the rank computes defined, so the smoke run can
    check that the loss is finite; no tensor is allocated, so the measured memory is unchanged.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    from lightning_4d.parallel._compat import TorchDispatchMode

    class DefinedCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            namespace, name = func.namespace, func.__name__.split(".")[0]
            targets: Any = None
            if namespace == "c10d" and name in _WRITES_FIRST_ARG and args:
                targets = args[0]
            elif namespace == "_c10d_functional" and name in _RETURNS_RECEIVED:
                targets = out
            if targets is not None:
                with torch.no_grad():
                    for t in tree_leaves(targets):
                        if torch.is_tensor(t):
                            t.zero_()
            return out

    return DefinedCollectives()


def run_row(
    row: Row,
    device: str = "cpu",
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    steps: int = 2,
) -> dict[str, Any]:
    """The smoke run of ``row``: rank ``worst`` of its layout trained ``steps`` steps in this process on torch's
    fake process group (:func:`lightning_4d.measure.measure_rank`), with the checks of the module docstring.

    Args:
        row: a row that is not refused.
        device: ``"cpu"`` or ``"cuda"``.
        seq_length, micro_batch_size: replace the row's (the CPU dry run's smaller sizes).
        steps: optimizer steps (2).

    Returns:
        ``{"status": "ok" | "failed" | "error" | "skipped", "error": text or None, "rank", "peak", "estimate",
        "cuda_library", "ratio": (estimate + cuda_library) / peak, "losses", "decoder_layers", "seconds"}``
        (bytes; "failed": it ran and a check failed; "error": it raised; "skipped": ``row.smoke_skip``).

    Raises:
        ValueError: ``row`` is refused, or ``device`` is neither cpu nor cuda.
    """
    if row.refused is not None:
        raise ValueError(f"support row {row.id!r} is refused ({row.refused}); the smoke matrix runs the others.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not valid: expected cpu or cuda.")
    if row.smoke_skip:
        return {"status": "skipped", "error": row.smoke_skip}
    overrides = {k: v for k, v in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)) if v}
    t0 = time.time()
    result: dict[str, Any] = {"status": "error", "error": None}
    try:
        from lightning_4d.measure import measure_rank, worst_rank

        args, cfg, pc = _parse(row, **overrides)
        b, s = args.micro_batch_size, args.seq_length
        rank = worst_rank(cfg, pc, b, s, args.precision, device_type=device)
        checks = _checks_callback()
        with defined_collectives():
            out = measure_rank(
                cfg,
                pc,
                rank,
                b,
                s,
                args.precision,
                steps=steps,
                device=device,
                compile=args.compile,
                callbacks=[checks],
            )
        peak = out["measured"]["peak_allocated"]
        estimate = out["estimate"]["total"]
        library = out["measured"].get("cuda_library", 0) or 0
        result.update(
            rank=rank,
            seq_length=s,
            micro_batch_size=b,
            peak=peak,
            estimate=estimate,
            cuda_library=library,
            ratio=(estimate + library) / peak if peak else None,
            losses=checks.losses,
            decoder_layers=checks.layers,
        )
        problems = []
        if not checks.layers:
            problems.append("no decoder layer found to check the residual stream's dtype")
        if checks.dtype_changes:
            problems.append("decoder layers change the residual stream's dtype: " + "; ".join(checks.dtype_changes))
        if not checks.losses:
            problems.append("no training loss was returned")
        elif not all(math.isfinite(x) for x in checks.losses):
            problems.append(f"loss not finite: {checks.losses}")
        if device == "cuda" and peak and abs(peak - estimate - library) > PEAK_TOLERANCE * peak:
            problems.append(
                f"peak {peak:,} B is not within {PEAK_TOLERANCE:.0%} of the estimate {estimate:,} B + CUDA library "
                f"workspaces {library:,} B (ratio {(estimate + library) / peak:.3f})"
            )
        result.update(status="failed" if problems else "ok", error="; ".join(problems) or None)
    except Exception as err:  # noqa: BLE001 - recorded per row, the matrix goes on
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
    finally:
        import gc

        gc.collect()
    result["seconds"] = round(time.time() - t0, 1)
    return result


def device_name(device: str) -> str:
    """The card's name (``torch.cuda.get_device_name()``) for ``cuda``, ``cpu`` for the CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return "cpu"


def run_smoke(
    rows: list[Row],
    device: str,
    out_dir: Path,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    budget_s: Optional[float] = None,
) -> Path:
    """Run :func:`run_row` for each of ``rows`` in this process and write ``smoke_<device name>_<date>.json`` into
    ``out_dir`` after every row (``{"device", "device_name", "date", "torch", "seq_length", "micro_batch_size",
    "rows": {id: run_row's dict}}``). Rows left when ``budget_s`` seconds have passed are recorded as skipped.
    On CPU the sizes default to :data:`CPU_SEQ_LENGTH` and :data:`CPU_MICRO_BATCH_SIZE`. Returns the file."""
    import torch

    if device == "cpu":
        seq_length = seq_length or CPU_SEQ_LENGTH
        micro_batch_size = micro_batch_size or CPU_MICRO_BATCH_SIZE
    name = device_name(device)
    date = datetime.date.today().isoformat()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"smoke_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}_{date}.json"
    record: dict[str, Any] = {
        "device": device,
        "device_name": name,
        "date": date,
        "torch": torch.__version__,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "rows": {},
    }
    start = time.time()
    for row in rows:
        if budget_s is not None and time.time() - start > budget_s:
            result = {"status": "skipped", "error": f"out of time (budget {budget_s:.0f} s)"}
        else:
            result = run_row(row, device, seq_length, micro_batch_size)
        record["rows"][row.id] = result
        ratio = result.get("ratio")
        print(
            f"smoke {row.id}: {result['status']}"
            + (f" ({result['seconds']} s, estimate/peak {ratio:.3f})" if ratio else "")
            + (f": {result['error'][:300]}" if result.get("error") and result["status"] != "skipped" else ""),
            flush=True,
        )
        path.write_text(json.dumps(record, indent=1))
    record["seconds"] = round(time.time() - start, 1)
    path.write_text(json.dumps(record, indent=1))
    return path


# ------------------------------------------------------------------------------------------------- CUDA results
def cuda_results(results_dir: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Per row id, its newest CUDA smoke result under ``results_dir`` (``smoke_*.json`` whose ``device`` is
    ``cuda``): ``{"card", "date", "status", "error"}``. CPU dry runs are not read."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(results_dir).glob("smoke_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("device") != "cuda":
            continue
        for row_id, result in data.get("rows", {}).items():
            if result.get("status") == "skipped":
                continue
            entry = {"card": data.get("device_name"), "date": data.get("date", ""), **result}
            if row_id not in found or entry["date"] >= found[row_id]["date"]:
                found[row_id] = entry
    return found


def _cuda_cell(row: Row, results: dict[str, dict[str, Any]]) -> str:
    if row.refused is not None:
        return "-"
    got = results.get(row.id)
    if got is None:
        return "not run on CUDA yet"
    if got.get("status") == "ok":
        return f"ok on {got['card']}, {got['date']}"
    return f"{got.get('status')} on {got['card']}, {got['date']}: {(got.get('error') or '')[:200]}"


def _layout_text(row: Row) -> str:
    """The row's options that differ from :data:`DEFAULTS`, as ``measure`` flags."""
    return " ".join(_flags(row.layout)) or "(defaults)"


def summary(results: Optional[dict] = None) -> dict[str, int]:
    """Row counts: total, refused, tested on CPU, not tested on CPU, run on CUDA (ok), smoke-run rows."""
    results = cuda_results() if results is None else results
    return {
        "rows": len(ROWS),
        "refused": sum(r.refused is not None for r in ROWS),
        "tested on CPU": sum(r.status == "tested on CPU" for r in ROWS),
        "not tested on CPU": sum(r.status == "not tested on CPU" for r in ROWS),
        "smoke-run": sum(r.refused is None and not r.smoke_skip for r in ROWS),
        "ok on CUDA": sum(results.get(r.id, {}).get("status") == "ok" for r in ROWS if r.refused is None),
    }


def to_json(results_dir: Path = RESULTS) -> dict[str, Any]:
    """The matrix as one JSON-able object (``lightning-4d support --json``)."""
    results = cuda_results(results_dir)
    return {
        "defaults": DEFAULTS,
        "summary": summary(results),
        "rows": [
            {
                "id": r.id,
                "description": r.description,
                "family": r.family,
                "layout": r.layout,
                "command": r.command(),
                "status": r.status,
                "refused": r.refused,
                "error_type": r.error_type if r.refused is not None else None,
                "cpu_tests": list(r.cpu_tests),
                "smoke_skip": r.smoke_skip,
                "cuda": _cuda_cell(r, results),
            }
            for r in ROWS
        ],
    }


def _status_text(row: Row) -> str:
    if row.refused is not None:
        return f"refused ({row.error_type}): {row.refused}"
    return row.status


def _test_names(row: Row) -> list[str]:
    return [t.replace("tests/", "").replace(".py::", "::") for t in row.cpu_tests]


def markdown(results_dir: Path = RESULTS) -> str:
    """The matrix as a Markdown table (``lightning-4d support --markdown``; docs/support.md)."""
    results = cuda_results(results_dir)
    counts = summary(results)
    defaults = " ".join(_flags(DEFAULTS))
    lines = [
        f"{counts['rows']} rows: {counts['refused']} refused, {counts['tested on CPU']} tested on CPU, "
        f"{counts['not tested on CPU']} not tested on CPU; {counts['smoke-run']} run by the smoke matrix, "
        f"{counts['ok on CUDA']} ok on CUDA. Every row's layout is `lightning-4d measure {defaults}` with the "
        "options shown.",
        "",
        "| id | combination | family | options | status | CPU tests | CUDA |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in ROWS:
        status = _status_text(row).replace("|", "\\|")
        tests = "<br>".join(f"`{t}`" for t in _test_names(row)) or "-"
        cuda = _cuda_cell(row, results)
        if row.refused is None and row.smoke_skip and row.id not in results:
            cuda = "not smoke-run: " + row.smoke_skip
        lines.append(
            f"| `{row.id}` | {row.description} | {FAMILIES[row.family]} | `{_layout_text(row)}` | {status} | "
            f"{tests} | {cuda.replace('|', chr(92) + '|')} |"
        )
    return "\n".join(lines) + "\n"


def print_table(results_dir: Path = RESULTS) -> None:
    """The matrix as a rich table (``lightning-4d support``)."""
    from rich.console import Console
    from rich.table import Table

    results = cuda_results(results_dir)
    counts = summary(results)
    table = Table(title=f"lightning_4d support matrix: {', '.join(f'{v} {k}' for k, v in counts.items())}")
    for col in ("id", "family", "options", "status", "CPU tests", "CUDA"):
        table.add_column(col, overflow="fold")
    for row in ROWS:
        table.add_row(
            row.id,
            row.family,
            _layout_text(row),
            _status_text(row),
            "\n".join(_test_names(row)) or "-",
            _cuda_cell(row, results) if not (row.refused is None and row.smoke_skip) else "not smoke-run",
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print(f"Defaults of every row: lightning-4d measure {' '.join(_flags(DEFAULTS))}")


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-4d support`` (also ``python -m lightning_4d.support``): print the matrix, or with ``--smoke``
    run the smoke matrix and write its JSON. Returns the exit code (0; 1 when a smoke row failed or raised; 2 bad
    input)."""
    p = argparse.ArgumentParser(prog="lightning-4d support", description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print the matrix as Markdown (docs/support.md)")
    p.add_argument("--json", action="store_true", help="print the matrix as one JSON object")
    p.add_argument("--results", default=str(RESULTS), help="folder of smoke_*.json results (benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="run the smoke matrix (every row not refused)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="--smoke: where (cpu: a dry run)")
    p.add_argument("--out", default=str(RESULTS), help="--smoke: the folder to write smoke_<device>_<date>.json to")
    p.add_argument("--rows", default=None, help="--smoke: comma-separated row ids (default: every row not refused)")
    p.add_argument("--seq-length", type=int, default=None, help=f"--smoke: override s (cpu: {CPU_SEQ_LENGTH})")
    p.add_argument("--micro-batch-size", type=int, default=None, help="--smoke: override b (cpu: 1)")
    p.add_argument("--budget-s", type=float, default=None, help="--smoke: seconds after which rows are skipped")
    args = p.parse_args(argv)
    if args.smoke:
        try:
            rows = [row_by_id(x) for x in args.rows.split(",")] if args.rows else smoke_rows()
            refused = [r.id for r in rows if r.refused is not None]
            if refused:
                raise ValueError(f"--rows {','.join(refused)}: refused rows are not smoke-run.")
        except ValueError as err:
            print(f"lightning-4d support: error: {err}", file=sys.stderr)
            return 2
        path = run_smoke(rows, args.device, Path(args.out), args.seq_length, args.micro_batch_size, args.budget_s)
        data = json.loads(path.read_text())
        bad = [k for k, v in data["rows"].items() if v["status"] in ("failed", "error")]
        print(
            f"wrote {path} ({data['seconds']} s); {len(bad)} of {len(rows)} rows failed{': ' if bad else ''}"
            + ", ".join(bad)
        )
        return 1 if bad else 0
    if args.json:
        print(json.dumps(to_json(Path(args.results))))
    elif args.markdown:
        print(markdown(Path(args.results)), end="")
    else:
        print_table(Path(args.results))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
