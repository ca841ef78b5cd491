"""Mixture-of-Experts and expert parallelism (``ep``): the feature's record (:data:`FEATURE`), its rules of a layout
(:func:`check_moe_layout`, :func:`check_float8`) and its rows of the support matrix (:data:`ROWS`: the tiny-moe
preset, ep, transformers' Mixtral), and the rest of MoE beside it in this folder (``docs/moe.md``;
``docs/extending.md``, "The MoE component"):

- ``costs.py``: its memory and step-time terms; torch-free;
- ``layer.py``: the MoE feed-forward (router, stacked experts, shared experts, capacity, load-balancing loss), the
  model's MoE methods and the layer's parameter names in transformers' Mixtral (our Llama's Hugging Face mapping,
  ``models/hf_mapping.py``, asks them);
- ``expert.py``: ep placement of the experts and the all-to-all dispatch and combine;
- ``runtime.py``: what the rest of the strategy asks of MoE (meshes, gradient groups, its parallelization step, its
  ZeRO 2/3 units, the task's aux-loss logic, the load monitor);
- ``hf_mixtral.py``: transformers' ``MixtralForCausalLM`` as a model family.

:class:`~lightning_4d.config.ParallelConfig` runs :func:`check_moe_layout` as this feature's ``check`` (the layout
alone) and calls it again from ``resolve`` (the resolved sizes) and ``validate_model`` (against the model), and
:func:`check_float8` from ``validate_model``'s float8 check; ``config.py`` holds no MoE rule itself.

This module is pure Python: no torch import (the memory estimator and the planner run the rules without torch).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightning_4d.features.feature import Feature
from lightning_4d.models.llama_config import divisors
from lightning_4d.support_rows import HF_SMOKE_REASON, Row

__all__ = [
    "FEATURE",
    "ROWS",
    "MoESizes",
    "check_float8",
    "check_moe_layout",
    "PLAN_NEEDS",
    "estimate_title",
    "labels",
    "layout_fields",
    "plan_cell",
]


class MoESizes:
    """The MoE feature's sizes of a layout with an ``expert_parallel_size`` field (its layout field,
    :data:`lightning_4d.layout.LAYOUT_FIELDS`): the base of :class:`~lightning_4d.config.ParallelConfig` and of the
    planner's :class:`~lightning_4d.planning.step_time.Layout`, so that the dense code reads ``ep`` and never the
    field by name. No state of its own (``__slots__ = ()``: the planner's layouts stay slotted)."""

    __slots__ = ()

    @property
    def ep(self) -> int:
        """Expert parallel size (1 without expert parallelism)."""
        return self.expert_parallel_size

    @property
    def expert_dp(self) -> int:
        """Size of the expert data-parallel group ``edp`` (dp·cp·tp / ep; under tp an MoE layer runs token parallel,
        so its tp ranks are data-parallel ranks for it): the ranks holding the same experts, over which the expert
        parameters' gradients are reduced and their ZeRO 1-3 states sharded."""
        return self.dp * self.cp * self.tp // self.ep

    def ep_coordinates(self, dp_cp_rank: int, tp_rank: int = 0) -> tuple[int, int]:
        """``(ep rank, expert data-parallel rank)`` of the rank at index ``dp_cp_rank`` of the flattened ``dp_cp``
        mesh and tp rank ``tp_rank``: ep groups are blocks of ``ep`` consecutive ranks of the MoE layers' token
        ranks ``dp_cp_tp`` (index ``i = dp_cp_rank·tp + tp_rank``, tp innermost; ``dp_cp`` when tp = 1:
        :func:`lightning_4d.features.moe.runtime.carve_meshes`), so ``(i % ep, i // ep)``."""
        i = dp_cp_rank * self.tp + tp_rank
        return i % self.ep, i // self.ep


def check_moe_layout(layout: Any, model_config: Any = None, resolved: bool = False) -> None:
    """The Mixture-of-Experts rules of a training layout (``layout``: a
    :class:`~lightning_4d.config.ParallelConfig`), called from its validation (``ParallelConfig.__post_init__``,
    ``resolve`` and ``validate_model``): without ``model_config`` the rules of the layout alone (the one that needs
    the resolved dp only when ``resolved``), with it those against the model (``model_config``: a
    :class:`~lightning_4d.models.llama_config.LlamaConfig` or any config with ``is_moe`` and ``num_experts``; one
    without them is dense). What training an MoE model supports today (``docs/moe.md``); the estimator and the planner
    follow, so that they propose only layouts ``FourDStrategy`` runs.

    Raises:
        ValueError: ``expert_parallel_size`` > 1 with PowerSGD, or not dividing dp·cp·tp (ep ranks are carved out
            of the ranks that hold disjoint tokens of an MoE layer: the data-parallel ranks and, folded, the tp ranks,
            ``docs/moe.md``), or with hybrid sharding; with ``model_config``: ep > 1 for a dense model, hybrid
            sharding of an MoE model, an ep that does not divide
            ``num_experts``, an MoE model with tp > 1 and PowerSGD.
    """
    ep, tp = layout.expert_parallel_size, layout.tp
    if model_config is None:
        if ep > 1 and layout.gradient_compression == "powersgd":
            raise ValueError(
                f"gradient_compression='powersgd' is not supported with expert_parallel_size="
                f"{ep}: use gradient_compression='none' or 'bf16' with expert parallelism."
            )
        if ep > 1 and layout.dp_replicate > 1:
            raise ValueError(
                f"data_parallel_replicate_size={layout.dp_replicate} is not supported with expert_parallel_size="
                f"{ep}: the ep groups are carved out of the whole dp*cp group. Use data_parallel_replicate_size=1 "
                "with expert parallelism."
            )
        if resolved and (layout.dp_cp * tp) % ep != 0:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide dp*cp*tp = {layout.dp}*{layout.cp}*{tp} = "
                f"{layout.dp_cp * tp}: ep ranks are carved out of the data-parallel ranks and, folded, the tp ranks; "
                f"valid expert_parallel_size values for this layout: {divisors(layout.dp_cp * tp)}."
            )
        return
    moe = getattr(model_config, "is_moe", False)
    if ep > 1 and not moe:
        raise ValueError(
            f"expert_parallel_size={ep} needs a Mixture-of-Experts model (num_experts > 0); this model is dense "
            f"(num_experts={getattr(model_config, 'num_experts', 0)}): the only valid expert_parallel_size is 1."
        )
    if ep > 1 and model_config.num_experts % ep != 0:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide num_experts={model_config.num_experts} (each ep rank holds "
            f"num_experts/ep whole experts); valid expert_parallel_size values for this model: "
            f"{divisors(model_config.num_experts)}."
        )
    if moe and layout.dp_replicate > 1:
        raise ValueError(
            f"data_parallel_replicate_size={layout.dp_replicate} is not supported for a Mixture-of-Experts model yet "
            "(its MoE layers are sharded over groups of their own): use data_parallel_replicate_size=1."
        )
    if moe and tp > 1 and layout.gradient_compression == "powersgd":
        raise ValueError(
            f"gradient_compression='powersgd' is not supported for a Mixture-of-Experts model with "
            f"tensor_parallel_size={tp} (its MoE gradients are reduced over dp*cp*tp, PowerSGD's over dp*cp): "
            "use gradient_compression='none' or 'bf16'."
        )


def check_float8(float8: Optional[str], model_config: Any) -> None:
    """Refuse float8 training (``float8``: ``ParallelConfig.float8``, a recipe name) of a Mixture-of-Experts model
    (``model_config``: a :class:`~lightning_4d.models.llama_config.LlamaConfig`): its grouped expert matmuls are not the
    linears torchao converts (``parallel/float8.py``). Called by ``ParallelConfig.validate_model`` with a recipe set,
    before the dimensions of the dense linears are checked.

    Raises:
        ValueError: ``model_config.num_experts`` > 0.
    """
    if model_config.num_experts > 0:
        raise ValueError(
            f"float8={float8!r} is not supported for a Mixture-of-Experts model (num_experts="
            f"{model_config.num_experts}) yet: its expert matmuls are not linears torchao converts. Use "
            "float8=None."
        )


MOE_PP = "tests/test_moe_pipeline.py::test_moe_pp2_every_schedule_equals_one_process"
MOE_TP = "tests/test_moe_tensor_parallel.py::test_moe_under_tp_and_cp_equals_one_process"
MOE_DP = "tests/test_moe.py::test_dp2_zero_losses_aux_and_routing_equal_one_process"
EP = "tests/test_expert_parallel.py::test_ep_losses_aux_routing_norm_and_states_equal_one_process"
MOE_PP_EP = "tests/test_moe_pipeline.py::test_moe_pp2_dp2_ep2_equals_one_process"
FOLDED_RESUME = "tests/test_moe_tensor_parallel.py::test_checkpoint_at_tp2_ep2_resumes_at_tp2_ep2_and_at_dp2_ep1"
COMPILE = "tests/test_compile.py::test_compiled_layout_matches_one_process"
HF_MIXTRAL = "tests/test_hf_mixtral.py::test_hf_mixtral_layout_matches_one_process"


def _moe_row(row_id: str, description: str, layout: dict, *cpu_tests: str) -> Row:
    """A row of the tiny-moe preset (``layout``: its other options) that ``cpu_tests`` run."""
    return Row(row_id, description, {"model": "tiny-moe", **layout}, cpu_tests=cpu_tests)


def _hf_row(row_id: str, description: str, layout: dict) -> Row:
    """A transformers Mixtral row the CPU tests run and the smoke runner cannot (:data:`HF_SMOKE_REASON`)."""
    return Row(row_id, description, layout, family="hf-mixtral", cpu_tests=(HF_MIXTRAL,), smoke_skip=HF_SMOKE_REASON)


ROWS: tuple[Row, ...] = (
    _moe_row(
        "offload-ep",
        "activation offload of an MoE layer under dp2 ep2 ZeRO 2 (the all-to-all's received rows in host memory)",
        {"dp": 2, "ep": 2, "zero_stage": 2, "activation_offload_layers": 1},
        EP,
    ),
    _moe_row(
        "compile-moe-tp2-ep2",
        "torch.compile per layer, MoE tp2 ep2 (the MoE feed-forward eager, token parallel, experts over the tp ranks)",
        {"tp": 2, "ep": 2, "compile": True},
        COMPILE,
    ),
    Row(
        "float8-moe",
        "float8 with a Mixture-of-Experts model",
        {"model": "tiny-moe", "float8": "tensorwise"},
        refused=(
            "float8='tensorwise' is not supported for a Mixture-of-Experts model (num_experts=8) yet: its expert "
            "matmuls are not linears torchao converts. Use float8=None."
        ),
    ),
    _moe_row("moe-dp2-z1", "MoE dp2 ZeRO 1 (grouped GEMM experts, router, aux loss)", {"dp": 2}, MOE_DP),
    _moe_row("moe-dp2-z3", "MoE dp2 ZeRO 3", {"dp": 2, "zero_stage": 3}, MOE_DP),
    _moe_row(
        "moe-full-checkpointing",
        "MoE dp2 ZeRO 0, full checkpointing",
        {"dp": 2, "zero_stage": 0, "activation_checkpointing": "full"},
        MOE_DP,
    ),
    _moe_row("moe-tp2", "MoE tp2 ZeRO 1: MoE layers token parallel over tp", {"tp": 2}, MOE_TP),
    _moe_row(
        "moe-tp2-z2",
        "MoE tp2 ZeRO 2: the MoE layers' FSDP2 units over dp_cp_tp (their gradients summed over tp)",
        {"tp": 2, "zero_stage": 2},
        MOE_TP,
    ),
    _moe_row("moe-cp2", "MoE cp2 ring attention", {"cp": 2}, MOE_TP),
    _moe_row(
        "moe-pp2", "MoE pp2 1F1B bf16-mixed (the stage boundary's dtype)", {"pp": 2, "num_microbatches": 2}, MOE_PP
    ),
    _moe_row("moe-ep2", "MoE dp2 ep2 ZeRO 1: experts split over ep, all-to-all dispatch", {"dp": 2, "ep": 2}, EP),
    _moe_row(
        "moe-ep2-z3",
        "MoE dp2 ep2 ZeRO 3: expert FSDP2 units over the edp group",
        {"dp": 2, "ep": 2, "zero_stage": 3},
        EP,
    ),
    Row(
        "moe-pp2-ep2",
        "MoE pp2 dp2 ep2 1F1B",
        {"model": "tiny-moe", "pp": 2, "dp": 2, "ep": 2, "num_microbatches": 2},
        cpu_tests=(MOE_PP_EP, "tests/test_expert_parallel.py::test_checkpoint_at_ep1_resumes_at_ep4_and_at_pp2_ep2"),
    ),
    *(  # ep folded over tp (the tp ranks are the innermost ep ranks): tests/test_moe_tensor_parallel.py
        Row(row_id, f"MoE {description}: ep folded over tp", {"model": "tiny-moe", **layout}, cpu_tests=(MOE_TP,))
        for row_id, description, layout in (
            ("moe-dp2-tp2-ep4", "dp2 tp2 ep4 ZeRO 1", {"dp": 2, "tp": 2, "ep": 4}),
            (
                "moe-dp2-tp2-ep4-z3",
                "dp2 tp2 ep4 ZeRO 3 (experts' and MoE layers' own FSDP2 units)",
                {"dp": 2, "tp": 2, "ep": 4, "zero_stage": 3},
            ),
            ("moe-cp2-tp2-ep2", "cp2 tp2 ep2 ZeRO 1", {"cp": 2, "tp": 2, "ep": 2}),
        )
    ),
    Row(
        "moe-pp2-tp2-ep2",
        "MoE pp2 tp2 ep2 1F1B: ep folded over tp; a tp2 ep2 checkpoint resumed at dp2 ep1",
        {"model": "tiny-moe", "pp": 2, "tp": 2, "ep": 2, "num_microbatches": 2},
        cpu_tests=(MOE_PP_EP, FOLDED_RESUME),
    ),
    Row(
        "moe-ep-beyond-dp-cp-tp",
        "expert parallelism over more ranks than dp*cp*tp",
        {"model": "tiny-moe", "tp": 2, "ep": 4},
        refused=(
            "expert_parallel_size=4 does not divide dp*cp*tp = 1*1*2 = 2: ep ranks are carved out of the "
            "data-parallel ranks and, folded, the tp ranks; valid expert_parallel_size values for this layout: [1, 2]."
        ),
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
    _hf_row(
        "hf-mixtral-ep2",
        "transformers MixtralForCausalLM, dp2 ep2 ZeRO 1",
        {"model": "tiny-moe", "dp": 2, "ep": 2},
    ),
    _hf_row(
        "hf-mixtral-z3",
        "transformers MixtralForCausalLM, dp2 ZeRO 3",
        {"model": "tiny-moe", "dp": 2, "zero_stage": 3},
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
)


def labels(options: Mapping[str, Any]) -> frozenset[str]:
    """``ep`` and ``ep over tp`` (:func:`lightning_4d.support.layout_features`; ``options`` by ``measure``'s names
    or by the layout fields' own, as ``plan --json`` writes them). ``MoE``, a label of the model, is the support
    matrix's."""
    ep = options.get("ep", options.get("expert_parallel_size", 1)) or 1
    if ep == 1:
        return frozenset()
    if options.get("tp", 1) > 1:  # the ep groups take the tp ranks first (features/moe/runtime.py)
        return frozenset({"ep", "ep over tp"})
    return frozenset({"ep"})


def layout_fields(ep: int) -> dict[str, int]:
    """The MoE feature's layout field at expert parallel size ``ep``, as keyword arguments of
    :class:`~lightning_4d.config.ParallelConfig` and of the planner's layouts (the planner writes its ep through
    this)."""
    return {"expert_parallel_size": ep}


#: what a layout of the MoE feature needs, in the planner's message when no layout of a job is valid
PLAN_NEEDS = "ep dp·cp·tp and the experts"


def plan_cell(options: Mapping[str, Any]) -> str:
    """The feature's cell of ``lightning-4d plan``'s table (its ``ep`` column): the expert parallel size."""
    return str(options["expert_parallel_size"])


def estimate_title(layout: Mapping[str, Any]) -> str:
    """The feature's words in the title of ``lightning-4d estimate``'s table (``layout``: its ``--json`` layout):
    ``"ep=<ep> "`` under expert parallelism, nothing without."""
    ep = layout["expert_parallel_size"]
    return f"ep={ep} " if ep > 1 else ""


FEATURE = Feature.of_package(__name__, "moe", ("ep",), check=check_moe_layout, rows=ROWS, labels=labels)
