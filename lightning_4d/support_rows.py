"""The rows of the support matrix (:mod:`lightning_4d.support`) but a feature's own (its
:attr:`~lightning_4d.features.feature.Feature.rows`): every feature combination a user can ask for, as data: its layout
(the options of ``lightning-4d measure`` that differ from :data:`DEFAULTS`), the error the project raises for it or the
CPU tests that run it, and why the CUDA smoke runner cannot run it. :mod:`lightning_4d.support` validates, runs and
prints them; ``tests/test_support.py`` checks every row.

This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_4d.layout import measure_flags, precision_refusal

__all__ = ["CORE_FILES", "DEFAULTS", "EXERCISES", "FAMILIES", "HF_SMOKE_REASON", "ROWS", "Row", "measure_flags"]

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
#: why the smoke runner cannot run a transformers model (yet): it builds lightning_4d's CausalLMModule
HF_SMOKE_REASON = (
    "the smoke runner builds lightning_4d's CausalLMModule (measure); a transformers model needs its own "
    "LightningModule (tests/scripts/hf_llama_4d.py), not in the smoke runner yet"
)


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
        error_type: the type of that error (``ValueError``).
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
        return measure_flags({**self.options(), **overrides})

    def command(self) -> str:
        """``lightning-4d measure ...`` for this row (a transformers family: the sizes of its preset)."""
        return "lightning-4d measure " + " ".join(self.argv())

    @property
    def status(self) -> str:
        """``refused``, ``tested on CPU`` or ``not tested on CPU``."""
        if self.refused is not None:
            return "refused"
        return "tested on CPU" if self.cpu_tests else "not tested on CPU"

    def exercises(self) -> tuple[str, ...]:
        """The files the row's run exercises (a folder ends in ``/``): :data:`CORE_FILES` and, for each key of
        :data:`EXERCISES` the row matches, its files. A CUDA result of the row is *changed since* its commit when one
        of them changed after it (:mod:`lightning_4d.support`)."""
        options = {**self.options(), "family": self.family}
        files = list(CORE_FILES)
        for key, paths in EXERCISES.items():
            name, _, value = key.partition("=")
            got = options.get(name)
            if (str(got) == value) if value else got not in (None, False, 0, 1, "none"):
                files += [p for p in paths if p not in files]
        return tuple(files)


def _hf_row(row_id: str, description: str, layout: dict, family: str, test: str) -> Row:
    """A transformers-family row the CPU tests run and the smoke runner cannot (:data:`HF_SMOKE_REASON`)."""
    return Row(row_id, description, layout, family=family, cpu_tests=(test,), smoke_skip=HF_SMOKE_REASON)


P = "tests/test_parity.py::"
PP = "tests/test_pipeline.py::"
CP = "tests/test_context_parallel.py::"
H = "tests/test_hsdp.py::"
OO = "tests/test_optimizer_offload.py::"
OFFLOAD = (
    "tests/test_activation_offload.py::test_offload_gives_the_same_loss_and_gradients_and_moves_the_saved_bytes_to_host"
)
HF_LLAMA = "tests/test_hf_llama_4d.py::test_hf_llama_layout_matches_one_process"
COMPILE = "tests/test_compile.py::test_compiled_layout_matches_one_process"
FLOAT8 = "tests/test_float8.py::"
F8_SPLIT = FLOAT8 + "test_float8_under_pipeline_and_context_parallelism"
F8_AC = FLOAT8 + "test_float8_with_checkpointing_and_offload"

#: DualPipeV on 2 ranks as the rows run it: small's 6 layers over its 4 stages, m = 2p
DUALPIPEV = {"pipeline_schedule": "dualpipev", "num_microbatches": 4, "pipeline_layer_split": [2, 1, 1, 2]}

#: the support matrix (order: ZeRO and precision, tp/sp, checkpointing / offload / compile, MoE, families)
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
    # ---------------------------------------------------------------- hybrid sharding (HSDP)
    Row(
        "hsdp-z1",
        "dp4 HSDP 2 replicas x shard 2, ZeRO 1: buckets reduce-scattered in the shard group, the shards all-reduced "
        "across replicas",
        {"dp": 4, "dp_replicate": 2, "zero_stage": 1},
        cpu_tests=(H + "test_hsdp_parity_world4", H + "test_hsdp_checkpoint_resumes_on_flat_zero3_and_back"),
    ),
    Row(
        "hsdp-z2",
        "dp4 HSDP 2 x 2, ZeRO 2: FSDP2 on the 2D (replicate, shard) mesh without resharding after forward",
        {"dp": 4, "dp_replicate": 2, "zero_stage": 2},
        cpu_tests=(H + "test_hsdp_parity_world4",),
    ),
    Row(
        "hsdp-z3",
        "dp4 HSDP 2 x 2, ZeRO 3: FSDP2's hybrid sharding, parameters all-gathered within the shard group",
        {"dp": 4, "dp_replicate": 2, "zero_stage": 3},
        cpu_tests=(H + "test_hsdp_parity_world4", H + "test_hsdp_checkpoint_resumes_on_flat_zero3_and_back"),
    ),
    Row(
        "hsdp-cp2-z3",
        "dp2 cp2 HSDP 2 replicas of a cp2 shard group, ZeRO 3",
        {"dp": 2, "cp": 2, "dp_replicate": 2, "zero_stage": 3},
        cpu_tests=(H + "test_hsdp_parity_world4",),
    ),
    Row(
        "hsdp-tp2-z3",
        "dp4 tp2 HSDP 2 x 2, ZeRO 1 and 3 (DTensor tp inside the shards)",
        {"dp": 4, "tp": 2, "dp_replicate": 2, "zero_stage": 3},
        cpu_tests=(H + "test_hsdp_parity_world8",),
    ),
    Row(
        "hsdp-pp2-z3",
        "pp2 dp4 HSDP 2 x 2, ZeRO 1 and 3, 1F1B",
        {"dp": 4, "pp": 2, "num_microbatches": 2, "pipeline_schedule": "1f1b", "dp_replicate": 2, "zero_stage": 3},
        cpu_tests=(H + "test_hsdp_parity_world8",),
    ),
    Row(
        "hsdp-optoffload",
        "dp4 HSDP 2 x 2 with the optimizer states on the host, ZeRO 1 and 3",
        {"dp": 4, "dp_replicate": 2, "zero_stage": 3, "optimizer_offload": True},
        cpu_tests=(H + "test_hsdp_parity_world4",),
    ),
    Row(
        "hsdp-z0",
        "HSDP with ZeRO 0",
        {"dp": 4, "dp_replicate": 2, "zero_stage": 0},
        refused=(
            "data_parallel_replicate_size=2 is not valid with zero_stage=0: hybrid sharding replicates a ZeRO shard "
            "group, and ZeRO 0 shards nothing (it already replicates over all of dp). Use zero_stage 1, 2 or 3 with "
            "it, or data_parallel_replicate_size=1."
        ),
    ),
    # ---------------------------------------------------------------- optimizer-state offload
    Row(
        "optoffload-z1",
        "dp2 ZeRO 1 optimizer offload: the owned slices' fp32 copies, their gradients and Adam's states on the host, "
        "torch's AdamW stepping them on the CPU",
        {"dp": 2, "zero_stage": 1, "optimizer_offload": True},
        cpu_tests=(
            OO + "test_optimizer_offload_parity_world2",
            OO + "test_measure_of_an_offload_rank_equals_the_estimate",
        ),
    ),
    Row(
        "optoffload-z3",
        "dp2 ZeRO 3 optimizer offload: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and states on the host)",
        {"dp": 2, "zero_stage": 3, "optimizer_offload": True},
        cpu_tests=(
            OO + "test_optimizer_offload_parity_world2",
            OO + "test_measure_of_an_offload_rank_equals_the_estimate",
        ),
    ),
    Row(
        "optoffload-tp2-z3",
        "tp2 dp2 optimizer offload, ZeRO 1 and 3 (DTensor tp shards on the host)",
        {"dp": 2, "tp": 2, "zero_stage": 3, "optimizer_offload": True},
        cpu_tests=(OO + "test_optimizer_offload_parity_world4",),
    ),
    Row(
        "optoffload-pp2-z3",
        "pp2 dp2 optimizer offload, ZeRO 1 and 3, 1F1B",
        {
            "dp": 2,
            "pp": 2,
            "num_microbatches": 2,
            "pipeline_schedule": "1f1b",
            "zero_stage": 3,
            "optimizer_offload": True,
        },
        cpu_tests=(OO + "test_optimizer_offload_parity_world4",),
    ),
    Row(
        "optoffload-z0",
        "optimizer offload with ZeRO 0",
        {"dp": 2, "zero_stage": 0, "optimizer_offload": True},
        refused=(
            "optimizer_offload=True is not valid with zero_stage=0: every dp rank would hold all of Adam's states on "
            "the host (dp copies per node). Use zero_stage 1, 2 or 3 with it, or optimizer_offload=False."
        ),
    ),
    Row(
        "fp16-mixed",
        "float16 with a gradient scaler (any ZeRO stage)",
        {"dp": 2, "zero_stage": 0, "precision": "16-mixed"},
        refused=precision_refusal("16-mixed"),
    ),
    Row(
        "resume-data-other-layout",
        "a dp4 checkpoint (b1, 3 accumulated) resumed at dp3 x 4, dp2 b2 x 3 and pp2 dp2 m6: the data position in "
        "consumed samples, the same samples and losses as the straight run",
        {"dp": 4, "micro_batch_size": 1, "precision": "32-true"},
        cpu_tests=("tests/test_data.py::test_resume_on_any_layout_sees_the_same_samples_and_losses",),
        smoke_skip="a resume on another layout is two runs; the smoke runner measures one",
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
        "offload-pp-gpipe",
        "activation offload under pp2 GPipe (every forward before any backward)",
        {"pp": 2, "pipeline_schedule": "gpipe", "num_microbatches": 2, "activation_offload_layers": 1},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "offload-pp-dualpipev",
        "activation offload under pp2 DualPipeV",
        {"pp": 2, **DUALPIPEV, "activation_offload_layers": 1},
        cpu_tests=(PP + "test_pipeline_world2",),
    ),
    Row(
        "offload-cp",
        "activation offload under cp2 ring attention",
        {"cp": 2, "activation_offload_layers": 1},
        cpu_tests=(CP + "test_context_parallel_world2",),
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
        "torch.compile per layer under dp2 tp2 (sequence parallel; DTensors inside the compiled layers)",
        {"tp": 2, "dp": 2, "compile": True},
        cpu_tests=(COMPILE,),
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
        "compile-offload-pp2-tp2",
        "torch.compile per layer with activation offload, pp2 tp2 1F1B",
        {"pp": 2, "tp": 2, "num_microbatches": 2, "compile": True, "activation_offload_layers": 1},
        cpu_tests=(COMPILE,),
    ),
    Row(
        "compile-cp2-checkpointing",
        "torch.compile per layer, cp2 dp2 (ring attention eager), full checkpointing",
        {"cp": 2, "dp": 2, "compile": True, "activation_checkpointing": "full"},
        cpu_tests=(COMPILE,),
    ),
    # ---------------------------------------------------------------- float8 (torchao)
    Row(
        "float8-tensorwise",
        "float8 linears (torchao, tensorwise scaling), bf16-mixed",
        {"float8": "tensorwise"},
        cpu_tests=(FLOAT8 + "test_float8_recipes_track_bf16_on_one_process",),
    ),
    Row(
        "float8-rowwise",
        "float8 linears (torchao, rowwise scaling), bf16-mixed",
        {"float8": "rowwise"},
        cpu_tests=(FLOAT8 + "test_float8_recipes_track_bf16_on_one_process",),
    ),
    Row(
        "float8-z3",
        "float8 tensorwise, dp2 ZeRO 3: a sharded checkpoint resumes bit for bit",
        {"dp": 2, "zero_stage": 3, "float8": "tensorwise"},
        cpu_tests=(FLOAT8 + "test_float8_checkpoint_resumes_exactly_under_zero3",),
    ),
    Row(
        "float8-z3-compile",
        "float8 tensorwise, dp2 ZeRO 3 (weights all-gathered in float8), torch.compile per layer",
        {"dp": 2, "zero_stage": 3, "float8": "tensorwise", "compile": True},
        cpu_tests=(FLOAT8 + "test_float8_all_gather_under_zero3_with_compile",),
    ),
    *(
        Row(f"float8-{name}", f"float8 {recipe}, {name} ({what})", {**layout, "float8": recipe}, cpu_tests=(test,))
        for name, recipe, what, layout, test in (
            (
                "pp2",
                "tensorwise",
                "1F1B, each stage converts its own layers",
                {"pp": 2, "num_microbatches": 2},
                F8_SPLIT,
            ),
            ("cp2", "rowwise", "ring attention", {"cp": 2}, F8_SPLIT),
            ("selective", "tensorwise", "selective checkpointing", {"activation_checkpointing": "selective"}, F8_AC),
            ("full-checkpointing", "rowwise", "full checkpointing", {"activation_checkpointing": "full"}, F8_AC),
            ("offload", "tensorwise", "activation offload", {"activation_offload_layers": 1}, F8_AC),
        )
    ),
    Row(
        "float8-hf-llama",
        "float8 with transformers' LlamaForCausalLM",
        {"float8": "tensorwise"},
        family="hf-llama",
        refused=(
            "float8='tensorwise' is not supported for a transformers LlamaForCausalLM yet (tested with lightning_4d "
            "Llama models only): use float8=None."
        ),
    ),
    # float8 under tp: the small preset's FFN (688) splits into 344 per rank at tp2, which torch._scaled_mm refuses
    # on CUDA (not a multiple of 16); tp2 with float8 runs in tests/test_float8.py on tiny-test (FFN 128: 64 per rank)
    *(
        Row(
            row_id,
            f"{what} (the small preset: FFN 688, 344 per rank at tp2)",
            layout,
            refused=(
                f"float8={layout['float8']!r} with tensor_parallel_size=2 gives per-rank linear shards not divisible "
                "by 16 (torch._scaled_mm): {'intermediate_size/tp': 344}; valid tensor_parallel_size values for "
                "float8 with this model: [1], or float8=None."
            ),
        )
        for row_id, what, layout in (
            ("float8-tp2-sp", "float8 tensorwise, tp2 with sp", {"tp": 2, "float8": "tensorwise"}),
            (
                "float8-tp2-no-sp",
                "float8 tensorwise, tp2 without sp",
                {"tp": 2, "sequence_parallel": False, "float8": "tensorwise"},
            ),
            (
                "float8-rowwise-tp2-sp-compile",
                "float8 rowwise, tp2 with sp, compiled",
                {"tp": 2, "float8": "rowwise", "compile": True},
            ),
        )
    ),
    # ---------------------------------------------------------------- transformers families
    _hf_row(
        "hf-llama-dp2-z3", "transformers LlamaForCausalLM, dp2 ZeRO 3", {"dp": 2, "zero_stage": 3}, "hf-llama", HF_LLAMA
    ),
    _hf_row(
        "hf-llama-compile",
        "transformers LlamaForCausalLM, tp2 (sequence parallel), torch.compile per decoder layer",
        {"tp": 2, "compile": True},
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
        "hf-llama-cp2-alltoall",
        "transformers LlamaForCausalLM, cp2 all-to-all (Ulysses) attention",
        {"cp": 2, "cp_method": "alltoall"},
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
]

#: the tests of document masking (``CausalLMModule(document_masking=True)``) against each document run alone
DOCS = "tests/test_document_masking.py::"
#: the layouts document masking is tested in (float32, ZeRO 0, one step against the per-document reference); the
#: smoke runner measures them on documents of 128 tokens (``measure --document-tokens``)
_PP2 = {"pp": 2, "num_microbatches": 2, "pipeline_schedule": "1f1b"}
_DOCUMENT_MASKING_LAYOUTS = [
    ("dp2", "dp2", {"dp": 2}, "world2"),
    ("tp2", "tp2 with sequence parallelism", {"tp": 2}, "world2"),
    ("pp2", "pp2 1F1B, each stage masking its micro-batch", _PP2, "world2"),
    ("cp2-ring", "cp2 ring, blocks no document spans skipped", {"cp": 2}, "world2"),
    ("cp2-allgather", "cp2 all-gather", {"cp": 2, "cp_method": "allgather"}, "world2"),
    ("cp2-alltoall", "cp2 all-to-all", {"cp": 2, "cp_method": "alltoall"}, "world2"),
    ("cp4-ring", "cp4 ring", {"cp": 4}, "world4"),
    ("cp4-allgather", "cp4 all-gather", {"cp": 4, "cp_method": "allgather"}, "world4"),
    ("cp2-tp2-ring", "cp2 x tp2 ring", {"cp": 2, "tp": 2}, "world4"),
    ("cp2-tp2-alltoall", "cp2 x tp2 all-to-all", {"cp": 2, "tp": 2, "cp_method": "alltoall"}, "world4"),
    ("dp2-cp2-allgather", "dp2 x cp2 all-gather", {"dp": 2, "cp": 2, "cp_method": "allgather"}, "world4"),
    ("pp2-cp2-ring", "pp2 x cp2 ring, 1F1B", {**_PP2, "cp": 2}, "world4"),
]  # fmt: skip
ROWS += [
    Row(
        f"docmask-{name}",
        f"document masking (attention within each document of a packed window), {description}",
        {**layout, "zero_stage": 0, "precision": "32-true", "document_tokens": 128},
        cpu_tests=(DOCS + f"test_layouts_{world}_equal_each_document_alone",),
    )
    for name, description, layout, world in _DOCUMENT_MASKING_LAYOUTS
]

#: the tests of asynchronous checkpoints (``async_checkpoint=True``) against synchronous saves of the same steps
ASYNC = "tests/test_async_checkpoint.py::"
#: why the smoke runner does not exercise them: ``measure`` trains without saving
_ASYNC_SMOKE_REASON = "measure saves no checkpoint: the CPU tests exercise the background write"
ROWS += [
    Row(
        "async-ckpt-z1",
        "async_checkpoint, dp2 ZeRO 1: gathered optimizer states staged and written in the background, bitwise the "
        "synchronous save; the next save waits; a failed write keeps last.ckpt",
        {"dp": 2, "zero_stage": 1, "precision": "32-true", "async_checkpoint": True},
        cpu_tests=(
            ASYNC + "test_async_save_writes_bitwise_what_a_sync_save_writes",
            ASYNC + "test_next_save_waits_for_the_previous_and_training_runs_meanwhile",
            ASYNC + "test_a_failed_write_keeps_the_previous_checkpoint_and_last",
        ),
        smoke_skip=_ASYNC_SMOKE_REASON,
    ),
    Row(
        "async-ckpt-z3",
        "async_checkpoint, dp2 ZeRO 3: FSDP2's DTensor shards staged and written in the background",
        {"dp": 2, "zero_stage": 3, "precision": "32-true", "async_checkpoint": True},
        cpu_tests=(ASYNC + "test_async_save_writes_bitwise_what_a_sync_save_writes",),
        smoke_skip=_ASYNC_SMOKE_REASON,
    ),
    Row(
        "async-ckpt-tp2",
        "async_checkpoint, tp2 ZeRO 1: tensor-parallel DTensors staged and written in the background",
        {"tp": 2, "zero_stage": 1, "precision": "32-true", "async_checkpoint": True},
        cpu_tests=(ASYNC + "test_async_save_writes_bitwise_what_a_sync_save_writes",),
        smoke_skip=_ASYNC_SMOKE_REASON,
    ),
    Row(
        "async-ckpt-auto-resume",
        "async_checkpoint, dp2 x tp2 ZeRO 1 under torchrun --max-restarts 1: a rank killed mid-run, fit --ckpt_path "
        "last resumes from the newest complete checkpoint with the straight run's losses",
        {"dp": 2, "tp": 2, "zero_stage": 1, "precision": "32-true", "async_checkpoint": True},
        cpu_tests=("tests/test_auto_resume.py::test_killed_rank_restarts_under_torchrun_and_resumes_from_last",),
        smoke_skip=_ASYNC_SMOKE_REASON,
    ),
]

PREEMPTION = "tests/test_preemption.py::test_sigterm_mid_step_ends_every_rank_together"
#: why the smoke runner does not exercise them: ``measure`` sends no signal
_SIGTERM_SMOKE_REASON = "measure sends no signal: the CPU test signals every rank in the middle of a step"
ROWS += [
    Row(
        "sigterm-pp2",
        "SIGTERM to every rank mid-step (preemption: srun, torchrun stopping its workers), pp2 1F1B: every rank raises "
        "Lightning's SIGTERMException at the end of that step, the handler issues no collective",
        {"pp": 2, "num_microbatches": 2, "pipeline_schedule": "1f1b", "precision": "32-true"},
        cpu_tests=(PREEMPTION,),
        smoke_skip=_SIGTERM_SMOKE_REASON,
    ),
    Row(
        "sigterm-dp2",
        "SIGTERM to every rank mid-step (preemption), dp2 ZeRO 1 with a rank in the gradient reduction: every rank "
        "raises Lightning's SIGTERMException at the end of that step",
        {"dp": 2, "zero_stage": 1, "precision": "32-true"},
        cpu_tests=(PREEMPTION,),
        smoke_skip=_SIGTERM_SMOKE_REASON,
    ),
]

# ------------------------------------------------------------------------------------- the code each row exercises
#: the files every smoke row runs: the smoke run itself, ``measure``, the strategy, the model, the training step and
#: the memory estimate its peak is checked against (a folder ends in ``/``)
CORE_FILES: tuple[str, ...] = (
    "lightning_4d/support.py",
    "lightning_4d/measure.py",
    "lightning_4d/strategy.py",
    "lightning_4d/config.py",
    "lightning_4d/layout.py",
    "lightning_4d/contract.py",
    "lightning_4d/precision.py",
    "lightning_4d/mesh.py",
    "lightning_4d/models/",
    "lightning_4d/tasks/",
    "lightning_4d/parallel/_compat/",
    "lightning_4d/parallel/parallelize.py",
    "lightning_4d/parallel/comm.py",
    "lightning_4d/parallel/loss.py",
    "lightning_4d/parallel/clipping.py",
    "lightning_4d/parallel/grad_buffers.py",
    "lightning_4d/parallel/sharded_optimizer.py",
    "lightning_4d/planning/activations.py",
    "lightning_4d/planning/buffers.py",
    "lightning_4d/planning/commands.py",
    "lightning_4d/planning/hardware.py",
    "lightning_4d/planning/model.py",
    "lightning_4d/planning/overhead.json",
    "lightning_4d/planning/params.py",
    "lightning_4d/planning/states.py",
    "lightning_4d/planning/tensors.py",
    "lightning_4d/planning/workload.py",
)
#: the files a row exercises beyond :data:`CORE_FILES`, declared once for the matrix's rows and each feature's: by
#: the option of ``measure`` the row sets (``"option"``: any value but 1, 0, None, False or ``"none"``;
#: ``"option=value"``: that value; ``family`` is the row's model family)
EXERCISES: dict[str, tuple[str, ...]] = {
    "zero_stage=2": ("lightning_4d/parallel/fsdp.py",),
    "zero_stage=3": ("lightning_4d/parallel/fsdp.py",),
    "dp_replicate": ("lightning_4d/parallel/fsdp.py",),
    "tp": ("lightning_4d/features/tensor_parallel/",),
    "pp": ("lightning_4d/features/pipeline/",),
    "cp": ("lightning_4d/features/context_parallel/",),
    "ep": ("lightning_4d/features/moe/",),
    "model=tiny-moe": ("lightning_4d/features/moe/",),
    "activation_checkpointing": ("lightning_4d/parallel/activation_checkpoint.py",),
    "activation_offload_layers": ("lightning_4d/parallel/offload.py", "lightning_4d/planning/offload_costs.py"),
    "optimizer_offload": (
        "lightning_4d/parallel/optimizer_offload.py",
        "lightning_4d/planning/optimizer_offload_costs.py",
    ),
    "compile": ("lightning_4d/parallel/compile.py",),
    "float8": ("lightning_4d/parallel/float8.py", "lightning_4d/planning/float8_costs.py"),
    "document_tokens": ("lightning_4d/data/documents.py",),
    "async_checkpoint": ("lightning_4d/checkpoint.py",),
    "family=hf-llama": ("lightning_4d/adapters/",),
    "family=hf-mixtral": ("lightning_4d/features/moe/",),
}
